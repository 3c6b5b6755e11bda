"""Measuring rows: each run in a fresh worker process, alone, as a group holding its model while PSS is read,
or as concurrent cold starters on one empty domain."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

from ..common import JsonValue, remove_tree
from ..memory import memory_rollup, weights_pss
from .batch import WorkerBatch, evict_from_page_cache
from .measure import RowSpec
from .options import BenchOptions
from .row_names import COLD
from .rows import BenchRow
from .stats import Stats
from .steal import StealSample, online_cpus, run_undisturbed, user_hz, was_disturbed

__all__ = ["Measurements"]


class Measurements:
    """Runs rows in fresh worker processes and keeps every sample."""

    def __init__(self, options: BenchOptions, shm_dir: Path, log: IO[bytes], say: Callable[[str], None]) -> None:
        self._options = options
        self._shm_dir = shm_dir
        self._log = log
        self._say = say
        self._fresh = 0

    def _spec_for_run(self, row: BenchRow) -> RowSpec:
        """The row's spec, with a new empty domain for a cold row."""
        if not row.fresh_domain:
            return row.spec
        self._fresh += 1
        return RowSpec(**{**_spec_fields(row.spec), "root": str(self._shm_dir / f"cold-domain-{self._fresh}")})

    def _batch(self, specs: Sequence[RowSpec], *, hold: bool) -> WorkerBatch:
        return WorkerBatch(
            specs,
            hold=hold,
            log=self._log,
            timeout_s=self._options.timeout_s,
            preimported=self._options.preimported_workers,
        )

    def solo(self, row: BenchRow, cache: str) -> dict[str, Any]:
        """`runs` fresh processes, measured one at a time (the others wait, imported and idle)."""
        self._say(f"{cache} cache: {row.spec.name}: starting {self._options.runs} workers")
        specs = [self._spec_for_run(row) for _ in range(self._options.runs)]
        rows: list[dict[str, Any]] = []
        batch = self._batch(specs, hold=False)
        try:
            for index, spec in enumerate(specs):
                self._say(f"{cache} cache: {row.spec.name}: run {index + 1}/{len(specs)}")
                if cache == COLD:
                    evict_from_page_cache(row.disk_files)
                if row.before_run is not None:
                    row.before_run()
                rows.extend(batch.go([index])[0])
                batch.finish([index])
                if spec.root is not None and row.fresh_domain:
                    remove_tree(Path(spec.root))
                rows[-1] = self._while_disturbed(row, cache, rows[-1])
        finally:
            batch.close()
            for spec in specs:
                if row.fresh_domain and spec.root is not None:
                    remove_tree(Path(spec.root))
        return _summarize_solo(rows)

    def _run_again(self, row: BenchRow, cache: str) -> dict[str, Any]:
        """One more run of `row` in a new worker, prepared as the others were."""
        spec = self._spec_for_run(row)
        batch = self._batch([spec], hold=False)
        try:
            if cache == COLD:
                evict_from_page_cache(row.disk_files)
            if row.before_run is not None:
                row.before_run()
            return batch.go([0])[0][0]
        finally:
            batch.close()
            if row.fresh_domain and spec.root is not None:
                remove_tree(Path(spec.root))

    def _while_disturbed(self, row: BenchRow, cache: str, measured: dict[str, Any]) -> dict[str, Any]:
        """The run again while the hypervisor's steal disturbed it (bounded); the kept run counts its re-runs."""
        done = [measured]

        def attempt() -> dict[str, Any]:
            if done:
                return done.pop()
            self._say(f"{cache} cache: {row.spec.name}: the host's steal disturbed the run, run again")
            return self._run_again(row, cache)

        kept, attempts = run_undisturbed(attempt, _steal_of)
        return {**kept, "reruns": attempts.reruns}

    def group(self, row: BenchRow) -> dict[str, JsonValue]:
        """`workers` fresh processes loading together and holding their models while their PSS is read: the
        whole processes' and that of the memory holding their weights (for a hit, the artifact's mappings)."""
        sums: list[float] = []
        weights: list[float] = []
        workers = self._options.workers
        runs = self._options.memory_runs or self._options.runs
        for run in range(runs):
            self._say(f"memory: {row.spec.name}: {workers} workers together, run {run + 1}/{runs}")
            batch = self._batch([row.spec] * workers, hold=True)
            try:
                indices = list(range(workers))
                rows, _ = batch.go(indices)
                pss_now = [memory_rollup(batch.pid(index))[1] for index in indices]
                weights_now = [weights_pss(row["weight_spans"], row["pid"]) for row in rows]
                batch.release(indices)
            finally:
                batch.close()
            sums.append(float(sum(pss_now)))
            weights.append(float(sum(weights_now)))
        return {"pss_sum_bytes": Stats.of(sums).to_dict(), "weights_pss_sum_bytes": Stats.of(weights).to_dict()}

    def cold_starters(self, row: BenchRow) -> dict[str, Any]:
        """`cold_starters` fresh processes starting together on one empty domain: the producer must run once."""
        walls: list[float] = []
        producers: list[float] = []
        outcomes: set[str] = set()
        starters = self._options.cold_starters
        runs = self._options.cold_starter_runs or self._options.runs
        for run in range(runs):
            self._say(f"{starters} concurrent cold starters, run {run + 1}/{runs}")
            spec = self._spec_for_run(row)
            batch = self._batch([spec] * starters, hold=False)
            try:
                rows, wall_ms = batch.go(list(range(starters)))
            finally:
                batch.close()
                if spec.root is not None:
                    remove_tree(Path(spec.root))
            walls.append(wall_ms)
            producers.append(float(sum(1 for item in rows if "built" in item["attempts"])))
            outcomes.update(f"{item['outcome']} ({'+'.join(item['attempts'])})" for item in rows)
        return {
            "starters": starters,
            "wall_ms": Stats.of(walls).to_dict(),
            "producer_runs": Stats.of(producers).to_dict(),
            "outcomes": sorted(outcomes),
        }


def _spec_fields(spec: RowSpec) -> dict[str, Any]:
    return {name: getattr(spec, name) for name in RowSpec.__slots__}


def _steal_of(measured: dict[str, Any]) -> StealSample:
    """A worker's row as a steal sample (a worker that records no steal, of an older tree, reads as none)."""
    ticks = int(measured.get("steal_ticks", 0))
    return StealSample(ticks, float(measured["time_to_ready_ms"]) / 1000.0, online_cpus(), user_hz())


def _disturbed(measured: dict[str, Any]) -> bool:
    return was_disturbed(_steal_of(measured))


def _summarize_solo(rows: list[dict[str, Any]]) -> dict[str, Any]:
    def stats(key: str) -> dict[str, JsonValue]:
        return Stats.of([float(row[key]) for row in rows]).to_dict()

    return {
        "time_to_ready_ms": stats("time_to_ready_ms"),
        "load_ms": stats("load_ms"),
        "touch_ms": stats("touch_ms"),
        "peak_rss_bytes": stats("peak_rss_bytes"),
        "peak_rss_rise_bytes": Stats.of([float(r["peak_rss_bytes"] - r["baseline_rss_bytes"]) for r in rows]).to_dict(),
        "pages": sorted({int(row["pages"]) for row in rows}),
        "checksums": sorted({int(row["checksum"]) for row in rows}),
        "outcomes": sorted({str(row["outcome"]) for row in rows}),
        "identity_keys": sorted({str(row["identity_key"]) for row in rows if row["identity_key"] is not None}),
        "publications": sorted({str(row["publication"]) for row in rows}),
        "failures": sorted({str(row["failure"]) for row in rows if row["failure"] is not None}),
        "published_ms": None
        if any(row["published_ms"] is None for row in rows)
        else Stats.of([float(row["published_ms"]) for row in rows]).to_dict(),
        "publication_ms": None
        if any(row["publication_ms"] is None for row in rows)
        else Stats.of([float(row["publication_ms"]) for row in rows]).to_dict(),
        "verification_s": None
        if any(row.get("verification_s") is None for row in rows)
        else Stats.of([float(row["verification_s"]) for row in rows]).to_dict(),
        "verifications": sorted({str(row.get("verification")) for row in rows}),
        "steal_ticks": [int(row.get("steal_ticks", 0)) for row in rows],  # the hypervisor's, in each kept run
        "reruns": sum(int(row.get("reruns", 0)) for row in rows),  # runs repeated because steal disturbed them
        "disturbed_runs": sum(1 for row in rows if _disturbed(row)),  # kept although still disturbed
    }

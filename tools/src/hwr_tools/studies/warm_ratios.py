"""Warm time to ready next to the three bare mmap rows, on /dev/shm and on a huge-page tmpfs, each run a fresh process.

    PYTHONPATH=src .venv/bin/python -m hwr_tools.studies.warm_ratios --size-gib 0.25 1 --rounds 5 [--src OTHER/src ...]

A targeted stand-in for the warm rows of `hwr bench` (minutes instead of twenty): an FP32
Flux checkpoint is written and published once per size into a `/dev/shm` domain and, when
this process runs as root, into a domain on a tmpfs mounted `huge=always` (as `hwr bench`
mounts it); a safetensors copy of the artifact's final-layout tensors goes next to each
domain. Then, round after round in rotating order, `hwr bench`'s own workers
(`hwr_tools.bench.worker`, imports off the clock) each measure one run:
the warm hit (`load_component`) and the bare views (`safetensors-mmap-views`, `-populate`,
`-prefault-thread`). With several `--src` trees (e.g. a checkout of the base commit) each
tree's warm row runs in the same rounds, so their ratios share the noise. The report gives
each warm row's median time to ready over the fastest bare row's median on the same tmpfs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hwr_tools.bench.batch import WorkerBatch
from hwr_tools.bench.measure import LoadKind, RowSpec
from hwr_tools.bench.peers import REFERENCE_PEERS, PeerFormat, write_peer_files
from hwr_tools.bench.setup import (
    GIB,
    MIB,
    SHM,
    _final_layout_state_dict,
    _runtime,
    huge_tmpfs,
)
from hwr_tools.bench.steal import (
    Attempts,
    StealSample,
    cpu_line,
    run_undisturbed,
    steal_summary,
)
from hwr_tools.common import REPO_ROOT, pythonpath_with_tools
from hwr_tools.synthetic_models import TRANSFORMER_SUBFOLDER, save_flux_pipeline_folder

_BARE = ("safetensors-mmap-views", *(peer.name for peer in REFERENCE_PEERS))


@contextlib.contextmanager
def _python_path(src: str) -> Iterator[None]:
    """Workers started inside inherit PYTHONPATH=src, so they import that tree's runtime."""
    before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = pythonpath_with_tools(src)
    try:
        yield
    finally:
        if before is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = before


def _prepare(size_gib: float, disk: Path, shm: Path, stack: contextlib.ExitStack) -> dict[str, tuple[Path, Path]]:
    """Publish the artifact per tmpfs; return {tmpfs label: (domain root, safetensors copy)}."""
    from host_weight_runtime.diffusion import prewarm_component

    pipeline = disk / "pipeline"
    bf16 = int(size_gib * GIB)
    save_flux_pipeline_folder(pipeline, target_bytes=2 * bf16, seed=0)
    places: dict[str, Path] = {"/dev/shm": shm}
    huge, status = stack.enter_context(huge_tmpfs(disk, 3 * bf16 + 512 * MIB, True))
    print(f"# huge-page tmpfs: {status}", file=sys.stderr)
    if huge is not None:
        places["huge-page tmpfs"] = huge
    result: dict[str, tuple[Path, Path]] = {}
    state_dict = None
    for label, folder in places.items():
        root = folder / "domain"
        prewarm_component(pipeline, subfolder=TRANSFORMER_SUBFOLDER, runtime=_runtime(root))
        if state_dict is None:
            state_dict = _final_layout_state_dict(pipeline, root)
        (folder / "views").mkdir()
        views = write_peer_files(state_dict, folder / "views", [PeerFormat.SAFETENSORS])[PeerFormat.SAFETENSORS]
        result[label] = (root, views)
    return result


def _specs(pipeline: Path, places: dict[str, tuple[Path, Path]], sources: list[str]) -> list[tuple[str, RowSpec]]:
    """(source tree or '' for the bare rows, spec) for every row of one round."""
    out: list[tuple[str, RowSpec]] = []
    for label, (root, views) in places.items():
        for src in sources:
            name = f"warm {label} [{src}]"
            out.append((src, RowSpec(name, LoadKind.HWR, str(pipeline), TRANSFORMER_SUBFOLDER, root=str(root))))
        for bare in _BARE:
            spec = RowSpec(f"{bare} {label}", LoadKind.PEER, str(pipeline), TRANSFORMER_SUBFOLDER,
                           peer=bare, peer_file=str(views))
            out.append((sources[0], spec))
    return out


def _go(batch: WorkerBatch, index: int) -> tuple[dict[str, Any], StealSample]:
    """One run by a started worker, with the hypervisor's steal seen while it ran."""
    before = cpu_line()
    (row,), wall_ms = batch.go([index])
    after = cpu_line()
    batch.finish([index])
    return row, StealSample.between(before, after, wall_ms / 1000)


def _again(src: str, spec: RowSpec, log: Any) -> tuple[dict[str, Any], StealSample]:
    """The same run in a new worker (its imports off the clock), for a run the host disturbed."""
    with _python_path(src):
        batch = WorkerBatch([spec], hold=False, log=log, timeout_s=1800.0)
    try:
        return _go(batch, 0)
    finally:
        batch.close()


def _sample(batch: WorkerBatch, index: int, src: str, spec: RowSpec, log: Any) -> tuple[dict[str, Any], Attempts]:
    """One sample: the started worker's run, then new workers' while the host disturbed it (bounded)."""
    started = [batch]

    def attempt() -> tuple[dict[str, Any], StealSample]:
        return _go(started.pop(), index) if started else _again(src, spec, log)

    (row, _), attempts = run_undisturbed(attempt, lambda done: done[1])
    return row, attempts


def _round(specs: list[tuple[str, RowSpec]], shift: int, log: Any, steal: list[Attempts]) -> list[dict[str, Any]]:
    """One run of every spec, each a fresh worker, in an order rotated by `shift`; a run disturbed by the
    hypervisor's steal is run again in a new worker (bounded), and every sample's attempts land in `steal`."""
    order = specs[shift % len(specs):] + specs[: shift % len(specs)]
    batches: dict[str, tuple[WorkerBatch, list[int]]] = {}
    try:
        for src in dict.fromkeys(src for src, _ in order):
            chosen = [spec for s, spec in order if s == src]
            with _python_path(src):
                batches[src] = (WorkerBatch(chosen, hold=False, log=log, timeout_s=1800.0), [])
        rows = []
        for src, spec in order:
            batch, used = batches[src]
            index = len(used)  # a tree's batch holds its specs in the order they run
            used.append(index)
            row, attempts = _sample(batch, index, src, spec, log)
            steal.append(attempts)
            rows.append({**row, "name": spec.name, "steal_ticks": attempts.steal[-1].steal_ticks,
                         "reruns": attempts.reruns})
        return rows
    finally:
        for batch, _ in batches.values():
            batch.close()


def _median(rows: list[dict[str, Any]], name: str, field: str = "time_to_ready_ms") -> float:
    return float(statistics.median(row[field] for row in rows if row["name"] == name))


def _report(
    size_gib: float, rows: list[dict[str, Any]], places: list[str], sources: list[str], steal: list[Attempts]
) -> list[str]:
    lines = [f"## {size_gib:g} GiB, {len(rows)} runs, load average {os.getloadavg()[0]:.1f} at the end", ""]
    lines.append("| row | time to ready ms, median [min, max] | load / touch ms | vs fastest bare |")
    lines.append("|---|---:|---:|---:|")
    checksums = {row["checksum"] for row in rows}
    for label in places:
        bare = {name: _median(rows, f"{name} {label}") for name in _BARE}
        fastest = min(bare.values())
        names = [f"warm {label} [{src}]" for src in sources] + [f"{name} {label}" for name in _BARE]
        for name in names:
            times = [row["time_to_ready_ms"] for row in rows if row["name"] == name]
            median = statistics.median(times)
            lines.append(
                f"| {name} | {median:.1f} [{min(times):.1f}, {max(times):.1f}] | "
                f"{_median(rows, name, 'load_ms'):.1f} / {_median(rows, name, 'touch_ms'):.1f} | "
                f"{median / fastest:.2f} |"
            )
    lines.append("")
    lines.append(f"checksums: {'all equal' if len(checksums) == 1 else sorted(checksums)}")
    lines.append(steal_summary(steal))
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gib", type=float, nargs="+", default=[0.25])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--src", action="append", default=[], help="a source tree whose warm row runs too")
    parser.add_argument("--workdir", default="/var/tmp")
    parser.add_argument("--json", help="write every sample here")
    options = parser.parse_args()
    sources = options.src or [str(REPO_ROOT / "src")]
    report: list[str] = [f"sources: {sources}", f"uid {os.geteuid()}", ""]
    samples: dict[str, list[dict[str, Any]]] = {}
    for size in options.size_gib:
        with contextlib.ExitStack() as stack:
            disk = Path(stack.enter_context(tempfile.TemporaryDirectory(dir=options.workdir, prefix="hwr-warm-")))
            shm = Path(stack.enter_context(tempfile.TemporaryDirectory(dir=SHM, prefix="hwr-warm-")))
            places = _prepare(size, disk, shm, stack)
            log = stack.enter_context((disk / "workers.log").open("wb"))
            specs = _specs(disk / "pipeline", places, sources)
            rows: list[dict[str, Any]] = []
            steal: list[Attempts] = []
            for index in range(options.rounds):
                rows.extend(_round(specs, index * 3, log, steal))
                print(f"# {size:g} GiB round {index + 1} done, load {os.getloadavg()[0]:.1f}", file=sys.stderr)
            samples[f"{size:g}"] = rows
            # Each size is reported (and its samples written) as soon as it is done: a long run keeps what it got.
            print("\n".join([*report, *_report(size, rows, list(places), sources, steal), ""]), flush=True)
            report = []
            if options.json:
                Path(options.json).write_text(json.dumps(samples, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`hwr bench` pipeline rows: a whole Flux pipeline with real proportions, loaded several ways in fresh processes.

The pipeline folder has a FluxTransformer2DModel of `transformer_mib` FP32 (its widths grow with
the size: about 8800 MiB gives FLUX's own widths with fewer layers), a T5 encoder of about 40% of
that (real checkpoints: the transformer is about 2.5x its T5), a CLIP text encoder and a VAE, with
real tokenizers and scheduler; the same folder is also laid out as a Hugging Face hub cache. Every
weighted component is prewarmed into a `/dev/shm` domain first. The rows, each a fresh worker
process with its imports done before the clock starts, ending with every tensor of every component
touched (one byte per 4 KiB page):

    pipeline-canonical         DiffusionPipeline.from_pretrained(folder, dtype=torch.bfloat16)
    pipeline-transformer-only  load_component(transformer) warm, diffusers loads the rest canonically
    pipeline-warm              load_pipeline(folder) warm: every weighted component from its artifact
    pipeline-limit             what no warm load can skip: every component's skeleton built on `meta` from
                               its config, tokenizers and scheduler loaded, the pipeline object built, then
                               read-only MAP_POPULATE views of every artifact payload (the same touch)
    pipeline-views             bare read-only mmap views of every artifact payload file (no model at all)
    pipeline-first-worker      load_pipeline(folder) with default settings on an empty domain (a node's first)
    hub-*                      canonical, warm, limit and first worker again, by repo id from the hub cache

Rows alternate round by round (`runs` rounds), so a noisy neighbour spreads over all of them.
Time to ready is measured solo; weight PSS is the PSS of `workers` workers holding their pipelines
together, less what each held before loading (canonical, transformer-only, warm and views). Goals
(reported, never asserted): warm <= 1.25x the limit and the first worker <= 1.1x canonical, from the
folder and from the hub cache; warm <= 1.2x the bare views; the warm workers' weight PSS <= 1.05x one
copy of every weighted component (its BF16 bytes).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import select
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import torch

from ..common import JsonValue, remove_tree
from ..memory import memory_rollup
from .batch import evict_from_page_cache
from .measure import touch_model
from .stats import Stats

__all__ = [
    "FIRST_CANONICAL_TARGET",
    "HUB_ROWS",
    "MEMORY_ROWS",
    "PIPELINE_ROWS",
    "WARM_LIMIT_TARGET",
    "WARM_PSS_TARGET",
    "WARM_VIEWS_TARGET",
    "measure_pipeline_rows",
]

MIB = 1 << 20
SHM = Path("/dev/shm")
HUB_REPO = "hwr-bench/flux-pipeline"
CANONICAL = "pipeline-canonical"
TRANSFORMER_ONLY = "pipeline-transformer-only"
WARM = "pipeline-warm"
LIMIT = "pipeline-limit"
VIEWS = "pipeline-views"
FIRST_WORKER = "pipeline-first-worker"
HUB_CANONICAL = "hub-canonical"
HUB_WARM = "hub-warm"
HUB_LIMIT = "hub-limit"
HUB_FIRST_WORKER = "hub-first-worker"
PIPELINE_ROWS = (CANONICAL, TRANSFORMER_ONLY, WARM, LIMIT, VIEWS, FIRST_WORKER)
HUB_ROWS = (HUB_CANONICAL, HUB_WARM, HUB_LIMIT, HUB_FIRST_WORKER)
MEMORY_ROWS = (CANONICAL, TRANSFORMER_ONLY, WARM, VIEWS)
"""The rows whose workers' PSS is also measured as a group."""
_FIRST_ROWS = (FIRST_WORKER, HUB_FIRST_WORKER)
_CHECKPOINT_ROWS = (CANONICAL, HUB_CANONICAL, TRANSFORMER_ONLY, *_FIRST_ROWS)
"""The rows that read the checkpoint (what `--cold-cache` evicts before each of them)."""
WARM_VIEWS_TARGET = 1.2
WARM_LIMIT_TARGET = 1.25
FIRST_CANONICAL_TARGET = 1.1
WARM_PSS_TARGET = 1.05
_WORKER_MODULE = "hwr_tools.bench.pipeline_rows"


# --------------------------------------------------------------------------- the worker side


def _quiet_imports() -> Any:
    """Import what every row uses before the clock starts; progress bars and logs off. Typed Any: untyped libs."""
    import accelerate  # noqa: F401
    import diffusers
    import transformers as _transformers
    from diffusers.utils import logging as diffusers_logging

    transformers: Any = _transformers
    diffusers_logging.set_verbosity_error()
    diffusers_logging.disable_progress_bar()
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    _ = (diffusers.FluxPipeline, diffusers.FluxTransformer2DModel, diffusers.AutoencoderKL, transformers.T5EncoderModel)
    return diffusers.DiffusionPipeline


def _holder(tensors: Sequence[torch.Tensor]) -> torch.nn.Module:
    holder = torch.nn.Module()
    for index, tensor in enumerate(tensors):
        holder.register_buffer(f"t{index}", tensor, persistent=False)
    return holder


def _pipeline_holder(pipeline: Any) -> torch.nn.Module:
    """Every torch component of a pipeline in one module, so one touch pass sees each tensor once."""
    holder = torch.nn.Module()
    for name, component in pipeline.components.items():
        if isinstance(component, torch.nn.Module):
            holder.add_module(name, component)
    return holder


def _runtime(root: str) -> Any:
    from host_weight_runtime import HostWeightRuntime, HostWeightRuntimeConfig, RuntimeMode, StorageClass

    config = HostWeightRuntimeConfig(mode=RuntimeMode.PREFERRED, root=Path(root), storage_class=StorageClass.TMPFS)
    return HostWeightRuntime(config)


def _views(root: str, peer_name: str) -> tuple[torch.nn.Module, dict[str, str], list[Any]]:
    from .peers import load_peer, peer_named

    peer = peer_named(peer_name)
    loads = [load_peer(peer, path) for path in sorted(Path(root, "artifacts").glob("*/*.safetensors"))]
    return _holder([tensor for load in loads for tensor in load.tensors.values()]), {}, loads


def _meta_component(library: str, class_name: str, folder: Path) -> Any:
    """One component as the limit row has it: a model's skeleton on `meta` from its config, anything else loaded.

    Each skeleton is built the fastest way its library offers: a diffusers model as its own from_pretrained
    builds it (no initialisation, empty weights, BF16 as the default dtype; building on `meta` and then
    casting takes about twice as long), a transformers model with `_from_config` on `meta`.
    """
    import accelerate
    import diffusers
    import transformers
    from diffusers.models.modeling_utils import no_init_weights

    module: Any = diffusers if library == "diffusers" else transformers
    model_class = getattr(module, class_name)
    if issubclass(model_class, diffusers.ModelMixin):
        config = model_class.load_config(str(folder))
        default = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            with no_init_weights(), accelerate.init_empty_weights():
                return model_class.from_config(config)
        finally:
            torch.set_default_dtype(default)
    if issubclass(model_class, transformers.PreTrainedModel):
        config = model_class.config_class.from_pretrained(str(folder))
        with torch.device("meta"):
            return model_class._from_config(config, dtype=torch.bfloat16)
    return model_class.from_pretrained(str(folder))


def _limit(source: Path, root: str) -> tuple[torch.nn.Module, dict[str, str], list[Any]]:
    """The limit row: every skeleton on `meta`, tokenizers and scheduler, the pipeline object, populated views."""
    import diffusers

    index = json.loads((source / "model_index.json").read_text())
    components: dict[str, Any] = {}
    for name, entry in index.items():
        if name.startswith("_") or not isinstance(entry, list) or len(entry) != 2:
            continue
        library, class_name = entry
        components[name] = None if library is None else _meta_component(library, class_name, source / name)
    _pipeline = getattr(diffusers, index["_class_name"])(**components)
    return _views(root, "safetensors-mmap-populate")


def _hub_root(repo: str, cache: str) -> Path:
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(repo, cache_dir=cache, local_files_only=True))


def _load(
    row: str, folder: str, root: str, pipeline_class: Any, cache: str | None = None
) -> tuple[torch.nn.Module, dict[str, str], list[Any]]:
    """The row's load: (a module holding every weight, component outcomes, what to close at the end).

    A hub row's `folder` is the repo id, found in the hub cache `cache`.
    """
    from host_weight_runtime.diffusion import load_component, load_pipeline

    where: dict[str, Any] = {} if cache is None else {"cache_dir": cache}
    if row in (CANONICAL, HUB_CANONICAL):
        pipeline = pipeline_class.from_pretrained(folder, dtype=torch.bfloat16, **where)
        return _pipeline_holder(pipeline), {}, []
    if row == TRANSFORMER_ONLY:
        loaded = load_component(folder, subfolder="transformer", runtime=_runtime(root))
        pipeline = pipeline_class.from_pretrained(folder, dtype=torch.bfloat16, transformer=loaded.model)
        return _pipeline_holder(pipeline), {"transformer": loaded.outcome.value}, [loaded]
    if row in (WARM, HUB_WARM, FIRST_WORKER, HUB_FIRST_WORKER):
        whole = load_pipeline(folder, runtime=_runtime(root), **where)
        return _pipeline_holder(whole.pipeline), {n: o.value for n, o in whole.outcomes.items()}, [whole]
    if row in (LIMIT, HUB_LIMIT):
        return _limit(Path(folder) if cache is None else _hub_root(folder, cache), root)
    if row == VIEWS:
        return _views(root, "safetensors-mmap-views")
    raise ValueError(f"unknown pipeline row {row!r}")


def _send(event: dict[str, JsonValue]) -> None:
    sys.stdout.write(json.dumps(event) + "\n")
    sys.stdout.flush()


def worker_main(row: str, folder: str, root: str, cache: str | None = None) -> int:
    """One fresh worker: import, say so, load on "go", touch, report, hold until "release"."""
    pipeline_class = _quiet_imports()
    gc.collect()  # the imports' collector debt, paid before "go" so no timed load pays it
    baseline_rss, baseline_pss = memory_rollup()
    _send({"event": "imported"})
    if sys.stdin.readline().strip() != "go":
        return 2
    started = time.perf_counter()
    holder, outcomes, closers = _load(row, folder, root, pipeline_class, cache)
    pages, checksum = touch_model(holder)
    ready_ms = (time.perf_counter() - started) * 1000.0
    weight_bytes = sum(
        t.numel() * t.element_size() for t in {t.data_ptr(): t for t in holder.state_dict().values()}.values()
    )
    _send(
        {
            "event": "ready",
            "time_to_ready_ms": ready_ms,
            "baseline_rss_bytes": baseline_rss,
            "baseline_pss_bytes": baseline_pss,
            "pages": pages,
            "checksum": checksum,
            "weight_bytes": weight_bytes,
            "outcomes": dict(outcomes),
        }
    )
    if sys.stdin.readline().strip() == "settle":
        _send({"event": "settled", "verifications": _wait_for_verifications(closers)})
    for closer in closers:
        closer.close()
    return 0


def _wait_for_verifications(closers: Sequence[Any]) -> list[JsonValue]:
    """Wait for every background full verification a warm load's leases started; their end states."""
    states: list[JsonValue] = []
    for closer in closers:
        components = getattr(closer, "components", {})
        for loaded in components.values():
            verification = None if loaded.lease is None else loaded.lease.verification
            if verification is not None:
                verification.wait()
                states.append(str(verification.state.value))
    return states


# --------------------------------------------------------------------------- the parent side


class _Worker:
    """A fresh worker process speaking JSON lines; every wait has a deadline, and it is always reaped."""

    def __init__(
        self, row: str, folder: Path | str, root: Path, log: IO[bytes], timeout_s: float, *, cache: Path | None = None
    ) -> None:
        command = [sys.executable, "-m", _WORKER_MODULE, "--worker", row, str(folder), str(root)]
        if cache is not None:
            command += ["--hub-cache", str(cache)]
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True)
        self.timeout_s = timeout_s

    def read(self, expected: str) -> dict[str, Any]:
        stdout = self.process.stdout
        assert stdout is not None
        ready, _, _ = select.select([stdout], [], [], self.timeout_s)
        line = stdout.readline() if ready else ""
        if not line:
            raise RuntimeError(f"a pipeline bench worker said nothing (exit {self.process.poll()}); see the log")
        event = json.loads(line)
        if not isinstance(event, dict) or event.get("event") != expected:
            raise RuntimeError(f"a pipeline bench worker sent {line!r}, expected {expected}")
        return event

    def say(self, word: str) -> None:
        stdin = self.process.stdin
        assert stdin is not None
        stdin.write(word + "\n")
        stdin.flush()

    def close(self) -> None:
        if self.process.poll() is None:
            with contextlib.suppress(OSError):
                self.say("release")
            try:
                self.process.wait(self.timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        for stream in (self.process.stdin, self.process.stdout):
            if stream is not None:
                stream.close()


@dataclass(frozen=True, slots=True)
class _Setup:
    """Where the workers load from and log to; `hub` is the hub cache holding the same folder as `HUB_REPO`."""

    folder: Path
    root: Path
    log: IO[bytes]
    timeout_s: float
    hub: Path | None = None
    scratch: Path | None = None
    """Where a first-worker row makes its empty domain (one per run, removed after it)."""
    cold: bool = False
    """Evict the checkpoint's files from the page cache before every row that reads them."""

    def checkpoint_files(self) -> list[Path]:
        """The weight files a canonical load reads: the folder's, and the hub cache's blobs."""
        files = [path for path in self.folder.glob("*/*.safetensors") if path.is_file()]
        if self.hub is not None:
            files += [path for path in self.hub.glob("*/blobs/*") if path.is_file()]
        return files

    def worker(self, row: str, root: Path | None = None) -> _Worker:
        if row.startswith("hub-"):
            assert self.hub is not None
            return _Worker(row, HUB_REPO, root or self.root, self.log, self.timeout_s, cache=self.hub)
        return _Worker(row, self.folder, root or self.root, self.log, self.timeout_s)


def _solo_run(setup: _Setup, row: str) -> dict[str, Any]:
    """One fresh worker of `row`, held while its PSS is read; a first worker gets an empty domain of its own."""
    if setup.cold and row in _CHECKPOINT_ROWS:
        evict_from_page_cache(setup.checkpoint_files())
    empty = None
    if row in _FIRST_ROWS:
        empty = Path(tempfile.mkdtemp(prefix="first-", dir=setup.scratch or setup.root.parent)) / "domain"
    try:
        worker = setup.worker(row, empty)
        try:
            worker.read("imported")
            worker.say("go")
            event = worker.read("ready")
            pss = memory_rollup(worker.process.pid)[1]
            return {**event, "pss_bytes": pss, "weights_pss_bytes": pss - event["baseline_pss_bytes"]}
        finally:
            worker.close()  # a first worker exits only once what it publishes is done
    finally:
        if empty is not None:
            remove_tree(empty.parent)


def _settle(setup: _Setup, row: str) -> list[JsonValue]:
    """The node's first hit, untimed: one warm worker that waits until its background verifications end.

    The first hit of each publication on a node re-hashes it once on a thread (HWR_BACKGROUND_VERIFY=once)
    and records it; a bench worker exits long before a large one ends, so without this every timed warm
    run would start it again and spend a core on it, which no later worker of a real node does.
    """
    worker = setup.worker(row)
    try:
        worker.read("imported")
        worker.say("go")
        worker.read("ready")
        worker.say("settle")
        states: list[JsonValue] = worker.read("settled")["verifications"]
    finally:
        worker.close()
    failed = [state for state in states if state not in ("verified", "skipped")]
    if failed:
        raise RuntimeError(f"the first hit's background verifications ended {failed}; the artifacts are not sound")
    return states


def _rounds(setup: _Setup, rows: Sequence[str], runs: int) -> dict[str, list[dict[str, Any]]]:
    """`runs` rounds of one solo run per row, every other round in reverse order."""
    results: dict[str, list[dict[str, Any]]] = {row: [] for row in rows}
    for index in range(runs):
        for row in rows if index % 2 == 0 else tuple(reversed(rows)):
            results[row].append(_solo_run(setup, row))
    return results


def _group(setup: _Setup, row: str, workers: int) -> dict[str, JsonValue]:
    """`workers` fresh workers loading together and holding; (sum of PSS, sum of PSS less each one's baseline)."""
    started = [setup.worker(row) for _ in range(workers)]
    try:
        for worker in started:
            worker.read("imported")
        for worker in started:
            worker.say("go")
        ready = [worker.read("ready") for worker in started]
        pss = [memory_rollup(worker.process.pid)[1] for worker in started]
    finally:
        for worker in started:
            worker.close()
    weights = sum(now - event["baseline_pss_bytes"] for now, event in zip(pss, ready, strict=True))
    return {"pss_sum_bytes": float(sum(pss)), "weights_pss_sum_bytes": float(weights)}


def _artifact_bytes(root: Path) -> int:
    return sum(path.stat().st_size for path in (root / "artifacts").glob("*/*.safetensors"))


def measure_pipeline_rows(
    *,
    transformer_mib: int = 256,
    runs: int = 3,
    workers: int = 4,
    workdir: Path | None = None,
    timeout_s: float = 600.0,
    hub: bool = True,
    cold_cache: bool = False,
    say: Callable[[str], None] = lambda _line: None,
) -> dict[str, JsonValue]:
    """Build the pipeline, prewarm it, measure every row (`hub`: the hub-cache rows too); remove everything made."""
    from host_weight_runtime.diffusion import prewarm_pipeline

    from ..synthetic_hub import save_hub_snapshot
    from ..synthetic_pipelines import save_proportional_flux_pipeline

    disk_parent = workdir if workdir is not None else Path("/var/tmp")
    disk_dir = Path(tempfile.mkdtemp(prefix="hwr-bench-pipeline-", dir=disk_parent))
    shm_dir = Path(tempfile.mkdtemp(prefix="hwr-bench-pipeline-", dir=SHM))
    try:
        folder = disk_dir / "flux-pipeline"
        say(f"pipeline rows: writing a Flux pipeline with a {transformer_mib} MiB FP32 transformer to {folder}")
        save_proportional_flux_pipeline(folder, transformer_bytes=transformer_mib * MIB, seed=0)
        component_bytes = {
            path.parent.name: path.stat().st_size for path in folder.glob("*/*.safetensors") if path.is_file()
        }
        hub_cache = None
        if hub:
            hub_cache = disk_dir / "hub"
            save_hub_snapshot(hub_cache, HUB_REPO, folder, hard_link=True)
        root = shm_dir / "domain"
        say(f"pipeline rows: prewarming every weighted component into {root}")
        prewarmed = prewarm_pipeline(folder, runtime=_runtime(str(root)))
        rows = PIPELINE_ROWS + (HUB_ROWS if hub else ())
        with (disk_dir / "workers.log").open("wb") as log:
            setup = _Setup(folder, root, log, timeout_s, hub_cache, shm_dir, cold=cold_cache)
            first_hit = _settle(setup, WARM)
            say(f"pipeline rows: the node's first hit verified {len(first_hit)} publication(s) in the background")
            say(f"pipeline rows: {runs} rounds of {len(rows)} rows, alternating")
            timed = _rounds(setup, rows, runs)
            one_copy = int(timed[CANONICAL][0]["weight_bytes"])
            solo: dict[str, JsonValue] = {
                row: {
                    "time_to_ready_ms": Stats.of([float(r["time_to_ready_ms"]) for r in results]).to_dict(),
                    "outcomes": results[0]["outcomes"],
                    "weight_bytes": int(results[0]["weight_bytes"]),
                }
                for row, results in timed.items()
            }
            memory: dict[str, JsonValue] = {}
            for row in MEMORY_ROWS:
                if workers == 1:  # a group of one is a solo run: its PSS was read while it held the pipeline
                    memory[row] = {
                        "pss_sum_bytes": float(timed[row][0]["pss_bytes"]),
                        "weights_pss_sum_bytes": float(timed[row][0]["weights_pss_bytes"]),
                    }
                else:
                    say(f"pipeline rows: {row}: {workers} workers together")
                    memory[row] = _group(setup, row, workers)
    finally:
        remove_tree(disk_dir)
        remove_tree(shm_dir)
    report = _report(
        solo=solo,
        memory=memory,
        one_copy=one_copy,
        workers=workers,
        checkpoint_bytes=component_bytes,
        artifact_bytes=prewarmed.total_bytes,
        transformer_mib=transformer_mib,
    )
    report["first_hit_verifications"] = first_hit
    return report


def _median(solo: dict[str, JsonValue], row: str) -> float:
    entry = solo[row]
    assert isinstance(entry, dict)
    times = entry["time_to_ready_ms"]
    assert isinstance(times, dict) and isinstance(times["median"], float)
    return times["median"]


def _ratio_goals(solo: dict[str, JsonValue]) -> tuple[dict[str, JsonValue], list[JsonValue]]:
    """warm / limit and first worker / canonical for every source measured, each with its goal."""
    pairs = [
        ("warm / limit", WARM, LIMIT, WARM_LIMIT_TARGET, "warm load_pipeline time to ready"),
        ("first worker / canonical", FIRST_WORKER, CANONICAL, FIRST_CANONICAL_TARGET, "first worker time to ready"),
        ("hub warm / limit", HUB_WARM, HUB_LIMIT, WARM_LIMIT_TARGET, "warm load_pipeline from the hub cache"),
        (
            "hub first worker / canonical",
            HUB_FIRST_WORKER,
            HUB_CANONICAL,
            FIRST_CANONICAL_TARGET,
            "first worker from the hub cache",
        ),
    ]
    ratios: dict[str, JsonValue] = {}
    goals: list[JsonValue] = []
    for label, row, base, target, what in pairs:
        if row not in solo or base not in solo:
            continue
        ratio = _median(solo, row) / _median(solo, base)
        ratios[label] = ratio
        goals.append({"goal": f"{what} <= {target}x {base}", "ratio": ratio, "met": ratio <= target})
    return ratios, goals


def _report(
    *,
    solo: dict[str, JsonValue],
    memory: dict[str, JsonValue],
    one_copy: int,
    workers: int,
    checkpoint_bytes: dict[str, int],
    artifact_bytes: int,
    transformer_mib: int,
) -> dict[str, JsonValue]:
    warm_views = _median(solo, WARM) / _median(solo, VIEWS)
    warm_memory = memory[WARM]
    assert isinstance(warm_memory, dict) and isinstance(warm_memory["weights_pss_sum_bytes"], float)
    warm_pss = warm_memory["weights_pss_sum_bytes"] / one_copy if one_copy else None
    ratios, ratio_goals = _ratio_goals(solo)
    goals: list[JsonValue] = [
        *ratio_goals,
        {
            "goal": f"warm whole pipeline time to ready <= {WARM_VIEWS_TARGET}x the bare mmap views of its artifacts",
            "ratio": warm_views,
            "met": warm_views <= WARM_VIEWS_TARGET,
        },
        {
            "goal": f"{workers} warm workers' weight PSS <= {WARM_PSS_TARGET}x one copy of every weighted component",
            "ratio": warm_pss,
            "met": warm_pss is not None and warm_pss <= WARM_PSS_TARGET,
        },
    ]
    canonical_of = {row: HUB_CANONICAL if row.startswith("hub-") else CANONICAL for row in solo}
    return {
        "transformer_mib": transformer_mib,
        "checkpoint_bytes": dict(checkpoint_bytes),
        "artifact_bytes": artifact_bytes,
        "one_copy_bytes": one_copy,
        "workers": workers,
        "rows": solo,
        "memory": memory,
        "vs_canonical": {row: _median(solo, row) / _median(solo, canonical_of[row]) for row in solo},
        "ratios": ratios,
        "goals": goals,
    }


def render(report: dict[str, Any]) -> str:
    """A markdown table of the rows and the goals, for benchmarks/README.md."""
    one_copy = report["one_copy_bytes"]
    lines = [
        f"Flux pipeline, {report['transformer_mib']} MiB FP32 transformer; one BF16 copy of every weighted "
        f"component {one_copy / MIB:.1f} MiB; artifacts {report['artifact_bytes'] / MIB:.1f} MiB",
        "",
        f"| row | time to ready, ms (median) | vs canonical | {report['workers']} workers' weight PSS, MiB | "
        "/ one copy | outcomes |",
        "|---|---|---|---|---|---|",
    ]
    for row, entry in report["rows"].items():
        memory = report["memory"].get(row)
        pss = "-" if memory is None else f"{memory['weights_pss_sum_bytes'] / MIB:.1f}"
        share = "-" if memory is None else f"{memory['weights_pss_sum_bytes'] / one_copy:.2f}"
        outcomes = ", ".join(f"{name}: {outcome}" for name, outcome in sorted(entry["outcomes"].items())) or "-"
        lines.append(
            f"| {row} | {entry['time_to_ready_ms']['median']:.0f} | {report['vs_canonical'][row]:.2f} | "
            f"{pss} | {share} | {outcomes} |"
        )
    lines.append("")
    for goal in report["goals"]:
        shown = "n/a" if goal["ratio"] is None else f"{goal['ratio']:.2f}"
        lines.append(f"- {goal['goal']}: {shown} ({'met' if goal['met'] else 'NOT met'})")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m hwr_tools.bench.pipeline_rows [--transformer-mib N]`, or a worker."""
    parser = argparse.ArgumentParser(prog=f"python -m {_WORKER_MODULE}", description="hwr bench pipeline rows")
    parser.add_argument("--worker", nargs=3, metavar=("ROW", "FOLDER", "ROOT"), default=None)
    parser.add_argument("--hub-cache", default=None, help="(a worker) the hub cache its repo id is in")
    parser.add_argument(
        "--transformer-mib", type=int, default=256, help="FP32 MiB of the transformer; about 8800 is FLUX's widths"
    )
    parser.add_argument("--runs", type=int, default=3, help="rounds; each runs every row once, alternating")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--no-hub", action="store_true", help="only the rows that load from the folder")
    parser.add_argument(
        "--cold-cache",
        action="store_true",
        help="evict the checkpoint from the page cache before every row that reads it (where the checkpoint, "
        "the artifacts and a loaded model do not all fit in memory, the only state every row can start from)",
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.worker is not None:
        row, folder, root = args.worker
        return worker_main(row, folder, root, args.hub_cache)

    def progress(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    report = measure_pipeline_rows(
        transformer_mib=args.transformer_mib,
        runs=args.runs,
        workers=args.workers,
        hub=not args.no_hub,
        cold_cache=args.cold_cache,
        say=progress,
    )
    print(json.dumps(report, indent=2) if args.json else render(report))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())

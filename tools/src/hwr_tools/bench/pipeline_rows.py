"""`hwr bench` pipeline rows: a whole Flux pipeline with real proportions, loaded four ways in fresh processes.

The pipeline folder has a FluxTransformer2DModel of `transformer_mib` FP32, a T5 encoder of
about 40% of that (real checkpoints: the transformer is about 2.5x its T5), a CLIP text encoder
and a VAE, with real tokenizers and scheduler. Every weighted component is prewarmed into a
`/dev/shm` domain first. The rows, each a fresh worker process with its imports done before the
clock starts, ending with every tensor of every component touched (one byte per 4 KiB page):

    pipeline-canonical         DiffusionPipeline.from_pretrained(folder, dtype=torch.bfloat16)
    pipeline-transformer-only  load_component(transformer) warm, diffusers loads the rest canonically
    pipeline-warm              load_pipeline(folder) warm: every weighted component from its artifact
    pipeline-views             bare read-only mmap views of every artifact payload file (no model at all)

Time to ready is measured solo (`runs` times each); weight PSS is the PSS of `workers` workers
holding their pipelines together, less what each held before loading. Goals (reported, never
asserted): warm time to ready <= 1.2x the bare views; the warm workers' weight PSS <= 1.05x one
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
from .measure import touch_model
from .stats import Stats

__all__ = ["PIPELINE_ROWS", "WARM_PSS_TARGET", "WARM_VIEWS_TARGET", "measure_pipeline_rows"]

MIB = 1 << 20
SHM = Path("/dev/shm")
CANONICAL = "pipeline-canonical"
TRANSFORMER_ONLY = "pipeline-transformer-only"
WARM = "pipeline-warm"
VIEWS = "pipeline-views"
PIPELINE_ROWS = (CANONICAL, TRANSFORMER_ONLY, WARM, VIEWS)
WARM_VIEWS_TARGET = 1.2
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


def _load(row: str, folder: str, root: str, pipeline_class: Any) -> tuple[torch.nn.Module, dict[str, str], list[Any]]:
    """The row's load: (a module holding every weight, component outcomes, what to close at the end)."""
    from host_weight_runtime.diffusion import load_component, load_pipeline

    from .peers import load_peer, peer_named

    if row == CANONICAL:
        pipeline = pipeline_class.from_pretrained(folder, dtype=torch.bfloat16)
        return _pipeline_holder(pipeline), {}, []
    if row == TRANSFORMER_ONLY:
        loaded = load_component(folder, subfolder="transformer", runtime=_runtime(root))
        pipeline = pipeline_class.from_pretrained(folder, dtype=torch.bfloat16, transformer=loaded.model)
        return _pipeline_holder(pipeline), {"transformer": loaded.outcome.value}, [loaded]
    if row == WARM:
        whole = load_pipeline(folder, runtime=_runtime(root))
        return _pipeline_holder(whole.pipeline), {n: o.value for n, o in whole.outcomes.items()}, [whole]
    if row == VIEWS:
        peer = peer_named("safetensors-mmap-views")
        loads = [load_peer(peer, path) for path in sorted(Path(root, "artifacts").glob("*/*.safetensors"))]
        return _holder([tensor for load in loads for tensor in load.tensors.values()]), {}, loads
    raise ValueError(f"unknown pipeline row {row!r}")


def _send(event: dict[str, JsonValue]) -> None:
    sys.stdout.write(json.dumps(event) + "\n")
    sys.stdout.flush()


def worker_main(row: str, folder: str, root: str) -> int:
    """One fresh worker: import, say so, load on "go", touch, report, hold until "release"."""
    pipeline_class = _quiet_imports()
    gc.collect()  # the imports' collector debt, paid before "go" so no timed load pays it
    baseline_rss, baseline_pss = memory_rollup()
    _send({"event": "imported"})
    if sys.stdin.readline().strip() != "go":
        return 2
    started = time.perf_counter()
    holder, outcomes, closers = _load(row, folder, root, pipeline_class)
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
    sys.stdin.readline()  # "release"
    for closer in closers:
        closer.close()
    return 0


# --------------------------------------------------------------------------- the parent side


class _Worker:
    """A fresh worker process speaking JSON lines; every wait has a deadline, and it is always reaped."""

    def __init__(self, row: str, folder: Path, root: Path, log: IO[bytes], timeout_s: float) -> None:
        command = [sys.executable, "-m", _WORKER_MODULE, "--worker", row, str(folder), str(root)]
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
    """Where the workers load from and log to."""

    folder: Path
    root: Path
    log: IO[bytes]
    timeout_s: float

    def worker(self, row: str) -> _Worker:
        return _Worker(row, self.folder, self.root, self.log, self.timeout_s)


def _solo(setup: _Setup, row: str, runs: int) -> list[dict[str, Any]]:
    results = []
    for _ in range(runs):
        worker = setup.worker(row)
        try:
            worker.read("imported")
            worker.say("go")
            event = worker.read("ready")
            pss = memory_rollup(worker.process.pid)[1]
            results.append({**event, "pss_bytes": pss, "weights_pss_bytes": pss - event["baseline_pss_bytes"]})
        finally:
            worker.close()
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
    say: Callable[[str], None] = lambda _line: None,
) -> dict[str, JsonValue]:
    """Build the pipeline, prewarm it, measure every row; remove everything it made. Returns the report."""
    from host_weight_runtime.diffusion import prewarm_pipeline

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
        root = shm_dir / "domain"
        say(f"pipeline rows: prewarming every weighted component into {root}")
        prewarmed = prewarm_pipeline(folder, runtime=_runtime(str(root)))
        with (disk_dir / "workers.log").open("wb") as log:
            setup = _Setup(folder, root, log, timeout_s)
            solo: dict[str, JsonValue] = {}
            memory: dict[str, JsonValue] = {}
            one_copy = 0
            for row in PIPELINE_ROWS:
                say(f"pipeline rows: {row}: {runs} solo runs, then {workers} workers together")
                results = _solo(setup, row, runs)
                if row == CANONICAL:
                    one_copy = int(results[0]["weight_bytes"])
                solo[row] = {
                    "time_to_ready_ms": Stats.of([float(r["time_to_ready_ms"]) for r in results]).to_dict(),
                    "outcomes": results[0]["outcomes"],
                    "weight_bytes": int(results[0]["weight_bytes"]),
                }
                if workers == 1:  # a group of one is a solo run: its PSS was read while it held the pipeline
                    memory[row] = {
                        "pss_sum_bytes": float(results[0]["pss_bytes"]),
                        "weights_pss_sum_bytes": float(results[0]["weights_pss_bytes"]),
                    }
                else:
                    memory[row] = _group(setup, row, workers)
    finally:
        remove_tree(disk_dir)
        remove_tree(shm_dir)
    return _report(
        solo=solo,
        memory=memory,
        one_copy=one_copy,
        workers=workers,
        checkpoint_bytes=component_bytes,
        artifact_bytes=prewarmed.total_bytes,
        transformer_mib=transformer_mib,
    )


def _median(solo: dict[str, JsonValue], row: str) -> float:
    entry = solo[row]
    assert isinstance(entry, dict)
    times = entry["time_to_ready_ms"]
    assert isinstance(times, dict) and isinstance(times["median"], float)
    return times["median"]


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
    goals: list[JsonValue] = [
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
    return {
        "transformer_mib": transformer_mib,
        "checkpoint_bytes": dict(checkpoint_bytes),
        "artifact_bytes": artifact_bytes,
        "one_copy_bytes": one_copy,
        "workers": workers,
        "rows": solo,
        "memory": memory,
        "vs_canonical": {row: _median(solo, row) / _median(solo, CANONICAL) for row in PIPELINE_ROWS},
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
    for row in PIPELINE_ROWS:
        entry, memory = report["rows"][row], report["memory"][row]
        weights = memory["weights_pss_sum_bytes"]
        outcomes = ", ".join(f"{name}: {outcome}" for name, outcome in sorted(entry["outcomes"].items())) or "-"
        lines.append(
            f"| {row} | {entry['time_to_ready_ms']['median']:.0f} | {report['vs_canonical'][row]:.2f} | "
            f"{weights / MIB:.1f} | {weights / one_copy:.2f} | {outcomes} |"
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
    parser.add_argument("--transformer-mib", type=int, default=256)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.worker is not None:
        return worker_main(*args.worker)

    def progress(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    report = measure_pipeline_rows(
        transformer_mib=args.transformer_mib, runs=args.runs, workers=args.workers, say=progress
    )
    print(json.dumps(report, indent=2) if args.json else render(report))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())

"""`hwr demo`: a real diffusers Flux transformer, loaded canonically, cold and warm, each in a fresh process.

The parent builds a small FluxTransformer2DModel checkpoint (FP32 safetensors, sharded,
seeded weights) in a temporary directory and creates a private domain, both on the tmpfs
at /dev/shm, and removes both at the end, also on error, SIGTERM or Ctrl-C. A checkpoint
in memory is the best case for the canonical load, and no disk writeback of the freshly
written files runs while the loads are timed. Then, each in a fresh process
(`python -m host_weight_runtime.tools.demo_diffusers --child ...`):

    canonical  FluxTransformer2DModel.from_pretrained(pipe, subfolder="transformer",
               torch_dtype=torch.bfloat16): what a diffusers user does today; its
               forward output on fixed inputs is saved as the parity reference
    cold       load_component(pipe, subfolder="transformer", runtime=...) in PREFERRED
               mode on the empty domain: CANONICAL_FALLBACK, then published after load
    warm-1..N  the same call in N more processes: LOCAL_HIT, restored zero-copy from
               the published artifact; all N hold their models while memory is read

Every row is measured the same way. Time to ready runs from the start of the load call
until the model is usable and one byte in every 4 KiB page of every parameter and
buffer has been read (so page faults and page-table setup count for every row). RSS
and PSS come from /proc/self/smaps_rollup while the model is loaded. Then the child
runs a forward pass on fixed inputs and compares it with the canonical reference with
`torch.equal`. The canonical row compares a second forward pass with the reference it
saved: a check that the reference itself is reproducible.

Children speak the JSON-line protocol of the synthetic demo (`host_weight_runtime.tools.demo_store`:
ready -> measure -> row -> release), started one at a time so no load contends with
another's start-up; every wait has a deadline and every child is reaped.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from rich.table import Table
from rich.text import Text

from host_weight_runtime import (
    HostWeightRuntime,
    HostWeightRuntimeConfig,
    PostLoadPublicationStatus,
    ResolutionOutcome,
    RuntimeMode,
    StorageClass,
)
from host_weight_runtime.diffusion import LoadedComponent, load_component

from .bench.measure import touch_model
from .common import JsonValue, remove_tree
from .demo_store import (
    SHM,
    DemoError,
    _expect,
    _memory_rollup,
    _run_child_group,
    _send,
    _terminate_as_exit,
)
from .memory import mapped_memory
from .synthetic_models import TRANSFORMER_SUBFOLDER, forward_inputs, run_forward, save_flux_pipeline_folder

__all__ = [
    "DEFAULT_SIZE_MIB",
    "DEFAULT_WORKERS",
    "FluxDemoReport",
    "FluxDemoRow",
    "failure_reason",
    "report_table",
    "run_demo",
    "summary_line",
]

MIB = 1 << 20
DEFAULT_SIZE_MIB = 320
DEFAULT_WORKERS = 3
MODEL_SEED = 0
INPUT_SEED = 0
CANONICAL = "canonical"
COLD = "cold"
WARM = "warm"
FROM_PRETRAINED = "from_pretrained"  # the canonical row's outcome: no runtime was asked
_KIND = "flux"
_REFERENCE_FILE = "reference.pt"


# --------------------------------------------------------------------------- one process's report


@dataclass(frozen=True, slots=True)
class FluxDemoRow:
    """What one child saw: how its model was loaded, how long until it was ready, its memory, its parity."""

    path: str
    pid: int
    outcome: str
    load_path: str
    publication: str | None
    publication_ms: float | None
    time_to_ready_ms: float
    rss_bytes: int
    pss_bytes: int
    artifact_pss_bytes: int
    artifact_bytes: int
    touched_pages: int
    parity: bool
    max_abs_diff: float | None
    failure: str | None = None

    def to_dict(self) -> dict[str, JsonValue]:
        return {
            "path": self.path,
            "pid": self.pid,
            "outcome": self.outcome,
            "load_path": self.load_path,
            "publication": self.publication,
            "publication_ms": self.publication_ms,
            "time_to_ready_ms": self.time_to_ready_ms,
            "rss_bytes": self.rss_bytes,
            "pss_bytes": self.pss_bytes,
            "artifact_pss_bytes": self.artifact_pss_bytes,
            "artifact_bytes": self.artifact_bytes,
            "touched_pages": self.touched_pages,
            "parity": self.parity,
            "max_abs_diff": self.max_abs_diff,
            "failure": self.failure,
        }

    @classmethod
    def from_dict(cls, value: object) -> FluxDemoRow:
        if not isinstance(value, dict):
            raise DemoError(f"a child sent a malformed row: {value!r}")
        try:
            return cls(
                path=str(value["path"]),
                pid=int(value["pid"]),
                outcome=str(value["outcome"]),
                load_path=str(value["load_path"]),
                publication=_optional_str(value["publication"]),
                publication_ms=_optional_float(value["publication_ms"]),
                time_to_ready_ms=float(value["time_to_ready_ms"]),
                rss_bytes=int(value["rss_bytes"]),
                pss_bytes=int(value["pss_bytes"]),
                artifact_pss_bytes=int(value["artifact_pss_bytes"]),
                artifact_bytes=int(value["artifact_bytes"]),
                touched_pages=int(value["touched_pages"]),
                parity=_strict_bool(value["parity"]),
                max_abs_diff=_optional_float(value["max_abs_diff"]),
                failure=_optional_str(value["failure"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise DemoError(f"a child sent a malformed row ({exc}): {value!r}") from exc


def _optional_str(value: object) -> str | None:
    return None if value is None else str(value)


def _optional_float(value: object) -> float | None:
    if value is None:
        return None
    if not isinstance(value, (int, float)):
        raise TypeError(f"expected a number or null, got {value!r}")
    return float(value)


def _strict_bool(value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"parity must be true or false, got {value!r}")
    return value


@dataclass(frozen=True, slots=True)
class FluxDemoReport:
    """The whole demo: the checkpoint, the domain (both removed by now) and one row per process."""

    size_mib: int
    checkpoint_bytes: int
    build_ms: float
    workdir: str
    domain: str
    rows: tuple[FluxDemoRow, ...]

    @property
    def canonical(self) -> FluxDemoRow | None:
        return next((row for row in self.rows if row.path == CANONICAL), None)

    @property
    def cold(self) -> FluxDemoRow | None:
        return next((row for row in self.rows if row.path == COLD), None)

    @property
    def warm(self) -> tuple[FluxDemoRow, ...]:
        return tuple(row for row in self.rows if row.path.startswith(f"{WARM}-"))

    @property
    def artifact_bytes(self) -> int:
        return max((row.artifact_bytes for row in self.rows), default=0)

    def problems(self) -> list[str]:
        """Everything that did not go as expected, one phrase each; empty when the demo passed."""
        found: list[str] = []
        canonical, cold = self.canonical, self.cold
        if canonical is None or cold is None or not self.warm:
            found.append("a canonical, a cold and at least one warm row are expected")
        if cold is not None and (
            cold.outcome != ResolutionOutcome.CANONICAL_FALLBACK.value
            or cold.publication != PostLoadPublicationStatus.PUBLISHED.value
        ):
            found.append(
                f"cold got {cold.outcome} / publication {cold.publication}, not canonical_fallback / published"
            )
        found += [
            f"{row.path} got {row.outcome}, not local_hit"
            for row in self.warm
            if row.outcome != ResolutionOutcome.LOCAL_HIT.value
        ]
        failed = [row.path for row in self.rows if not row.parity]
        if failed:
            found.append(f"parity FAILED for {', '.join(failed)} (output differs from the canonical reference)")
        return found

    @property
    def ok(self) -> bool:
        return not self.problems()

    def to_dict(self) -> dict[str, JsonValue]:
        problems = self.problems()
        return {
            "size_mib": self.size_mib,
            "checkpoint_bytes": self.checkpoint_bytes,
            "build_ms": self.build_ms,
            "artifact_bytes": self.artifact_bytes,
            "workdir": self.workdir,
            "domain": self.domain,
            "warm_pss_bytes": sum(row.pss_bytes for row in self.warm),
            "warm_artifact_pss_bytes": sum(row.artifact_pss_bytes for row in self.warm),
            "ok": not problems,
            "problems": [problem for problem in problems],
            "rows": [row.to_dict() for row in self.rows],
        }


# --------------------------------------------------------------------------- the child side


def _touch_model(model: torch.nn.Module) -> int:
    """Read one byte in every 4 KiB page of every parameter and buffer (the benchmark's touch pass); return pages."""
    pages, _checksum = touch_model(model)
    return pages


def _flux_class() -> Any:
    """FluxTransformer2DModel, imported before any clock starts (diffusers imports lazily), without progress bars.

    Typed Any: diffusers is untyped.
    """
    import accelerate  # noqa: F401  (load_component's skeleton needs it; import it outside the timed load)
    import diffusers
    from diffusers.utils import logging as diffusers_logging

    diffusers_logging.set_verbosity_error()
    diffusers_logging.disable_progress_bar()
    return diffusers.FluxTransformer2DModel


def _compare(output: torch.Tensor, reference_path: Path) -> tuple[bool, float | None]:
    reference = torch.load(reference_path, weights_only=True)
    if not isinstance(reference, torch.Tensor):
        raise DemoError(f"{reference_path} does not hold a tensor")
    if reference.shape != output.shape or reference.dtype != output.dtype:
        return False, None
    equal = torch.equal(output, reference)
    return equal, 0.0 if equal else float((output.float() - reference.float()).abs().max())


def child_main(path: str, pipeline: Path, root: Path, reference: Path, reference_seed: int) -> int:
    """Load one way, touch, report when told, release when told. Runs in a fresh process."""
    flux_class = _flux_class()

    loaded: LoadedComponent | None = None
    started = time.perf_counter()
    if path == CANONICAL:
        model: torch.nn.Module = flux_class.from_pretrained(
            str(pipeline), subfolder=TRANSFORMER_SUBFOLDER, torch_dtype=torch.bfloat16
        )
    else:
        config = HostWeightRuntimeConfig(mode=RuntimeMode.PREFERRED, root=root, storage_class=StorageClass.TMPFS)
        loaded = load_component(pipeline, subfolder=TRANSFORMER_SUBFOLDER, runtime=HostWeightRuntime(config))
        model = loaded.model
    touched = _touch_model(model)
    ready_ms = (time.perf_counter() - started) * 1000.0
    try:
        _send({"event": "ready"})
        _expect("measure")
        rss, pss = _memory_rollup()
        lease = None if loaded is None else loaded.lease
        artifact_pss = artifact_bytes = 0
        if lease is not None:
            _, artifact_pss = mapped_memory([(region.address, region.length) for region in lease.mapped_regions])
            artifact_bytes = sum(entry.size for entry in lease.manifest.files)
        if path == CANONICAL:
            inputs = forward_inputs(_KIND, model, seed=reference_seed)
            torch.save(run_forward(_KIND, model, inputs).clone(), reference)
        output = run_forward(_KIND, model, forward_inputs(_KIND, model, seed=INPUT_SEED))
        parity, max_abs_diff = _compare(output, reference)
        outcome = FROM_PRETRAINED
        publication: str | None = None
        publication_ms: float | None = None
        failure: str | None = None
        if loaded is not None:
            outcome = loaded.outcome.value
            if loaded.publication is not None:
                publication = loaded.publication.status.value
                publication_ms = loaded.publication.elapsed_s * 1000.0
            failure = _failure_text(loaded)
        row = FluxDemoRow(
            path=path,
            pid=os.getpid(),
            outcome=outcome,
            load_path="canonical" if loaded is None else loaded.load_path.value,
            publication=publication,
            publication_ms=publication_ms,
            time_to_ready_ms=ready_ms,
            rss_bytes=rss,
            pss_bytes=pss,
            artifact_pss_bytes=artifact_pss,
            artifact_bytes=artifact_bytes,
            touched_pages=touched,
            parity=parity,
            max_abs_diff=max_abs_diff,
            failure=failure,
        )
        _send({"event": "row", "row": row.to_dict()})
        _expect("release")
    finally:
        if loaded is not None:
            loaded.close()
    return 0


def _failure_text(loaded: LoadedComponent) -> str | None:
    """The first failure the load reported (identity, restore, resolution, publication), as `[code] message`."""
    publication = loaded.publication
    for problem in (
        loaded.identity_failure,
        loaded.restore_failure,
        loaded.resolution.failure,
        None if publication is None else publication.failure,
    ):
        if problem is not None:
            return f"[{problem.code.value}] {problem.message}"
    return None


# --------------------------------------------------------------------------- the parent side


def _child_command(path: str, pipeline: Path, root: Path, reference: Path, reference_seed: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "host_weight_runtime.tools.demo_diffusers",
        "--child",
        path,
        "--pipeline",
        str(pipeline),
        "--root",
        str(root),
        "--reference",
        str(reference),
        "--reference-seed",
        str(reference_seed),
    ]


def _folder_bytes(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())


def run_demo(
    *, size_mib: int = DEFAULT_SIZE_MIB, workers: int = DEFAULT_WORKERS, reference_seed: int = INPUT_SEED
) -> FluxDemoReport:
    """Build a Flux checkpoint, then load it canonical, cold and warm in fresh processes; always clean up.

    `reference_seed` is a test seam: the canonical child computes the parity reference on
    inputs drawn with it, so any seed other than INPUT_SEED must make every parity check fail.
    """
    if type(size_mib) is not int or size_mib < 1:
        raise ValueError(f"--size-mib must be a positive integer, got {size_mib!r}")
    if type(workers) is not int or workers < 1:
        raise ValueError(f"--workers must be a positive integer, got {workers!r}")
    if not SHM.is_dir() or not os.access(SHM, os.W_OK):
        raise DemoError(f"{SHM} is missing or not writable; the demo needs a tmpfs at {SHM}")
    with _terminate_as_exit(), contextlib.ExitStack() as cleanup:
        workdir = Path(tempfile.mkdtemp(prefix="hwr-flux-demo-", dir=SHM))
        cleanup.callback(remove_tree, workdir)
        root = Path(tempfile.mkdtemp(prefix="hwr-demo-", dir=SHM))
        cleanup.callback(remove_tree, root)
        pipeline = workdir / "pipeline"
        reference = workdir / _REFERENCE_FILE
        started = time.perf_counter()
        save_flux_pipeline_folder(pipeline, target_bytes=size_mib * MIB, seed=MODEL_SEED)
        build_ms = (time.perf_counter() - started) * 1000.0
        checkpoint_bytes = _folder_bytes(pipeline / TRANSFORMER_SUBFOLDER)

        def group(paths: Sequence[str]) -> list[FluxDemoRow]:
            commands = [(path, _child_command(path, pipeline, root, reference, reference_seed)) for path in paths]
            return [FluxDemoRow.from_dict(row) for row in _run_child_group(commands, one_at_a_time=True)]

        rows = group([CANONICAL]) + group([COLD]) + group([f"{WARM}-{index}" for index in range(1, workers + 1)])
    return FluxDemoReport(
        size_mib=size_mib,
        checkpoint_bytes=checkpoint_bytes,
        build_ms=build_ms,
        workdir=str(workdir),
        domain=str(root),
        rows=tuple(rows),
    )


# --------------------------------------------------------------------------- what people read


def _mib(value: float) -> str:
    return f"{value / MIB:.1f}"


def report_table(report: FluxDemoReport) -> Table:
    """One row per process: path, outcome, time to ready (ms), RSS and PSS (MiB), parity."""
    table = Table(
        title=(
            f"FluxTransformer2DModel, {_mib(report.checkpoint_bytes)} MiB FP32 checkpoint -> "
            f"{_mib(report.artifact_bytes)} MiB BF16 artifact"
        ),
        title_justify="left",
    )
    # Two-line headers and outcomes keep the table within 80 columns (a pipe or a small terminal).
    for column in ("path", "outcome", "time to\nready (ms)", "RSS\n(MiB)", "PSS\n(MiB)", "parity"):
        table.add_column(column, justify="left" if column in ("path", "outcome", "parity") else "right", no_wrap=True)
    for row in report.rows:
        outcome = row.outcome if row.publication is None else f"{row.outcome}\n+ {row.publication}"
        table.add_row(
            row.path,
            Text(outcome, style="green" if row.failure is None else "red"),
            f"{row.time_to_ready_ms:.0f}",
            _mib(row.rss_bytes),
            _mib(row.pss_bytes),
            Text("ok", style="green") if row.parity else Text("FAILED", style="bold red"),
        )
    return table


def summary_line(report: FluxDemoReport) -> str:
    """The footer: warm against canonical time to ready, the warm workers' PSS against one artifact, parity."""
    parts: list[str] = []
    canonical, cold, warm = report.canonical, report.cold, report.warm
    if canonical is not None and warm:
        warm_ms = sum(row.time_to_ready_ms for row in warm) / len(warm)
        ratio = canonical.time_to_ready_ms / warm_ms if warm_ms > 0 else float("inf")
        speed = f"{ratio:.1f}x faster" if ratio >= 1 else f"{1 / ratio:.1f}x slower"
        parts.append(
            f"warm time to ready {warm_ms:.0f} ms (mean of {len(warm)}) vs canonical "
            f"{canonical.time_to_ready_ms:.0f} ms ({speed})"
        )
    if cold is not None and cold.publication_ms is not None:
        parts.append(f"the cold load published the artifact in {cold.publication_ms:.0f} ms (within its time to ready)")
    if warm:
        size = report.artifact_bytes
        shared = sum(row.artifact_pss_bytes for row in warm)
        copies = f"{shared / size:.2f}x" if size else "n/a"
        warm_pss = sum(row.pss_bytes for row in warm)
        versus = ""
        if canonical is not None:
            versus = (
                f" (each canonical process holds a private copy: PSS {_mib(canonical.pss_bytes)} MiB vs "
                f"{_mib(warm_pss / len(warm))} MiB per warm worker)"
            )
        parts.append(
            f"{len(warm)} warm workers' PSS sum {_mib(warm_pss)} MiB, of which their artifact mappings "
            f"{_mib(shared)} MiB = {copies} one {_mib(size)} MiB artifact{versus}"
        )
    failed = [row.path for row in report.rows if not row.parity]
    parts.append("parity: all bit-identical" if not failed else f"parity: FAILED for {', '.join(failed)}")
    return "; ".join(parts)


def failure_reason(report: FluxDemoReport) -> str:
    """One line saying why the demo failed (empty when it passed)."""
    problems = report.problems()
    return "" if not problems else "the demo did not go as expected: " + "; ".join(problems)


# --------------------------------------------------------------------------- child entry point


def _parse_child_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m host_weight_runtime.tools.demo_diffusers", description="hwr demo (Flux) child process"
    )
    parser.add_argument("--child", required=True, help="canonical, cold or warm-N")
    parser.add_argument("--pipeline", required=True, type=Path)
    parser.add_argument("--root", required=True, type=Path)
    parser.add_argument("--reference", required=True, type=Path)
    parser.add_argument("--reference-seed", required=True, type=int)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of a demo child (`python -m host_weight_runtime.tools.demo_diffusers --child ...`)."""
    args = _parse_child_args(argv)
    return child_main(args.child, args.pipeline, args.root, args.reference, args.reference_seed)


if __name__ == "__main__":
    sys.exit(main())

"""`hwr demo`: a real diffusers Flux pipeline, loaded canonically, cold and warm, each in a fresh process.

The parent builds a FluxPipeline folder with real proportions (a FluxTransformer2DModel of
`--size-mib` FP32, a T5 encoder of about 40% of that, a CLIP text encoder and a VAE, real
tokenizers and scheduler, seeded weights, `save_pretrained`) and a private domain, both on
the tmpfs at /dev/shm, and removes both at the end, also on error, SIGTERM or Ctrl-C. Then,
each in a fresh process (`python -m hwr_tools.demo_diffusers --child ...`):

    canonical  DiffusionPipeline.from_pretrained(pipe, dtype=torch.bfloat16): what a
               diffusers user does today; its image with a fixed seed is the parity reference
    cold       load_pipeline(pipe, runtime=...) in PREFERRED mode on the empty domain: every
               weighted component CANONICAL_FALLBACK at canonical speed, published behind it
    warm-1..N  the same call in N more processes: LOCAL_HIT for every weighted component,
               restored zero-copy; all N hold their pipelines while memory is read

Every row is measured the same way. Time to ready runs from the start of the load call
until the pipeline is usable and one byte in every 4 KiB page of every parameter and
buffer of every component has been read. RSS and PSS come from /proc/self/smaps_rollup;
artifact PSS sums the PSS of every artifact mapping. Then the child generates one image
(2 steps, fixed generator seed) and compares it with the canonical reference with
`torch.equal`. The canonical row compares a second image with the reference it saved.

Children speak the JSON-line protocol of the synthetic demo (`hwr_tools.demo_store`:
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
from dataclasses import dataclass, field
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
from host_weight_runtime.diffusion import LoadedComponent, LoadedPipeline, load_pipeline

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
from .synthetic_pipelines import generation_kwargs, save_proportional_flux_pipeline

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
    components: dict[str, str] = field(default_factory=dict)

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
            "components": dict(self.components),
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
                components={str(name): str(outcome) for name, outcome in dict(value.get("components", {})).items()},
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


def _touch_pipeline(pipeline: Any) -> int:
    """Read one byte in every 4 KiB page of every tensor of every torch component (the benchmark's touch pass)."""
    pages = 0
    for component in pipeline.components.values():
        if isinstance(component, torch.nn.Module):
            pages += touch_model(component)[0]
    return pages


def _quiet_diffusers() -> Any:
    """DiffusionPipeline, imported before any clock starts (diffusers imports lazily), without progress bars.

    Typed Any: diffusers is untyped.
    """
    import accelerate  # noqa: F401  (load_component's skeleton needs it; import it outside the timed load)
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


def _compare(output: torch.Tensor, reference_path: Path) -> tuple[bool, float | None]:
    reference = torch.load(reference_path, weights_only=True)
    if not isinstance(reference, torch.Tensor):
        raise DemoError(f"{reference_path} does not hold a tensor")
    if reference.shape != output.shape or reference.dtype != output.dtype:
        return False, None
    equal = torch.equal(output, reference)
    return equal, 0.0 if equal else float((output.float() - reference.float()).abs().max())


def _image(pipeline: Any, seed: int) -> torch.Tensor:
    with torch.no_grad():
        output = pipeline(**generation_kwargs(_KIND, seed)).images
    if not isinstance(output, torch.Tensor):
        raise DemoError(f"the pipeline returned {type(output).__name__}, not a tensor")
    return output


def _publication_of(component: LoadedComponent) -> tuple[str, float] | None:
    """How this component's artifact was published, and in how many ms: before the load returned, or behind it
    (the default for a first worker: waited for here, after the time to ready was taken)."""
    behind = component.background_publication
    if behind is not None:
        behind.wait()
        status = "failed" if behind.failure is not None else PostLoadPublicationStatus.PUBLISHED.value
        return status, (behind.elapsed_s or 0.0) * 1000.0
    if component.publication is not None:
        return component.publication.status.value, component.publication.elapsed_s * 1000.0
    return None


def _overall(values: Sequence[str]) -> str:
    """One word for all components: their common value, or "mixed"."""
    distinct = set(values)
    return distinct.pop() if len(distinct) == 1 else "mixed"


def child_main(path: str, pipeline_folder: Path, root: Path, reference: Path, reference_seed: int) -> int:
    """Load one way, touch, report when told, release when told. Runs in a fresh process."""
    pipeline_class = _quiet_diffusers()

    loaded: LoadedPipeline | None = None
    started = time.perf_counter()
    if path == CANONICAL:
        pipeline = pipeline_class.from_pretrained(str(pipeline_folder), dtype=torch.bfloat16)
    else:
        config = HostWeightRuntimeConfig(mode=RuntimeMode.PREFERRED, root=root, storage_class=StorageClass.TMPFS)
        loaded = load_pipeline(pipeline_folder, runtime=HostWeightRuntime(config))
        pipeline = loaded.pipeline
    touched = _touch_pipeline(pipeline)
    ready_ms = (time.perf_counter() - started) * 1000.0
    pipeline.set_progress_bar_config(disable=True)
    try:
        _send({"event": "ready"})
        _expect("measure")
        rss, pss = _memory_rollup()
        served = {} if loaded is None else dict(loaded.components)
        leases = [component.lease for component in served.values() if component.lease is not None]
        regions = [(region.address, region.length) for lease in leases for region in lease.mapped_regions]
        _, artifact_pss = mapped_memory(regions) if regions else (0, 0)
        artifact_bytes = sum(entry.size for lease in leases for entry in lease.manifest.files)
        if path == CANONICAL:
            torch.save(_image(pipeline, reference_seed).clone(), reference)
        parity, max_abs_diff = _compare(_image(pipeline, INPUT_SEED), reference)
        publications = [_publication_of(component) for component in served.values()]
        row = FluxDemoRow(
            path=path,
            pid=os.getpid(),
            outcome=FROM_PRETRAINED if loaded is None else _overall([c.outcome.value for c in served.values()]),
            load_path="canonical" if loaded is None else _overall([c.load_path.value for c in served.values()]),
            publication=None
            if loaded is None or any(p is None for p in publications)
            else _overall([p[0] for p in publications if p is not None]),
            publication_ms=None
            if loaded is None or any(p is None for p in publications)
            else sum(p[1] for p in publications if p is not None),
            time_to_ready_ms=ready_ms,
            rss_bytes=rss,
            pss_bytes=pss,
            artifact_pss_bytes=artifact_pss,
            artifact_bytes=artifact_bytes,
            touched_pages=touched,
            parity=parity,
            max_abs_diff=max_abs_diff,
            failure=next((text for text in map(_failure_text, served.values()) if text is not None), None),
            components=_component_outcomes(loaded),
        )
        _send({"event": "row", "row": row.to_dict()})
        _expect("release")
    finally:
        if loaded is not None:
            loaded.close()
    return 0


def _component_outcomes(loaded: LoadedPipeline | None) -> dict[str, str]:
    """Each weighted component's outcome, or why diffusers loaded it itself."""
    if loaded is None:
        return {}
    outcomes = {name: component.outcome.value for name, component in loaded.components.items()}
    for record in loaded.records:
        if record.handling.value == "canonical":
            outcomes[record.name] = f"canonical ({record.reason})"
    return outcomes


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
        "hwr_tools.demo_diffusers",
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
    """Build a Flux pipeline folder, then load it canonical, cold and warm in fresh processes; always clean up.

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
        _quiet_diffusers()
        save_proportional_flux_pipeline(pipeline, transformer_bytes=size_mib * MIB, seed=MODEL_SEED)
        build_ms = (time.perf_counter() - started) * 1000.0
        checkpoint_bytes = _folder_bytes(pipeline)

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
            f"FluxPipeline, {_mib(report.checkpoint_bytes)} MiB FP32 folder -> "
            f"{_mib(report.artifact_bytes)} MiB of BF16 artifacts"
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
        parts.append(
            f"the cold load published the artifacts behind it in {cold.publication_ms:.0f} ms (after its time to ready)"
        )
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
            f"{_mib(shared)} MiB = {copies} one copy of its {_mib(size)} MiB of artifacts{versus}"
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
        prog="python -m hwr_tools.demo_diffusers", description="hwr demo (Flux) child process"
    )
    parser.add_argument("--child", required=True, help="canonical, cold or warm-N")
    parser.add_argument("--pipeline", required=True, type=Path)
    parser.add_argument("--root", required=True, type=Path)
    parser.add_argument("--reference", required=True, type=Path)
    parser.add_argument("--reference-seed", required=True, type=int)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of a demo child (`python -m hwr_tools.demo_diffusers --child ...`)."""
    args = _parse_child_args(argv)
    return child_main(args.child, args.pipeline, args.root, args.reference, args.reference_seed)


if __name__ == "__main__":
    sys.exit(main())

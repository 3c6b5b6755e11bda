"""`hwr prewarm MODEL`: build a model's artifact, or every weighted component's, straight from the checkpoint."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any

from rich.table import Table
from rich.text import Text

from ._command import Subcommands, add_command
from ._domain import add_root_option, runtime_config
from ._output import (
    EXIT_OK,
    UsageError,
    add_json_option,
    byte_progress,
    print_json,
    seconds,
    size,
    stdout_console,
)

if TYPE_CHECKING:
    from ..diffusion import PipelinePrewarmResult, PrewarmResult
    from ..runtime import HostWeightRuntime

__all__ = ["register", "run"]


def register(commands: Subcommands) -> None:
    """Add `hwr prewarm MODEL [--subfolder] [--variant] [--dtype] [--representation] [--revision] [--cache-dir]
    [--root DIR] [--json]`."""
    sub = add_command(commands, "prewarm", run, "build a model's or a whole pipeline's artifacts from the checkpoint")
    sub.add_argument("model", help="diffusers model or pipeline folder, or a repo id in the local HF cache")
    sub.add_argument(
        "--subfolder",
        default=None,
        help="one component of a pipeline, e.g. transformer (without it, a pipeline folder prewarms every component)",
    )
    sub.add_argument(
        "--variant", default=None, help="weight variant, e.g. fp16 for *.fp16.safetensors (as diffusers' variant=)"
    )
    sub.add_argument(
        "--dtype",
        default="bfloat16",
        choices=("bfloat16", "float16", "float32"),
        help="the representation to build, as load_component's torch_dtype (default bfloat16)",
    )
    sub.add_argument(
        "--representation",
        default="bf16",
        choices=("bf16", "fp8"),
        help="bf16 (as --dtype says), or fp8: float8 Linear weights with one scale per tensor, as "
        "load_component(representation='fp8') serves them (one diffusers component: needs --subfolder on a pipeline)",
    )
    sub.add_argument("--revision", default=None, help="cache revision (branch, tag or commit); default main")
    sub.add_argument("--cache-dir", default=None, metavar="DIR", help="Hugging Face cache (default: $HF_HUB_CACHE)")
    add_root_option(sub)
    add_json_option(sub)


def run(args: argparse.Namespace) -> int:
    """Stream the checkpoint into the domain (a bar on a terminal) and print the resolution."""
    # The application layer may use the adapters; the core never does (C08).
    from ..diffusion import prewarm_component
    from ..runtime import HostWeightRuntime

    runtime = HostWeightRuntime(runtime_config(args.root))
    if args.subfolder is None and _is_pipeline(args):
        if args.representation != "bf16":
            raise UsageError(
                f"--representation {args.representation} prewarms one diffusers component; add --subfolder "
                "(e.g. --subfolder transformer)"
            )
        return _run_pipeline(args, runtime)
    kwargs: dict[str, Any] = {
        "subfolder": args.subfolder,
        "variant": args.variant,
        "torch_dtype": args.dtype,
        "representation": args.representation,
        "revision": args.revision,
        "runtime": runtime,
        "cache_dir": args.cache_dir,
    }
    result: PrewarmResult
    if not args.json and sys.stderr.isatty():
        with byte_progress("streaming") as progress:
            task = progress.add_task(str(args.model), total=None)

            def advance(done: int, total: int) -> None:
                progress.update(task, completed=done, total=total or None)

            result = prewarm_component(args.model, progress=advance, **kwargs)
    else:
        result = prewarm_component(args.model, **kwargs)
    report = result.resolution
    if args.json:
        print_json(
            {
                "model": str(args.model),
                "subfolder": args.subfolder,
                "variant": args.variant,
                "representation": args.representation,
                "identity_key": result.identity_key,
                "total_bytes": result.total_bytes,
                "tensor_count": result.tensor_count,
                "resolution": report.to_dict(),
            }
        )
        return EXIT_OK
    table = Table(title=f"prewarmed {args.model}", title_justify="left", show_header=False)
    table.add_column("field", style="bold")
    table.add_column("value")
    table.add_row("key", result.identity_key)
    table.add_row("outcome", Text(report.outcome.value, style="green"))
    table.add_row("artifact", f"{size(result.total_bytes)} in {result.tensor_count} tensors")
    table.add_row("time", seconds(report.elapsed_s))
    table.add_row("domain", str(runtime.config.resolved_root))
    stdout_console().print(table)
    return EXIT_OK


def _is_pipeline(args: argparse.Namespace) -> bool:
    """A folder (or cached repo) with model_index.json and no config.json of its own: prewarm every component."""
    from ..diffusion.pipeline_loader import pipeline_root
    from ..failures import HostWeightError

    try:
        root = pipeline_root(args.model, revision=args.revision, cache_dir=args.cache_dir)
    except HostWeightError:
        return False  # the single-model path reports what is wrong with the path
    return (root / "model_index.json").is_file() and not (root / "config.json").is_file()


def _run_pipeline(args: argparse.Namespace, runtime: HostWeightRuntime) -> int:
    """Prewarm every weighted component (a bar per component on a terminal) and print one row each."""
    from ..diffusion.pipeline_loader import prewarm_pipeline

    kwargs: dict[str, Any] = {
        "torch_dtype": args.dtype,
        "variant": args.variant,
        "revision": args.revision,
        "runtime": runtime,
        "cache_dir": args.cache_dir,
    }
    result: PipelinePrewarmResult
    if not args.json and sys.stderr.isatty():
        with byte_progress("streaming") as progress:
            tasks: dict[str, Any] = {}

            def advance(name: str, done: int, total: int) -> None:
                if name not in tasks:
                    tasks[name] = progress.add_task(f"{args.model} {name}", total=None)
                progress.update(tasks[name], completed=done, total=total or None)

            result = prewarm_pipeline(args.model, progress=advance, **kwargs)
    else:
        result = prewarm_pipeline(args.model, **kwargs)
    if args.json:
        print_json({"model": str(args.model), "variant": args.variant, **result.to_dict()})
        return EXIT_OK
    table = Table(title=f"prewarmed pipeline {args.model}", title_justify="left")
    for column in ("component", "class", "outcome", "artifact", "key or reason"):
        table.add_column(column)
    for record in result.records:
        built = result.built.get(record.name)
        if record.handling.value == "absent":
            continue
        if built is None:
            table.add_row(record.name, record.class_name or "-", record.handling.value, "-", record.reason or "")
            continue
        outcome = Text(built.resolution.outcome.value, style="green")
        artifact = f"{size(built.total_bytes)} in {built.tensor_count} tensors"
        table.add_row(record.name, record.class_name or "-", outcome, artifact, built.identity_key[:16])
    stdout_console().print(table)
    stdout_console().print(
        f"{size(result.total_bytes)} in {len(result.built)} artifacts; domain {runtime.config.resolved_root}"
    )
    return EXIT_OK

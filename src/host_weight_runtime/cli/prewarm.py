"""`hwr prewarm MODEL`: build a diffusers model's artifact straight from its checkpoint."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any

from rich.table import Table
from rich.text import Text

from ._command import Subcommands, add_command
from ._domain import add_root_option, runtime_config
from ._output import EXIT_OK, add_json_option, byte_progress, print_json, seconds, size, stdout_console

if TYPE_CHECKING:
    from ..diffusion import PrewarmResult

__all__ = ["register", "run"]


def register(commands: Subcommands) -> None:
    """Add `hwr prewarm MODEL [--subfolder] [--variant] [--revision] [--cache-dir] [--root DIR] [--json]`."""
    sub = add_command(commands, "prewarm", run, "build a diffusers model's artifact straight from its checkpoint")
    sub.add_argument("model", help="diffusers model or pipeline folder, or a repo id in the local HF cache")
    sub.add_argument("--subfolder", default=None, help="component folder inside a pipeline, e.g. transformer")
    sub.add_argument(
        "--variant", default=None, help="weight variant, e.g. fp16 for *.fp16.safetensors (as diffusers' variant=)"
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
    kwargs: dict[str, Any] = {
        "subfolder": args.subfolder,
        "variant": args.variant,
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

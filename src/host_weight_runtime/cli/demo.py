"""`hwr demo`: a real Flux pipeline loaded canonically, cold and warm (or, with --synthetic, the store alone)."""

from __future__ import annotations

import argparse

from rich.table import Table
from rich.text import Text

from ._command import Subcommands, add_command, positive_int
from ._output import (
    EXIT_FAILURE,
    EXIT_OK,
    ReportedError,
    add_json_option,
    print_json,
    short_key,
    size,
    stderr_console,
    stdout_console,
)
from ._tools import tools_needed

__all__ = ["register", "run"]


def register(commands: Subcommands) -> None:
    """Add `hwr demo [--synthetic] [--size-mib N] [--workers N] [--json]`."""
    sub = add_command(
        commands,
        "demo",
        run,
        "load a whole diffusers Flux pipeline canonically, cold and warm in fresh processes: time, memory, parity",
    )
    sub.add_argument(
        "--synthetic", action="store_true", help="the synthetic demo instead: publish once, lease from fresh workers"
    )
    sub.add_argument(
        "--size-mib",
        type=positive_int,
        default=None,
        metavar="N",
        help="FP32 Flux checkpoint size (default 320); with --synthetic, the artifact size (default 512)",
    )
    sub.add_argument("--workers", type=positive_int, default=3, metavar="N", help="warm worker processes (default 3)")
    add_json_option(sub)


def run(args: argparse.Namespace) -> int:
    """Run the chosen demo; exit 1 unless every process reported what the demo expects."""
    return _run_synthetic(args) if args.synthetic else _run_flux(args)


def _run_synthetic(args: argparse.Namespace) -> int:
    with tools_needed("demo"):
        from hwr_tools.demo_store import DEFAULT_SIZE_MIB, DemoError, run_demo, summary_line

    size_mib = args.size_mib if args.size_mib is not None else DEFAULT_SIZE_MIB
    try:
        if not args.json:
            stderr_console().print(
                f"publishing a {size_mib} MiB synthetic artifact in a fresh process, then leasing it from "
                f"{args.workers} more (a temporary tmpfs domain under /dev/shm)..."
            )
        report = run_demo(size_mib=size_mib, workers=args.workers)
    except DemoError as exc:
        raise ReportedError(str(exc)) from exc
    if args.json:
        print_json(report.to_dict())
    else:
        console = stdout_console()
        table = Table(
            title=f"artifact {short_key(report.key)}, {size(report.artifact_bytes)}; ready in ms, memory in MiB",
            title_justify="left",
        )
        for column in ("process", "outcome", "ready", "RSS", "PSS", "artifact PSS"):
            table.add_column(column, justify="left" if column in ("process", "outcome") else "right", no_wrap=True)
        mib = float(1 << 20)
        for row in report.rows:
            table.add_row(
                row.process,
                Text(row.outcome, style="green" if row.failure is None else "red"),
                f"{row.time_to_ready_ms:.0f}",
                f"{row.rss_bytes / mib:.1f}",
                f"{row.pss_bytes / mib:.1f}",
                f"{row.artifact_pss_bytes / mib:.1f}",
            )
        console.print(table)
        console.print(Text(summary_line(report)))
        for row in report.rows:
            if row.failure is not None:
                stderr_console().print(Text(f"{row.process}: {row.failure}"))
    if not report.ok:
        stderr_console().print(
            "the demo did not go as expected: the publisher should report local_production and every worker local_hit"
        )
        return EXIT_FAILURE
    return EXIT_OK


def _run_flux(args: argparse.Namespace) -> int:
    # The tools are their own package, imported only here (C08).
    with tools_needed("demo"):
        from hwr_tools.demo_diffusers import DEFAULT_SIZE_MIB, failure_reason, report_table, run_demo, summary_line
        from hwr_tools.demo_store import DemoError

    size_mib = args.size_mib if args.size_mib is not None else DEFAULT_SIZE_MIB
    try:
        if not args.json:
            stderr_console().print(
                f"building a Flux pipeline folder with a {size_mib} MiB FP32 transformer, then loading the whole "
                f"pipeline in fresh processes: canonical DiffusionPipeline.from_pretrained, cold load_pipeline, "
                f"{args.workers} warm load_pipeline (a temporary tmpfs domain under /dev/shm)..."
            )
        report = run_demo(size_mib=size_mib, workers=args.workers)
    except DemoError as exc:
        raise ReportedError(str(exc)) from exc
    if args.json:
        print_json(report.to_dict())
    else:
        console = stdout_console()
        console.print(report_table(report))
        for row in report.rows:
            if row.components:
                shown = ", ".join(f"{name} {outcome}" for name, outcome in sorted(row.components.items()))
                console.print(Text(f"{row.path}: {shown}"))
        console.print(Text(summary_line(report)))
        for row in report.rows:
            if row.failure is not None:
                stderr_console().print(Text(f"{row.path}: {row.failure}"))
    if not report.ok:
        stderr_console().print(Text(failure_reason(report)))
        return EXIT_FAILURE
    return EXIT_OK

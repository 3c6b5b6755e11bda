"""`hwr cleanup KEY`: remove one artifact, its deny marker and leftover builds, after a confirmation."""

from __future__ import annotations

import argparse
import sys

from rich.console import Console
from rich.text import Text

from ..outcomes import CleanupResult, CleanupStatus
from ._command import Subcommands, add_command
from ._domain import add_key_argument, add_root_option, domain_root, open_existing, resolve_key
from ._output import (
    EXIT_FAILURE,
    EXIT_OK,
    UsageError,
    add_json_option,
    confirm,
    print_json,
    size,
    stderr_console,
    stdout_console,
)

__all__ = ["register", "run"]


def register(commands: Subcommands) -> None:
    """Add `hwr cleanup KEY [--dry-run] [--yes] [--root DIR] [--json]`."""
    sub = add_command(commands, "cleanup", run, "remove one artifact, its deny marker and leftover builds")
    add_key_argument(sub)
    sub.add_argument("--dry-run", action="store_true", help="only show what would be removed")
    sub.add_argument("--yes", action="store_true", help="remove without asking")
    add_root_option(sub)
    add_json_option(sub)


def run(args: argparse.Namespace) -> int:
    """Plan, confirm (unless --yes or --dry-run), remove; refuses to remove unattended without --yes."""
    interactive = sys.stdin.isatty()
    if not (args.yes or args.dry_run or interactive):
        raise UsageError(
            "refusing to remove files without a confirmation, and stdin is not a terminal to ask on: "
            "pass --yes to remove without asking, or --dry-run to only show what would be removed"
        )
    store = open_existing(domain_root(args.root))
    key = resolve_key(store, args.key)
    if args.dry_run:
        return _report_cleanup(store.cleanup(key, dry_run=True), json_output=args.json)
    if not args.yes:
        plan = store.cleanup(key, dry_run=True)
        if plan.status is not CleanupStatus.PLANNED:
            return _report_cleanup(plan, json_output=args.json)
        console = stderr_console() if args.json else stdout_console()
        _render_cleanup(console, plan)
        if not confirm("Remove these paths?", console):
            stderr_console().print("cancelled; nothing was removed")
            return EXIT_FAILURE
    return _report_cleanup(store.cleanup(key), json_output=args.json)


def _report_cleanup(result: CleanupResult, *, json_output: bool) -> int:
    failed = result.status in (CleanupStatus.ACTIVE_BUILD, CleanupStatus.ACTIVE_LEASE, CleanupStatus.FAILED)
    if json_output:
        print_json(result.to_dict())
    else:
        _render_cleanup(stderr_console() if failed else stdout_console(), result)
    return EXIT_FAILURE if failed else EXIT_OK


def _render_cleanup(console: Console, result: CleanupResult) -> None:
    key = result.key
    if result.status is CleanupStatus.NOT_PRESENT:
        console.print(Text(f"nothing stored under {key}; nothing to remove"))
        return
    if result.status not in (CleanupStatus.REMOVED, CleanupStatus.PLANNED):
        line = Text()
        line.append(f"{result.status.value} ", style="red bold")
        line.append(f"{key}: ")
        line.append(result.failure.message if result.failure is not None else "nothing was removed")
        console.print(line)
        return
    verb = "would remove" if result.dry_run else "removed"
    console.print(Text(f"{verb} {size(result.removed_bytes)} for {key}:"))
    for path in result.removed_paths:
        console.print(Text(f"  {path}"))

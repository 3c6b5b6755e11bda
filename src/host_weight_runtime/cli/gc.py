"""`hwr gc`: free a domain's space: unleased artifacts, stale deny markers, old quarantine, dead builds.

The same plan-then-execute model as `hwr cleanup`: the plan is shown (or printed with
--dry-run), confirmed (unless --yes), and exactly that plan is executed; an item that
changed since (a lease appeared, a build started) is kept and reported.
"""

from __future__ import annotations

import argparse
import re
import sys
import time

from rich.console import Console
from rich.table import Table
from rich.text import Text

from ..filesystem.garbage import DEFAULT_QUARANTINE_RETENTION_S, GcItem, GcItemStatus, GcPlan, GcResult
from ._command import Subcommands, add_command
from ._domain import add_root_option, domain_root, open_existing
from ._output import (
    EXIT_FAILURE,
    EXIT_OK,
    UsageError,
    add_json_option,
    ago,
    confirm,
    print_json,
    short_key,
    size,
    stderr_console,
    stdout_console,
)

__all__ = ["parse_bytes", "parse_duration", "register", "run"]

_LOCK_WAIT_S = 60.0
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|sec|m|min|h|d|w)?\s*$", re.IGNORECASE)
_DURATION_UNITS = {None: 1.0, "s": 1.0, "sec": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}
_BYTES = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)
_BYTE_POWERS = {"k": 1, "m": 2, "g": 3, "t": 4}


def parse_duration(text: str) -> float:
    """An argparse type: seconds from "90", "90s", "30m", "12h", "7d" or "2w"."""
    match = _DURATION.match(text)
    if match is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration: use a number with s, m, h, d or w (e.g. 12h)")
    unit = match.group(2).lower() if match.group(2) else None
    return float(match.group(1)) * _DURATION_UNITS[unit]


def parse_bytes(text: str) -> int:
    """An argparse type: bytes from "1000000", "500M", "20GiB", "1.5T" (K/M/G/T are powers of 1024)."""
    match = _BYTES.match(text)
    if match is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size: use bytes or a number with K, M, G or T (e.g. 20G)")
    suffix = (match.group(2) or "b").lower()
    power = _BYTE_POWERS.get(suffix[0], 0)
    return int(float(match.group(1)) * 1024**power)


def register(commands: Subcommands) -> None:
    """Add `hwr gc [--max-bytes N] [--older-than DURATION] [--dry-run] [--yes] [--root DIR] [--json]`."""
    sub = add_command(
        commands,
        "gc",
        run,
        "free space: unleased artifacts (LRU), stale deny markers, old quarantine and dead builds' leftovers",
    )
    sub.add_argument(
        "--max-bytes",
        type=parse_bytes,
        metavar="N",
        help="evict unleased artifacts, least recently used first, until the store holds at most N bytes (e.g. 20G)",
    )
    sub.add_argument(
        "--older-than",
        type=parse_duration,
        metavar="DURATION",
        help="evict unleased artifacts not used for longer than DURATION (e.g. 7d); also the age past which "
        f"quarantined copies go (default for those: {DEFAULT_QUARANTINE_RETENTION_S / 3600:.0f}h)",
    )
    sub.add_argument("--dry-run", action="store_true", help="only show what would be freed")
    sub.add_argument("--yes", action="store_true", help="free without asking")
    add_root_option(sub)
    add_json_option(sub)


def run(args: argparse.Namespace) -> int:
    """Plan, confirm (unless --yes or --dry-run), execute the plan; refuses to remove unattended without --yes."""
    if not (args.yes or args.dry_run or sys.stdin.isatty()):
        raise UsageError(
            "refusing to remove files without a confirmation, and stdin is not a terminal to ask on: "
            "pass --yes to free without asking, or --dry-run to only show what would be freed"
        )
    store = open_existing(domain_root(args.root))
    retention = args.older_than if args.older_than is not None else DEFAULT_QUARANTINE_RETENTION_S
    plan = store.plan_gc(max_bytes=args.max_bytes, older_than_s=args.older_than, quarantine_older_than_s=retention)
    if args.dry_run:
        if args.json:
            print_json({"dry_run": True, **plan.to_dict()})
        else:
            _render_plan(stdout_console(), plan, verb="would free")
        return EXIT_OK
    if plan.items and not args.yes:
        console = stderr_console() if args.json else stdout_console()
        _render_plan(console, plan, verb="will free")
        if not confirm("Free these?", console):
            stderr_console().print("cancelled; nothing was removed")
            return EXIT_FAILURE
    result = store.execute_gc(plan, deadline=time.monotonic() + _LOCK_WAIT_S)
    if args.json:
        print_json({"dry_run": False, **result.to_dict()})
    else:
        _render_result(stdout_console() if result.ok else stderr_console(), result)
    return EXIT_OK if result.ok else EXIT_FAILURE


def _items_table(items: tuple[GcItem, ...], statuses: dict[int, GcItemStatus] | None = None) -> Table:
    table = Table(title_justify="left")
    columns = ["kind", "reason", "key", "on disk", "last used"] + (["result"] if statuses is not None else [])
    for column in columns:
        table.add_column(column, justify="right" if column == "on disk" else "left", no_wrap=True)
    for index, item in enumerate(items):
        row = [item.kind.value, item.reason.value, short_key(item.key), size(item.size_bytes), ago(item.last_used_ns)]
        if statuses is not None:
            row.append(statuses[index].value)
        table.add_row(*row)
    return table


def _render_kept(console: Console, plan: GcPlan) -> None:
    for kept in plan.kept:
        console.print(Text(f"kept {short_key(kept.key)} ({size(kept.size_bytes)}): {kept.reason.value}"))


def _render_plan(console: Console, plan: GcPlan, *, verb: str) -> None:
    console.print(Text(f"domain {plan.root}: store holds {size(plan.store_bytes)}"))
    if not plan.items:
        console.print("nothing to free")
    else:
        console.print(_items_table(plan.items))
        console.print(Text(f"{verb} {size(plan.bytes_to_free)} ({len(plan.items)} item(s))"))
    _render_kept(console, plan)


def _render_result(console: Console, result: GcResult) -> None:
    plan = result.plan
    if not result.results:
        console.print(Text(f"domain {plan.root}: nothing to free; freed 0 B"))
    else:
        statuses = {index: item.status for index, item in enumerate(result.results)}
        console.print(_items_table(plan.items, statuses))
        for item in result.results:
            if item.failure is not None:
                console.print(Text(f"{short_key(item.item.key)}: [{item.failure.code.value}] {item.failure.message}"))
        console.print(Text(f"freed {size(result.freed_bytes)} of {size(plan.bytes_to_free)} planned"))
    _render_kept(console, plan)

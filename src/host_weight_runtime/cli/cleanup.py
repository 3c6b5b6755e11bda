"""`hwr cleanup KEY` / `hwr cleanup --model MODEL`: remove artifacts, their deny markers and leftover builds.

Like `hf cache delete`: the plan is shown first and nothing is removed without a yes (or `--yes`);
`--dry-run` only shows the plan. A plan says `planned_bytes`/`planned_paths`; only what was
actually removed says `removed_bytes`/`removed_paths`. An artifact a build or a live lease holds
is refused on its own and the others still go.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from rich.console import Console
from rich.text import Text

from ..canonical_json import JsonValue
from ..failures import FailureCode
from ..filesystem.inspection import ArtifactInspection
from ..filesystem.store import FilesystemHostWeightStore
from ..outcomes import CleanupResult, CleanupStatus
from ._command import Subcommands, add_command
from ._domain import add_root_option, domain_root, open_existing, resolve_key
from ._output import (
    EXIT_FAILURE,
    EXIT_OK,
    ReportedError,
    UsageError,
    add_json_option,
    confirm,
    print_json,
    short_key,
    size,
    stderr_console,
    stdout_console,
)

__all__ = ["cleanup_json", "models_matching", "register", "run"]

_REFUSED = (CleanupStatus.ACTIVE_BUILD, CleanupStatus.ACTIVE_LEASE, CleanupStatus.FAILED)


def register(commands: Subcommands) -> None:
    """Add `hwr cleanup (KEY | --model MODEL) [--dry-run] [--yes] [--root DIR] [--json]`."""
    sub = add_command(
        commands, "cleanup", run, "remove one artifact (or every artifact of a model), its deny marker and leftovers"
    )
    sub.add_argument("key", nargs="?", help="artifact key, or a unique prefix of it (see `hwr inspect`)")
    sub.add_argument(
        "--model",
        metavar="MODEL",
        help="remove every artifact built from MODEL (the MODEL column of `hwr inspect`: a repo id or a folder)",
    )
    sub.add_argument("--dry-run", action="store_true", help="only show what would be removed")
    sub.add_argument("--yes", action="store_true", help="remove without asking")
    add_root_option(sub)
    add_json_option(sub)


def run(args: argparse.Namespace) -> int:
    """Plan, confirm (unless --yes or --dry-run), remove; refuses to remove unattended without --yes."""
    if (args.key is None) == (args.model is None):
        raise UsageError("give an artifact KEY or --model MODEL (one of them; `hwr inspect` lists both)")
    interactive = sys.stdin.isatty()
    if not (args.yes or args.dry_run or interactive):
        raise UsageError(
            "refusing to remove files without a confirmation, and stdin is not a terminal to ask on: "
            "pass --yes to remove without asking, or --dry-run to only show what would be removed"
        )
    store = open_existing(domain_root(args.root))
    keys = [resolve_key(store, args.key)] if args.key is not None else _model_keys(store, args.model)
    if args.yes and not args.dry_run:
        return _report([store.cleanup(key) for key in keys], model=args.model, dry_run=False, json_output=args.json)
    plans = [store.cleanup(key, dry_run=True) for key in keys]
    if args.dry_run or not any(plan.status is CleanupStatus.PLANNED for plan in plans):
        return _report(plans, model=args.model, dry_run=True, json_output=args.json)
    console = stderr_console() if args.json else stdout_console()
    _render(console, plans, model=args.model)
    if not confirm("Remove these paths?", console):
        stderr_console().print("cancelled; nothing was removed")
        return EXIT_FAILURE
    # Only what the confirmed plan listed: an artifact refused there stays refused, even if it became free since.
    results = [store.cleanup(plan.key) if plan.status is CleanupStatus.PLANNED else plan for plan in plans]
    return _report(results, model=args.model, dry_run=False, json_output=args.json)


def models_matching(model: str, entries: Sequence[ArtifactInspection]) -> list[ArtifactInspection]:
    """The artifacts built from `model`: its repo id as `hwr inspect` shows it, or a folder (any spelling of it)."""
    wanted = {model}
    if os.path.exists(model):
        wanted.add(os.path.realpath(model))
    return [entry for entry in entries if entry.model_id is not None and entry.model_id in wanted]


def _model_keys(store: FilesystemHostWeightStore, model: str) -> list[str]:
    entries = models_matching(model, store.inspect_domain().artifacts)
    if not entries:
        raise ReportedError(
            f"no artifact in {store.root} was built from {model!r}; `hwr inspect` lists the models",
            code=FailureCode.NOT_FOUND,
        )
    return sorted({entry.key for entry in entries})


def cleanup_json(result: CleanupResult, *, planned: bool) -> dict[str, JsonValue]:
    """One key's cleanup for `--json`: a plan says planned_bytes/planned_paths, and only a cleanup that ran
    says removed_bytes/removed_paths (what it did remove)."""
    value = result.to_dict()
    value["dry_run"] = planned
    if planned:
        value["planned_bytes"] = value.pop("removed_bytes")
        value["planned_paths"] = value.pop("removed_paths")
    return value


def _report(results: list[CleanupResult], *, model: str | None, dry_run: bool, json_output: bool) -> int:
    failed = any(result.status in _REFUSED for result in results)
    if json_output:
        if model is None:
            print_json(cleanup_json(results[0], planned=dry_run))
        else:
            total = sum(result.removed_bytes for result in results if result.status not in _REFUSED)
            print_json(
                {
                    "model": model,
                    "dry_run": dry_run,
                    "planned_bytes" if dry_run else "removed_bytes": total,
                    "artifacts": [cleanup_json(result, planned=dry_run) for result in results],
                }
            )
    else:
        _render(stderr_console() if failed and model is None else stdout_console(), results, model=model)
        if failed and model is not None:
            refused = [result for result in results if result.status in _REFUSED]
            stderr_console().print(Text(f"{len(refused)} of {len(results)} artifacts of {model} were not removed"))
    return EXIT_FAILURE if failed else EXIT_OK


def _render(console: Console, results: list[CleanupResult], *, model: str | None) -> None:
    if model is not None:
        done = [result for result in results if result.status in (CleanupStatus.REMOVED, CleanupStatus.PLANNED)]
        verb = "would remove" if any(result.dry_run for result in done) else "removed"
        total = sum(result.removed_bytes for result in done)
        noun = "artifact" if len(results) == 1 else "artifacts"
        console.print(Text(f"{model}: {verb} {size(total)} in {len(done)} of {len(results)} {noun}"))
    for result in results:
        _render_one(console, result, indent="  " if model is not None else "")


def _render_one(console: Console, result: CleanupResult, *, indent: str) -> None:
    key = short_key(result.key) if indent else result.key
    if result.status is CleanupStatus.NOT_PRESENT:
        console.print(Text(f"{indent}nothing stored under {key}; nothing to remove"))
        return
    if result.status not in (CleanupStatus.REMOVED, CleanupStatus.PLANNED):
        line = Text(indent)
        line.append(f"{result.status.value} ", style="red bold")
        line.append(f"{key}: ")
        line.append(result.failure.message if result.failure is not None else "nothing was removed")
        console.print(line)
        return
    verb = "would remove" if result.dry_run else "removed"
    console.print(Text(f"{indent}{verb} {size(result.removed_bytes)} for {key}:"))
    for path in result.removed_paths:
        console.print(Text(f"{indent}  {path}"))

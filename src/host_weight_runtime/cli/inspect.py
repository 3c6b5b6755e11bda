"""`hwr inspect`: the domain (filesystem, capacity, policy) and every artifact in it."""

from __future__ import annotations

import argparse

from rich.console import Console
from rich.table import Table
from rich.text import Text

from ..filesystem.inspection import ArtifactInspection, ArtifactState, DomainInspection
from ._command import Subcommands, add_command
from ._domain import add_root_option, domain_root, open_existing
from ._output import (
    EXIT_OK,
    SHORT_KEY,
    add_json_option,
    ago,
    limit,
    print_json,
    short_key,
    size,
    stdout_console,
)

__all__ = ["register", "run"]


def register(commands: Subcommands) -> None:
    """Add `hwr inspect [--root DIR] [--json]`."""
    sub = add_command(commands, "inspect", run, "show the domain (filesystem, capacity, policy) and its artifacts")
    add_root_option(sub)
    add_json_option(sub)


def run(args: argparse.Namespace) -> int:
    """Print the domain's inspection snapshot; read-only, so it always exits 0 once the domain opens."""
    store = open_existing(domain_root(args.root))
    snapshot = store.inspect_domain()
    if args.json:
        print_json(snapshot.to_dict())
    else:
        _render_domain(stdout_console(), snapshot)
    return EXIT_OK


def _render_domain(console: Console, snapshot: DomainInspection) -> None:
    capacity = snapshot.capacity
    policy = capacity.policy
    facts = Table.grid(padding=(0, 2))
    facts.add_column(style="bold")
    facts.add_column()
    facts.add_row("root", snapshot.root)
    facts.add_row("domain id", snapshot.domain_id)
    facts.add_row("scope", snapshot.scope)
    facts.add_row("filesystem", f"{snapshot.fs_type} mounted at {snapshot.mount_point}")
    facts.add_row("storage class", snapshot.storage_class)
    facts.add_row("huge_pages", "n/a (not tmpfs)" if snapshot.huge_pages is None else snapshot.huge_pages)
    medium = "memory (tmpfs: stored bytes are RAM)" if capacity.is_memory else "disk"
    facts.add_row(
        "capacity",
        f"total {size(capacity.total_bytes)}, free {size(capacity.free_bytes)}, "
        f"store {size(capacity.store_bytes)}; {medium}",
    )
    facts.add_row(
        "policy",
        f"max_artifact_bytes {limit(policy.max_artifact_bytes)}, max_store_bytes {limit(policy.max_store_bytes)}, "
        f"min_free_bytes {size(policy.min_free_bytes)}",
    )
    console.print(facts)
    console.print()
    if not snapshot.artifacts:
        console.print("no artifacts")
        return
    table = Table(title=f"inventory ({len(snapshot.artifacts)})", title_justify="left")
    for column in ("key", "state", "size", "model", "tensors", "last used", "leases", "locks held", "problem"):
        wraps = column in ("model", "problem")
        table.add_column(
            column,
            justify="right" if column in ("size", "tensors", "leases") else "left",
            no_wrap=not wraps,
            overflow="fold" if wraps else "ellipsis",
            min_width=SHORT_KEY if column == "key" else None,
        )
    for entry in snapshot.artifacts:
        table.add_row(
            short_key(entry.key),
            Text(entry.state.value, style="green" if entry.state is ArtifactState.READY else "red"),
            size(entry.size_bytes),
            Text(entry.model_id or "-"),
            "-" if entry.tensor_count is None else str(entry.tensor_count),
            ago(entry.last_used_ns),
            str(entry.live_leases),
            _locks_text(entry),
            Text(entry.problem.code.value if entry.problem is not None else "-"),
        )
    console.print(table)


def _locks_text(entry: ArtifactInspection) -> str:
    held = [
        name for name, active in (("build", entry.locks.build_active), ("lease", entry.locks.lease_active)) if active
    ]
    return "+".join(held) if held else "-"

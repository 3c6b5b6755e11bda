"""`hwr inspect`: the domain (filesystem, capacity, policy) and its artifacts, grouped per model.

The inventory reads like `hf cache scan`: one row per artifact, the rows of a model together,
long values cut with an ellipsis rather than wrapped; `--wide` prints every value in full
(lines may then be wider than the terminal) and `--json` carries every field.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from ..filesystem.inspection import ArtifactInspection, ArtifactState, DomainInspection
from ._command import Subcommands, add_command
from ._domain import add_root_option, domain_root, open_existing
from ._output import (
    EXIT_OK,
    add_json_option,
    age,
    limit,
    print_json,
    short_key,
    size,
    stdout_console,
    timestamp,
    wide_console,
)

__all__ = ["group_by_model", "register", "run"]

SHORT_REVISION = 8
MIN_SHRUNK = len("COMPONENT")
NO_MODEL = "-"
_SHORT_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "float64": "fp64"}


def register(commands: Subcommands) -> None:
    """Add `hwr inspect [--wide] [--root DIR] [--json]`."""
    sub = add_command(commands, "inspect", run, "show the domain (filesystem, capacity, policy) and its artifacts")
    sub.add_argument(
        "--wide", action="store_true", help="print full keys, revisions, times and paths (lines may be long)"
    )
    add_root_option(sub)
    add_json_option(sub)


def run(args: argparse.Namespace) -> int:
    """Print the domain's inspection snapshot; read-only, so it always exits 0 once the domain opens."""
    store = open_existing(domain_root(args.root))
    snapshot = store.inspect_domain()
    if args.json:
        print_json(snapshot.to_dict())
    else:
        console = wide_console() if args.wide else stdout_console()
        _render_domain(console, snapshot, wide=args.wide)
    return EXIT_OK


def group_by_model(artifacts: Sequence[ArtifactInspection]) -> list[tuple[str, list[ArtifactInspection]]]:
    """Artifacts per model id (entries without a readable manifest last), each group oldest first."""
    groups: dict[str, list[ArtifactInspection]] = {}
    for entry in artifacts:
        groups.setdefault(entry.model_id or NO_MODEL, []).append(entry)
    ordered = sorted(groups.items(), key=lambda item: (item[0] == NO_MODEL, item[0]))
    return [
        (model, sorted(entries, key=lambda e: (e.component or "", e.created_at_ns or 0, e.key)))
        for model, entries in ordered
    ]


def _render_domain(console: Console, snapshot: DomainInspection, *, wide: bool) -> None:
    capacity = snapshot.capacity
    policy = capacity.policy
    facts = Table.grid(padding=(0, 2))
    facts.add_column(style="bold", no_wrap=True)
    facts.add_column(overflow="fold")
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
    groups = group_by_model(snapshot.artifacts)
    table = _inventory(groups, wide=wide, width=console.width)
    needed = sum(column.width or 0 for column in table.columns) + len(table.columns) - 1
    # Narrower than the columns that never give way: print whole lines (the terminal wraps them) rather than
    # let rich cut every column, names included, to nothing distinguishable.
    (console if needed <= console.width else wide_console()).print(table)
    console.print(Text(_summary(groups)))
    console.print(Text(SIZE_NOTE))


SIZE_HEADER = "SIZE*"
SIZE_NOTE = "* SIZE: tensor bytes (what a lease maps); verify and gc print bytes on disk"


def _inventory(groups: list[tuple[str, list[ArtifactInspection]]], *, wide: bool, width: int) -> Table:
    names = ["MODEL", "COMPONENT", "REVISION", "DTYPE", SIZE_HEADER, "TENSORS", "CREATED", "STATE", "KEY"]
    if wide:
        names += ["LAST USED", "LEASES", "SOURCE", "PATH"]
    now_ns = time.time_ns()
    rows: list[list[Text]] = []
    sections: list[bool] = []
    for _model, entries in groups:
        for index, entry in enumerate(entries):
            row = [
                Text(entry.model_id or NO_MODEL),
                Text(entry.component or "-"),
                Text(_revision(entry.revision, wide=wide)),
                Text(_dtype(entry.dtype, wide=wide)),
                Text(size(entry.tensor_bytes if entry.tensor_bytes is not None else entry.size_bytes)),
                Text("-" if entry.tensor_count is None else str(entry.tensor_count)),
                Text(_created(entry.created_at_ns, now_ns, wide=wide)),
                _state(entry),
                Text(entry.key if wide else short_key(entry.key)),
            ]
            if wide:
                row += [
                    Text(_created(entry.last_used_ns, now_ns, wide=wide)),
                    Text(str(entry.live_leases)),
                    Text(", ".join(entry.source_paths) or "-"),
                    Text(entry.path),
                ]
            rows.append(row)
            sections.append(index == len(entries) - 1)
    widths = [max([len(name), *(row[column].cell_len for row in rows)]) for column, name in enumerate(names)]
    if not wide:
        widths[0], widths[1] = _shrunk(widths[0], widths[1], room=width - (sum(widths[2:]) + len(names) - 1))
        for column in (0, 1):
            widths[column] = _cut_column(rows, column, widths[column])
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, header_style="bold", padding=0)
    for name, column_width in zip(names, widths, strict=True):
        table.add_column(
            name,
            justify="right" if name in (SIZE_HEADER, "TENSORS", "LEASES") else "left",
            no_wrap=True,
            overflow="ellipsis",
            width=column_width,
        )
    for row, last in zip(rows, sections, strict=True):
        table.add_row(*row, end_section=last)
    return table


def _shrunk(model: int, component: int, *, room: int) -> tuple[int, int]:
    """Widths for the model and component columns in `room` columns: only these two give way on a narrow
    terminal, so keys, sizes and times always print whole. Components (short folder names) keep their
    width while the model ids give way; then both share what is left."""
    if model + component <= room:
        return model, component
    if room - component >= MIN_SHRUNK:
        return room - component, component
    component = min(component, max(room // 2, MIN_SHRUNK))
    return max(room - component, MIN_SHRUNK), component


def middle_cut(text: str, width: int) -> str:
    """`text` in `width` cells, cut in the middle: both ends stay (an org and a name, `text_encoder` and its `_2`)."""
    if len(text) <= width:
        return text
    if width < 2:
        return text[:width]
    tail = (width - 1) // 2
    return text[: width - 1 - tail] + "…" + (text[-tail:] if tail else "")


def _cut_column(rows: list[list[Text]], column: int, width: int) -> int:
    """Cut the column's cells in the middle to `width`, widened until different values stay different."""
    values = [row[column].plain for row in rows]
    full = max((len(value) for value in values), default=width)
    while width < full and len({middle_cut(v, width) for v in set(values)}) < len(set(values)):
        width += 1
    for row, value in zip(rows, values, strict=True):
        row[column] = Text(middle_cut(value, width))
    return width


def _dtype(dtype: str | None, *, wide: bool) -> str:
    if dtype is None:
        return "-"
    return dtype if wide else _SHORT_DTYPES.get(dtype, dtype)


def _revision(revision: str | None, *, wide: bool) -> str:
    if revision is None:
        return "-"
    return revision if wide else "+".join(part[:SHORT_REVISION] for part in revision.split("+"))


def _created(created_at_ns: int | None, now_ns: int, *, wide: bool) -> str:
    if created_at_ns is None:
        return "-"
    return timestamp(created_at_ns) if wide else age(now_ns - created_at_ns)


def _state(entry: ArtifactInspection) -> Text:
    """The state, what holds the artifact now (a build, a lease) and the problem code, in one short cell."""
    text = Text(entry.state.value, style="green" if entry.state is ArtifactState.READY else "red")
    locks = entry.locks
    held = [name for name, active in (("building", locks.build_active), ("leased", locks.lease_active)) if active]
    if entry.problem is not None:
        held.append(entry.problem.code.value)
    if held:
        text.append(f" ({', '.join(held)})")
    return text


def _summary(groups: list[tuple[str, list[ArtifactInspection]]]) -> str:
    entries = [entry for _model, group in groups for entry in group]
    models = sum(1 for model, _group in groups if model != NO_MODEL)
    tensors = sum(entry.tensor_bytes or 0 for entry in entries)
    disk = sum(entry.size_bytes for entry in entries)
    noun = "artifact" if len(entries) == 1 else "artifacts"
    model_noun = "model" if models == 1 else "models"
    return f"{len(entries)} {noun} from {models} {model_noun}: {size(tensors)} of tensors, {size(disk)} on disk"

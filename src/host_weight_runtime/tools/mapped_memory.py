"""What a process's mappings of files under a directory cost: RSS, PSS and private pages, from /proc/<pid>/smaps.

PSS splits each shared page between the processes that map it, so the PSS of N workers'
mappings of one artifact sums to about one copy when the pages are shared, and to N copies
when each worker holds its own. Private_Dirty counts pages a worker wrote to (copy-on-write
copies of a MAP_PRIVATE mapping), which the artifact file never sees.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

__all__ = ["MappedMemory", "mapped_file_memory", "total_mapped_memory"]

_FIELDS = {"Rss:": "rss", "Pss:": "pss", "Private_Dirty:": "private_dirty", "Private_Clean:": "private_clean"}


@dataclass(frozen=True, slots=True)
class MappedMemory:
    """Bytes of one process's (or several processes') file mappings under one directory."""

    rss: int = 0
    pss: int = 0
    private_dirty: int = 0
    private_clean: int = 0
    mappings: int = 0

    def __add__(self, other: MappedMemory) -> MappedMemory:
        return MappedMemory(
            self.rss + other.rss,
            self.pss + other.pss,
            self.private_dirty + other.private_dirty,
            self.private_clean + other.private_clean,
            self.mappings + other.mappings,
        )


def _is_header(line: str) -> bool:
    """A mapping header ("start-end perms offset dev inode [path]") rather than a "Field: value" line."""
    head = line.split(None, 1)[0] if line.strip() else ""
    return "-" in head and not head.endswith(":")


def mapped_file_memory(pid: int | str, directory: Path | str) -> MappedMemory:
    """The memory of `pid`'s mappings of files under `directory` (a path prefix, resolved)."""
    prefix = str(Path(directory).resolve()).rstrip("/") + "/"
    totals = dict.fromkeys(_FIELDS.values(), 0)
    mappings = 0
    inside = False
    with open(f"/proc/{pid}/smaps", encoding="utf-8", errors="replace") as smaps:
        for line in smaps:
            if _is_header(line):
                fields = line.split(None, 5)
                inside = len(fields) == 6 and fields[5].strip().startswith(prefix)
                mappings += inside
                continue
            if inside:
                name, _, rest = line.partition(" ")
                key = _FIELDS.get(name)
                if key is not None:
                    totals[key] += int(rest.split()[0]) * 1024
    return MappedMemory(mappings=mappings, **totals)


def total_mapped_memory(pids: Iterable[int], directory: Path | str) -> MappedMemory:
    """The sum over `pids` of `mapped_file_memory`."""
    total = MappedMemory()
    for pid in pids:
        total = total + mapped_file_memory(pid, directory)
    return total

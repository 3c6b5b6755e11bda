"""Memory readings from /proc shared by the demos and the benchmark: a process's whole RSS and PSS, and the
part of them held by the mappings that contain given address ranges (an artifact's, or a model's weights).

PSS splits each shared page between the processes that map it, so N workers mapping one
artifact sum to about one copy; read it while all of them hold their mappings.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "MappedMemory",
    "MappingUsage",
    "mapped_file_memory",
    "mapped_memory",
    "mappings",
    "memory_rollup",
    "merged_spans",
    "total_mapped_memory",
    "weights_pss",
]

Span = tuple[int, int]  # (address, length in bytes)
_SMAPS_FIELDS = ("Rss:", "Pss:", "Private_Dirty:", "Private_Clean:")


def memory_rollup(pid: int | str = "self") -> tuple[int, int]:
    """(RSS, PSS) in bytes of a whole process, from /proc/<pid>/smaps_rollup (Linux 4.14+)."""
    values: dict[str, int] = {}
    with open(f"/proc/{pid}/smaps_rollup") as rollup:
        for line in rollup:
            name, _, rest = line.partition(":")
            if name in ("Rss", "Pss"):
                values[name] = int(rest.split()[0]) * 1024
    return values.get("Rss", 0), values.get("Pss", 0)


@dataclass(frozen=True, slots=True)
class MappingUsage:
    """One mapping of /proc/<pid>/smaps: its address range, what backs it, its RSS and PSS, and its private pages
    in bytes (Private_Dirty counts copy-on-write copies of a MAP_PRIVATE mapping, which its file never sees)."""

    low: int
    high: int
    path: str
    rss: int
    pss: int
    private_dirty: int = 0
    private_clean: int = 0


def mappings(pid: int | str = "self") -> list[MappingUsage]:
    """Every mapping of a process with its RSS and PSS, from /proc/<pid>/smaps."""
    found: list[MappingUsage] = []
    header: tuple[int, int, str] | None = None
    sizes = dict.fromkeys(_SMAPS_FIELDS, 0)
    with open(f"/proc/{pid}/smaps", encoding="utf-8", errors="replace") as smaps:
        for line in [*smaps, "0-0 end"]:
            head, _, rest = line.partition(" ")
            if "-" in head and not head.endswith(":"):  # a mapping's header: "low-high perms offset dev inode path"
                if header is not None:
                    low_address, high_address, path = header
                    found.append(
                        MappingUsage(
                            low_address,
                            high_address,
                            path,
                            rss=sizes["Rss:"],
                            pss=sizes["Pss:"],
                            private_dirty=sizes["Private_Dirty:"],
                            private_clean=sizes["Private_Clean:"],
                        )
                    )
                low, _, high = head.partition("-")
                fields = rest.split(maxsplit=4)
                header = (int(low, 16), int(high, 16), fields[4].strip() if len(fields) > 4 else "")
                sizes = dict.fromkeys(_SMAPS_FIELDS, 0)
            elif head in sizes:
                sizes[head] = int(rest.split()[0]) * 1024
    return found


def merged_spans(spans: Iterable[Span]) -> list[Span]:
    """The spans sorted, with overlapping or touching ones joined (tied weights share their bytes)."""
    merged: list[list[int]] = []
    for address, length in sorted(span for span in spans if span[1] > 0):
        if merged and address <= merged[-1][0] + merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], address + length - merged[-1][0])
        else:
            merged.append([address, length])
    return [(address, length) for address, length in merged]


def _overlap(mapping: MappingUsage, spans: Sequence[Span]) -> int:
    return sum(max(0, min(mapping.high, a + n) - max(mapping.low, a)) for a, n in spans)


def mapped_memory(spans: Sequence[Span], pid: int | str = "self") -> tuple[int, int]:
    """(RSS, PSS) in bytes of the mappings that overlap any of `spans` (a lease's mapped regions)."""
    chosen = [mapping for mapping in mappings(pid) if _overlap(mapping, spans) > 0]
    return sum(mapping.rss for mapping in chosen), sum(mapping.pss for mapping in chosen)


def weights_pss(spans: Sequence[Span], pid: int | str = "self") -> int:
    """PSS in bytes of the memory holding `spans` (a model's tensors) in process `pid`.

    Per mapping, the smaller of its PSS and the bytes of `spans` inside it: an artifact's file
    mapping counts its shared share, and an anonymous mapping that also holds other
    allocations (the heap) counts no more than the weights in it.
    """
    merged = merged_spans(spans)
    return sum(min(mapping.pss, inside) for mapping in mappings(pid) if (inside := _overlap(mapping, merged)) > 0)


@dataclass(frozen=True, slots=True)
class MappedMemory:
    """Bytes of one process's (or several processes') mappings of the files under one directory."""

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


def mapped_file_memory(pid: int | str, directory: Path | str) -> MappedMemory:
    """The memory of `pid`'s mappings of files under `directory` (an artifacts folder, resolved)."""
    prefix = str(Path(directory).resolve()).rstrip("/") + "/"
    total = MappedMemory()
    for mapping in mappings(pid):
        if mapping.path.startswith(prefix):
            total = total + MappedMemory(
                mapping.rss, mapping.pss, mapping.private_dirty, mapping.private_clean, mappings=1
            )
    return total


def total_mapped_memory(pids: Iterable[int], directory: Path | str) -> MappedMemory:
    """The sum over `pids` of `mapped_file_memory`: N workers sharing one artifact sum to about one copy."""
    total = MappedMemory()
    for pid in pids:
        total = total + mapped_file_memory(pid, directory)
    return total

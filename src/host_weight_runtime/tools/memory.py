"""Memory readings from /proc shared by the demos and the benchmark: a process's whole RSS and PSS, and the
part of them held by the mappings that contain given address ranges (an artifact's, or a model's weights).

PSS splits each shared page between the processes that map it, so N workers mapping one
artifact sum to about one copy; read it while all of them hold their mappings.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = ["MappingUsage", "mapped_memory", "mappings", "memory_rollup", "merged_spans", "weights_pss"]

Span = tuple[int, int]  # (address, length in bytes)


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
    """One mapping of /proc/<pid>/smaps: its address range, what backs it, and its RSS and PSS in bytes."""

    low: int
    high: int
    path: str
    rss: int
    pss: int


def mappings(pid: int | str = "self") -> list[MappingUsage]:
    """Every mapping of a process with its RSS and PSS, from /proc/<pid>/smaps."""
    found: list[MappingUsage] = []
    header: tuple[int, int, str] | None = None
    sizes = {"Rss:": 0, "Pss:": 0}
    with open(f"/proc/{pid}/smaps") as smaps:
        for line in [*smaps, "0-0 end"]:
            head, _, rest = line.partition(" ")
            if "-" in head and not head.endswith(":"):  # a mapping's header: "low-high perms offset dev inode path"
                if header is not None:
                    found.append(MappingUsage(*header, rss=sizes["Rss:"], pss=sizes["Pss:"]))
                low, _, high = head.partition("-")
                fields = rest.split(maxsplit=4)
                header = (int(low, 16), int(high, 16), fields[4].strip() if len(fields) > 4 else "")
                sizes = {"Rss:": 0, "Pss:": 0}
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

"""Which rows of a tensor have been written, so a payload file is accepted only when every byte was written once.

Also the check that turns one `write_tensor` / `write_rows` call into the row interval it covers.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from ._safetensors_layout import Placement
from ._write_failures import producer_failed

if TYPE_CHECKING:
    import torch

__all__ = ["RowCoverage", "claims_of", "rows_of_write"]


class RowCoverage:
    """Mutable bookkeeping for one tensor: written row intervals and the claims of writes in flight."""

    __slots__ = ("done", "pending", "placement")

    def __init__(self, placement: Placement) -> None:
        self.placement = placement
        self.done: list[tuple[int, int]] = []  # sorted, merged, half-open row intervals
        self.pending: list[tuple[int, int]] = []  # claimed by writes still in flight

    def overlaps(self, start: int, stop: int) -> tuple[int, int] | None:
        """The first already written or in-flight interval that meets [start, stop), if any."""
        index = bisect.bisect_left(self.done, stop, key=lambda interval: interval[0])
        if index and self.done[index - 1][1] > start:  # the last interval that begins before `stop`
            return self.done[index - 1]
        for candidate in self.pending:
            if candidate[0] < stop and start < candidate[1]:
                return candidate
        return None

    def mark_done(self, start: int, stop: int) -> None:
        index = bisect.bisect_left(self.done, (start, stop))
        self.done.insert(index, (start, stop))
        merged: list[tuple[int, int]] = []
        for begin, end in self.done[max(index - 1, 0) : index + 2]:
            if merged and merged[-1][1] == begin:
                merged[-1] = (merged[-1][0], end)
            else:
                merged.append((begin, end))
        self.done[max(index - 1, 0) : index + 2] = merged

    def first_missing(self) -> tuple[int, int] | None:
        """The first row interval never written, or None when every byte is covered."""
        if self.placement.nbytes == 0:
            return None
        position = 0
        for begin, end in self.done:
            if begin > position:
                return (position, begin)
            position = end
        if position < self.placement.rows:
            return (position, self.placement.rows)
        return None


def rows_of_write(
    file_name: str, placement: Placement, start_row: int | None, tensor: torch.Tensor, *, converts: bool = False
) -> tuple[int, int]:
    """Validate one write against the declared spec; returns the half-open row interval it covers.

    `start_row` is None for `write_tensor` (the whole tensor) and the first row for `write_rows`.
    `converts`: the writer converts the rows to the declared dtype itself (`copy_rows`), so any dtype is fine.
    """
    import torch  # the producer holds a tensor, so this is a lookup; the module itself stays torch-free

    spec = placement.spec
    where = f"{file_name}: tensor {spec.name}"
    if not isinstance(tensor, torch.Tensor):
        raise producer_failed(
            f"{where}: expected a torch.Tensor, got {type(tensor).__name__}", file=file_name, tensor=spec.name
        )
    if tensor.device.type != "cpu" or tensor.layout != torch.strided:
        raise producer_failed(
            f"{where}: expected a dense CPU tensor, got {tensor.device} / {tensor.layout}; move it to the CPU",
            file=file_name,
            tensor=spec.name,
        )
    if tensor.dtype != spec.dtype and not converts:
        raise producer_failed(
            f"{where}: dtype {tensor.dtype} differs from the declared {spec.dtype}",
            file=file_name,
            tensor=spec.name,
        )
    shape = tuple(tensor.shape)
    if start_row is None:
        if shape != spec.shape:
            raise producer_failed(
                f"{where}: shape {shape} differs from the declared {spec.shape}", file=file_name, tensor=spec.name
            )
        return (0, placement.rows)
    if not spec.shape:
        raise producer_failed(
            f"{where}: a 0-dim tensor has no rows; use write_tensor", file=file_name, tensor=spec.name
        )
    if type(start_row) is not int or start_row < 0:
        raise producer_failed(
            f"{where}: start_row must be a non-negative int, got {start_row!r}", file=file_name, tensor=spec.name
        )
    if len(shape) != len(spec.shape) or shape[1:] != spec.shape[1:]:
        raise producer_failed(
            f"{where}: rows of shape {shape} do not fit the declared {spec.shape} (trailing dims must match)",
            file=file_name,
            tensor=spec.name,
        )
    stop = start_row + shape[0]
    if stop > spec.shape[0]:
        raise producer_failed(
            f"{where}: rows {start_row}..{stop} run past the declared {spec.shape[0]} rows",
            file=file_name,
            tensor=spec.name,
            start_row=start_row,
            stop_row=stop,
        )
    return (start_row, stop)


def claims_of(
    file_name: str, coverage: Mapping[str, RowCoverage], placements: Sequence[Placement], begin: int, end: int
) -> list[tuple[RowCoverage, int, int]]:
    """The row intervals that data bytes [begin, end) cover, or a producer failure unless they are whole rows."""
    if not placements or end < begin or end > placements[-1].end:
        raise producer_failed(f"{file_name}: data bytes {begin}..{end} run past its tensors", file=file_name)
    claims: list[tuple[RowCoverage, int, int]] = []
    # Placements are contiguous in offset order: start at the first that ends after `begin` (a bisection, so
    # a file of many tensors written piece by piece costs O(log n) per piece, not a scan of every tensor).
    first = bisect.bisect_right(placements, begin, key=_end_of)
    for index in range(first, len(placements)):
        placement = placements[index]
        if placement.begin >= end:
            break
        low, high = max(begin, placement.begin), min(end, placement.end)
        if low >= high:
            continue
        row_bytes = max(placement.row_bytes, 1)
        if (low - placement.begin) % row_bytes or (high - placement.begin) % row_bytes:
            raise producer_failed(
                f"{file_name}: data bytes {begin}..{end} split a row of tensor {placement.spec.name}; copy whole rows",
                file=file_name,
                tensor=placement.spec.name,
            )
        first, stop = (low - placement.begin) // row_bytes, (high - placement.begin) // row_bytes
        claims.append((coverage[placement.spec.name], first, stop))
    return claims


def _end_of(placement: Placement) -> int:
    return placement.end

"""The reused buffers a payload file converts `copy_rows` chunks into, each reused once the lane is done with it."""

from __future__ import annotations

from concurrent.futures import Future
from concurrent.futures import wait as futures_wait
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["CAST_BUFFERS", "CastBuffers"]


CAST_BUFFERS = 2
"""Buffers in rotation: one being converted into while the lane writes and hashes the other. A third one
cost about 15% more CPU on the 2-core VM (three 16 MiB buffers no longer stay in its 32 MiB L3 cache)."""


class CastBuffers:
    """Reusable buffers that `copy_rows` converts rows into: the lane writes and hashes one while the next
    is filled.

    Converting into a small buffer that is reused (so its pages stay mapped and mostly in cache) and
    writing it with `pwrite` costs less CPU than converting into a shared mapping of a tmpfs file: a
    fallocated tmpfs page is zeroed on its first fault and its page-table entry and dirty state are set
    up per page, while `pwrite` copies over it without zeroing (measured on the 2-core VM, 256 MiB into a
    fallocated file: `pwrite` about 66 ms of CPU, populated shared mapping + copy about 195 ms).
    """

    __slots__ = ("_buffers", "_next", "_pending")

    def __init__(self) -> None:
        self._buffers: list[torch.Tensor | None] = [None] * CAST_BUFFERS
        self._pending: list[Future[None] | None] = [None] * CAST_BUFFERS
        self._next = 0

    def take(self, nbytes: int) -> tuple[int, torch.Tensor]:
        """A buffer of `nbytes` (uint8) whose previous bytes are written and hashed already, and its index."""
        import torch  # the caller holds a tensor, so this is a lookup; the module itself stays torch-free

        index, self._next = self._next, (self._next + 1) % CAST_BUFFERS
        pending, self._pending[index] = self._pending[index], None
        if pending is not None:
            futures_wait([pending])  # its failure, if any, is raised by the lane's next feed or wait
        buffer = self._buffers[index]
        if buffer is None or buffer.numel() < nbytes:
            self._buffers[index] = None  # free the smaller one first
            buffer = self._buffers[index] = torch.empty(nbytes, dtype=torch.uint8)
        return index, buffer[:nbytes]

    def hashed_by(self, index: int, future: Future[None]) -> None:
        """Buffer `index` may be reused only once `future` (its write and hash on the lane) is done."""
        self._pending[index] = future

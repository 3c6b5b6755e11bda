"""The reused ring of memory a payload file converts `copy_rows` chunks into, each slot reused once the lane is done
with it."""

from __future__ import annotations

import collections
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import wait as futures_wait
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["CAST_RING_BYTES", "CAST_SLOTS", "CastBuffers"]


CAST_RING_BYTES = 32 * 2**20
"""The ring's usual size: two of the stream's largest converted chunks (16 MiB each). A larger ring cost about
15% more CPU on the 2-core VM (converted bytes no longer stay in its 32 MiB L3 cache until they are written)."""

CAST_SLOTS = 16
"""Chunks in flight at most: many small tensors (biases, norms) may be queued while one large one is written."""

_ALIGN = 64  # each slot starts on a cache line, so any dtype can view it


class _Slot:
    __slots__ = ("begin", "end", "future")

    def __init__(self, begin: int, end: int) -> None:
        self.begin = begin
        self.end = end
        self.future: Future[None] | None = None

    def overlaps(self, other: _Slot) -> bool:
        return other.begin < self.end and self.begin < other.end


class CastBuffers:
    """A ring of memory that `copy_rows` converts rows into: the lane writes and hashes earlier chunks while the
    next ones are converted, and a slot is reused once its chunk is written and hashed.

    A ring rather than two alternating buffers: a checkpoint is mostly a large weight followed by a small
    bias or norm, and with two buffers the large weight after the bias waited for the previous weight's write
    (the converting thread and the write thread then took turns instead of running side by side). Converting
    into memory that is reused (so its pages stay mapped and mostly in cache) and writing it with `pwrite`
    costs less CPU than converting into a shared mapping of a tmpfs file: a fallocated tmpfs page is zeroed on
    its first fault and its page-table entry and dirty state are set up per page, while `pwrite` copies over
    it without zeroing (measured on the 2-core VM, 256 MiB into a fallocated file: `pwrite` about 66 ms of
    CPU, populated shared mapping + copy about 195 ms).
    """

    __slots__ = ("_await", "_head", "_pending", "_ring", "_ring_bytes", "_slots")

    def __init__(
        self,
        ring_bytes: int = CAST_RING_BYTES,
        slots: int = CAST_SLOTS,
        *,
        await_chunk: Callable[[Future[None]], object] = lambda future: futures_wait([future]),
    ) -> None:
        """`await_chunk` waits for a chunk's write and hash (its failure, if any, is raised by the lane's next
        feed or wait); tests pass one that records what was waited for."""
        if ring_bytes <= 0 or slots <= 0:
            raise ValueError(f"ring_bytes and slots must be positive, got {ring_bytes!r} and {slots!r}")
        self._ring: torch.Tensor | None = None
        self._ring_bytes = ring_bytes
        self._slots = slots
        self._await = await_chunk
        self._head = 0
        self._pending: collections.deque[_Slot] = collections.deque()  # oldest first; the lane finishes in order

    def take(self, nbytes: int) -> tuple[_Slot, torch.Tensor]:
        """Memory for `nbytes` (uint8) whose previous bytes are written and hashed already, and its slot."""
        import torch  # the caller holds a tensor, so this is a lookup; the module itself stays torch-free

        ring = self._ring
        if ring is None or 2 * nbytes > ring.numel():
            self._wait_all()  # a larger ring for a larger chunk: nothing may still read the old one
            self._ring = None
            ring = self._ring = torch.empty(max(self._ring_bytes, 2 * nbytes + _ALIGN), dtype=torch.uint8)
            self._head = 0
        begin = self._head
        if begin + nbytes > ring.numel():
            begin = 0
        slot = _Slot(begin, begin + nbytes)
        while self._pending and (len(self._pending) >= self._slots or any(map(slot.overlaps, self._pending))):
            self._wait(self._pending.popleft())
        self._pending.append(slot)
        self._head = -(-slot.end // _ALIGN) * _ALIGN
        return slot, ring[slot.begin : slot.end]

    def hashed_by(self, slot: _Slot, future: Future[None]) -> None:
        """`slot` may be reused only once `future` (its write and hash on the lane) is done."""
        slot.future = future

    def _wait_all(self) -> None:
        while self._pending:
            self._wait(self._pending.popleft())

    def _wait(self, slot: _Slot) -> None:
        if slot.future is not None and not slot.future.done():
            self._await(slot.future)

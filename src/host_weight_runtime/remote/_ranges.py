"""The read plan and buffers of a one-pass remote import from an object store: byte ranges of a payload file, the
tensors each range carries, reused range buffers, and the hash lanes that hash each range from its buffer behind
the writes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

import collections
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from .._digest import DigestAlgorithm, TreeHasher
from ..manifest import FileManifestEntry, TensorManifestEntry
from ..protocols import (
    TensorWriteSpec,
)
from ..tensors import dtype_from_code, dtype_itemsize

__all__ = [
    "HashLanes",
    "RangeBuffers",
    "RangeWrite",
    "ReadRange",
    "leaf_threads",
    "plan_ranges",
    "spec_of",
    "tensor_from",
]

# --------------------------------------------------------------------------- read plan


@dataclass(frozen=True, slots=True)
class RangeWrite:
    """One writer call: rows [start_row, start_row + rows) of a tensor, at `offset` inside its range."""

    spec: TensorWriteSpec
    entry: TensorManifestEntry
    start_row: int | None  # None: write_tensor (0-dim or empty tensors)
    rows: int
    offset: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class ReadRange:
    """One ranged read [start, end) of a payload object and the writes it feeds."""

    start: int
    end: int
    writes: tuple[RangeWrite, ...]


def plan_ranges(
    file: FileManifestEntry,
    tensors: tuple[TensorManifestEntry, ...],
    chunk_bytes: int,
) -> list[ReadRange]:
    """Split a file's data section into reads of about `chunk_bytes`, each ending on a row boundary."""
    ranges: list[ReadRange] = []
    pending: list[RangeWrite] = []
    range_start = file.header_size
    position = file.header_size

    limit = chunk_bytes

    def flush() -> None:
        nonlocal pending, range_start
        if pending:
            ranges.append(ReadRange(range_start, position, tuple(pending)))
        pending = []
        range_start = position

    for entry in tensors:
        spec = spec_of(entry)
        if not entry.shape or entry.nbytes == 0:
            if position - range_start + entry.nbytes > limit:
                flush()
            pending.append(RangeWrite(spec, entry, None, 0, position - range_start, entry.nbytes))
            position += entry.nbytes
            continue
        rows_total = entry.shape[0]
        row_bytes = entry.nbytes // rows_total
        row = 0
        while row < rows_total:
            room = limit - (position - range_start)
            if room < row_bytes and pending:
                flush()
                room = limit
            rows = min(rows_total - row, max(1, room // row_bytes))
            nbytes = rows * row_bytes
            pending.append(RangeWrite(spec, entry, row, rows, position - range_start, nbytes))
            position += nbytes
            row += rows
    flush()
    return ranges


def spec_of(entry: TensorManifestEntry) -> TensorWriteSpec:
    return TensorWriteSpec(
        name=entry.name, shape=entry.shape, dtype=dtype_from_code(entry.dtype), kind=entry.kind, role=entry.role
    )


def tensor_from(buffer: bytearray, write: RangeWrite) -> torch.Tensor:
    """A tensor viewing `write`'s bytes inside `buffer` (no copy); written before the buffer is dropped."""
    import torch  # only a fetch needs it: `hwr inspect` and friends start without torch

    dtype = write.spec.dtype
    if write.nbytes == 0:
        return torch.empty(write.spec.shape, dtype=dtype)
    count = write.nbytes // dtype_itemsize(dtype)
    flat = torch.frombuffer(buffer, dtype=dtype, count=count, offset=write.offset)
    shape = write.spec.shape if write.start_row is None else (write.rows, *write.spec.shape[1:])
    return flat.reshape(shape)


class HashLanes:
    """Hashes each range's bytes right after they were written, behind the writes, in file order.

    One lane thread feeds every tensor's tree hasher in order (ranges of a tensor arrive in
    order); whole digest chunks spread over a few more threads. At most `pending` ranges wait
    for hashing, so memory stays bounded; `drain` waits for them and raises what they raised.
    """

    def __init__(self, chunk_bytes: int, algorithm: DigestAlgorithm, *, pending: int, buffers: RangeBuffers) -> None:
        self.buffers = buffers
        self._chunk_bytes = chunk_bytes
        self._algorithm = algorithm
        self._pending = pending
        self._lane = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hwr-remote-hash")
        self._leaves = ThreadPoolExecutor(max_workers=leaf_threads(), thread_name_prefix="hwr-remote-leaf")
        self._queued: collections.deque[Future[None]] = collections.deque()

    def __enter__(self) -> HashLanes:
        return self

    def __exit__(self, *exc_info: object) -> None:
        for future in self._queued:
            future.cancel()
        self._lane.shutdown(wait=True)
        self._leaves.shutdown(wait=True)

    def open_file(self, tensors: tuple[TensorManifestEntry, ...]) -> dict[str, TreeHasher]:
        return {tensor.name: TreeHasher(self._chunk_bytes, self._algorithm) for tensor in tensors}

    def hash_behind(self, hashers: dict[str, TreeHasher], buffer: bytearray, writes: tuple[RangeWrite, ...]) -> None:
        while len(self._queued) >= self._pending:
            self._queued.popleft().result()
        self._queued.append(self._lane.submit(self._hash, hashers, buffer, writes))

    def hash_stored(self, hashers: dict[str, TreeHasher], view: memoryview, writes: tuple[RangeWrite, ...]) -> None:
        """Hash a range from a view of the bytes as stored (the lane releases it), behind the next write."""
        while len(self._queued) >= self._pending:
            self._queued.popleft().result()
        self._queued.append(self._lane.submit(self._hash_view, hashers, view, writes))

    def drain(self, through: Future[None] | None = None) -> None:
        """Wait for every queued hash, or only up to `through` (the lane runs them in order); raise what they raised."""
        if through is not None and through not in self._queued:
            through.result()
            return
        while self._queued:
            future = self._queued.popleft()
            future.result()
            if future is through:
                return

    def _hash(self, hashers: dict[str, TreeHasher], buffer: bytearray, writes: tuple[RangeWrite, ...]) -> None:
        with memoryview(buffer) as whole:
            for write in writes:
                hashers[write.spec.name].update(whole[write.offset : write.offset + write.nbytes], self._leaves)
        self.buffers.give(buffer)

    def _hash_view(self, hashers: dict[str, TreeHasher], view: memoryview, writes: tuple[RangeWrite, ...]) -> None:
        with view:
            for write in writes:
                with view[write.offset : write.offset + write.nbytes] as piece:
                    hashers[write.spec.name].update(piece, self._leaves)


class RangeBuffers:
    """Range buffers handed back after use: a fresh buffer of tens of MiB costs a page fault and a zeroed page
    per 4 KiB on first touch; a reused one costs neither. Only buffers of the usual size are kept, at most `keep`."""

    def __init__(self, size: int, *, keep: int) -> None:
        self._size = size
        self._keep = keep
        self._free: list[bytearray] = []
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> bytearray:
        if nbytes > self._size:
            return bytearray(nbytes)  # one row longer than a range: read whole, never kept
        with self._lock:
            if self._free:
                return self._free.pop()
        return bytearray(self._size)

    def give(self, buffer: bytearray) -> None:
        if len(buffer) != self._size:
            return
        with self._lock:
            if len(self._free) < self._keep:
                self._free.append(buffer)


def leaf_threads() -> int:
    return max(1, min(8, os.cpu_count() or 1))


# --------------------------------------------------------------------------- provider

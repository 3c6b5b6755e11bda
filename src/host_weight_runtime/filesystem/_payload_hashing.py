"""The one place the writer hashes payload bytes: rows converted by the writer are written on one lane thread
while the converting thread hashes them (from the buffer they were converted into, never read back); other
ordered writes are read back tensor by tensor on the pool behind the writes; unordered files from one mapping at close.
"""

from __future__ import annotations

import collections
import contextlib
import mmap
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait

from .._digest import (
    DEFAULT_DIGEST_ALGORITHM,
    DigestAlgorithm,
    LeafHasher,
    chunk_digest,
    combine_chunk_digests,
    file_digest,
    leaf_hasher,
    tree_digest,
    tree_digests_parallel,
)
from .._faults import fault_point
from ._safetensors_layout import FileLayout, Placement
from ._write_failures import os_failed

__all__ = ["InOrderHashLane", "PayloadHasher", "hash_file_range"]


def hash_file_range(fd: int, offset: int, length: int, algorithm: DigestAlgorithm = DEFAULT_DIGEST_ALGORITHM) -> bytes:
    """The chunk digest of `length` bytes at `offset` of a written file, through a mapping of just those bytes."""
    fault_point("writer.hash")
    if length == 0:
        return chunk_digest(memoryview(b""), algorithm)
    aligned = offset - offset % mmap.ALLOCATIONGRANULARITY
    with (
        mmap.mmap(fd, offset - aligned + length, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ, offset=aligned) as mapping,
        memoryview(mapping) as whole,
        whole[offset - aligned :] as piece,
    ):
        return chunk_digest(piece, algorithm)


class _Leaf:
    """The bytes of one leaf that a piece completes: [begin, end) of the piece's buffer, after what
    `started` (the leaf's earlier bytes, from earlier pieces) already hashed."""

    __slots__ = ("begin", "end", "index", "started")

    def __init__(self, index: int, started: LeafHasher | None, begin: int, end: int) -> None:
        self.index = index
        self.started = started
        self.begin = begin
        self.end = end


class _TensorLeaves:
    """One tensor's leaf digests as they are completed (in any order), and the hasher of the leaf its
    bytes so far end inside, which only the caller's thread continues."""

    __slots__ = ("digests", "fed", "partial", "total")

    def __init__(self, total: int, chunk_bytes: int) -> None:
        self.total = total
        self.fed = 0
        self.partial: LeafHasher | None = None
        self.digests: list[bytes | None] = [None] * max(1, -(-total // chunk_bytes))


class InOrderHashLane:
    """Tree digests of tensors whose bytes are handed over in order, each piece written on the lane's write
    thread while its leaves are hashed on both threads, shared by the CPU each has spent.

    The writer converts rows into a reused buffer and hands the lane that buffer: the write thread
    `pwrite`s it, and the leaves the piece completes are hashed from the same bytes, still in cache from
    the conversion, some by the caller's thread while the write runs and some by the write thread right
    after it (both only read the buffer, and both release the GIL). A tree digest's leaves are
    independent (docs/DIGEST.md), so a piece's leaves go to whichever thread has spent less CPU on the
    lane so far, counting the work already handed to it: the split follows the costs measured on this
    machine, piece by piece, and neither thread waits for the other's hash of an earlier piece. Only a
    leaf that a piece leaves unfinished is hashed on the caller's thread before `feed` returns, so the
    next piece continues it; no byte is copied or read back. The first failure on any thread is kept;
    later pieces are skipped and the writer's next `feed` or `wait` raises it. `clock` (the calling
    thread's CPU seconds) is a seam for tests.
    """

    __slots__ = (
        "_algorithm",
        "_caller_started",
        "_chunk_bytes",
        "_clock",
        "_error",
        "_in_flight",
        "_last_store",
        "_lock",
        "_queued",
        "_tensors",
        "_write_pool",
        "_writer_busy",
        "_writer_hash",
        "_writer_store",
        "hashed_while_writing",
    )

    def __init__(
        self, *, chunk_bytes: int, algorithm: DigestAlgorithm, clock: Callable[[], float] = time.thread_time
    ) -> None:
        self._chunk_bytes = chunk_bytes
        self._algorithm = algorithm
        self._clock = clock
        self._tensors: dict[str, _TensorLeaves] = {}
        self._write_pool: ThreadPoolExecutor | None = None
        self._last_store: Future[None] | None = None  # the write thread runs in order: its latest piece is done last
        self._caller_started: float | None = None  # the caller's CPU clock at the first piece
        # the write thread's CPU seconds and bytes (only it writes them): [seconds, bytes]
        self._writer_store = [0.0, 0]
        self._writer_hash = [0.0, 0]
        self._writer_busy = 0.0  # CPU seconds of the write thread's finished pieces
        self._in_flight: collections.deque[tuple[Future[None], float]] = collections.deque()  # (piece, estimate)
        self._queued = 0.0  # the estimates in _in_flight, summed
        self._lock = threading.Lock()
        self._error: BaseException | None = None  # the first failed piece; later pieces are skipped
        self.hashed_while_writing = 0
        """Leaves the write thread hashed (after its write)."""

    def feed(
        self, name: str, whole: memoryview, begin: int, end: int, store: Callable[[], None], *, tensor_nbytes: int
    ) -> Future[None]:
        """Bytes [begin, end) of `whole` are the next bytes of tensor `name` (`tensor_nbytes` long in all):
        `store` (the writer's `pwrite` of them) runs on the write thread, and the leaves they complete are
        hashed on either thread (see the class). The future is done once the write and every hash of these
        bytes are; the caller keeps the bytes unchanged until then."""
        if self._error is not None:
            raise self._error  # an earlier piece failed: stop the writer now rather than at close
        tensor = self._tensors.get(name)
        if tensor is None:
            tensor = self._tensors[name] = _TensorLeaves(tensor_nbytes, self._chunk_bytes)
        if tensor.total != tensor_nbytes or end - begin > tensor.total - tensor.fed:
            raise ValueError(
                f"{name}: {end - begin} more bytes after {tensor.fed} do not fit a tensor of {tensor.total} bytes "
                f"(fed as {tensor_nbytes})"
            )
        nbytes = end - begin
        completed, unfinished = self._leaves_of(tensor, begin, end)
        now = self._clock()
        if self._caller_started is None:
            self._caller_started = now
        store_rate = _rate(self._writer_store, _STORE_SECONDS_PER_BYTE)
        hash_rate = _rate(self._writer_hash, _HASH_SECONDS_PER_BYTE)
        mine, theirs = self._share(completed, nbytes * store_rate, hash_rate, now - self._caller_started)
        hashed_there = sum(leaf.end - leaf.begin for leaf in theirs)
        if self._write_pool is None:
            self._write_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hwr-write-lane")

        def on_write_thread() -> None:
            started = self._clock()
            self._run(store)
            stored = self._clock()
            self._writer_store[0] += stored - started
            self._writer_store[1] += nbytes
            finished = stored
            if theirs:
                self._run(lambda: self._hash_leaves(tensor, whole, theirs))
                finished = self._clock()
                self._writer_hash[0] += finished - stored
                self._writer_hash[1] += hashed_there
            self._writer_busy += finished - started

        stored = self._last_store = self._write_pool.submit(on_write_thread)
        estimate = nbytes * store_rate + hashed_there * hash_rate
        self._in_flight.append((stored, estimate))
        self._queued += estimate
        self.hashed_while_writing += len(theirs)
        if mine or unfinished is not None:
            self._run(lambda: self._hash_here(tensor, whole, mine, unfinished))
        if self._error is not None:
            raise self._error
        return stored

    def _leaves_of(self, tensor: _TensorLeaves, begin: int, end: int) -> tuple[list[_Leaf], _Leaf | None]:
        """The leaves bytes [begin, end) complete, and the part of a leaf they leave unfinished (if any)."""
        completed: list[_Leaf] = []
        unfinished: _Leaf | None = None
        chunk_bytes = self._chunk_bytes
        position = tensor.fed
        at = begin
        while at < end:
            index = position // chunk_bytes
            leaf_end = min((index + 1) * chunk_bytes, tensor.total)
            step = min(end - at, leaf_end - position)
            started, tensor.partial = tensor.partial, None
            leaf = _Leaf(index, started, at, at + step)
            if position + step == leaf_end:
                completed.append(leaf)
            else:
                unfinished = leaf
            position += step
            at += step
        tensor.fed = position
        return completed, unfinished

    def _share(
        self, completed: list[_Leaf], store_cost: float, hash_rate: float, caller_busy: float
    ) -> tuple[list[_Leaf], list[_Leaf]]:
        """Split a piece's completed leaves: each, largest first, to the thread whose CPU so far, plus what it
        has been handed and not finished, plus this piece's share, is the smaller."""
        in_flight = self._in_flight
        while in_flight and in_flight[0][0].done():
            self._queued -= in_flight.popleft()[1]
        if not completed:
            return completed, completed
        writer_load = self._writer_busy + self._queued + store_cost
        if len(completed) == 1:
            return ([], completed) if writer_load <= caller_busy else (completed, [])
        caller_load = caller_busy
        mine: list[_Leaf] = []
        theirs: list[_Leaf] = []
        for leaf in sorted(completed, key=lambda leaf: leaf.end - leaf.begin, reverse=True):
            cost = (leaf.end - leaf.begin) * hash_rate
            if writer_load <= caller_load:
                theirs.append(leaf)
                writer_load += cost
            else:
                mine.append(leaf)
                caller_load += cost
        return mine, theirs

    def _hash_here(self, tensor: _TensorLeaves, whole: memoryview, mine: list[_Leaf], unfinished: _Leaf | None) -> None:
        self._hash_leaves(tensor, whole, mine)
        if unfinished is not None:  # continued by the next piece, which only this thread feeds
            fault_point("writer.hash")
            hasher = unfinished.started if unfinished.started is not None else leaf_hasher(self._algorithm)
            with whole[unfinished.begin : unfinished.end] as piece:
                hasher.update(piece)
            tensor.partial = hasher

    def _hash_leaves(self, tensor: _TensorLeaves, whole: memoryview, leaves: list[_Leaf]) -> None:
        for leaf in leaves:
            fault_point("writer.hash")
            with whole[leaf.begin : leaf.end] as piece:
                if leaf.started is None:
                    tensor.digests[leaf.index] = chunk_digest(piece, self._algorithm)
                else:
                    leaf.started.update(piece)
                    tensor.digests[leaf.index] = leaf.started.digest()

    def _run(self, step: Callable[[], None]) -> None:
        if self._error is not None:
            return
        try:
            step()
        except BaseException as exc:  # recorded, raised by the writer's next feed or wait
            with self._lock:
                if self._error is None:
                    self._error = exc

    def holds(self, name: str) -> bool:
        """Whether tensor `name` is hashed by this lane (it was fed)."""
        return name in self._tensors

    def digest(self, name: str) -> str:
        """The tree digest of tensor `name`; waits for the lane (its first failure raises). Every byte of the
        tensor must have been fed."""
        self.wait()
        tensor = self._tensors[name]
        if tensor.fed != tensor.total:
            raise ValueError(f"{name}: only {tensor.fed} of its {tensor.total} bytes were fed")
        if tensor.total == 0:
            return combine_chunk_digests(0, [chunk_digest(memoryview(b""), self._algorithm)], self._algorithm)
        leaves = [leaf for leaf in tensor.digests if leaf is not None]
        assert len(leaves) == len(tensor.digests), f"{name}: a leaf was never hashed"
        return combine_chunk_digests(tensor.total, leaves, self._algorithm)

    def wait(self) -> None:
        """Wait until every piece fed so far is written and hashed; raises the first failure of any of them."""
        if self._last_store is not None:
            futures_wait([self._last_store])
        if self._error is not None:
            raise self._error

    def drain(self) -> None:
        """Stop the write thread once every queued piece has run (so none reads a closed mapping); never raises."""
        if self._write_pool is not None:
            self._write_pool.shutdown(wait=True)
        self._write_pool = None


_HASH_SECONDS_PER_BYTE = 0.4e-9
"""A first guess of a leaf hash's CPU per byte, until this lane has measured its own."""
_STORE_SECONDS_PER_BYTE = 0.8e-9
"""A first guess of a `pwrite`'s CPU per byte into tmpfs, until this lane has measured its own."""


def _rate(measured: list[float], guess: float) -> float:
    """Seconds per byte from the write thread's [seconds, bytes] counters, or the guess before any."""
    seconds, nbytes = measured
    return seconds / nbytes if nbytes else guess


class PayloadHasher:
    """The digests of one payload file: per tensor, and of the whole file (header included).

    Not thread-safe: the file writer calls it under its own lock. It reads through the
    writer's descriptor, so `drain()` must run before that descriptor is closed.
    """

    __slots__ = (
        "_algorithm",
        "_chunk_bytes",
        "_executor",
        "_fd",
        "_hash_threads",
        "_layout",
        "_name",
        "_queued",
        "lane",
    )

    def __init__(
        self,
        fd: int,
        name: str,
        layout: FileLayout,
        *,
        chunk_bytes: int,
        algorithm: DigestAlgorithm = DEFAULT_DIGEST_ALGORITHM,
        hash_threads: int | None,
        executor: Callable[[], ThreadPoolExecutor],
    ) -> None:
        self._fd = fd
        self._name = name
        self._layout = layout
        self._chunk_bytes = chunk_bytes
        self._algorithm = algorithm
        self._hash_threads = hash_threads
        self._executor = executor
        self._queued: dict[str, list[Future[bytes]]] = {}  # ordered files: chunk hashes by tensor name
        self.lane = InOrderHashLane(chunk_bytes=chunk_bytes, algorithm=algorithm)
        """Tensors whose rows were copied into the file's mapping: hashed as they were copied."""

    def hash_behind(self, placement: Placement) -> None:
        """Queue the chunks of a completely written tensor for hashing on the pool; later calls do nothing.

        Writing goes on while earlier tensors hash, so publication runs at the speed of all
        hash threads together, and the producer may reuse its buffers as soon as a write
        returns. Each chunk maps only its own bytes, so the mapped memory stays bounded.
        """
        name = placement.spec.name
        if name in self._queued:
            return
        chunk_bytes = self._chunk_bytes
        begin = len(self._layout.header) + placement.begin
        length = placement.end - placement.begin
        pool = self._executor()
        starts = range(begin, begin + length, chunk_bytes) if length else range(begin, begin + 1)
        self._queued[name] = [
            pool.submit(hash_file_range, self._fd, start, min(chunk_bytes, begin + length - start), self._algorithm)
            for start in starts
        ]

    def drain(self) -> None:
        """Wait for every queued chunk hash, so none reads the file after its descriptor closes; never raises."""
        self.lane.drain()
        for futures in self._queued.values():
            for future in futures:
                future.cancel()
                with contextlib.suppress(BaseException):  # only waiting here; results are read elsewhere
                    future.exception()

    def tensor_digests(self, *, ordered: bool) -> list[str]:
        """Every tensor's digest, in offset order: from the queued chunks (ordered) or the whole file."""
        if not ordered:
            return self._hash_from_file()
        digests = []
        try:
            for placement in self._layout.placements:
                if self.lane.holds(placement.spec.name):
                    digests.append(self.lane.digest(placement.spec.name))
                    continue
                self.hash_behind(placement)  # a tensor with no bytes was never written, so never queued
                chunk_results = [future.result() for future in self._queued[placement.spec.name]]
                digests.append(combine_chunk_digests(placement.end - placement.begin, chunk_results, self._algorithm))
        finally:
            self.drain()
        return digests

    def file_digest(self, tensor_digests: list[str]) -> str:
        """The file's digest: its header bytes and its tensors' digests together."""
        return file_digest(tree_digest(self._layout.header, self._chunk_bytes, self._algorithm), tensor_digests)

    def _hash_from_file(self) -> list[str]:
        """Hash every tensor from the file itself, chunks spread over the hash threads."""
        header_size = len(self._layout.header)
        try:
            fault_point("writer.hash")
            mapping = mmap.mmap(self._fd, self._layout.size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        except OSError as exc:
            raise os_failed(exc, f"mapping {self._name} to hash it", file=self._name) from exc
        try:
            whole = memoryview(mapping)
            views = [whole[header_size + p.begin : header_size + p.end] for p in self._layout.placements]
            try:
                return tree_digests_parallel(
                    views, chunk_bytes=self._chunk_bytes, threads=self._hash_threads, algorithm=self._algorithm
                )
            finally:
                for view in views:
                    view.release()
                whole.release()
        finally:
            with contextlib.suppress(BufferError):  # a view still alive after an error; it goes with it
                mapping.close()

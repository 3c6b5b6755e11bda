"""The one place the writer hashes payload bytes: rows converted by the writer are written on one lane thread
while the converting thread hashes them (from the buffer they were converted into, never read back); other
ordered writes are read back tensor by tensor on the pool behind the writes; unordered files from one mapping at close.
"""

from __future__ import annotations

import contextlib
import mmap
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait

from .._digest import (
    DEFAULT_DIGEST_ALGORITHM,
    DigestAlgorithm,
    TreeHasher,
    chunk_digest,
    combine_chunk_digests,
    file_digest,
    tree_digest,
    tree_digests_parallel,
)
from .._faults import fault_point
from ._safetensors_layout import FileLayout, Placement
from ._write_failures import os_failed

__all__ = ["InOrderHashLane", "PayloadHasher", "hash_file_range"]


def hash_file_range(
    fd: int, offset: int, length: int, algorithm: DigestAlgorithm = DEFAULT_DIGEST_ALGORITHM
) -> bytes:
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


class InOrderHashLane:
    """Tree digests of tensors whose bytes are handed over in order, each piece written on the lane's write
    thread while the caller hashes it; the write thread hashes too whenever it would otherwise wait.

    The writer converts rows into a reused buffer and hands the lane that buffer: the write thread
    `pwrite`s it while the caller's thread hashes the same bytes, still in cache from the conversion
    (both only read the buffer, and both release the GIL), then converts the next chunk. On two cores
    that is two threads of about equal work (convert + hash, write) instead of three competing for
    two cores. When the write thread has already finished everything handed to it (the caller is the
    slower side), the next piece is hashed on the write thread after its write, so neither core waits.
    A tensor's pieces are hashed in order either way: a piece goes to the write thread while an earlier
    piece of its tensor is still queued there. Nothing is read back from the file later; the digest is
    the same tree digest a read-back would give (docs/DIGEST.md). The first failure on any thread is
    kept; later pieces are skipped and the writer's next `feed` or `wait` raises it.
    """

    __slots__ = (
        "_algorithm",
        "_chunk_bytes",
        "_error",
        "_hash_pool",
        "_hashers",
        "_last_hash",
        "_last_store",
        "_lock",
        "_queued_hash",
        "_write_pool",
        "hashed_while_writing",
    )

    def __init__(self, *, chunk_bytes: int, algorithm: DigestAlgorithm) -> None:
        self._chunk_bytes = chunk_bytes
        self._algorithm = algorithm
        self._hashers: dict[str, TreeHasher] = {}
        self._hash_pool: ThreadPoolExecutor | None = None
        self._write_pool: ThreadPoolExecutor | None = None
        self._last_hash: Future[None] | None = None  # each pool runs in order: its latest piece is done last
        self._last_store: Future[None] | None = None
        self._queued_hash: dict[str, Future[None]] = {}  # tensor -> its latest piece hashed on the write thread
        self._lock = threading.Lock()
        self._error: BaseException | None = None  # the first failed piece; later pieces are skipped
        self.hashed_while_writing = 0
        """Pieces the write thread hashed (after their write) because it would otherwise have waited."""

    def feed(
        self, name: str, whole: memoryview, begin: int, end: int, store: Callable[[], None] | None = None
    ) -> Future[None]:
        """Hash bytes [begin, end) of `whole` as the next bytes of tensor `name`; done when the future is.

        `store`, when given, runs on the write thread (the writer's `pwrite` of those bytes) while this
        thread hashes them, or the write thread hashes them after storing (see the class). The future is
        done once the write and the hash both are; the caller keeps the bytes unchanged until then."""
        if self._error is not None:
            raise self._error  # an earlier piece failed: stop the writer now rather than at close
        hasher = self._hashers.get(name)
        if hasher is None:
            hasher = self._hashers[name] = TreeHasher(self._chunk_bytes, self._algorithm)

        def hash_piece() -> None:
            self._hash_piece(hasher, whole, begin, end)

        if store is None:
            if self._hash_pool is None:
                self._hash_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hwr-hash-lane")
            hashed = self._last_hash = self._hash_pool.submit(self._run, hash_piece)
            return hashed
        if self._write_pool is None:
            self._write_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hwr-write-lane")
        queued = self._queued_hash.get(name)
        writer_idle = self._last_store is None or self._last_store.done()
        if writer_idle or (queued is not None and not queued.done()):

            def store_then_hash() -> None:
                store()
                hash_piece()

            stored = self._last_store = self._queued_hash[name] = self._write_pool.submit(self._run, store_then_hash)
            self.hashed_while_writing += 1
            return stored
        stored = self._last_store = self._write_pool.submit(self._run, store)
        self._run(hash_piece)  # here, while the write thread stores the same bytes
        if self._error is not None:
            raise self._error
        return stored

    def _run(self, step: Callable[[], None]) -> None:
        if self._error is not None:
            return
        try:
            step()
        except BaseException as exc:  # recorded, raised by the writer's next feed or wait
            with self._lock:
                if self._error is None:
                    self._error = exc

    def _hash_piece(self, hasher: TreeHasher, whole: memoryview, begin: int, end: int) -> None:
        fault_point("writer.hash")
        with whole[begin:end] as piece:
            hasher.update(piece)

    def holds(self, name: str) -> bool:
        """Whether tensor `name` is hashed by this lane (it was fed)."""
        return name in self._hashers

    def digest(self, name: str) -> str:
        """The tree digest of everything fed for `name`; waits for the lane (its first failure raises)."""
        self.wait()
        return self._hashers[name].hexdigest()

    def wait(self) -> None:
        """Wait until every piece fed so far is written and hashed; raises the first failure of any of them."""
        pending = [future for future in (self._last_hash, self._last_store) if future is not None]
        if pending:
            futures_wait(pending)
        if self._error is not None:
            raise self._error

    def drain(self) -> None:
        """Stop both threads once every queued piece has run (so none reads a closed mapping); never raises."""
        for pool in (self._hash_pool, self._write_pool):
            if pool is not None:
                pool.shutdown(wait=True)
        self._hash_pool = self._write_pool = None


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

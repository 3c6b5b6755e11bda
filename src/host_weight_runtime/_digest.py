"""Digests of artifact bytes: a chunked SHA-256 tree, so verification can use every core.

A buffer's digest is SHA-256 over a domain tag, its length and the SHA-256 of each
fixed-size chunk. Chunks hash independently (hashlib releases the GIL), so a
verifier hashes one artifact on several threads; a writer that sees bytes in order
hashes them incrementally with the same result.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor

from .canonical_json import encode_canonical

DIGEST_ALGORITHM = "sha256-tree-v1"
DIGEST_CHUNK_BYTES = 8 * 1024 * 1024
_TREE_TAG = b"hwr/sha256-tree-v1\x00"
_FILE_TAG = b"hwr/file-v1\x00"


def _check_chunk_bytes(chunk_bytes: int) -> None:
    if type(chunk_bytes) is not int or chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be a positive integer, got {chunk_bytes!r}")


def _combine(length: int, chunk_digests: Iterable[bytes]) -> str:
    outer = hashlib.sha256(_TREE_TAG)
    outer.update(length.to_bytes(8, "little"))
    for chunk_digest in chunk_digests:
        outer.update(chunk_digest)
    return outer.hexdigest()


class TreeHasher:
    """Incremental tree digest for bytes that arrive in order."""

    __slots__ = ("_chunk", "_chunk_bytes", "_chunk_digests", "_chunk_fill", "_length")

    def __init__(self, chunk_bytes: int = DIGEST_CHUNK_BYTES) -> None:
        _check_chunk_bytes(chunk_bytes)
        self._chunk_bytes = chunk_bytes
        self._chunk = hashlib.sha256()
        self._chunk_fill = 0
        self._chunk_digests: list[bytes] = []
        self._length = 0

    def update(self, data: memoryview | bytes, executor: Executor | None = None) -> None:
        """Feed the next bytes; whole chunks go to `executor` in parallel when one is given.

        Returns only when every byte has been hashed, so the caller may reuse `data`.
        """
        view = memoryview(data).cast("B")
        if self._chunk_fill:
            head = view[: self._chunk_bytes - self._chunk_fill]
            self._feed_partial(head)
            view = view[len(head) :]
        whole = len(view) - len(view) % self._chunk_bytes
        if whole:
            chunks = [view[start : start + self._chunk_bytes] for start in range(0, whole, self._chunk_bytes)]
            if executor is not None and len(chunks) > 1:
                self._chunk_digests.extend(executor.map(_chunk_digest, chunks))
            else:
                self._chunk_digests.extend(_chunk_digest(chunk) for chunk in chunks)
            self._length += whole
        if len(view) > whole:
            self._feed_partial(view[whole:])

    def _feed_partial(self, piece: memoryview) -> None:
        self._chunk.update(piece)
        self._chunk_fill += len(piece)
        self._length += len(piece)
        if self._chunk_fill == self._chunk_bytes:
            self._chunk_digests.append(self._chunk.digest())
            self._chunk = hashlib.sha256()
            self._chunk_fill = 0

    def hexdigest(self) -> str:
        digests = list(self._chunk_digests)
        if self._chunk_fill or not digests:
            digests.append(self._chunk.copy().digest())
        return _combine(self._length, digests)


def _chunk_digest(view: memoryview) -> bytes:
    return hashlib.sha256(view).digest()


def chunk_digest(view: memoryview) -> bytes:
    """SHA-256 of one chunk (hashlib releases the GIL while it hashes)."""
    return _chunk_digest(view)


def combine_chunk_digests(length: int, chunk_digests: Iterable[bytes]) -> str:
    """The tree digest of a buffer of `length` bytes from its chunks' digests, in order."""
    return _combine(length, chunk_digests)


def tree_digest(data: memoryview | bytes, chunk_bytes: int = DIGEST_CHUNK_BYTES) -> str:
    """Digest of one buffer on the calling thread."""
    hasher = TreeHasher(chunk_bytes)
    hasher.update(data)
    return hasher.hexdigest()


def default_hash_threads() -> int:
    return max(1, min(8, os.cpu_count() or 1))


def tree_digests_parallel(
    buffers: Sequence[memoryview],
    *,
    chunk_bytes: int = DIGEST_CHUNK_BYTES,
    threads: int | None = None,
    progress: Callable[[int], None] | None = None,
) -> list[str]:
    """Digests of many buffers, every chunk of every buffer hashed on a thread pool."""
    _check_chunk_bytes(chunk_bytes)
    jobs: list[tuple[int, memoryview]] = []
    counts: list[int] = []
    for index, buffer in enumerate(buffers):
        view = memoryview(buffer).cast("B")
        pieces = [view[start : start + chunk_bytes] for start in range(0, len(view), chunk_bytes)]
        if not pieces:
            pieces = [view[0:0]]
        counts.append(len(pieces))
        jobs.extend((index, piece) for piece in pieces)
    worker_count = threads if threads is not None else default_hash_threads()
    pieces_only = [piece for _, piece in jobs]
    if worker_count <= 1 or len(jobs) <= 1:
        chunk_results = []
        for piece in pieces_only:
            chunk_results.append(_chunk_digest(piece))
            if progress is not None:
                progress(len(piece))
    else:
        with ThreadPoolExecutor(max_workers=worker_count, thread_name_prefix="hwr-hash") as pool:
            chunk_results = []
            for piece, digest in zip(pieces_only, pool.map(_chunk_digest, pieces_only), strict=True):
                chunk_results.append(digest)
                if progress is not None:
                    progress(len(piece))
    results: list[str] = []
    position = 0
    for index, count in enumerate(counts):
        length = len(memoryview(buffers[index]).cast("B"))
        results.append(_combine(length, chunk_results[position : position + count]))
        position += count
    return results


def file_digest(header_digest: str, tensor_digests_in_offset_order: Iterable[str]) -> str:
    """A payload file's digest from its header prefix digest and its tensors' digests."""
    outer = hashlib.sha256(_FILE_TAG)
    outer.update(bytes.fromhex(header_digest))
    for digest in tensor_digests_in_offset_order:
        outer.update(bytes.fromhex(digest))
    return outer.hexdigest()


def content_digest(entries: Iterable[tuple[str, str, tuple[int, ...], str]]) -> str:
    """Digest of (name, dtype, shape, digest) for every tensor, independent of file split."""
    rows = sorted([name, dtype, list(shape), digest] for name, dtype, shape, digest in entries)
    return hashlib.sha256(encode_canonical(rows)).hexdigest()

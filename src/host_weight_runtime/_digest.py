"""Digests of artifact bytes: a chunked hash tree, so verification can use every core.

A buffer's digest is SHA-256 over a domain tag, its length and the leaf hash of each
fixed-size chunk. Two leaf hashes exist, each its own algorithm name recorded in the
manifest (docs/DIGEST.md specifies both byte for byte): `sha256-tree-v1` (SHA-256
leaves, the original format) and `blake3-tree-v1` (BLAKE3 leaves, about four times
faster per core). Chunks hash independently (hashlib and blake3 release the GIL), so a
verifier hashes one artifact on several threads; a writer that sees bytes in order
hashes them incrementally with the same result.
"""

from __future__ import annotations

import enum
import hashlib
import os
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from typing import Protocol

from .canonical_json import canonical_sha256

DIGEST_CHUNK_BYTES = 8 * 1024 * 1024
_FILE_TAG = b"hwr/file-v1\x00"


class DigestAlgorithm(enum.Enum):
    """How a payload's bytes are digested; the value is the name a manifest records."""

    SHA256_TREE_V1 = "sha256-tree-v1"
    BLAKE3_TREE_V1 = "blake3-tree-v1"

    @classmethod
    def from_name(cls, name: str) -> DigestAlgorithm:
        """The algorithm a manifest names, or ValueError for one this version does not know."""
        for algorithm in cls:
            if algorithm.value == name:
                return algorithm
        known = ", ".join(repr(algorithm.value) for algorithm in cls)
        raise ValueError(f"unknown digest algorithm {name!r} (this version knows {known})")


DEFAULT_DIGEST_ALGORITHM = DigestAlgorithm.SHA256_TREE_V1
DIGEST_ALGORITHM = DEFAULT_DIGEST_ALGORITHM.value
"""The default algorithm's name (the format every artifact used before `blake3-tree-v1`)."""


class LeafHasher(Protocol):
    """One leaf's incremental hash (SHA-256 or BLAKE3): bytes in order, then its 32-byte digest."""

    def update(self, data: memoryview | bytes, /) -> object: ...

    def digest(self) -> bytes: ...

    def copy(self) -> LeafHasher: ...


def _tree_tag(algorithm: DigestAlgorithm) -> bytes:
    return b"hwr/" + algorithm.value.encode("ascii") + b"\x00"


def _blake3_leaf(data: memoryview | bytes = b"") -> LeafHasher:
    try:
        from blake3 import blake3
    except ImportError as exc:  # a base dependency; only a broken install lacks it
        raise RuntimeError(
            "the blake3-tree-v1 digest needs the 'blake3' package (a dependency of host-weight-runtime); "
            "reinstall the package"
        ) from exc
    return blake3(data)


def _new_leaf(algorithm: DigestAlgorithm, data: memoryview | bytes = b"") -> LeafHasher:
    if algorithm is DigestAlgorithm.BLAKE3_TREE_V1:
        return _blake3_leaf(data)
    return hashlib.sha256(data)


def _check_chunk_bytes(chunk_bytes: int) -> None:
    if type(chunk_bytes) is not int or chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be a positive integer, got {chunk_bytes!r}")


def _check_algorithm(algorithm: DigestAlgorithm) -> None:
    if not isinstance(algorithm, DigestAlgorithm):
        raise ValueError(f"algorithm must be a DigestAlgorithm, got {algorithm!r}")


def _combine(length: int, chunk_digests: Iterable[bytes], algorithm: DigestAlgorithm) -> str:
    outer = hashlib.sha256(_tree_tag(algorithm))
    outer.update(length.to_bytes(8, "little"))
    for chunk_digest in chunk_digests:
        outer.update(chunk_digest)
    return outer.hexdigest()


class TreeHasher:
    """Incremental tree digest for bytes that arrive in order."""

    __slots__ = ("_algorithm", "_chunk", "_chunk_bytes", "_chunk_digests", "_chunk_fill", "_length")

    def __init__(
        self, chunk_bytes: int = DIGEST_CHUNK_BYTES, algorithm: DigestAlgorithm = DEFAULT_DIGEST_ALGORITHM
    ) -> None:
        _check_chunk_bytes(chunk_bytes)
        _check_algorithm(algorithm)
        self._algorithm = algorithm
        self._chunk_bytes = chunk_bytes
        self._chunk = _new_leaf(algorithm)
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
            leaf = _LEAF_DIGESTS[self._algorithm]
            if executor is not None and len(chunks) > 1:
                self._chunk_digests.extend(executor.map(leaf, chunks))
            else:
                self._chunk_digests.extend(leaf(chunk) for chunk in chunks)
            self._length += whole
        if len(view) > whole:
            self._feed_partial(view[whole:])

    def _feed_partial(self, piece: memoryview) -> None:
        self._chunk.update(piece)
        self._chunk_fill += len(piece)
        self._length += len(piece)
        if self._chunk_fill == self._chunk_bytes:
            self._chunk_digests.append(self._chunk.digest())
            self._chunk = _new_leaf(self._algorithm)
            self._chunk_fill = 0

    def hexdigest(self) -> str:
        digests = list(self._chunk_digests)
        if self._chunk_fill or not digests:
            digests.append(self._chunk.copy().digest())
        return _combine(self._length, digests, self._algorithm)


def _sha256_chunk(view: memoryview) -> bytes:
    return hashlib.sha256(view).digest()


def _blake3_chunk(view: memoryview) -> bytes:
    return _blake3_leaf(view).digest()


_LEAF_DIGESTS: dict[DigestAlgorithm, Callable[[memoryview], bytes]] = {
    DigestAlgorithm.SHA256_TREE_V1: _sha256_chunk,
    DigestAlgorithm.BLAKE3_TREE_V1: _blake3_chunk,
}


def chunk_digest(view: memoryview, algorithm: DigestAlgorithm = DEFAULT_DIGEST_ALGORITHM) -> bytes:
    """The leaf digest of one chunk (both leaf hashes release the GIL while they hash)."""
    return _LEAF_DIGESTS[algorithm](view)


def leaf_hasher(algorithm: DigestAlgorithm = DEFAULT_DIGEST_ALGORITHM) -> LeafHasher:
    """An incremental hasher of one leaf, for a leaf whose bytes arrive in more than one piece."""
    _check_algorithm(algorithm)
    return _new_leaf(algorithm)


def combine_chunk_digests(
    length: int, chunk_digests: Iterable[bytes], algorithm: DigestAlgorithm = DEFAULT_DIGEST_ALGORITHM
) -> str:
    """The tree digest of a buffer of `length` bytes from its chunks' digests, in order."""
    return _combine(length, chunk_digests, algorithm)


def tree_digest(
    data: memoryview | bytes,
    chunk_bytes: int = DIGEST_CHUNK_BYTES,
    algorithm: DigestAlgorithm = DEFAULT_DIGEST_ALGORITHM,
) -> str:
    """Digest of one buffer on the calling thread."""
    hasher = TreeHasher(chunk_bytes, algorithm)
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
    algorithm: DigestAlgorithm = DEFAULT_DIGEST_ALGORITHM,
) -> list[str]:
    """Digests of many buffers, every chunk of every buffer hashed on a thread pool."""
    _check_chunk_bytes(chunk_bytes)
    _check_algorithm(algorithm)
    leaf = _LEAF_DIGESTS[algorithm]
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
            chunk_results.append(leaf(piece))
            if progress is not None:
                progress(len(piece))
    else:
        with ThreadPoolExecutor(max_workers=worker_count, thread_name_prefix="hwr-hash") as pool:
            chunk_results = []
            for piece, digest in zip(pieces_only, pool.map(leaf, pieces_only), strict=True):
                chunk_results.append(digest)
                if progress is not None:
                    progress(len(piece))
    results: list[str] = []
    position = 0
    for index, count in enumerate(counts):
        length = len(memoryview(buffers[index]).cast("B"))
        results.append(_combine(length, chunk_results[position : position + count], algorithm))
        position += count
    return results


def file_digest(header_digest: str, tensor_digests_in_offset_order: Iterable[str]) -> str:
    """A payload file's digest from its header prefix digest and its tensors' digests (SHA-256 for every algorithm)."""
    outer = hashlib.sha256(_FILE_TAG)
    outer.update(bytes.fromhex(header_digest))
    for digest in tensor_digests_in_offset_order:
        outer.update(bytes.fromhex(digest))
    return outer.hexdigest()


def content_digest(entries: Iterable[tuple[str, str, tuple[int, ...], str]]) -> str:
    """Digest of (name, dtype, shape, digest) for every tensor, independent of file split."""
    rows = sorted([name, dtype, list(shape), digest] for name, dtype, shape, digest in entries)
    return canonical_sha256(rows)

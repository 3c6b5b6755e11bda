"""Hashing a checkpoint's files into the node digest cache while the load does other work.

A folder seen for the first time on a node must have its weight files hashed (SHA-256, the
content id in the key) before anything can be looked up. `SourcePrehash` starts that hashing
on threads as soon as the files are known, largest first, so the skeleton build and, in
PREFERRED mode where a core is free (`cores_free_beside_load`), the canonical load run meanwhile.
The hashes land in the node digest cache (`_digest_cache.py`); `identify_component` then reads
them from there, so the key is computed exactly as without the overlap (a file that changed in
between is caught there, by its state).
"""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from .._digest import default_hash_threads
from ._digest_cache import NodeSourceDigestCache
from ._file_state import stat_source
from ._source_snapshot import is_content_id_known
from ._weight_source import PreparedWeightSource

__all__ = ["SourcePrehash", "cores_free_beside_load"]


class SourcePrehash:
    """The weight files of one source that still need hashing, being hashed into the digest cache on threads."""

    __slots__ = ("_futures", "_pool", "files")

    def __init__(
        self, source: PreparedWeightSource, cache: NodeSourceDigestCache, *, threads: int | None = None
    ) -> None:
        if threads is not None and threads < 1:
            raise ValueError(f"threads must be at least 1 (got {threads}); pass None for one per core")
        self.files = sorted(
            (path for path in source.weight_files if not is_content_id_known(path, cache)),
            key=lambda path: -_size_or_zero(path),  # largest first: the last thread to finish starts soonest
        )
        self._pool: ThreadPoolExecutor | None = None
        self._futures: list[Future[str]] = []
        if not self.files:
            return
        self._pool = ThreadPoolExecutor(
            max_workers=min(len(self.files), threads or default_hash_threads()), thread_name_prefix="hwr-source-prehash"
        )
        self._futures = [self._pool.submit(_hash_into_cache, cache, path) for path in self.files]

    def wait(self) -> None:
        """Wait for every file; a file that could not be hashed raises its typed failure, as the identity step would."""
        if self._pool is None:
            return
        pool, self._pool = self._pool, None
        try:
            for future in self._futures:
                future.result()
        finally:
            pool.shutdown(wait=True, cancel_futures=True)

    def cancel(self) -> None:
        """Stop hashing files not yet started (the load no longer needs the key); running ones finish."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None


def cores_free_beside_load() -> int:
    """The cores this process may run on that torch's intra-op threads leave free during a canonical load.

    torch waits for its slowest thread at the end of every parallel cast and copy, so a hash thread on
    a core the pool uses slows the load by more than it gains: on 2 cores a 205-277 ms load took up to
    680 ms beside one SHA-256 thread, and hashing first, then loading, was sooner.
    """
    return max(0, len(os.sched_getaffinity(0)) - torch.get_num_threads())


def _hash_into_cache(cache: NodeSourceDigestCache, path: Path) -> str:
    """The file's content id, recorded in the cache (hashed here unless another worker did it meanwhile)."""
    return cache.content_id(path, stat_source(path, "does not exist"))


def _size_or_zero(path: Path) -> int:
    """The file's size for ordering only (a file that cannot be stat'ed fails where it is hashed)."""
    try:
        return path.stat().st_size
    except OSError:
        return 0

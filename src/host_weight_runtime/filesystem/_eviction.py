"""Eviction: free space by removing least-recently-used artifacts that no live lease holds.

An artifact is evicted only while its artifact lock is held exclusively, taken without
waiting: a live lease holds that lock shared, so a leased artifact is never touched,
however old. Removal is crash-safe the way quarantine is: the directory is renamed out
of `artifacts/` (one atomic step, made durable by fsyncing `artifacts/`) into
`tmp/evicting-<key>...`, and only then deleted. A crash after the rename leaves an
invisible leftover that still counts toward the store's bytes; the next reservation
(which holds the capacity lock, as every evictor does) or `hwr gc` deletes it.

Callers hold the domain's capacity lock, so two evictors never count the same freed bytes.
"""

from __future__ import annotations

import contextlib
import os
import re
from dataclasses import dataclass

from .. import _telemetry
from .._faults import fault_point
from ._fsutil import fsync_dir, remove_tree, tree_bytes
from ._layout import DomainLayout
from .locks import try_lock

__all__ = ["EvictionCandidate", "EvictionOutcome", "Evictor"]

_LOCK_SUFFIX = ".artifact.lock"
_KEY = re.compile(r"^[0-9a-f]{64}$")
_PRIVATE_DIR_MODE = 0o700
_SEALED_DIR_MODE = 0o555


@dataclass(frozen=True, slots=True)
class EvictionCandidate:
    """A published artifact in eviction order: denied ones first, then least recently used."""

    key: str
    last_used_ns: int
    denied: bool


@dataclass(frozen=True, slots=True)
class EvictionOutcome:
    """What one round of eviction freed, and how many candidates a live lease kept."""

    freed_bytes: int
    evicted: tuple[str, ...]
    leased: int


class Evictor:
    """Evicts unleased artifacts of one domain; the caller holds the capacity lock."""

    __slots__ = ("_layout", "_storage_class")

    def __init__(self, layout: DomainLayout, storage_class: str) -> None:
        self._layout = layout
        self._storage_class = storage_class

    def candidates(self) -> list[EvictionCandidate]:
        """Every published artifact, denied first, then oldest last use first (ties by key).

        Three directory scans and a stat per lock file: no per-artifact path objects or tree walks.
        """
        layout = self._layout
        try:
            with os.scandir(layout.artifacts) as listing:
                published = {entry.name: entry for entry in listing if _is_key(entry.name)}
        except FileNotFoundError:
            return []
        used: dict[str, int] = {}
        with contextlib.suppress(FileNotFoundError), os.scandir(layout.locks) as listing:
            for entry in listing:
                key = entry.name.removesuffix(_LOCK_SUFFIX)
                if key in published and entry.name.endswith(_LOCK_SUFFIX):
                    with contextlib.suppress(FileNotFoundError):
                        used[key] = entry.stat(follow_symlinks=False).st_mtime_ns
        try:
            denied = {name.removesuffix(".json") for name in os.listdir(layout.deny)}
        except FileNotFoundError:
            denied = set()
        found: list[EvictionCandidate] = []
        for key, entry in published.items():
            last = used.get(key)
            if last is None:  # never leased: its publication time
                try:
                    last = entry.stat(follow_symlinks=False).st_mtime_ns
                except FileNotFoundError:
                    continue
            found.append(EvictionCandidate(key, last, key in denied))
        found.sort(key=lambda c: (not c.denied, c.last_used_ns, c.key))
        return found

    def evict(self, key: str, *, expected_inode: int | None = None) -> int | None:
        """Remove `key`'s artifact if no lease holds it; the bytes freed, or None when leased or gone.

        With `expected_inode`, only that very directory is removed (not a copy published since).

        OSError propagates; the artifact is then either still published, read-only, or out
        of `artifacts/` already (a leftover the next evictor deletes).
        """
        lock = try_lock(self._layout.artifact_lock(key), exclusive=True)
        if lock is None:
            return None
        try:
            artifact_dir = self._layout.artifact_dir(key)
            try:
                inode = os.stat(artifact_dir, follow_symlinks=False).st_ino
            except FileNotFoundError:
                return None
            if expected_inode is not None and inode != expected_inode:
                return None
            size = tree_bytes(artifact_dir)
            doomed = self._layout.new_eviction_dir(key)
            # Moving a directory to another parent rewrites its "..", which needs write permission on it.
            os.chmod(artifact_dir, _PRIVATE_DIR_MODE)
            try:
                os.rename(artifact_dir, doomed)
            except OSError:
                with contextlib.suppress(OSError):
                    os.chmod(artifact_dir, _SEALED_DIR_MODE)
                raise
            fsync_dir(self._layout.artifacts)
        finally:
            lock.release()
        fault_point("eviction.after_move")
        remove_tree(doomed)
        _telemetry.emit(_telemetry.TelemetryEvent(_telemetry.TelemetryKind.EVICTED, self._storage_class, size))
        return size

    def free(self, needed: int) -> EvictionOutcome:
        """Evict in candidate order until at least `needed` bytes are freed or no candidate is left."""
        freed = 0
        evicted: list[str] = []
        leased = 0
        for candidate in self.candidates():
            if freed >= needed:
                break
            got = self.evict(candidate.key)
            if got is None:
                if os.path.lexists(self._layout.artifact_dir(candidate.key)):
                    leased += 1
                continue
            freed += got
            evicted.append(candidate.key)
        return EvictionOutcome(freed, tuple(evicted), leased)

    def remove_leftovers(self) -> int:
        """Delete what crashed evictions left in tmp/; only safe while holding the capacity lock."""
        freed = 0
        for leftover in self._layout.eviction_dirs():
            try:
                size = tree_bytes(leftover)
                remove_tree(leftover)
            except FileNotFoundError:
                continue
            freed += size
        return freed


def _is_key(name: str) -> bool:
    return _KEY.match(name) is not None

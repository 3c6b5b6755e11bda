"""Capacity limits checked before bytes are written, and typed out-of-space failures.

Checking before writing means a build that cannot fit fails fast with a failure that
names the setting to change, instead of filling the disk (or, on tmpfs, the node's
memory) and failing halfway.

A build reserves space one payload file at a time, inside `reservation()`: the domain's
capacity lock is held around the check, any eviction, and the file's preallocation, so
the preallocated file in tmp/ is itself the reservation the next builder counts. Two
builders can never both count the same free or freed bytes. A file that is only sized
(a tmpfs import, whose copy allocates as it goes) reserves by its size: what it does not
occupy yet is taken off the free space the check sees.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from .._faults import fault_point
from ..canonical_json import CanonicalJson
from ..config import (
    ENV_EVICTION,
    ENV_MAX_ARTIFACT_BYTES,
    ENV_MAX_STORE_BYTES,
    ENV_MIN_FREE_BYTES,
    CapacityPolicy,
    StorageClass,
)
from ..failures import FailureCode, HostWeightError, HostWeightFailure, ResolutionStage, raise_failure
from ._eviction import Evictor
from ._fsutil import failure_from_os_error, tree_bytes, unallocated_bytes
from ._layout import DomainLayout
from .locks import acquire_lock

__all__ = ["CapacityGuard", "CapacitySnapshot", "failure_from_os_error"]

_STAGE = ResolutionStage.PRODUCTION
_EVICTABLE = (FailureCode.STORE_LIMIT_EXCEEDED, FailureCode.INSUFFICIENT_CAPACITY)


@dataclass(frozen=True, slots=True)
class CapacitySnapshot:
    """Sizes of the domain's filesystem and of the store; `is_memory` marks tmpfs (bytes are RAM)."""

    total_bytes: int
    free_bytes: int
    store_bytes: int
    is_memory: bool
    policy: CapacityPolicy


class CapacityGuard:
    """Applies one domain's capacity policy; its only state is a cache of published artifacts' sizes (immutable)."""

    __slots__ = ("_layout", "_policy", "_sizes", "_storage_class")

    def __init__(self, layout: DomainLayout, policy: CapacityPolicy, storage_class: StorageClass) -> None:
        if storage_class is StorageClass.AUTO:
            raise ValueError("CapacityGuard needs the detected storage class (tmpfs or disk), not auto")
        self._layout = layout
        self._policy = policy
        self._storage_class = storage_class
        self._sizes: dict[str, tuple[int, int, int]] = {}  # artifacts/ entry -> (inode, ctime_ns, bytes)

    @property
    def policy(self) -> CapacityPolicy:
        return self._policy

    @property
    def is_memory(self) -> bool:
        """tmpfs bytes are memory: every stored byte is a byte of RAM the node cannot use otherwise."""
        return self._storage_class is StorageClass.TMPFS

    def store_bytes(self) -> int:
        """Bytes of regular files under artifacts/, tmp/ and quarantine/: all of it occupies the medium."""
        return self._published_bytes() + tree_bytes(self._layout.tmp) + tree_bytes(self._layout.quarantine)

    def _published_bytes(self) -> int:
        """artifacts/ without walking every artifact each time: a published directory never changes, so its
        size is remembered per (name, inode, ctime) and only a new or replaced directory is walked."""
        known = self._sizes
        seen: dict[str, tuple[int, int, int]] = {}
        total = 0
        try:
            with os.scandir(self._layout.artifacts) as listing:
                entries = list(listing)
        except FileNotFoundError:
            return 0
        for entry in entries:
            try:
                info = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue  # evicted or cleaned up meanwhile
            if stat.S_ISREG(info.st_mode):
                total += info.st_size
            elif stat.S_ISDIR(info.st_mode):
                cached = known.get(entry.name)
                if cached is not None and cached[:2] == (info.st_ino, info.st_ctime_ns):
                    size = cached[2]
                else:
                    size = tree_bytes(Path(entry.path))
                seen[entry.name] = (info.st_ino, info.st_ctime_ns, size)
                total += size
        self._sizes = seen
        return total

    def check(self, *, artifact_bytes: int, additional_bytes: int) -> None:
        """Raise a retryable HostWeightError (stage PRODUCTION) if writing `additional_bytes` more
        would break the policy; `artifact_bytes` is this artifact's total including them."""
        if type(artifact_bytes) is not int or artifact_bytes < 0:
            raise ValueError(f"artifact_bytes must be a non-negative int, got {artifact_bytes!r}")
        if type(additional_bytes) is not int or additional_bytes < 0:
            raise ValueError(f"additional_bytes must be a non-negative int, got {additional_bytes!r}")
        self._check_artifact(artifact_bytes)
        self._check_measured(additional_bytes, self._measure())

    def _measure(self) -> tuple[int | None, int, int]:
        """(store bytes, or None without a store limit; total; free) right now."""
        current = self._measure_store() if self._policy.max_store_bytes is not None else None
        total, free = self._statvfs()
        try:
            promised = unallocated_bytes(self._layout.tmp)  # sized, not yet filled: already reserved
        except OSError as exc:
            raise HostWeightError(failure_from_os_error(exc, stage=_STAGE, what="measuring the store")) from exc
        return current, total, max(0, free - promised)

    def _shortfall(self, additional_bytes: int, measured: tuple[int | None, int, int]) -> int:
        """Bytes that must be freed before `additional_bytes` more fit every limit (0 when they fit)."""
        current, _total, free = measured
        limit = self._policy.max_store_bytes
        needed = 0 if limit is None or current is None else current + additional_bytes - limit
        return max(needed, additional_bytes + self._policy.min_free_bytes - free, 0)

    def _check_artifact(self, artifact_bytes: int) -> None:
        policy = self._policy
        medium = "memory (tmpfs)" if self.is_memory else "disk"
        limit = policy.max_artifact_bytes
        if limit is not None and artifact_bytes > limit:
            raise raise_failure(
                _STAGE,
                FailureCode.ARTIFACT_TOO_LARGE,
                f"this artifact needs {artifact_bytes} bytes of {medium}, more than max_artifact_bytes={limit}: "
                f"raise {ENV_MAX_ARTIFACT_BYTES} (or unset it) to store artifacts this large",
                retryable=True,
                artifact_bytes=artifact_bytes,
                max_artifact_bytes=limit,
                setting=ENV_MAX_ARTIFACT_BYTES,
                is_memory=self.is_memory,
            )

    def _check_measured(self, additional_bytes: int, measured: tuple[int | None, int, int]) -> None:
        policy = self._policy
        medium = "memory (tmpfs)" if self.is_memory else "disk"
        current, total, free = measured
        limit = policy.max_store_bytes
        if limit is not None and current is not None and current + additional_bytes > limit:
            raise raise_failure(
                _STAGE,
                FailureCode.STORE_LIMIT_EXCEEDED,
                f"the store holds {current} bytes of {medium} and {additional_bytes} more would pass "
                f"max_store_bytes={limit}: remove unused artifacts (`hwr gc`) or raise "
                f"{ENV_MAX_STORE_BYTES}",
                retryable=True,
                store_bytes=current,
                additional_bytes=additional_bytes,
                max_store_bytes=limit,
                setting=ENV_MAX_STORE_BYTES,
                is_memory=self.is_memory,
            )
        minimum = policy.min_free_bytes
        if free < additional_bytes or free - additional_bytes < minimum:
            if free < additional_bytes:
                problem = f"needs {additional_bytes} bytes but only {free} are free"
            else:
                problem = (
                    f"would leave {free - additional_bytes} bytes free after writing {additional_bytes}, "
                    f"less than min_free_bytes={minimum}"
                )
            raise raise_failure(
                _STAGE,
                FailureCode.INSUFFICIENT_CAPACITY,
                f"the domain's {medium} at {self._layout.root} {problem}: free space there, remove unused "
                f"artifacts (`hwr gc`), or lower {ENV_MIN_FREE_BYTES}",
                retryable=True,
                free_bytes=free,
                total_bytes=total,
                additional_bytes=additional_bytes,
                min_free_bytes=minimum,
                setting=ENV_MIN_FREE_BYTES,
                is_memory=self.is_memory,
            )

    @contextmanager
    def reservation(self, deadline: float | None) -> Iterator[None]:
        """Hold the domain's capacity lock around a check (with any eviction) and the allocation it allows."""
        fault_point("capacity.before_reserve")
        lock = acquire_lock(
            self._layout.capacity_lock,
            exclusive=True,
            deadline=deadline,
            stage=_STAGE,
            what="the domain's capacity lock (another build is reserving space)",
        )
        try:
            yield
            fault_point("capacity.reserved")
        finally:
            lock.release()

    def reserve(self, *, artifact_bytes: int, additional_bytes: int, evictor: Evictor | None) -> None:
        """`check`, and when only the store limit or free space is short, evict (LRU, unleased) until it fits.

        The caller holds `reservation()`. Raises the capacity failure when eviction cannot
        free enough (or `evictor` is None), with what eviction did in its details.
        """
        if type(artifact_bytes) is not int or artifact_bytes < 0:
            raise ValueError(f"artifact_bytes must be a non-negative int, got {artifact_bytes!r}")
        if type(additional_bytes) is not int or additional_bytes < 0:
            raise ValueError(f"additional_bytes must be a non-negative int, got {additional_bytes!r}")
        self._check_artifact(artifact_bytes)
        if evictor is None:
            try:
                self._check_measured(additional_bytes, self._measure())
            except HostWeightError as exc:
                if exc.code in _EVICTABLE:
                    raise HostWeightError(_with_eviction(exc.failure, 0, (), 0, enabled=False)) from exc
                raise
            return
        # A crashed evictor's leftover still occupies the medium; holding the capacity lock, it is garbage.
        freed_total = evictor.remove_leftovers()
        evicted: list[str] = []
        while True:
            measured = self._measure()
            try:
                self._check_measured(additional_bytes, measured)
                return
            except HostWeightError as exc:
                if exc.code not in _EVICTABLE:
                    raise
                outcome = evictor.free(max(self._shortfall(additional_bytes, measured), 1))
                freed_total += outcome.freed_bytes
                evicted.extend(outcome.evicted)
                if not outcome.evicted:
                    raise HostWeightError(
                        _with_eviction(exc.failure, freed_total, tuple(evicted), outcome.leased, enabled=True)
                    ) from exc

    def snapshot(self) -> CapacitySnapshot:
        """Sizes right now, for inspection; raises HostWeightError if the filesystem cannot be queried."""
        total, free = self._statvfs()
        return CapacitySnapshot(
            total_bytes=total,
            free_bytes=free,
            store_bytes=self._measure_store(),
            is_memory=self.is_memory,
            policy=self._policy,
        )

    def _measure_store(self) -> int:
        try:
            return self.store_bytes()
        except OSError as exc:
            raise HostWeightError(failure_from_os_error(exc, stage=_STAGE, what="measuring the store")) from exc

    def _statvfs(self) -> tuple[int, int]:
        """(total, free) bytes; free counts what an unprivileged writer may use (f_bavail)."""
        try:
            info = os.statvfs(self._layout.root)
        except OSError as exc:
            raise HostWeightError(
                failure_from_os_error(exc, stage=_STAGE, what="querying free space of the domain")
            ) from exc
        return info.f_blocks * info.f_frsize, info.f_bavail * info.f_frsize


def _with_eviction(
    problem: HostWeightFailure, freed: int, evicted: tuple[str, ...], leased: int, *, enabled: bool
) -> HostWeightFailure:
    """The capacity failure, saying what eviction did (or that it is off) in its message and details."""
    if enabled:
        note = (
            f"; eviction freed {freed} bytes from {len(evicted)} unleased artifact(s) and {leased} leased "
            "artifact(s) cannot be evicted while workers hold them"
        )
    else:
        note = f"; eviction is off ({ENV_EVICTION}=none), so no artifact was evicted to make room"
    details = problem.details.to_value()
    merged = dict(details) if isinstance(details, dict) else {}
    merged.update({"eviction": "lru" if enabled else "none", "evicted_bytes": freed, "evicted_artifacts": len(evicted)})
    merged["leased_artifacts"] = leased
    return HostWeightFailure(
        problem.stage, problem.code, problem.retryable, problem.message + note, CanonicalJson.from_value(merged)
    )

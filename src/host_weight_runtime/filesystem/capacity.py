"""Capacity limits checked before bytes are written, and typed out-of-space failures.

Checking before writing means a build that cannot fit fails fast with a failure that
names the setting to change, instead of filling the disk (or, on tmpfs, the node's
memory) and failing halfway.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..config import (
    ENV_MAX_ARTIFACT_BYTES,
    ENV_MAX_STORE_BYTES,
    ENV_MIN_FREE_BYTES,
    CapacityPolicy,
    StorageClass,
)
from ..failures import FailureCode, HostWeightError, ResolutionStage, raise_failure
from ._fsutil import failure_from_os_error, tree_bytes
from ._layout import DomainLayout

__all__ = ["CapacityGuard", "CapacitySnapshot", "failure_from_os_error"]

_STAGE = ResolutionStage.PRODUCTION


@dataclass(frozen=True, slots=True)
class CapacitySnapshot:
    """Sizes of the domain's filesystem and of the store; `is_memory` marks tmpfs (bytes are RAM)."""

    total_bytes: int
    free_bytes: int
    store_bytes: int
    is_memory: bool
    policy: CapacityPolicy


class CapacityGuard:
    """Applies one domain's capacity policy; stateless apart from the paths it measures."""

    __slots__ = ("_layout", "_policy", "_storage_class")

    def __init__(self, layout: DomainLayout, policy: CapacityPolicy, storage_class: StorageClass) -> None:
        if storage_class is StorageClass.AUTO:
            raise ValueError("CapacityGuard needs the detected storage class (tmpfs or disk), not auto")
        self._layout = layout
        self._policy = policy
        self._storage_class = storage_class

    @property
    def policy(self) -> CapacityPolicy:
        return self._policy

    @property
    def is_memory(self) -> bool:
        """tmpfs bytes are memory: every stored byte is a byte of RAM the node cannot use otherwise."""
        return self._storage_class is StorageClass.TMPFS

    def store_bytes(self) -> int:
        """Bytes of regular files under artifacts/, tmp/ and quarantine/: all of it occupies the medium."""
        return tree_bytes(self._layout.artifacts) + tree_bytes(self._layout.tmp) + tree_bytes(self._layout.quarantine)

    def check(self, *, artifact_bytes: int, additional_bytes: int) -> None:
        """Raise a retryable HostWeightError (stage PRODUCTION) if writing `additional_bytes` more
        would break the policy; `artifact_bytes` is this artifact's total including them."""
        if type(artifact_bytes) is not int or artifact_bytes < 0:
            raise ValueError(f"artifact_bytes must be a non-negative int, got {artifact_bytes!r}")
        if type(additional_bytes) is not int or additional_bytes < 0:
            raise ValueError(f"additional_bytes must be a non-negative int, got {additional_bytes!r}")
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
        limit = policy.max_store_bytes
        if limit is not None:
            current = self._measure_store()
            if current + additional_bytes > limit:
                raise raise_failure(
                    _STAGE,
                    FailureCode.STORE_LIMIT_EXCEEDED,
                    f"the store holds {current} bytes of {medium} and {additional_bytes} more would pass "
                    f"max_store_bytes={limit}: remove unused artifacts (`hwr cleanup`) or raise "
                    f"{ENV_MAX_STORE_BYTES}",
                    retryable=True,
                    store_bytes=current,
                    additional_bytes=additional_bytes,
                    max_store_bytes=limit,
                    setting=ENV_MAX_STORE_BYTES,
                    is_memory=self.is_memory,
                )
        total, free = self._statvfs()
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
                f"artifacts (`hwr cleanup`), or lower {ENV_MIN_FREE_BYTES}",
                retryable=True,
                free_bytes=free,
                total_bytes=total,
                additional_bytes=additional_bytes,
                min_free_bytes=minimum,
                setting=ENV_MIN_FREE_BYTES,
                is_memory=self.is_memory,
            )

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

"""Deny markers: a published artifact that failed validation is refused until a build quarantines and replaces it."""

from __future__ import annotations

import os
import time

from .._faults import fault_point
from ..canonical_json import encode_canonical
from ..failures import FailureCode, HostWeightFailure, ResolutionStage, failure
from ._fsutil import failure_from_os_error, fsync_dir, write_file_atomic
from ._layout import DomainLayout

__all__ = ["DenyMarkers"]


class DenyMarkers:
    """The `deny/<key>.json` markers of one domain."""

    __slots__ = ("_layout",)

    def __init__(self, layout: DomainLayout) -> None:
        self._layout = layout

    def present(self, key: str) -> bool:
        return os.path.lexists(self._layout.deny_marker(key))

    def failure(self, key: str) -> HostWeightFailure:
        """What a lookup of a denied artifact reports."""
        return failure(
            ResolutionStage.LOOKUP,
            FailureCode.ARTIFACT_DENIED,
            f"artifact {key[:16]}... failed validation earlier and is denied; "
            "the next build quarantines and rebuilds it",
            key=key,
        )

    def write(self, key: str, problem: HostWeightFailure) -> HostWeightFailure | None:
        """Write the deny marker; return a retryable failure if that write itself failed."""
        record = {
            "key": key,
            "code": problem.code.value,
            "message": problem.message,
            "pid": os.getpid(),
            "denied_at_ns": time.time_ns(),
        }
        try:
            fault_point("store.write_deny")
            write_file_atomic(self._layout.deny_marker(key), encode_canonical(record))
        except OSError as exc:
            io_failure = failure_from_os_error(exc, stage=ResolutionStage.LOOKUP, what="writing the deny marker")
            return HostWeightFailure(
                ResolutionStage.LOOKUP,
                io_failure.code,
                True,
                f"the artifact is invalid ({problem.code.value}) but its deny marker could not be written: "
                f"{io_failure.message}",
                io_failure.details,
            )
        return None

    def remove_orphan(self, key: str) -> None:
        """Remove the marker of an artifact that is gone (quarantined or never there), durably."""
        marker = self._layout.deny_marker(key)
        if os.path.lexists(marker):
            marker.unlink()
            fsync_dir(marker.parent)

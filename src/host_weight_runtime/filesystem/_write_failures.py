"""How the payload writer types what goes wrong: a producer's misuse, or an OS error while writing."""

from __future__ import annotations

from ..canonical_json import JsonValue
from ..failures import FailureCode, HostWeightError, ResolutionStage, failure
from ._fsutil import failure_from_os_error

__all__ = ["os_failed", "producer_failed"]


def producer_failed(message: str, **details: JsonValue) -> HostWeightError:
    """A misuse of the writer by the producer: never retryable, a retry would do the same."""
    return HostWeightError(
        failure(ResolutionStage.PRODUCTION, FailureCode.PRODUCER_FAILED, message, retryable=False, **details)
    )


def os_failed(exc: OSError, what: str, **details: JsonValue) -> HostWeightError:
    """Type an OSError: no space and quota are retryable capacity failures, EIO a retryable I/O error."""
    return HostWeightError(failure_from_os_error(exc, stage=ResolutionStage.PRODUCTION, what=what, **details))

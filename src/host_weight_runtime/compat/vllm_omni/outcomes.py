"""The reference's report and store-result shapes, made from this runtime's reports (one resolve, two views)."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ... import outcomes as native
from ...canonical_json import CanonicalJson
from ...failures import FailureCode, HostWeightFailure, ResolutionStage
from ...outcomes import ResolutionOutcome, StoreStatus
from .errors import ResolutionAction

if TYPE_CHECKING:
    from ...lease import HostWeightLease

__all__ = [
    "AttemptResult",
    "HostWeightResolution",
    "PostLoadPublicationOutcome",
    "PostLoadPublicationReport",
    "ResolutionAttempt",
    "ResolutionOutcome",
    "ResolutionReport",
    "StoreResult",
    "StoreStatus",
    "publication_report_of",
    "resolution_of",
    "resolution_report_of",
    "store_result_of",
]

_LEASE_STATUSES = frozenset({StoreStatus.HIT, StoreStatus.BUILT, StoreStatus.JOINED})
_FAILURE_STATUSES = frozenset({StoreStatus.INVALID, StoreStatus.TIMEOUT, StoreStatus.FAILED})


@dataclass(frozen=True)
class StoreResult:
    """A store call's outcome in the reference's shape (no identity field: the caller knows what it asked)."""

    status: StoreStatus
    lease: HostWeightLease | None = None
    failure: HostWeightFailure | None = None

    def __post_init__(self) -> None:
        if (self.status in _LEASE_STATUSES) != (self.lease is not None):
            raise ValueError(f"store result {self.status.value} has inconsistent lease ownership")
        if self.status not in _FAILURE_STATUSES and self.failure is not None:
            raise ValueError(f"successful store result {self.status.value} must not carry a failure")
        if self.status in _FAILURE_STATUSES and self.failure is None:
            raise ValueError(f"store result {self.status.value} requires a typed failure")


class AttemptResult(str, enum.Enum):
    HIT = "hit"
    MISS = "miss"
    SUCCESS = "success"
    TIMEOUT = "timeout"
    ERROR = "error"
    SKIPPED = "skipped"


class PostLoadPublicationOutcome(str, enum.Enum):
    """Terminal outcome of one post-load publication (this runtime's `PostLoadPublicationStatus`)."""

    RUNTIME_DISABLED = "runtime_disabled"
    POLICY_DISABLED = "policy_disabled"
    ALREADY_PRESENT = "already_present"
    PUBLISHED = "published"
    JOINED = "joined"
    FAILED = "failed"


def _check_elapsed(value: float, what: str) -> None:
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{what} elapsed_seconds must be finite and non-negative")


@dataclass(frozen=True)
class ResolutionAttempt:
    stage: ResolutionStage
    result: AttemptResult
    action: ResolutionAction
    elapsed_seconds: float
    failure: HostWeightFailure | None = None

    def __post_init__(self) -> None:
        _check_elapsed(self.elapsed_seconds, "resolution attempt")
        if self.result in {AttemptResult.HIT, AttemptResult.MISS, AttemptResult.SUCCESS} and self.failure is not None:
            raise ValueError(f"resolution attempt {self.result.value} must not carry a failure")
        if self.result in {AttemptResult.TIMEOUT, AttemptResult.ERROR} and self.failure is None:
            raise ValueError(f"resolution attempt {self.result.value} requires a typed failure")


@dataclass(frozen=True)
class ResolutionReport:
    resolution_id: str
    outcome: ResolutionOutcome
    attempts: tuple[ResolutionAttempt, ...]
    elapsed_seconds: float

    def __post_init__(self) -> None:
        if not self.resolution_id:
            raise ValueError("resolution report requires a resolution_id")
        if not isinstance(self.attempts, tuple):
            raise ValueError("resolution report attempts must be an immutable tuple")
        _check_elapsed(self.elapsed_seconds, "resolution report")


_LEASE_OUTCOMES = frozenset(
    {ResolutionOutcome.LOCAL_HIT, ResolutionOutcome.REMOTE_IMPORT, ResolutionOutcome.LOCAL_PRODUCTION}
)


@dataclass(frozen=True)
class HostWeightResolution:
    report: ResolutionReport
    lease: HostWeightLease | None = None

    def __post_init__(self) -> None:
        if (self.report.outcome in _LEASE_OUTCOMES) != (self.lease is not None):
            raise ValueError("resolution outcome has inconsistent lease ownership")


@dataclass(frozen=True)
class PostLoadPublicationReport:
    operation_id: str
    outcome: PostLoadPublicationOutcome
    identity_digest: str | None
    elapsed_seconds: float
    failure: HostWeightFailure | None = None

    def __post_init__(self) -> None:
        if not self.operation_id:
            raise ValueError("post-load publication report requires an operation_id")
        if not isinstance(self.outcome, PostLoadPublicationOutcome):
            raise ValueError("post-load publication outcome must use PostLoadPublicationOutcome")
        if self.identity_digest is not None and not self.identity_digest:
            raise ValueError("post-load publication identity digest must not be empty")
        disabled = {PostLoadPublicationOutcome.RUNTIME_DISABLED, PostLoadPublicationOutcome.POLICY_DISABLED}
        if (self.outcome not in disabled) != (self.identity_digest is not None):
            raise ValueError("post-load publication identity ownership is inconsistent")
        _check_elapsed(self.elapsed_seconds, "post-load publication")
        if (self.outcome is PostLoadPublicationOutcome.FAILED) != (self.failure is not None):
            raise ValueError("post-load publication failure ownership is inconsistent")


# ----------------------------------------------------------------------------- translations


def store_result_of(result: native.StoreResult) -> StoreResult:
    failure = result.failure if result.status in _FAILURE_STATUSES else None
    status = result.status
    if status is StoreStatus.FAILED and failure is not None and failure.code is FailureCode.LOCK_TIMEOUT:
        status = StoreStatus.TIMEOUT  # the reference's status for a wait that ran out
    if failure is not None and failure.code is FailureCode.PAYLOAD_INVALID:
        failure = reference_failure(failure)
    if failure is not None and failure.stage is ResolutionStage.PRODUCTION and failure.code is FailureCode.UNSUPPORTED:
        # a coordination scope this store does not run: the reference calls the producer unsupported
        failure = HostWeightFailure(
            failure.stage, FailureCode.PRODUCER_UNSUPPORTED, False, failure.message, failure.details
        )
    return StoreResult(status, result.lease, failure)


def reference_failure(found: HostWeightFailure) -> HostWeightFailure:
    """A payload file that is not what the manifest describes is the reference's MANIFEST_CORRUPT.

    The reference has no payload code: a symlinked, truncated or malformed payload file is a corrupt
    artifact there (digest mismatches stay CHECKSUM_MISMATCH in both), so its name is given here.
    """
    if found.code is not FailureCode.PAYLOAD_INVALID:
        return found
    return HostWeightFailure(found.stage, FailureCode.MANIFEST_INVALID, found.retryable, found.message, found.details)


def _attempt_result(attempt: native.ResolutionAttempt) -> AttemptResult:
    result = attempt.result
    if result is native.AttemptResult.HIT:
        return AttemptResult.HIT
    if result is native.AttemptResult.MISS:
        return AttemptResult.MISS
    if result in (native.AttemptResult.BUILT, native.AttemptResult.JOINED):
        return AttemptResult.SUCCESS
    if attempt.failure is None:
        return AttemptResult.SKIPPED
    if attempt.failure.code is FailureCode.LOCK_TIMEOUT:
        return AttemptResult.TIMEOUT
    return AttemptResult.SKIPPED if result is native.AttemptResult.SKIPPED else AttemptResult.ERROR


def _attempt_action(attempt: native.ResolutionAttempt, following: native.ResolutionAttempt | None) -> ResolutionAction:
    action = attempt.action
    if action is native.AttemptAction.USE:
        return ResolutionAction.RETURN_LEASE
    if action is native.AttemptAction.FALL_BACK:
        return ResolutionAction.CANONICAL_FALLBACK
    if action is native.AttemptAction.FAIL:
        return ResolutionAction.FAIL_STARTUP
    if following is not None and following.stage is ResolutionStage.REMOTE:
        return ResolutionAction.TRY_REMOTE
    if following is not None and following.stage is ResolutionStage.PRODUCTION:
        if following.result is native.AttemptResult.SKIPPED:  # no producer may run: the reference ends here
            return _attempt_action(following, None)
        invalid = attempt.result is native.AttemptResult.INVALID
        return ResolutionAction.QUARANTINE_THEN_PRODUCE if invalid else ResolutionAction.TRY_PRODUCER
    return ResolutionAction.SKIP


def _attempts(report: native.ResolutionReport) -> tuple[ResolutionAttempt, ...]:
    made: list[ResolutionAttempt] = []
    steps = report.attempts
    for index, attempt in enumerate(steps):
        following = steps[index + 1] if index + 1 < len(steps) else None
        result = _attempt_result(attempt)
        failure = None if result in (AttemptResult.HIT, AttemptResult.MISS, AttemptResult.SUCCESS) else attempt.failure
        failure = None if failure is None else reference_failure(failure)
        made.append(
            ResolutionAttempt(attempt.stage, result, _attempt_action(attempt, following), attempt.elapsed_s, failure)
        )
    return tuple(made)


def resolution_report_of(report: native.ResolutionReport) -> ResolutionReport:
    return ResolutionReport(report.resolution_id, report.outcome, _attempts(report), report.elapsed_s)


def resolution_of(resolution: native.HostWeightResolution) -> HostWeightResolution:
    return HostWeightResolution(resolution_report_of(resolution.report), resolution.lease)


# What the store answered, for each publication status this runtime reports after it.
_STORE_OUTCOME = {"published": "built", "already_present": "hit", "joined": "joined"}


def _publication_failure(found: HostWeightFailure | None) -> HostWeightFailure | None:
    """The reference's words for two publication failures.

    A store that broke its contract is its PRODUCER_FAILED (PRODUCTION); a publication whose lease could
    not be closed is its PUBLICATION_FAILED (LIFECYCLE), with the exception's type and the store's outcome.
    """
    if found is not None and found.code is FailureCode.LEASE_CLOSE_FAILED:
        value = found.details.to_value()
        details = value if isinstance(value, dict) else {}
        exception_type = str(details.get("exception_type", "")).rsplit(".", 1)[-1]
        store_outcome = _STORE_OUTCOME.get(str(details.get("publication_status")), "unknown")
        translated = {"exception_type": exception_type, "store_outcome": store_outcome}
        return HostWeightFailure(
            ResolutionStage.LIFECYCLE,
            FailureCode.PUBLICATION_FAILED,
            False,
            found.message,
            CanonicalJson.from_value(translated),
        )
    if found is None or found.code is not FailureCode.UNEXPECTED_STATUS:
        return found
    return HostWeightFailure(
        ResolutionStage.PRODUCTION, FailureCode.PRODUCER_FAILED, False, found.message, found.details
    )


def publication_report_of(report: native.PostLoadPublicationReport) -> PostLoadPublicationReport:
    outcome = PostLoadPublicationOutcome(report.status.value)
    disabled = outcome in (PostLoadPublicationOutcome.RUNTIME_DISABLED, PostLoadPublicationOutcome.POLICY_DISABLED)
    failure = _publication_failure(report.failure) if outcome is PostLoadPublicationOutcome.FAILED else None
    return PostLoadPublicationReport(
        report.resolution_id, outcome, None if disabled else report.identity_key, report.elapsed_s, failure
    )

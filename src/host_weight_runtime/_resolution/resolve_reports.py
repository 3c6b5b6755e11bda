"""Assembling what a call reports: attempt records, the terminal conclusion, and the one report (logged).

Every resolve logs exactly one record on the `host_weight_runtime.resolve` logger: INFO for
a hit, a build or a clean cold start, WARNING for a fallback with a failure or a failed
resolve. The record carries the whole report as a JSON-safe dict in `record.hwr_report`
(`ResolutionReport.to_dict()`, with anything that looks like a credential redacted).
"""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass

from ..canonical_json import JsonValue
from ..failures import FailureCode, HostWeightFailure, ResolutionStage, failure
from ..lease import HostWeightLease
from ..outcomes import (
    AttemptAction,
    PostLoadPublicationReport,
    PostLoadPublicationStatus,
    ResolutionAttempt,
    ResolutionOutcome,
    ResolutionReport,
)
from .stage import StageOutcome

__all__ = [
    "REPORT_ATTRIBUTE",
    "RESOLVE_LOGGER",
    "PublicationOutcome",
    "ResolveConclusion",
    "attempt_of",
    "conclude_with_lease",
    "conclude_without_lease",
    "publication_report",
    "resolution_report",
]

_LOG = logging.getLogger("host_weight_runtime")
RESOLVE_LOGGER = "host_weight_runtime.resolve"
REPORT_ATTRIBUTE = "hwr_report"  # the LogRecord attribute holding the report's dict
_RESOLVE_LOG = logging.getLogger(RESOLVE_LOGGER)
_SECRET_NAME = re.compile(r"token|secret|password|passwd|credential|storage_option|authorization|api_key|access_key")
_URL_USERINFO = re.compile(r"(?P<scheme>[a-zA-Z][a-zA-Z0-9+.-]*://)[^/@\s]+@")
REDACTED = "<redacted>"


@dataclass(frozen=True, slots=True)
class ResolveConclusion:
    """How one resolve ended, before it is stamped with its total time and reported."""

    outcome: ResolutionOutcome
    attempts: tuple[ResolutionAttempt, ...]
    failure: HostWeightFailure | None = None
    lease: HostWeightLease | None = None
    publication_id: str | None = None


@dataclass(frozen=True, slots=True)
class PublicationOutcome:
    """How one post-load publication ended, before it is stamped with its time and reported."""

    status: PostLoadPublicationStatus
    failure: HostWeightFailure | None = None
    publication_id: str | None = None


def attempt_of(outcome: StageOutcome, action: AttemptAction, elapsed_s: float) -> ResolutionAttempt:
    """The attempt record of a tried stage, once the decision table gave its action."""
    assert outcome.result is not None, "a stage that was not tried records no attempt"
    return ResolutionAttempt(outcome.stage, outcome.result, action, elapsed_s, outcome.failure, outcome.detail)


def conclude_with_lease(outcome: StageOutcome, attempts: list[ResolutionAttempt]) -> ResolveConclusion:
    """The resolve uses the lease the stage found."""
    assert outcome.lease is not None and outcome.outcome is not None
    return ResolveConclusion(
        outcome.outcome, tuple(attempts), lease=outcome.lease, publication_id=outcome.publication_id
    )


def conclude_without_lease(
    key: str, attempts: list[ResolutionAttempt], action: AttemptAction, fail: HostWeightFailure | None
) -> ResolveConclusion:
    """No lease: canonical fallback when the action is FALL_BACK, otherwise a failure (never without one)."""
    if action is AttemptAction.FALL_BACK:
        return ResolveConclusion(ResolutionOutcome.CANONICAL_FALLBACK, tuple(attempts), fail)
    if fail is None:  # defensive: a FAILED report always carries a failure
        fail = failure(ResolutionStage.CONFIGURATION, FailureCode.NOT_FOUND, f"no artifact for key {key}", key=key)
    return ResolveConclusion(ResolutionOutcome.FAILED, tuple(attempts), fail)


def resolution_report(key: str, mode: str, conclusion: ResolveConclusion, started: float) -> ResolutionReport:
    """The one terminal report of a resolve; fallbacks and failures are logged loudly."""
    made = ResolutionReport(
        identity_key=key,
        mode=mode,
        outcome=conclusion.outcome,
        attempts=conclusion.attempts,
        elapsed_s=time.monotonic() - started,
        failure=conclusion.failure,
        publication_id=conclusion.publication_id,
    )
    log_resolution(made)
    return made


def publication_report(key: str, outcome: PublicationOutcome, started: float) -> PostLoadPublicationReport:
    """The one report of a post-load publication; a failure is logged as a warning."""
    made = PostLoadPublicationReport(
        key, outcome.status, time.monotonic() - started, outcome.failure, outcome.publication_id
    )
    fail = outcome.failure
    if fail is not None:
        _LOG.warning("post-load publication of %s failed: [%s] %s", key, fail.code.value, fail.message)
    return made


def log_resolution(made: ResolutionReport) -> None:
    """The one log record of a resolve, carrying the report (redacted) in `record.hwr_report`."""
    key, outcome, fail = made.identity_key, made.outcome, made.failure
    level = logging.INFO
    args: tuple[object, ...]
    if outcome is ResolutionOutcome.FAILED and fail is not None:
        level = logging.WARNING
        message, args = "host weight resolve of %s failed: [%s] %s", (key, fail.code.value, fail.message)
    elif outcome is ResolutionOutcome.CANONICAL_FALLBACK and fail is None:
        # A clean miss is an ordinary cold start, not a problem.
        message, args = "host weight resolve of %s: no artifact yet; loading canonically", (key,)
    elif outcome is ResolutionOutcome.CANONICAL_FALLBACK and fail is not None:
        level = logging.WARNING
        message = "host weight resolve of %s falls back to canonical loading: [%s] %s"
        args = (key, fail.code.value, fail.message)
    else:
        message, args = "host weight resolve of %s: %s in %.3f s", (key, outcome.value, made.elapsed_s)
    if _RESOLVE_LOG.isEnabledFor(level):
        _RESOLVE_LOG.log(level, message, *args, extra={REPORT_ATTRIBUTE: redact(made.to_dict())})


def redact(value: JsonValue) -> JsonValue:
    """A copy of `value` with credential-like fields and URL user-info replaced, for logs."""
    if isinstance(value, dict):
        return {name: REDACTED if _SECRET_NAME.search(name.lower()) else redact(item) for name, item in value.items()}
    if isinstance(value, list):
        return [redact(item) for item in value]
    if isinstance(value, str):
        return _URL_USERINFO.sub(lambda match: f"{match.group('scheme')}{REDACTED}@", value)
    return value

"""The decision table: what a resolve does with each stage's result, in each mode (DESIGN section 7).

Stages only say what they found (a `StageVerdict`); this module alone turns that into an
action, so the whole policy (behaviours R02 and R10) reads in one place:

================================================  ==========  ========
what a stage produced                             PREFERRED   REQUIRED
================================================  ==========  ========
clean miss, nothing else could build it           fall back   fail
invalid artifact (StoreStatus.INVALID)            fall back   fail
failure marked retryable                          fall back   fail
failure not retryable, or a code in ALWAYS_FATAL  fail        fail
remote import failed, code not in ALWAYS_FATAL    next stage  fail
================================================  ==========  ========

An invalid artifact found by the lookup is not final: the producer stage still runs
(the store quarantines the copy and rebuilds). A retryable *lookup* failure (a lock
timeout, EIO) ends the resolve: the build would need the same locks and reads. A
remote is an optional source: when every configured remote missed or failed, PREFERRED
goes on to the local build (even after a non-retryable failure: a bad remote must not
stop a good local build) and then to the canonical fallback; REQUIRED fails.

Per verdict (`stage_action`): USE ends with the lease; MISS, SKIPPED, and a DENIED or
UNAVAILABLE result whose code is not in ALWAYS_FATAL continue to the next stage
(UNAVAILABLE only in PREFERRED); FAILED and INVALID end the resolve with
`fallback_action`; REJECTED always fails. When every stage continued, the canonical
fallback decides with `after_last_stage` on the denial or remote failure still pending
(or on a clean miss when there is none).
"""

from __future__ import annotations

import enum

from ..config import RuntimeMode
from ..failures import FailureCode, HostWeightFailure
from ..outcomes import AttemptAction

__all__ = [
    "ALWAYS_FATAL",
    "StageVerdict",
    "after_last_stage",
    "fallback_action",
    "is_always_fatal",
    "may_fall_back",
    "stage_action",
]

# Codes that are semantic or configuration errors: they fail in every mode, even if a
# store marked them retryable, so a real problem is never disguised as a miss (R10).
ALWAYS_FATAL: frozenset[FailureCode] = frozenset(
    {
        FailureCode.INVALID_CONFIGURATION,
        FailureCode.UNSUPPORTED,
        FailureCode.PRODUCER_UNSUPPORTED,
        FailureCode.UNSUPPORTED_FILESYSTEM,
        FailureCode.STORAGE_CLASS_MISMATCH,
        FailureCode.UNSAFE_PERMISSIONS,
        FailureCode.DOMAIN_POLICY_CONFLICT,
        FailureCode.IDENTITY_COLLISION,
        FailureCode.PRODUCER_FAILED,
        FailureCode.PUBLICATION_FAILED,
        FailureCode.STORE_INIT_FAILED,
        FailureCode.UNEXPECTED_STATUS,
    }
)


class StageVerdict(enum.Enum):
    """What one stage found: the row of the decision table its result falls in."""

    USE = "use"  # it holds a validated lease
    MISS = "miss"  # nothing there; a later stage may still provide it
    DENIED = "denied"  # an invalid artifact was denied; a later stage may rebuild it
    SKIPPED = "skipped"  # the stage could not run (no producer, policy); a later stage may still provide it
    NOT_TRIED = "not_tried"  # the stage does not apply to this runtime: no attempt is recorded
    UNAVAILABLE = "unavailable"  # an optional source (a remote) failed; a later stage may still provide it
    FAILED = "failed"  # the stage failed; the resolve ends here
    INVALID = "invalid"  # the stage's own result is an invalid artifact; the resolve ends here
    REJECTED = "rejected"  # the stage refused its input before running: fatal in every mode


def is_always_fatal(fail: HostWeightFailure) -> bool:
    """A code that fails in every mode, whatever the store said about retrying."""
    return fail.code in ALWAYS_FATAL


def may_fall_back(failure: HostWeightFailure | None, *, invalid_artifact: bool = False) -> bool:
    """The mode-independent half of the decision table: may PREFERRED fall back after this?

    A clean miss (no failure) and an invalid artifact may; otherwise only a failure
    marked retryable whose code is not in `ALWAYS_FATAL`.
    """
    if failure is None:
        return True
    if failure.code in ALWAYS_FATAL:
        return False
    return invalid_artifact or failure.retryable


def fallback_action(
    mode: RuntimeMode, fail: HostWeightFailure | None, *, invalid_artifact: bool = False
) -> AttemptAction:
    """The table's answer for a result that ends the resolve without a lease: fall back or fail."""
    if mode is RuntimeMode.PREFERRED and may_fall_back(fail, invalid_artifact=invalid_artifact):
        return AttemptAction.FALL_BACK
    return AttemptAction.FAIL


def stage_action(mode: RuntimeMode, verdict: StageVerdict, fail: HostWeightFailure | None) -> AttemptAction:
    """The action a stage's verdict leads to; CONTINUE hands the resolve to the next stage."""
    if verdict is StageVerdict.USE:
        return AttemptAction.USE
    if verdict in (StageVerdict.MISS, StageVerdict.SKIPPED, StageVerdict.NOT_TRIED):
        return AttemptAction.CONTINUE
    if verdict is StageVerdict.DENIED:
        assert fail is not None, "a denial carries the store's failure"
        return AttemptAction.FAIL if is_always_fatal(fail) else AttemptAction.CONTINUE
    if verdict is StageVerdict.UNAVAILABLE:
        assert fail is not None, "an unavailable source carries its failure"
        if mode is RuntimeMode.PREFERRED and not is_always_fatal(fail):
            return AttemptAction.CONTINUE
        return AttemptAction.FAIL
    if verdict is StageVerdict.FAILED:
        return fallback_action(mode, fail)
    if verdict is StageVerdict.INVALID:
        return fallback_action(mode, fail, invalid_artifact=True)
    assert verdict is StageVerdict.REJECTED
    return AttemptAction.FAIL


def after_last_stage(mode: RuntimeMode, denial: HostWeightFailure | None) -> AttemptAction:
    """Every stage continued (canonical fallback): a clean miss, or a denial or remote failure still pending."""
    return fallback_action(mode, denial, invalid_artifact=denial is not None)

"""vLLM-Omni's failure vocabulary: this runtime's failures, with the reference's names as aliases."""

from __future__ import annotations

import enum

from ...failures import FailureCode, HostWeightError, HostWeightFailure, ResolutionStage

__all__ = ["FailureCode", "HostWeightError", "HostWeightFailure", "ResolutionAction", "ResolutionStage"]


class ResolutionAction(str, enum.Enum):
    """What the reference's runtime did after an attempt (this runtime's `AttemptAction`, spelled out)."""

    RETURN_LEASE = "return_lease"
    TRY_REMOTE = "try_remote"
    TRY_PRODUCER = "try_producer"
    QUARANTINE_THEN_PRODUCE = "quarantine_then_produce"
    CANONICAL_FALLBACK = "canonical_fallback"
    FAIL_STARTUP = "fail_startup"
    SKIP = "skip"

"""Stage 1, local lookup: a validated artifact already published on this node."""

from __future__ import annotations

from ..failures import ResolutionStage
from ..outcomes import AttemptResult, ResolutionOutcome, StoreStatus
from .decisions import StageVerdict, is_always_fatal
from .stage import StageContext, StageOutcome
from .store_calls import call_store, publication_id_of

__all__ = ["local_lookup"]

_STAGE = ResolutionStage.LOOKUP


def local_lookup(context: StageContext) -> StageOutcome:
    """Ask the store for the exact artifact; a denied (invalid) copy leaves the rebuild to a later stage."""
    identity, store = context.identity, context.store
    validation, deadline = context.config.validation, context.deadline
    result, call_failure = call_store(
        _STAGE,
        identity,
        lambda: store.lookup(identity, validation=validation, deadline=deadline),
        allowed=(StoreStatus.HIT, StoreStatus.MISS, StoreStatus.INVALID, StoreStatus.FAILED),
    )
    if result is None:
        return StageOutcome.found(
            _STAGE, StageVerdict.FAILED, AttemptResult.FAILED, "store lookup failed", call_failure
        )
    if result.status is StoreStatus.HIT:
        lease = result.lease
        assert lease is not None
        return StageOutcome.used(
            _STAGE,
            AttemptResult.HIT,
            "validated local hit",
            lease=lease,
            outcome=ResolutionOutcome.LOCAL_HIT,
            publication_id=publication_id_of(result, lease),
        )
    if result.status is StoreStatus.MISS:
        return StageOutcome.found(_STAGE, StageVerdict.MISS, AttemptResult.MISS, "no artifact")
    denial = result.failure
    assert denial is not None
    if result.status is StoreStatus.INVALID:
        detail = (
            "invalid artifact with a fatal failure code"
            if is_always_fatal(denial)
            else "artifact denied; a producer may rebuild it"
        )
        return StageOutcome.found(_STAGE, StageVerdict.DENIED, AttemptResult.INVALID, detail, denial)
    return StageOutcome.found(_STAGE, StageVerdict.FAILED, AttemptResult.FAILED, "store lookup failed", denial)

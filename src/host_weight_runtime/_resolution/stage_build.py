"""Stage 3, local build: run the caller's PRE_LOAD_SAFE producer through the store's get_or_build."""

from __future__ import annotations

from ..config import HostWeightRuntimeConfig
from ..failures import ResolutionStage
from ..outcomes import AttemptResult, ResolutionOutcome, StoreStatus
from ..protocols import BuildRequest, LookupPhase, WeightProducer
from .checks import producer_rejection
from .decisions import StageVerdict
from .stage import StageContext, StageOutcome
from .store_calls import call_store, publication_id_of

__all__ = ["local_build"]

_STAGE = ResolutionStage.PRODUCTION

# A store result that carries a lease: what the attempt records and what the resolve becomes.
_WITH_LEASE: dict[StoreStatus, tuple[AttemptResult, ResolutionOutcome, str]] = {
    StoreStatus.BUILT: (AttemptResult.BUILT, ResolutionOutcome.LOCAL_PRODUCTION, "built and published"),
    StoreStatus.JOINED: (AttemptResult.JOINED, ResolutionOutcome.LOCAL_PRODUCTION, "joined another process's build"),
    StoreStatus.HIT: (AttemptResult.HIT, ResolutionOutcome.LOCAL_HIT, "published meanwhile by another"),
}


def local_build(context: StageContext) -> StageOutcome:
    """Build (or join the build of) the artifact; skipped when there is no producer resolve may run."""
    producer = context.producer
    skip_reason = _skip_reason(context.config, producer)
    if skip_reason is not None:
        return StageOutcome.found(_STAGE, StageVerdict.SKIPPED, AttemptResult.SKIPPED, skip_reason)
    assert producer is not None
    identity, store = context.identity, context.store
    rejection = producer_rejection(_STAGE, identity, producer)
    if rejection is not None:
        return StageOutcome.found(
            _STAGE, StageVerdict.REJECTED, AttemptResult.FAILED, "producer rejected before running", rejection
        )
    validation, deadline = context.config.validation, context.deadline
    result, call_failure = call_store(
        _STAGE,
        identity,
        lambda: store.get_or_build(BuildRequest(identity), producer, validation=validation, deadline=deadline),
        allowed=(StoreStatus.HIT, StoreStatus.BUILT, StoreStatus.JOINED, StoreStatus.INVALID, StoreStatus.FAILED),
    )
    if result is None:
        return StageOutcome.found(
            _STAGE, StageVerdict.FAILED, AttemptResult.FAILED, "get_or_build failed", call_failure
        )
    if result.lease is not None:
        lease = result.lease
        attempt_result, outcome, detail = _WITH_LEASE[result.status]
        return StageOutcome.used(
            _STAGE,
            attempt_result,
            detail,
            lease=lease,
            outcome=outcome,
            publication_id=publication_id_of(result, lease),
        )
    build_failure = result.failure
    assert build_failure is not None
    if result.status is StoreStatus.INVALID:
        detail = "get_or_build returned an invalid artifact"
        return StageOutcome.found(_STAGE, StageVerdict.INVALID, AttemptResult.INVALID, detail, build_failure)
    return StageOutcome.found(_STAGE, StageVerdict.FAILED, AttemptResult.FAILED, "get_or_build failed", build_failure)


def _skip_reason(config: HostWeightRuntimeConfig, producer: WeightProducer | None) -> str | None:
    """Why resolve will not run this producer, or None when it may (subject to validation)."""
    if producer is None:
        return "no producer was given"
    if not config.allow_local_build:
        return "local builds are disabled by policy (allow_local_build=False)"
    if producer.spec.lookup_phase is LookupPhase.POST_LOAD_ONLY:
        return (
            f"producer {producer.spec.producer_id!r} is POST_LOAD_ONLY; resolve never runs it "
            "(publish it with publish_after_load once the model is loaded)"
        )
    return None

"""The resolve pipeline: open the store, run the stages in order, conclude with canonical fallback.

Order (DESIGN section 7): local lookup -> remote import -> local build -> canonical
fallback. The stages are `RESOLVE_STAGES`; a new one (a group cohort) joins by adding
its unit there, with any new verdict row in `decisions`.

The pipeline records one attempt per stage tried, with the action the decision table
gave it. A stage that continues hands over to the next; when no stage is left, the
canonical fallback decides, and its action is recorded on the last stage tried.
"""

from __future__ import annotations

import time

from ..config import HostWeightRuntimeConfig, RuntimeMode
from ..failures import FailureCode, HostWeightFailure, ResolutionStage, failure
from ..identity import WeightArtifactIdentity
from ..outcomes import AttemptAction, AttemptResult, ResolutionAttempt
from ..protocols import RemoteArtifactProvider, WeightProducer
from .decisions import StageVerdict, after_last_stage, stage_action
from .resolve_reports import ResolveConclusion, attempt_of, conclude_with_lease, conclude_without_lease
from .stage import ResolveStage, StageContext, StageOutcome
from .stage_build import local_build
from .stage_lookup import local_lookup
from .stage_remote import remote_import
from .store_calls import StoreAcquirer

__all__ = ["RESOLVE_STAGES", "run_resolution"]

RESOLVE_STAGES: tuple[ResolveStage, ...] = (local_lookup, remote_import, local_build)


def run_resolution(
    config: HostWeightRuntimeConfig,
    identity: WeightArtifactIdentity,
    producer: WeightProducer | None,
    *,
    deadline: float,
    acquire_store: StoreAcquirer,
    stages: tuple[ResolveStage, ...] = RESOLVE_STAGES,
    remote_providers: tuple[RemoteArtifactProvider, ...] = (),
) -> ResolveConclusion:
    """Resolve an enabled runtime's request; every store and policy outcome is a conclusion, never raised."""
    key, mode = identity.key, config.mode

    # DOMAIN: recorded only when the store cannot be opened.
    stage_start = time.monotonic()
    store, init_failure = acquire_store()
    if store is None:
        assert init_failure is not None
        opened = StageOutcome.found(
            ResolutionStage.DOMAIN,
            StageVerdict.FAILED,
            AttemptResult.FAILED,
            "the host weight store could not be opened",
            init_failure,
        )
        action = stage_action(mode, opened.verdict, opened.failure)
        return conclude_without_lease(
            key, [attempt_of(opened, action, time.monotonic() - stage_start)], action, init_failure
        )

    context = StageContext(identity, producer, deadline, config, store, remote_providers)
    attempts: list[ResolutionAttempt] = []
    # The last stage that continued: its action is CONTINUE once a later stage is tried,
    # or the canonical fallback's action when none is.
    continued: tuple[StageOutcome, float] | None = None
    # The last denial (or remote failure) no later stage has repaired: the canonical fallback's reason.
    denial: HostWeightFailure | None = None
    for run_stage in stages:
        stage_start = time.monotonic()
        outcome = run_stage(context)
        elapsed = time.monotonic() - stage_start
        if outcome.verdict is StageVerdict.NOT_TRIED:
            continue
        if continued is not None:
            attempts.append(attempt_of(continued[0], AttemptAction.CONTINUE, continued[1]))
            continued = None
        action = stage_action(mode, outcome.verdict, outcome.failure)
        if action is AttemptAction.CONTINUE:
            continued = (outcome, elapsed)
            if outcome.verdict in (StageVerdict.DENIED, StageVerdict.UNAVAILABLE):
                denial = outcome.failure
            continue
        attempts.append(attempt_of(outcome, action, elapsed))
        if action is AttemptAction.USE:
            return conclude_with_lease(outcome, attempts)
        return conclude_without_lease(key, attempts, action, outcome.failure)

    reason = continued[0].detail if continued is not None else "no stage could be tried"
    action, terminal = _canonical_fallback(mode, key, denial, reason)
    if continued is not None:
        attempts.append(attempt_of(continued[0], action, continued[1]))
    return conclude_without_lease(key, attempts, action, terminal)


def _canonical_fallback(
    mode: RuntimeMode, key: str, denial: HostWeightFailure | None, reason: str
) -> tuple[AttemptAction, HostWeightFailure | None]:
    """No stage gave a lease: fall back or fail per `after_last_stage`; a clean miss in REQUIRED is NOT_FOUND."""
    action = after_last_stage(mode, denial)
    if denial is None and mode is RuntimeMode.REQUIRED:
        return action, failure(
            ResolutionStage.LOOKUP,
            FailureCode.NOT_FOUND,
            f"no artifact for key {key} and no producer could build it ({reason}); "
            "REQUIRED mode does not fall back to canonical loading",
            retryable=True,
            key=key,
            reason=reason,
        )
    return action, denial

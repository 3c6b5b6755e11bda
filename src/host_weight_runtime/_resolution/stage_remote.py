"""Stage 2, remote import: the exact artifact from the configured remotes, imported as a local build.

Each provider (HWR_REMOTE's URLs, or the runtime's `remote_providers`) is probed in
order; the first that offers the identity has it streamed into the store's writer,
re-hashed and published atomically (`remote.import_remote_artifact`). A provider that
offers nothing is skipped; one that fails is remembered and the next is tried. With no
provider configured the stage is not tried and the report lists no attempt for it.
"""

from __future__ import annotations

import logging

from ..failures import HostWeightFailure, ResolutionStage
from ..outcomes import AttemptResult, ResolutionOutcome, StoreResult, StoreStatus
from ..protocols import RemoteArtifactProvider
from .decisions import StageVerdict, is_always_fatal
from .stage import StageContext, StageOutcome
from .store_calls import call_store, publication_id_of

__all__ = ["remote_import"]

_LOG = logging.getLogger("host_weight_runtime")

_STAGE = ResolutionStage.REMOTE

# An import result that carries a lease: what the attempt records and what the resolve becomes.
_WITH_LEASE: dict[StoreStatus, tuple[AttemptResult, ResolutionOutcome, str]] = {
    StoreStatus.BUILT: (AttemptResult.BUILT, ResolutionOutcome.REMOTE_IMPORT, "imported and published from {}"),
    StoreStatus.JOINED: (
        AttemptResult.JOINED,
        ResolutionOutcome.REMOTE_IMPORT,
        "joined another process's import or build (remote {})",
    ),
    StoreStatus.HIT: (AttemptResult.HIT, ResolutionOutcome.LOCAL_HIT, "published meanwhile by another (remote {})"),
}


def remote_import(context: StageContext) -> StageOutcome:
    """Import from the first remote that offers the identity; MISS when none does, UNAVAILABLE when one failed."""
    providers = context.remote_providers
    if not providers:
        return StageOutcome.not_tried(_STAGE, "no remote provider is configured")
    first_failure: HostWeightFailure | None = None
    failed = 0
    for provider in providers:
        result, problem = _import_from(context, provider)
        if result is not None and result.lease is not None:
            lease = result.lease
            attempt_result, outcome, detail = _WITH_LEASE[result.status]
            return StageOutcome.used(
                _STAGE,
                attempt_result,
                detail.format(provider.provider_id),
                lease=lease,
                outcome=outcome,
                publication_id=publication_id_of(result, lease),
            )
        if problem is None:
            continue  # this remote does not hold the artifact
        if is_always_fatal(problem):
            return StageOutcome.found(
                _STAGE, StageVerdict.UNAVAILABLE, AttemptResult.FAILED, f"remote {provider.provider_id} failed", problem
            )
        failed += 1
        first_failure = first_failure or problem
        _LOG.warning(
            "remote %s failed for %s: [%s] %s",
            provider.provider_id,
            context.identity.key,
            problem.code.value,
            problem.message,
        )
    probed = ", ".join(str(provider.provider_id) for provider in providers)
    if first_failure is not None:
        detail = f"{failed} of {len(providers)} remote(s) failed and none offered the artifact ({probed})"
        return StageOutcome.found(_STAGE, StageVerdict.UNAVAILABLE, AttemptResult.FAILED, detail, first_failure)
    return StageOutcome.found(_STAGE, StageVerdict.MISS, AttemptResult.MISS, f"no remote offers it ({probed})")


def _import_from(
    context: StageContext, provider: RemoteArtifactProvider
) -> tuple[StoreResult | None, HostWeightFailure | None]:
    """One provider's import held to the store contract: (result with a lease, None), (None, failure) or a miss."""
    from ..remote import import_remote_artifact  # only runtimes with a remote load fsspec's side of the package

    identity, store = context.identity, context.store
    validation, deadline = context.config.validation, context.deadline
    missing = StoreResult(StoreStatus.MISS, identity)
    result, problem = call_store(
        _STAGE,
        identity,
        lambda: import_remote_artifact(store, identity, provider, validation=validation, deadline=deadline) or missing,
        allowed=(StoreStatus.HIT, StoreStatus.MISS, StoreStatus.BUILT, StoreStatus.JOINED, StoreStatus.FAILED),
    )
    if result is None:
        return None, problem
    if result.status is StoreStatus.FAILED:
        return None, result.failure
    if result.status is StoreStatus.MISS:
        return None, None
    return result, None

"""The post-load publication stage: publish a loaded model's weights for later workers.

It runs after the serving model is loaded, off the resolve path: only POST_LOAD_ONLY
producers, gated by `allow_post_load_publish`; every outcome is a `PublicationOutcome`,
and the lease the store hands back is always closed here.
"""

from __future__ import annotations

import logging

from ..config import HostWeightRuntimeConfig, RuntimeMode
from ..failures import FailureCode, ResolutionStage, failure
from ..identity import WeightArtifactIdentity
from ..outcomes import PostLoadPublicationStatus, StoreStatus
from ..protocols import BuildRequest, LookupPhase, WeightProducer
from .checks import producer_rejection
from .resolve_reports import PublicationOutcome
from .store_calls import StoreAcquirer, call_store, exception_details, failure_with, publication_id_of

__all__ = ["post_load_publication"]

_LOG = logging.getLogger("host_weight_runtime")

_STAGE = ResolutionStage.POST_LOAD_PUBLICATION

_PUBLISHED_AS: dict[StoreStatus, PostLoadPublicationStatus] = {
    StoreStatus.BUILT: PostLoadPublicationStatus.PUBLISHED,
    StoreStatus.HIT: PostLoadPublicationStatus.ALREADY_PRESENT,
    StoreStatus.JOINED: PostLoadPublicationStatus.JOINED,
}


def post_load_publication(
    config: HostWeightRuntimeConfig,
    identity: WeightArtifactIdentity,
    producer: WeightProducer,
    deadline: float,
    acquire_store: StoreAcquirer,
) -> PublicationOutcome:
    """Publish through the store's get_or_build; policy, producer and store problems come back as outcomes."""
    if config.mode is RuntimeMode.DISABLED:
        return PublicationOutcome(PostLoadPublicationStatus.RUNTIME_DISABLED)
    if not config.allow_post_load_publish:
        return PublicationOutcome(PostLoadPublicationStatus.POLICY_DISABLED)
    spec = producer.spec
    if spec.lookup_phase is not LookupPhase.POST_LOAD_ONLY:
        return PublicationOutcome(
            PostLoadPublicationStatus.FAILED,
            failure(
                _STAGE,
                FailureCode.PRODUCER_UNSUPPORTED,
                f"publish_after_load accepts only POST_LOAD_ONLY producers; {spec.producer_id!r} is "
                f"{spec.lookup_phase.value}; pass it to resolve() instead",
                producer_id=spec.producer_id,
                lookup_phase=spec.lookup_phase.value,
            ),
        )
    rejection = producer_rejection(_STAGE, identity, producer)
    if rejection is not None:
        return PublicationOutcome(PostLoadPublicationStatus.FAILED, rejection)

    store, init_failure = acquire_store()
    if store is None:
        return PublicationOutcome(PostLoadPublicationStatus.FAILED, init_failure)

    validation = config.validation
    result, call_failure = call_store(
        _STAGE,
        identity,
        lambda: store.get_or_build(BuildRequest(identity), producer, validation=validation, deadline=deadline),
        allowed=(StoreStatus.HIT, StoreStatus.BUILT, StoreStatus.JOINED, StoreStatus.INVALID, StoreStatus.FAILED),
    )
    if result is None:
        return PublicationOutcome(PostLoadPublicationStatus.FAILED, call_failure)
    lease = result.lease
    if lease is None:
        return PublicationOutcome(PostLoadPublicationStatus.FAILED, result.failure, result.publication_id)
    publication_id = publication_id_of(result, lease)
    status = _PUBLISHED_AS[result.status]
    try:
        lease.close()
    except Exception as exc:
        _LOG.exception("closing the post-load publication lease of %s failed", identity.key)
        return PublicationOutcome(
            PostLoadPublicationStatus.FAILED,
            failure_with(
                ResolutionStage.LEASE,
                FailureCode.LEASE_CLOSE_FAILED,
                f"the artifact is {status.value} but its lease could not be closed; "
                "the shared artifact lock may stay held until this process exits",
                {"publication_status": status.value, **exception_details(exc)},
            ),
            publication_id,
        )
    return PublicationOutcome(status, None, publication_id)

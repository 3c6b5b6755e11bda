"""Input checks shared by resolve and post-load publication: caller errors raise, producer limits are failures."""

from __future__ import annotations

import math

from ..failures import FailureCode, HostWeightFailure, ResolutionStage, failure
from ..identity import WeightArtifactIdentity
from ..protocols import CoordinationScope, WeightBundleProducer, WeightProducer

__all__ = ["check_identity", "check_producer", "deadline_from", "producer_rejection"]

_UNSUPPORTED_SCOPES = frozenset({CoordinationScope.GROUP_COHORT, CoordinationScope.ARTIFACT_BUNDLE})
"""Scopes a producer cannot declare; ARTIFACT_BUNDLE is allowed for a `WeightBundleProducer`, and a group
cohort is coordinated above the runtime (it is not a property of one producer)."""


def check_identity(identity: object) -> None:
    if not isinstance(identity, WeightArtifactIdentity):
        raise TypeError(f"identity must be a WeightArtifactIdentity, got {type(identity).__name__}")


def check_producer(producer: object) -> None:
    if not isinstance(producer, WeightProducer):
        raise TypeError(f"producer must implement WeightProducer (spec, produce), got {type(producer).__name__}")


def deadline_from(deadline: float | None, started: float, lock_timeout_s: float) -> float:
    """The caller's absolute `time.monotonic()` deadline, or `started + lock_timeout_s` when none was given."""
    if deadline is None:
        return started + lock_timeout_s
    if type(deadline) not in (int, float) or not math.isfinite(deadline):
        raise ValueError(f"deadline must be a finite time.monotonic() value, got {deadline!r}")
    return deadline


def producer_rejection(
    stage: ResolutionStage, identity: WeightArtifactIdentity, producer: WeightProducer
) -> HostWeightFailure | None:
    """Refuse producers V1 cannot run correctly (S24) or that do not make this identity."""
    spec = producer.spec
    bundle = spec.coordination_scope is CoordinationScope.ARTIFACT_BUNDLE and isinstance(
        producer, WeightBundleProducer
    )
    if spec.coordination_scope in _UNSUPPORTED_SCOPES and not bundle:
        return failure(
            stage,
            FailureCode.UNSUPPORTED,
            f"producer {spec.producer_id!r} needs coordination scope {spec.coordination_scope.value}, which this "
            "version does not implement; use a single_process producer",
            producer_id=spec.producer_id,
            coordination_scope=spec.coordination_scope.value,
        )
    key = identity.key
    if not any(output.key == key for output in spec.outputs):
        return failure(
            stage,
            FailureCode.INVALID_CONFIGURATION,
            f"producer {spec.producer_id!r} does not declare identity {key} among its outputs",
            producer_id=spec.producer_id,
            key=key,
            outputs=[output.key for output in spec.outputs],
        )
    return None

"""The resolve step: ask the runtime for a component's artifact, streamed from the checkpoint on a miss if asked."""

from __future__ import annotations

from ..failures import HostWeightError
from ..outcomes import HostWeightResolution, ResolutionOutcome
from ..runtime import HostWeightRuntime
from .producers.fp8_checkpoint import streaming_producer
from .skeleton import IdentifiedComponent

__all__ = ["resolve_component"]


def resolve_component(
    identified: IdentifiedComponent, runtime: HostWeightRuntime, *, stream: bool
) -> HostWeightResolution:
    """The runtime's answer; a FAILED outcome (no lease, no fallback allowed) raises its HostWeightError."""
    context = identified.context
    streams = stream and identified.skeleton.source.use_safetensors
    producer = streaming_producer(context) if streams else None
    resolution = runtime.resolve(context.identity, producer)
    if resolution.lease is None and resolution.outcome is ResolutionOutcome.FAILED:
        assert resolution.report.failure is not None
        raise HostWeightError(resolution.report.failure)
    return resolution

"""The publish step: leave the artifact for the next worker, after a canonical load, on a thread, or streamed.

A post-load publication copies the loaded model's tensors; a build streams the checkpoint
(`build_artifact`, which `prewarm_component` and the background publication run).
"""

from __future__ import annotations

from collections.abc import Hashable

import torch

from ..failures import FailureCode, HostWeightError, ResolutionStage, failure
from ..outcomes import PostLoadPublicationReport
from ..runtime import HostWeightRuntime
from ._build_progress import ProgressRecorder
from .background import BackgroundPublication
from .fp8 import FinalLayoutFP8Producer
from .identity_adapter import FinalLayoutIdentityContext
from .load_reports import PrewarmResult
from .load_runtime import required_runtime
from .producers._shards import ProgressCallback
from .producers.finalized import FinalLayoutBF16Producer
from .producers.fp8_checkpoint import streaming_producer
from .skeleton import ComponentSkeleton, IdentifiedComponent, identify_component

__all__ = ["build_artifact", "publish_after_canonical_load", "require_safetensors", "start_background_publication"]


def publish_after_canonical_load(
    runtime: HostWeightRuntime,
    context: FinalLayoutIdentityContext,
    component_name: str,
    model: torch.nn.Module,
    *,
    fp8: bool,
) -> PostLoadPublicationReport:
    """Publish the canonically loaded model's tensors under the context's identity; every outcome is a report."""
    producer_class = FinalLayoutFP8Producer if fp8 else FinalLayoutBF16Producer
    # The model is not handed out before this returns, so nothing else can write it while it is published.
    producer = producer_class(context, [(component_name, model)], model_is_private=True)
    return runtime.publish_after_load(context.identity, producer)


def require_safetensors(skeleton: ComponentSkeleton, what: str, instead: str) -> None:
    """A streamed build reads safetensors only; anything else is PRODUCER_UNSUPPORTED, saying what to do instead."""
    if not skeleton.source.use_safetensors:
        raise HostWeightError(
            failure(
                ResolutionStage.PRODUCTION,
                FailureCode.PRODUCER_UNSUPPORTED,
                f"{skeleton.source.model_or_path} has no safetensors weights; {what} is streamed from safetensors "
                f"only. {instead} instead: that publishes after a canonical load",
            )
        )


def build_artifact(
    component: ComponentSkeleton | IdentifiedComponent, runtime: HostWeightRuntime, progress: ProgressCallback | None
) -> PrewarmResult:
    """Identify (when not yet done) and stream the checkpoint into the artifact; raises HostWeightError."""
    required = required_runtime(runtime)
    identified = component if isinstance(component, IdentifiedComponent) else identify_component(component, required)
    require_safetensors(identified.skeleton, "the artifact", "Load it once with load_component")
    context = identified.context
    resolution = required.resolve(context.identity, streaming_producer(context, progress=progress))
    if resolution.lease is None:
        assert resolution.report.failure is not None
        raise HostWeightError(resolution.report.failure)
    resolution.lease.close()
    return PrewarmResult(
        identity_key=context.identity.key,
        resolution=resolution.report,
        total_bytes=context.total_bytes,
        tensor_count=len(context.tensors),
    )


def start_background_publication(
    component: ComponentSkeleton | IdentifiedComponent,
    runtime: HostWeightRuntime,
    *,
    canonical_s: float | None = None,
    source: Hashable | None = None,
) -> BackgroundPublication:
    """Build the artifact from the checkpoint on a thread of its own (hashing first, when not yet identified).

    The build keeps a progress record (`_build_progress.py`) carrying `canonical_s`, the canonical
    load this worker just paid, so a worker arriving meanwhile can tell which is sooner.
    """
    return BackgroundPublication(lambda: _build_recording_progress(component, runtime, canonical_s), source=source)


def _build_recording_progress(
    component: ComponentSkeleton | IdentifiedComponent, runtime: HostWeightRuntime, canonical_s: float | None
) -> PrewarmResult:
    required = required_runtime(runtime)
    identified = component if isinstance(component, IdentifiedComponent) else identify_component(component, required)
    recorder = ProgressRecorder(required.config.resolved_root, identified.context.identity.key, canonical_s)
    try:
        return build_artifact(identified, required, recorder)
    finally:
        recorder.close()

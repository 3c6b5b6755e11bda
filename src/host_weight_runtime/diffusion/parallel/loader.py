"""`load_component` for one tensor-parallel rank (TP > 1), with or without a group cohort.

Without a process group each rank resolves its own artifact independently. With one, the
group decides together (GROUP_COHORT): every rank hit -> all restore; any rank failed ->
all raise that typed failure; otherwise one bundle build (when streaming is allowed) or
the same canonical fallback on every rank (PREFERRED), or a typed failure on every rank
(REQUIRED). The result is always a parallelized model (DTensor on the group's mesh).
"""

from __future__ import annotations

import os
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...config import RuntimeMode
from ...failures import FailureCode, HostWeightError, ResolutionStage, failure
from ...lease import HostWeightLease
from ...outcomes import ResolutionOutcome
from ...runtime import HostWeightRuntime
from ..contracts import FINAL_LAYOUT_BF16_POLICY, FinalLayoutParallelIdentity, FinalLayoutTensorPolicy
from ..identity_adapter import FinalLayoutIdentityContext
from ..producers.checkpoint_stream import FinalLayoutBF16CheckpointProducer
from ..producers.finalized import FinalLayoutBF16Producer
from ..restorer import FinalLayoutTensorRestorer
from .apply import parallelize_localized
from .bundle import FinalLayoutBF16BundleProducer
from .cohort import CohortStatus, TorchCohort, cohort_failure
from .plan import TensorParallelPlan, localize_module, plan_for_model, resolve_tensor_shards
from .ranks import identify_ranks

if TYPE_CHECKING:
    from ..loader import PrewarmResult, _Skeleton

__all__ = ["load_tensor_parallel_component", "prewarm_tensor_parallel"]


def _mesh(process_group: Any, size: int) -> Any:
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    if not dist.is_initialized():
        raise ValueError(
            "tensor_parallel_size > 1 needs torch.distributed: call init_process_group() (gloo on CPU) first"
        )
    group: Any = process_group if process_group is not None else dist.group.WORLD
    if dist.get_world_size(group) != size:
        raise ValueError(f"the process group has {dist.get_world_size(group)} ranks, tensor_parallel_size is {size}")
    return DeviceMesh.from_group(group, "cpu")


def load_tensor_parallel_component(
    model_or_path: str | os.PathLike[str],
    *,
    parallel: FinalLayoutParallelIdentity,
    runtime: HostWeightRuntime,
    subfolder: str | None = None,
    revision: str | None = None,
    cache_dir: Path | None = None,
    stream_on_miss: bool | None = None,
    process_group: Any = None,
    representation: str = "bf16",
) -> Any:
    """One rank's parallelized component; see the module docstring for the group decision.

    With `representation="fp8"` every rank serves FP8Linear shards quantized with the full
    tensor's scale; FP8 artifacts are published after a canonical load (no bundle build).
    """
    from .._load_options import LoadOptions
    from ..fp8 import FINAL_LAYOUT_FP8_POLICY, FinalLayoutFP8Producer, FinalLayoutFP8Restorer
    from ..loader import (
        ComponentLoadPath,
        LoadedComponent,
        _anchor,
        _canonical,
        _prepare_skeleton,
        check_representation,
        quantize_model_fp8,
    )

    fp8 = check_representation(representation, stream_on_miss=stream_on_miss)

    started = time.monotonic()
    size, rank = parallel.tensor_parallel_size, parallel.tensor_parallel_rank
    mesh = _mesh(process_group, size)
    mode = runtime.config.mode
    if mode is RuntimeMode.DISABLED:
        raise ValueError("tensor-parallel loading through the runtime needs mode PREFERRED or REQUIRED")
    cohort = TorchCohort(process_group, timeout_s=runtime.config.lock_timeout_s) if process_group is not None else None
    if cohort is not None and cohort.rank != rank:
        raise ValueError(f"tensor_parallel_rank {rank} is rank {cohort.rank} of the process group; they must match")
    stream = stream_on_miss if stream_on_miss is not None else mode is RuntimeMode.REQUIRED and not fp8
    skeleton = _prepare_skeleton(
        model_or_path,
        subfolder=subfolder,
        revision=revision,
        parallel=parallel,
        cache_dir=cache_dir,
        options=LoadOptions(),
    )
    plan = plan_for_model(skeleton.skeleton)  # on the plain skeleton: a registered plan keys on its class
    if fp8:
        quantize_model_fp8(skeleton.skeleton)
    policy = FINAL_LAYOUT_FP8_POLICY if fp8 else FINAL_LAYOUT_BF16_POLICY
    contexts = _identify_every_rank(skeleton, runtime, policy, plan)
    context = contexts[rank]
    lookup_runtime = HostWeightRuntime(replace(runtime.config, mode=RuntimeMode.PREFERRED))
    build_runtime = HostWeightRuntime(replace(runtime.config, mode=RuntimeMode.REQUIRED, allow_local_build=True))

    def restore(lease: HostWeightLease) -> Any:
        restorer = FinalLayoutFP8Restorer(context) if fp8 else FinalLayoutTensorRestorer(context)
        restorer._plan_on_identity_skeleton(skeleton.holder, lease).commit()
        model = skeleton.skeleton
        _anchor(model, lease)
        parallelize_localized(model, plan, mesh)
        return LoadedComponent(
            model,
            ComponentLoadPath.ARTIFACT,
            elapsed_s=time.monotonic() - started,
            domain_root=runtime.config.resolved_root,
            identity_key=context.identity.key,
            resolution=resolution.report,
            lease=lease,
        )

    def canonical(publish: bool) -> Any:
        model = _canonical(skeleton.model_class, skeleton.source, str(model_or_path), LoadOptions())
        if fp8:  # quantized whole (one scale per full tensor), then cut: each shard is a slice of the TP=1 bytes
            quantize_model_fp8(model)
        localize_module(model, resolve_tensor_shards(model, plan, size, rank))
        publication = None
        if publish:
            producer_class = FinalLayoutFP8Producer if fp8 else FinalLayoutBF16Producer
            producer = producer_class(context, [(skeleton.component_name, model)])
            publication = runtime.publish_after_load(context.identity, producer)
        parallelize_localized(model, plan, mesh)
        return LoadedComponent(
            model,
            ComponentLoadPath.CANONICAL,
            elapsed_s=time.monotonic() - started,
            domain_root=runtime.config.resolved_root,
            identity_key=context.identity.key,
            resolution=resolution.report,
            publication=publication,
        )

    def build() -> Any:
        producer = FinalLayoutBF16BundleProducer(contexts) if cohort is not None else _single(context)
        return build_runtime.resolve(context.identity, producer)

    if cohort is None:
        resolution = lookup_runtime.resolve(context.identity, None)
        if resolution.lease is not None:
            return restore(resolution.lease)
        if stream and skeleton.source.use_safetensors:
            resolution = build()
            if resolution.lease is not None:
                return restore(resolution.lease)
        if mode is RuntimeMode.REQUIRED:
            if resolution.report.failure is not None:
                raise HostWeightError(resolution.report.failure)
            raise _missing(rank)
        return canonical(publish=True)

    resolution = lookup_runtime.resolve(context.identity, None)
    status = _status(resolution.outcome, resolution.lease)
    failed = resolution.report.failure
    reports = cohort.exchange("lookup", status, None if failed is None else failed.code)
    cohort.raise_if_any_failed("lookup", reports)
    if all(report.status is CohortStatus.HIT for report in reports):
        assert resolution.lease is not None
        return restore(resolution.lease)
    if resolution.lease is not None:
        resolution.lease.close()
    if stream and skeleton.source.use_safetensors:
        try:
            resolution = build()
            built = _status(resolution.outcome, resolution.lease)
            code = resolution.report.failure.code if resolution.report.failure is not None else None
        except HostWeightError as exc:
            built, code = CohortStatus.FAILED, exc.failure.code
        reports = cohort.exchange("build", built if built is not CohortStatus.MISS else CohortStatus.FAILED, code)
        if all(report.status is CohortStatus.HIT for report in reports):
            assert resolution.lease is not None
            return restore(resolution.lease)
        if resolution.lease is not None:
            resolution.lease.close()
        if mode is RuntimeMode.REQUIRED:
            cohort.raise_if_any_failed("build", reports)
        return canonical(publish=False)
    if mode is RuntimeMode.REQUIRED:
        missing = [report.rank for report in reports if report.status is not CohortStatus.HIT]
        raise cohort_failure(
            f"ranks {missing} of the group have no artifact and REQUIRED mode without a build cannot serve them; "
            "the whole group fails together",
            code=FailureCode.NOT_FOUND,
            missing_ranks=missing,
        )
    return canonical(publish=True)


def prewarm_tensor_parallel(
    model_or_path: str | os.PathLike[str],
    *,
    tensor_parallel_size: int,
    subfolder: str | None = None,
    revision: str | None = None,
    runtime: HostWeightRuntime | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
) -> tuple[PrewarmResult, ...]:
    """Build (or find) every TP rank's BF16 artifact in one pass over the checkpoint (ARTIFACT_BUNDLE).

    Needs no process group: a node operator runs it once before the ranks start, and each
    rank's `load_component(..., parallel=...)` then hits. Returns one result per rank, in
    rank order. Runs in REQUIRED mode with local builds allowed, like `prewarm_component`:
    a failure raises `HostWeightError`; a bad argument raises `HostWeightUsageError`.
    """
    from .._load_options import LoadOptions
    from ..loader import PrewarmResult, _announce, _prepare_skeleton, _required

    if type(tensor_parallel_size) is not int or tensor_parallel_size < 2:
        raise ValueError(f"tensor_parallel_size must be an int >= 2, got {tensor_parallel_size!r}")
    required = _required(runtime if runtime is not None else HostWeightRuntime.from_env())
    _announce(required)
    skeleton = _prepare_skeleton(
        model_or_path,
        subfolder=subfolder,
        revision=revision,
        parallel=FinalLayoutParallelIdentity(tensor_parallel_size=tensor_parallel_size),
        cache_dir=Path(cache_dir) if cache_dir is not None else None,
        options=LoadOptions(),
    )
    if not skeleton.source.use_safetensors:
        raise HostWeightError(
            failure(
                ResolutionStage.PRODUCTION,
                FailureCode.PRODUCER_UNSUPPORTED,
                f"{skeleton.source.model_or_path} has no safetensors weights; a bundle is streamed from safetensors "
                "only. Load each rank once with load_component instead: that publishes after a canonical load",
            )
        )
    contexts = _identify_every_rank(skeleton, required, FINAL_LAYOUT_BF16_POLICY, plan_for_model(skeleton.skeleton))
    producer = FinalLayoutBF16BundleProducer(contexts)
    results: list[PrewarmResult] = []
    for context in contexts:  # the first resolve builds every missing rank; the others then hit
        resolution = required.resolve(context.identity, producer)
        if resolution.lease is None:
            assert resolution.report.failure is not None
            raise HostWeightError(resolution.report.failure)
        resolution.lease.close()
        results.append(
            PrewarmResult(
                identity_key=context.identity.key,
                resolution=resolution.report,
                total_bytes=context.total_bytes,
                tensor_count=len(context.tensors),
            )
        )
    return tuple(results)


def _identify_every_rank(
    skeleton: _Skeleton, runtime: HostWeightRuntime, policy: FinalLayoutTensorPolicy, plan: TensorParallelPlan
) -> tuple[FinalLayoutIdentityContext, ...]:
    """Every rank's identity context; the skeleton is localized to the (shared) per-rank shapes."""
    from ..loader import _digest_cache

    return identify_ranks(
        skeleton.holder,
        dit_name=skeleton.component_name,
        skeleton=skeleton.skeleton,
        prepared_sources=[skeleton.source],
        request=skeleton.request,
        policy=policy,
        ranks=list(range(skeleton.request.parallel.tensor_parallel_size)),
        source_digest_cache=_digest_cache(runtime),
        plan=plan,
    )


def _single(context: FinalLayoutIdentityContext) -> FinalLayoutBF16CheckpointProducer:
    return FinalLayoutBF16CheckpointProducer(context)


def _status(outcome: ResolutionOutcome, lease: HostWeightLease | None) -> CohortStatus:
    if lease is not None:
        return CohortStatus.HIT
    return CohortStatus.FAILED if outcome is ResolutionOutcome.FAILED else CohortStatus.MISS


def _missing(rank: int) -> HostWeightError:
    return cohort_failure(f"rank {rank} has no artifact", code=FailureCode.NOT_FOUND)

"""`load_component` for one tensor-parallel rank (TP > 1), with or without a group cohort.

A rank's weights are two artifacts (parts.py): the replicated part, one per node for every
rank, and the rank's shard part; a rank "hits" when both are found and belong to one build
(rank_lease.py). Without a process group each rank resolves its parts independently; a
build is the whole bundle (every missing part, one pass), so ranks that start together
build once and join. With a group, every rank first says whether it could prepare (find its
checkpoint or its name index entry, build its skeleton and key its layout): one rank's failure
there fails every rank at once, with one code. The ranks then agree on the layout (the replicated
part's key: plan, checkpoint, representation and TP size), then decide together
(GROUP_COHORT): every rank hit -> all restore; any rank failed -> all raise that typed
failure; otherwise one bundle build (when streaming is allowed) or the same canonical
fallback on every rank (PREFERRED), or a typed failure on every rank (REQUIRED). A part
found without its sibling is rebuilt by the bundle or, after a canonical load, published
again. The result is always a parallelized model (DTensor on the group's mesh).

A rank whose checkpoint is not on this node (a repo id the cache lacks, a remote configured,
a pinned revision) loads by name (`named_source.py`): the skeleton and keys come from the
index entry of its shard part, the computed shard key must equal the index's (it names the
replicated part's key), and the parts are imported by key; with no checkpoint there is no build
and no canonical load, so a part that cannot be imported fails the rank (the group) typed.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from ...config import RuntimeMode
from ...failures import FailureCode, HostWeightError, usage_error
from ...lease import HostWeightLease
from ...remote.names import ArtifactName
from ...runtime import HostWeightRuntime
from .._load_options import LoadOptions
from ..canonical_step import load_canonical_for
from ..component_source import ComponentLocation, node_digest_cache
from ..contracts import FinalLayoutParallelIdentity, FinalLayoutTensorPolicy
from ..dtype_policies import ModelFamilyName
from ..identity_adapter import FinalLayoutIdentityContext
from ..load_reports import ComponentLoadPath, PrewarmResult
from ..load_runtime import required_runtime, runtime_for_load
from ..loaded import LoadedComponent
from ..named_source import NameLayout, check_index_key, checkpoint_or_named_source, name_dtype, wants_name
from ..publish_step import require_safetensors
from ..representation import check_representation, quantize_model_fp8, tensor_policy
from ..restore_step import restore_into_skeleton
from ..skeleton import ComponentSkeleton, prepare_skeleton
from .apply import parallelize_localized
from .bundle import bundle_parts
from .cohort import CohortStatus, TorchCohort, cohort_failure
from .fp8_bundle import bundle_producer
from .part_publish import publish_parts_after_load
from .parts import RankParts
from .plan import TensorParallelPlan, localize_module, plan_for_model, resolve_tensor_shards
from .rank_lease import PartsResolution, resolve_parts
from .ranks import identify_ranks

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


@dataclass(frozen=True, slots=True)
class _RankLoad:
    """One rank's load once its identity is known: the restore, canonical and build steps it may take."""

    skeleton: ComponentSkeleton
    contexts: tuple[FinalLayoutIdentityContext, ...]
    parts: RankParts
    plan: TensorParallelPlan
    mesh: Any
    runtime: HostWeightRuntime
    fp8: bool
    started: float

    @property
    def rank(self) -> int:
        return self.parts.rank_index

    @property
    def named(self) -> bool:
        """Loaded by name: no checkpoint here, so no build and no canonical load."""
        return self.skeleton.source.recorded is not None

    @property
    def context(self) -> FinalLayoutIdentityContext:
        return self.parts.rank

    def lookup(self) -> PartsResolution:
        """The rank's two parts, looked up in PREFERRED mode: a miss is a report, never raised."""
        return resolve_parts(self.runtime.with_policy(RuntimeMode.PREFERRED), self.parts)

    def build(self) -> PartsResolution:
        """The rank's parts streamed from the checkpoint: the bundle writes every missing part of every rank."""
        return resolve_parts(required_runtime(self.runtime), self.parts, bundle_producer(self.contexts))

    def restore(self, lease: HostWeightLease, resolution: PartsResolution) -> LoadedComponent:
        model = restore_into_skeleton(self.skeleton, self.context, lease, fp8=self.fp8)
        parallelize_localized(model, self.plan, self.mesh)
        return LoadedComponent(
            model,
            ComponentLoadPath.ARTIFACT,
            elapsed_s=time.monotonic() - self.started,
            domain_root=self.runtime.config.resolved_root,
            identity_key=self.parts.shard.identity.key,
            resolution=resolution.shard.report,
            lease=lease,
            tensor_parallel_plan=self.plan.name,
        )

    def canonical(self, resolution: PartsResolution, *, publish: bool) -> LoadedComponent:
        # FP8 is quantized whole (one scale per full tensor), then cut: each shard is a slice of the TP=1 bytes.
        model = load_canonical_for(self.skeleton, fp8=self.fp8)
        size = self.skeleton.request.parallel.tensor_parallel_size
        localize_module(model, resolve_tensor_shards(model, self.plan, size, self.rank))
        publication = None
        if publish:
            publication = publish_parts_after_load(self.runtime, self.parts, self.skeleton.component_name, model)
        parallelize_localized(model, self.plan, self.mesh)
        return LoadedComponent(
            model,
            ComponentLoadPath.CANONICAL,
            elapsed_s=time.monotonic() - self.started,
            domain_root=self.runtime.config.resolved_root,
            identity_key=self.parts.shard.identity.key,
            resolution=resolution.shard.report,
            publication=publication,
            tensor_parallel_plan=self.plan.name,
        )


def _require_diffusers(skeleton: ComponentSkeleton) -> None:
    """Tensor-parallel plans are diffusers plans; a transformers component (a text encoder) loads whole."""
    if skeleton.family.family_name is not ModelFamilyName.DIFFUSERS:
        raise usage_error(
            f"tensor parallelism serves diffusers models; {skeleton.model_class.__name__} is a "
            f"{skeleton.family.family_name.value} model: load it without parallel= (one copy per node is shared)",
            argument="parallel",
        )


def load_tensor_parallel_component(
    location: ComponentLocation,
    *,
    parallel: FinalLayoutParallelIdentity,
    runtime: HostWeightRuntime,
    stream_on_miss: bool | None = None,
    process_group: Any = None,
    representation: str = "bf16",
) -> LoadedComponent:
    """One rank's parallelized component; see the module docstring for the group decision.

    With `representation="fp8"` every rank serves FP8Linear shards quantized with the full
    tensor's scale; the FP8 bundle streams them from the checkpoint as the BF16 bundle does, and
    a canonical load publishes the same bytes after it.
    """
    fp8 = check_representation(representation)
    started = time.monotonic()
    size, rank = parallel.tensor_parallel_size, parallel.tensor_parallel_rank
    mesh = _mesh(process_group, size)
    mode = runtime.config.mode
    if mode is RuntimeMode.DISABLED:
        raise ValueError("tensor-parallel loading through the runtime needs mode PREFERRED or REQUIRED")
    cohort = TorchCohort(process_group, timeout_s=runtime.config.lock_timeout_s) if process_group is not None else None
    if cohort is not None and cohort.rank != rank:
        raise ValueError(f"tensor_parallel_rank {rank} is rank {cohort.rank} of the process group; they must match")
    stream = stream_on_miss if stream_on_miss is not None else mode is RuntimeMode.REQUIRED

    def prepare() -> _RankLoad:
        return _prepare_rank(location, parallel, runtime, fp8=fp8, mesh=mesh, started=started)

    load = prepare() if cohort is None else _prepared_together(cohort, prepare)
    stream = stream and load.skeleton.source.use_safetensors and not load.named
    if cohort is None:
        return _load_alone(load, stream=stream)
    cohort.agree("layout", load.parts.replicated.identity.key)
    return _load_with_cohort(load, cohort, stream=stream)


def _prepare_rank(
    location: ComponentLocation,
    parallel: FinalLayoutParallelIdentity,
    runtime: HostWeightRuntime,
    *,
    fp8: bool,
    mesh: Any,
    started: float,
) -> _RankLoad:
    """The rank's source (its checkpoint, else the name index's), skeleton, plan and every rank's keys; a load
    by name whose shard key differs from the index's is refused here (REMOTE_FAILED)."""
    size, rank = parallel.tensor_parallel_size, parallel.tensor_parallel_rank
    layout = NameLayout(name_dtype(LoadOptions().dtype, fp8), size, ArtifactName.shard_part(rank))
    source = checkpoint_or_named_source(location, LoadOptions(), runtime, layout)
    skeleton = prepare_skeleton(location, LoadOptions(), parallel, source=source)
    _require_diffusers(skeleton)
    # On the plain skeleton (a registered plan keys on its class); the default depends on config and size only,
    # so every rank picks the same plan.
    plan = plan_for_model(skeleton.model, size)
    if fp8:
        quantize_model_fp8(skeleton.model)
    contexts = _identify_every_rank(skeleton, runtime, tensor_policy(fp8), plan)
    load = _RankLoad(skeleton, contexts, bundle_parts(contexts)[rank], plan, mesh, runtime, fp8, started)
    check_index_key(load.skeleton.source, load.parts.shard.identity.key)
    return load


_PREPARE = "prepare"
_PREPARE_HINT = " (finding its checkpoint or its name index entry, or keying its layout; its own error says why)"


def _prepared_together(cohort: TorchCohort, prepare: Callable[[], _RankLoad]) -> _RankLoad:
    """`prepare()` on every rank, then one exchange of whether it worked: a rank that failed (no checkpoint and
    no index entry for its part, an index key that differs) fails every rank now, with the lowest failing rank's
    code, instead of leaving the others waiting at the next step until the lock deadline."""
    try:
        load = prepare()
    except Exception as exc:
        code = exc.failure.code if isinstance(exc, HostWeightError) else FailureCode.UNEXPECTED_STATUS
        _fail_together(cohort, _PREPARE, exc, code, _PREPARE_HINT)
    group = cohort.group_failure(_PREPARE, cohort.exchange(_PREPARE, CohortStatus.HIT), _PREPARE_HINT)
    if group is not None:
        raise group
    return load


def _fail_together(cohort: TorchCohort, step: str, own: Exception, code: FailureCode, hint: str = "") -> NoReturn:
    """Tell the group this rank failed at `step`, then raise: its own error when its code is the group's (the
    lowest failing rank's), else the group's failure, so every rank raises one code."""
    try:
        reports = cohort.exchange(step, CohortStatus.FAILED, code)
    except HostWeightError as lost:  # the others are gone: this rank's own failure is the one to see
        raise own from lost
    group = cohort.group_failure(step, reports, hint)
    if group is not None and group.failure.code is not code:
        raise group from own
    raise own


def _named_miss(load: _RankLoad, resolution: PartsResolution) -> HostWeightError:
    """A rank loaded by name that got no parts has no checkpoint to build or load from: why, typed."""
    reports = (resolution.shard.report, resolution.replicated.report)
    problem = resolution.failure or next((report.failure for report in reports if report.failure is not None), None)
    why = problem.message if problem is not None else "no configured remote holds them"
    return cohort_failure(
        f"rank {load.rank}'s checkpoint is not on this node and its {' and '.join(resolution.missing_parts)} "
        f"part(s) could not be imported ({why}); download the checkpoint here, or push the parts from a node "
        "that built them (hwr push --all)",
        code=problem.code if problem is not None else FailureCode.NOT_FOUND,
        missing_parts=list(resolution.missing_parts),
    )


def _load_alone(load: _RankLoad, *, stream: bool) -> LoadedComponent:
    """Without a process group: this rank's own lookup, build and fallback."""
    resolution = load.lookup()
    if resolution.lease is not None:
        return load.restore(resolution.lease, resolution)
    if stream and not resolution.failed:
        resolution = load.build()
        if resolution.lease is not None:
            return load.restore(resolution.lease, resolution)
    if load.named:
        raise _named_miss(load, resolution)
    if load.runtime.config.mode is RuntimeMode.REQUIRED:
        if resolution.failure is not None:
            raise HostWeightError(resolution.failure)
        raise _missing(load.rank, resolution.missing_parts)
    return load.canonical(resolution, publish=not resolution.failed)


def _load_with_cohort(load: _RankLoad, cohort: TorchCohort, *, stream: bool) -> LoadedComponent:
    """With a process group: every rank takes the same path, decided from what each rank found (GROUP_COHORT)."""
    required = load.runtime.config.mode is RuntimeMode.REQUIRED
    resolution = load.lookup()
    if load.named and resolution.lease is None:  # nothing to build or load instead: the group fails together
        refusal = _named_miss(load, resolution)
        _fail_together(cohort, "lookup", refusal, refusal.failure.code)
    failed = resolution.failure
    reports = cohort.exchange("lookup", _status(resolution), None if failed is None else failed.code)
    cohort.raise_if_any_failed("lookup", reports)
    if all(report.status is CohortStatus.HIT for report in reports):
        assert resolution.lease is not None
        return load.restore(resolution.lease, resolution)
    if resolution.lease is not None:
        resolution.lease.close()
    if stream:
        try:
            resolution = load.build()
            built = _status(resolution)
            code = resolution.failure.code if resolution.failure is not None else None
        except HostWeightError as exc:
            built, code = CohortStatus.FAILED, exc.failure.code
        reports = cohort.exchange("build", built if built is not CohortStatus.MISS else CohortStatus.FAILED, code)
        if all(report.status is CohortStatus.HIT for report in reports):
            assert resolution.lease is not None
            return load.restore(resolution.lease, resolution)
        if resolution.lease is not None:
            resolution.lease.close()
        if required:
            cohort.raise_if_any_failed("build", reports)
        return load.canonical(resolution, publish=False)
    if required:
        missing = [report.rank for report in reports if report.status is not CohortStatus.HIT]
        raise cohort_failure(
            f"ranks {missing} of the group have no artifact and REQUIRED mode without a build cannot serve them; "
            "the whole group fails together",
            code=FailureCode.NOT_FOUND,
            missing_ranks=missing,
        )
    return load.canonical(resolution, publish=True)


def prewarm_tensor_parallel(
    model_or_path: str | os.PathLike[str],
    *,
    tensor_parallel_size: int,
    subfolder: str | None = None,
    revision: str | None = None,
    runtime: HostWeightRuntime | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    representation: str = "bf16",
) -> tuple[PrewarmResult, ...]:
    """Build (or find) the replicated part and every TP rank's shard part in one checkpoint pass (ARTIFACT_BUNDLE).

    Needs no process group: a node operator runs it once before the ranks start, and each
    rank's `load_component(..., parallel=...)` then hits. Returns the replicated part's result
    first, then one per rank's shard part, in rank order. Runs in REQUIRED mode with local
    builds allowed, like `prewarm_component`: a failure raises `HostWeightError`; a bad
    argument raises `HostWeightUsageError`. `representation="fp8"` builds the FP8 parts that
    `load_component(..., parallel=..., representation="fp8")` hits (each weight's scale taken
    over the full tensor, so every rank holds the slice of the TP=1 quantization). It builds from the
    checkpoint only: where the node lacks it and a remote is configured, it raises a `HostWeightUsageError`
    (UNSUPPORTED) giving the `hwr pull REPO --revision R --tensor-parallel-size N` that imports the parts by name.
    """
    fp8 = check_representation(representation)
    if type(tensor_parallel_size) is not int or tensor_parallel_size < 2:
        raise ValueError(f"tensor_parallel_size must be an int >= 2, got {tensor_parallel_size!r}")
    given = runtime if runtime is not None else HostWeightRuntime.from_env()
    required = runtime_for_load(required_runtime(given))
    location = ComponentLocation(model_or_path, subfolder, revision, Path(cache_dir) if cache_dir is not None else None)
    try:
        skeleton = prepare_skeleton(
            location, LoadOptions(), FinalLayoutParallelIdentity(tensor_parallel_size=tensor_parallel_size)
        )
    except HostWeightError as exc:
        if wants_name(location, given, exc):
            raise _no_prewarm_by_name(location, tensor_parallel_size, representation) from exc
        raise
    _require_diffusers(skeleton)
    require_safetensors(skeleton, "a bundle", "Load each rank once with load_component")
    plan = plan_for_model(skeleton.model, tensor_parallel_size)  # plain skeleton: a registered plan keys on class
    if fp8:
        quantize_model_fp8(skeleton.model)
    producer = bundle_producer(_identify_every_rank(skeleton, required, tensor_policy(fp8), plan))
    results: list[PrewarmResult] = []
    for part in (producer.parts[0].replicated, *(part.shard for part in producer.parts)):
        # the first resolve's bundle builds every missing part; the others then hit
        resolution = required.resolve(part.identity, producer)
        if resolution.lease is None:
            assert resolution.report.failure is not None
            raise HostWeightError(resolution.report.failure)
        resolution.lease.close()
        results.append(
            PrewarmResult(
                identity_key=part.identity.key,
                resolution=resolution.report,
                total_bytes=part.total_bytes,
                tensor_count=len(part.tensors),
                tensor_parallel_plan=plan.name,
            )
        )
    return tuple(results)


def _no_prewarm_by_name(location: ComponentLocation, size: int, representation: str) -> HostWeightError:
    """A prewarm builds from the checkpoint; a node without it imports the parts by name with `hwr pull`."""
    command = f"hwr pull {os.fspath(location.model_or_path)} --revision {location.revision or '<commit>'}"
    if location.subfolder:
        command += f" --subfolder {location.subfolder}"
    command += f" --tensor-parallel-size {size}"
    if representation == "fp8":
        command += " --representation fp8"
    return usage_error(
        f"prewarm_tensor_parallel builds the parts from the checkpoint, and {os.fspath(location.model_or_path)} "
        "is not in this node's Hugging Face cache; to import the parts another node pushed by name from the "
        f"remote, run `{command}` (or let each rank's load_component(..., parallel=...) import its parts by name)",
        code=FailureCode.UNSUPPORTED,
        argument="model_or_path",
        command=command,
    )


def _identify_every_rank(
    skeleton: ComponentSkeleton, runtime: HostWeightRuntime, policy: FinalLayoutTensorPolicy, plan: TensorParallelPlan
) -> tuple[FinalLayoutIdentityContext, ...]:
    """Every rank's identity context; the skeleton is localized to the (shared) per-rank shapes."""
    return identify_ranks(
        skeleton.holder,
        dit_name=skeleton.component_name,
        skeleton=skeleton.model,
        prepared_sources=[skeleton.source],
        request=skeleton.request,
        policy=policy,
        ranks=list(range(skeleton.request.parallel.tensor_parallel_size)),
        source_digest_cache=node_digest_cache(runtime),
        plan=plan,
    )


def _status(resolution: PartsResolution) -> CohortStatus:
    if resolution.lease is not None:
        return CohortStatus.HIT
    return CohortStatus.FAILED if resolution.failed else CohortStatus.MISS


def _missing(rank: int, parts: tuple[str, ...]) -> HostWeightError:
    return cohort_failure(
        f"rank {rank} has no artifact for its {' and '.join(parts) or 'layout'} part(s); REQUIRED mode without a "
        "build cannot serve it: prewarm the node (prewarm_tensor_parallel) or allow stream_on_miss",
        code=FailureCode.NOT_FOUND,
        missing_parts=list(parts),
    )

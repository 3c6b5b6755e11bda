"""`load_component`: a component load as a short composition of named steps.

source (`component_source.py`) -> skeleton and identity (`skeleton.py`) -> resolve (`resolve_step.py`)
-> restore (`restore_step.py`) or canonical load (`canonical_step.py`) and publish (`publish_step.py`)
-> report (`loaded.py`). Every step is reported on the returned value.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .._digest import default_hash_threads
from ..config import RuntimeMode
from ..failures import (
    FailureCode,
    HostWeightError,
    HostWeightFailure,
    HostWeightUsageError,
    ResolutionStage,
    failure,
    usage_error,
)
from ..lease import deferred_verifications
from ..outcomes import AttemptAction, AttemptResult, ResolutionAttempt, ResolutionOutcome, ResolutionReport
from ..runtime import HostWeightRuntime
from ._build_progress import ArrivalChoice, arrival_choice
from ._load_options import LoadOptions, check_load_arguments
from ._source_prehash import SourcePrehash, cores_free_beside_load
from .background import BackgroundPublication, in_flight
from .canonical_step import load_canonical_at, load_canonical_for, load_canonical_of
from .canonical_warning import warn_if_canonical
from .component_source import (
    ComponentLocation,
    component_model_class,
    existing_node_digest_cache,
    never_identified_here,
    node_digest_cache,
)
from .contracts import FinalLayoutParallelIdentity
from .family_diffusers import DIFFUSERS_FAMILY
from .load_reports import ComponentLoadPath, report_without_lookup
from .load_runtime import runtime_for_load
from .loaded import LoadedComponent, LoadStopwatch
from .model_family import ImportClock, ModelFamily
from .named_source import NameLayout, check_index_key, checkpoint_or_named_source, name_dtype
from .parallel.loader import load_tensor_parallel_component
from .publish_step import publish_after_canonical_load, start_background_publication
from .representation import check_fp8_dtype, check_representation, fp8_skeleton
from .resolve_step import resolve_component
from .restore_step import restore_or_fall_back
from .skeleton import (
    ComponentSkeleton,
    IdentifiedComponent,
    describe_model,
    identify_component,
    prepare_skeleton,
    with_ownership,
)
from .source_identity import PreparedWeightSource

__all__ = ["load_component"]

_LOG = logging.getLogger(__name__)

_SKIPPED_LOOKUP = (
    "no worker of this node has identified these checkpoint files, so no artifact can exist for them here; the "
    "lookup is skipped and the background publication identifies them (hashing what needs it) and builds the artifact"
)


def load_component(
    model_or_path: str | os.PathLike[str],
    *,
    subfolder: str | None = None,
    revision: str | None = None,
    variant: str | None = None,
    torch_dtype: torch.dtype | str = torch.bfloat16,
    dtype: torch.dtype | str | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    use_safetensors: bool | None = None,
    low_cpu_mem_usage: bool | None = None,
    local_files_only: bool | None = None,
    device_map: str | torch.device | Mapping[str, str | torch.device] | None = None,
    token: str | bool | None = None,
    output_loading_info: bool = False,
    disable_mmap: bool = False,
    runtime: HostWeightRuntime | None = None,
    parallel: FinalLayoutParallelIdentity | None = None,
    stream_on_miss: bool | None = None,
    publish_in_background: bool | None = None,
    process_group: Any = None,
    representation: str = "bf16",
    **from_pretrained_kwargs: Any,
) -> LoadedComponent:
    """Load a diffusers or transformers model component through the node's host weight artifact.

    The component is a diffusers `ModelMixin` (its config.json has `_class_name`) or a transformers
    `PreTrainedModel` (text and vision encoders: the class `model_index.json` names for the
    subfolder, else the config's `architectures`); either way the result equals that library's
    own `from_pretrained(..., torch_dtype/dtype=...)` in every parameter and buffer, and tied
    weights stay tied. `model_or_path` is a model folder, a pipeline folder with `subfolder`, or a repo id in
    the local Hugging Face cache (never the network). The other arguments are those of
    diffusers' `from_pretrained`: `variant` and `use_safetensors` choose the checkpoint files
    as there (and so the artifact); `torch_dtype`/`dtype` is BF16 (the default), FP16 or FP32
    (a torch dtype or its name), each served as its own representation under its own key (a BF16
    artifact never serves an FP16 load); `device_map` may be None or the CPU; `low_cpu_mem_usage`,
    `local_files_only`, `token` and `proxies` are accepted and change nothing (nothing is
    downloaded; the token is never used, kept or logged); anything else is refused with a
    `HostWeightUsageError` (a ValueError too) naming it.

    `runtime=None` reads `HWR_*` from the environment. In PREFERRED mode any failure falls back
    to the canonical load; in REQUIRED mode it raises `HostWeightError`. On a miss the checkpoint
    is streamed into a new artifact before returning when `stream_on_miss` (default: only in
    REQUIRED mode, which so keeps building before it returns).

    Otherwise (PREFERRED, the default) no worker waits for the runtime on a miss: the first
    worker on a node returns its canonical model as soon as it is loaded, and the artifact is
    built from the checkpoint (safetensors) on a nice'd thread
    (`LoadedComponent.background_publication`; the process waits for it at exit; a killed
    process leaves only an invisible tmp build that the next builder removes). When no worker of
    this node ever identified the checkpoint files (every lookup, build and import identifies its
    sources first and marks them in the node's digest cache) and no remote is configured, no
    artifact can exist for them here, so the lookup and its skeleton are skipped (outcome
    CANONICAL_FALLBACK, one SKIPPED attempt) and the identity, hashing included, moves to that
    thread too; once some worker identified them, the lookup runs first and a hit is served from
    the artifact. (An artifact `hwr pull` imported is found by loads by name, or by any load with
    the remote configured.) A worker whose
    lookup misses while another worker publishes the same key takes whichever is sooner, by a
    rule decided from the build lock and the builder's progress record (`_build_progress.py`):
    no build lock held, it publishes behind as a first worker; held, it waits for the artifact
    when the bytes still to stream, at the builder's rate so far, take less than the canonical
    load the builder measured (always once every byte is streamed), and otherwise loads
    canonically and leaves the publication to the builder. A publication in flight in this very
    process is always waited for. A runtime whose policy disallows local builds or post-load
    publication (`allow_local_build`, `allow_post_load_publish`, their HWR_* variables) keeps the
    path below unless `publish_in_background=True`. `publish_in_background=False` publishes before returning
    (after the canonical load; files this node never hashed are hashed beside the skeleton and,
    where a core is free, the load); `.bin`-only checkpoints always publish that way.

    `HWR_REMOTE` (or the runtime's remote providers) makes a local miss import the exact
    artifact from a remote (outcome REMOTE_IMPORT) before any local build or canonical load;
    `HWR_REMOTE_PUBLISH=true` pushes what this node publishes, off the request path. A repo id
    the local cache lacks is then looked up by name in the remote's index (`revision` must be a
    commit hash; see `named_source.py`): the key is recomputed here and must equal the index's.

    With `parallel.tensor_parallel_size > 1` (torch.distributed initialized) this rank loads its
    own artifact and returns a parallelized model; `process_group=` makes the group's ranks
    resolve together (GROUP_COHORT, see `diffusion/parallel/loader.py`). A rank publishes its
    parts after a canonical load or streams the bundle on a miss, never on a background thread:
    `publish_in_background` applies to TP=1 loads only.

    `representation="fp8"` serves float8_e4m3fn Linear weights with one FP32 scale per tensor
    (`FP8Linear` modules that dequantize in forward; see `diffusion/fp8.py`), under a key of
    its own; it streams from the checkpoint (`stream_on_miss`, `publish_in_background`,
    `prewarm_component(..., representation="fp8")`, and at TP > 1 the bundle) into the very
    bytes a post-load publication writes, with each weight's scale taken over the full tensor.
    """
    del token  # accepted so that a pasted call runs; nothing is downloaded, so it is never used, kept or logged
    tensor_parallel = isinstance(parallel, FinalLayoutParallelIdentity) and parallel.tensor_parallel_size > 1
    fp8 = check_representation(representation)
    location = ComponentLocation(model_or_path, subfolder, revision, Path(cache_dir) if cache_dir is not None else None)
    if isinstance(parallel, FinalLayoutParallelIdentity) and tensor_parallel:
        _refuse_with_tensor_parallel(variant, from_pretrained_kwargs)
        return warn_if_canonical(
            location,
            load_tensor_parallel_component(
                location,
                parallel=parallel,
                runtime=runtime if runtime is not None else HostWeightRuntime.from_env(),
                stream_on_miss=stream_on_miss,
                process_group=process_group,
                representation=representation,
            ),
        )
    started = time.monotonic()
    options = check_load_arguments(
        torch_dtype=torch_dtype,
        dtype=dtype,
        variant=variant,
        use_safetensors=use_safetensors,
        low_cpu_mem_usage=low_cpu_mem_usage,
        local_files_only=local_files_only,
        device_map=device_map,
        output_loading_info=output_loading_info,
        disable_mmap=disable_mmap,
        parallel=parallel,
        extra=from_pretrained_kwargs,
    )
    if fp8:
        check_fp8_dtype(options.dtype)
    clock = ImportClock()
    DIFFUSERS_FAMILY.import_up_front(clock)
    runtime = runtime_for_load(runtime)
    mode = runtime.config.mode
    stopwatch = LoadStopwatch(started, clock, None if mode is RuntimeMode.DISABLED else runtime.config.resolved_root)
    call = _ComponentCall(location, options, runtime, None, stopwatch, fp8)
    if mode is RuntimeMode.DISABLED:
        return warn_if_canonical(
            location, call.canonical_only(report_without_lookup(mode, ResolutionOutcome.CANONICAL_DIRECT))
        )
    stream = stream_on_miss if stream_on_miss is not None else mode is RuntimeMode.REQUIRED
    background = _publishes_behind(publish_in_background, runtime) and mode is RuntimeMode.PREFERRED and not stream
    parallel = parallel if parallel is not None else FinalLayoutParallelIdentity()
    with deferred_verifications():  # the artifact is re-hashed only once the model is restored
        return warn_if_canonical(location, _load_through_runtime(call, parallel, stream=stream, background=background))


def _publishes_behind(publish_in_background: bool | None, runtime: HostWeightRuntime) -> bool:
    """The default publishes behind only where the runtime's policy lets a worker publish at all."""
    if publish_in_background is not None:
        return publish_in_background
    return runtime.config.allow_local_build and runtime.config.allow_post_load_publish


def _refuse_with_tensor_parallel(variant: str | None, from_pretrained_kwargs: Mapping[str, Any]) -> None:
    """What tensor-parallel loading cannot honour yet is refused, naming the argument."""
    if variant is not None or from_pretrained_kwargs:
        unsupported = "variant" if variant is not None else sorted(from_pretrained_kwargs)[0]
        raise usage_error(
            f"{unsupported} is not supported with tensor_parallel_size > 1 yet; pass it without tensor parallelism",
            argument=unsupported,
        )


@dataclass(frozen=True, slots=True)
class _ComponentCall:
    """What one `load_component` call settled before its first step: where, how, through which runtime."""

    location: ComponentLocation
    options: LoadOptions
    runtime: HostWeightRuntime
    family: ModelFamily | None
    """None: the family the folder's config.json names (diffusers or transformers)."""
    stopwatch: LoadStopwatch
    fp8: bool

    @property
    def mode(self) -> RuntimeMode:
        return self.runtime.config.mode

    def canonical_only(self, report: ResolutionReport, **reports: Any) -> LoadedComponent:
        """The canonical model, without asking the runtime (DISABLED, or no identity could be built)."""
        model = load_canonical_at(self.location, self.options, self.family, self.stopwatch.clock, fp8=self.fp8)
        return self.stopwatch.finish(model, ComponentLoadPath.CANONICAL, report, **reports)


def _load_through_runtime(
    call: _ComponentCall, parallel: FinalLayoutParallelIdentity, *, stream: bool, background: bool
) -> LoadedComponent:
    """Skeleton and identity, then resolve; an identity that cannot be built falls back (PREFERRED) or raises.

    Files this node never hashed are hashed on threads from the moment they are known, while the
    skeleton is built and, in PREFERRED mode without a remote where torch leaves a core free, while
    the canonical load runs on the free cores: no artifact can be published under their key before
    some process hashed them too, so the load that would follow a miss starts at once, and the
    lookup after the hashing still uses a hit. With no core free the files hash on every core first.
    """
    identify_started = time.monotonic()
    source = _checkpoint_or_named_source(call)
    _wait_for_own_publication(call, source)
    hash_behind = background and source.use_safetensors and _first_on_node(source, call.runtime)
    if hash_behind and not call.fp8:
        return _canonical_then_described(call, source, parallel, identify_started)
    free_cores = cores_free_beside_load() if call.mode is RuntimeMode.PREFERRED and not stream else 0
    prehash = None
    if not hash_behind and source.recorded is None:
        prehash = _start_prehash(source, call.runtime, threads=min(free_cores, default_hash_threads()) or None)
    try:
        skeleton = _prepare_skeleton(call, source, parallel)
        if call.fp8:
            skeleton = fp8_skeleton(skeleton)
    except HostWeightError as exc:
        if prehash is not None:
            prehash.cancel()
        return _identity_fallback(call, exc, source, identify_started, None)
    if hash_behind:
        return _canonical_then_hash_in_background(call, skeleton)
    early = None
    if prehash is not None and prehash.files and free_cores:
        early = load_canonical_for(skeleton, fp8=call.fp8)  # the key cannot exist here before it is hashed
    try:
        if prehash is not None:
            prehash.wait()
        identified = identify_component(skeleton, call.runtime)
        check_index_key(source, identified.context.identity.key)
    except HostWeightError as exc:
        return _identity_fallback(call, exc, source, identify_started, early)
    return _serve(call, identified, stream=stream, background=background, early=early)


def _start_prehash(
    source: PreparedWeightSource, runtime: HostWeightRuntime, *, threads: int | None
) -> SourcePrehash | None:
    """Hash the files this node never hashed, on threads, into its digest cache; None where nothing can be cached."""
    cache = node_digest_cache(runtime)
    if cache is None or runtime.remote_providers:
        return None  # with a remote, the key decides whether to import instead of loading: nothing to overlap
    return SourcePrehash(source, cache, threads=threads)


def _identity_fallback(
    call: _ComponentCall,
    exc: HostWeightError,
    source: PreparedWeightSource,
    started: float,
    early: torch.nn.Module | None,
) -> LoadedComponent:
    """No identity: the canonical model (the one already loaded, if any) in PREFERRED; raises otherwise."""
    if source.recorded is not None:
        raise exc  # a load by name has no checkpoint to fall back to
    report = _identity_fallback_report(exc, call, started)
    if early is not None:
        return call.stopwatch.finish(early, ComponentLoadPath.CANONICAL, report, identity_failure=exc.failure)
    return call.canonical_only(report, identity_failure=exc.failure)


def _checkpoint_or_named_source(call: _ComponentCall) -> PreparedWeightSource:
    """The checkpoint here; else, with a remote configured, the one its name index records (never both)."""
    layout = NameLayout(name_dtype(call.options.dtype, call.fp8))
    return checkpoint_or_named_source(call.location, call.options, call.runtime, layout)


def _source_name(call: _ComponentCall, source: PreparedWeightSource) -> tuple[object, ...] | None:
    """What names this checkpoint and representation in this process (None for a load by name)."""
    if not source.weight_files:
        return None
    return (tuple(os.path.realpath(path) for path in source.weight_files), str(call.options.dtype), call.fp8)


def _wait_for_own_publication(call: _ComponentCall, source: PreparedWeightSource) -> None:
    """This process already publishes this checkpoint on a thread: wait for it, then the lookup finds it.

    A second canonical load here would compete with that thread for the same cores and disk.
    """
    name = _source_name(call, source)
    publication = None if name is None else in_flight(name)
    if publication is not None:
        _LOG.info("%s is being published by this process; waiting for it", call.location.name_or_path)
        publication.wait()


def _first_on_node(source: PreparedWeightSource, runtime: HostWeightRuntime) -> bool:
    """Without a remote, a node where no worker ever identified these files cannot hold their artifact: skip
    the lookup (and the skeleton it needs), from a folder and from a hub cache alike."""
    return not runtime.remote_providers and never_identified_here(source, runtime)


def _canonical_then_described(
    call: _ComponentCall, source: PreparedWeightSource, parallel: FinalLayoutParallelIdentity, started: float
) -> LoadedComponent:
    """The first worker on a node: the canonical model now, described for the artifact a thread builds after it.

    The model `from_pretrained` built is described (request, bindings, tensor ownership) before it is
    handed out, so no `meta` skeleton is built beside it. What an artifact cannot reproduce (a checkpoint
    a transformers model cannot be bound to, say) is found then, and the model is served unpublished.
    """
    try:
        family, model_class = component_model_class(source, call.family, call.stopwatch.clock)
    except HostWeightError as exc:
        return _identity_fallback(call, exc, source, started, None)
    loading = time.monotonic()
    try:
        model = load_canonical_of(family, model_class, source, call.location, call.options)
    except HostWeightError as canonical_failure:
        return _diagnosed_by_skeleton(call, source, parallel, started, canonical_failure)
    canonical_s = time.monotonic() - loading
    try:
        described = with_ownership(
            describe_model(
                call.location,
                call.options,
                parallel,
                model,
                family=family,
                model_class=model_class,
                source=source,
                records=existing_node_digest_cache(call.runtime),
            )
        )
    except HostWeightError as exc:
        return _identity_fallback(call, exc, source, started, model)
    return _hash_in_background(call, described, model, canonical_s)


def _diagnosed_by_skeleton(
    call: _ComponentCall,
    source: PreparedWeightSource,
    parallel: FinalLayoutParallelIdentity,
    started: float,
    canonical_failure: HostWeightError,
) -> LoadedComponent:
    """A first worker whose canonical load failed: the skeleton's own refusal, where it has one, is what the
    caller gets (it says which config or file to fix, as every other load says it); else the load's."""
    try:
        _prepare_skeleton(call, source, parallel)
    except HostWeightError as exc:
        return _identity_fallback(call, exc, source, started, None)
    raise canonical_failure


def _prepare_skeleton(
    call: _ComponentCall, source: PreparedWeightSource, parallel: FinalLayoutParallelIdentity
) -> ComponentSkeleton:
    return prepare_skeleton(
        call.location,
        call.options,
        parallel,
        family=call.family,
        clock=call.stopwatch.clock,
        source=source,
        records=existing_node_digest_cache(call.runtime),
    )


def _canonical_then_hash_in_background(call: _ComponentCall, skeleton: ComponentSkeleton) -> LoadedComponent:
    """The canonical model now (an FP8 one: beside its FP8 skeleton); hashing and the build on a thread after it.

    Started before the load, the thread slowed the load and published no sooner on a shared 2-core VM.
    """
    loading = time.monotonic()
    model = load_canonical_for(skeleton, fp8=call.fp8)
    return _hash_in_background(call, skeleton, model, time.monotonic() - loading)


def _hash_in_background(
    call: _ComponentCall, skeleton: ComponentSkeleton, model: torch.nn.Module, canonical_s: float
) -> LoadedComponent:
    """Serve the canonical `model`; the background publication hashes the checkpoint and builds its artifact."""
    publication = start_background_publication(
        skeleton,
        call.runtime,
        canonical_s=canonical_s,
        source=_source_name(call, skeleton.source),
    )
    skipped = ResolutionAttempt(
        ResolutionStage.LOOKUP, AttemptResult.SKIPPED, AttemptAction.FALL_BACK, 0.0, None, _SKIPPED_LOOKUP
    )
    return call.stopwatch.finish(
        model,
        ComponentLoadPath.CANONICAL,
        report_without_lookup(call.mode, ResolutionOutcome.CANONICAL_FALLBACK, skipped),
        background_publication=publication,
    )


def _identity_fallback_report(exc: HostWeightError, call: _ComponentCall, started: float) -> ResolutionReport:
    """The report of a canonical fallback for want of an identity; raises where no fallback is allowed."""
    if isinstance(exc, HostWeightUsageError) or call.mode is RuntimeMode.REQUIRED:
        raise exc
    if exc.failure.code is FailureCode.NOT_FOUND:
        raise exc
    attempt = ResolutionAttempt(
        exc.failure.stage,
        AttemptResult.FAILED,
        AttemptAction.FALL_BACK,
        time.monotonic() - started,
        exc.failure,
        "the final-layout identity could not be built",
    )
    return report_without_lookup(call.mode, ResolutionOutcome.CANONICAL_FALLBACK, attempt)


def _serve(
    call: _ComponentCall,
    identified: IdentifiedComponent,
    *,
    stream: bool,
    background: bool,
    early: torch.nn.Module | None = None,
) -> LoadedComponent:
    """Restore from the artifact on a hit; otherwise load canonically and leave the artifact for the next worker.

    `early` is the canonical model when it was loaded while the sources hashed: a hit still wins (the
    shared artifact is served and nothing is published), a miss publishes that model.
    """
    key = identified.context.identity.key
    resolution = resolve_component(identified, call.runtime, stream=stream)
    restore_failure = None
    if resolution.lease is not None:
        restored = restore_or_fall_back(
            identified, resolution.lease, fp8=call.fp8, required=call.mode is RuntimeMode.REQUIRED
        )
        if restored.model is not None:
            return call.stopwatch.finish(
                restored.model, ComponentLoadPath.ARTIFACT, resolution.report, identity_key=key, lease=resolution.lease
            )
        restore_failure = restored.failure
    if identified.skeleton.source.recorded is not None:
        raise _named_load_failed(identified, resolution.report, restore_failure)
    publish = restore_failure is None and resolution.outcome is ResolutionOutcome.CANONICAL_FALLBACK
    behind = publish and background and identified.skeleton.source.use_safetensors
    choice = arrival_choice(call.runtime.config.resolved_root, key) if behind else ArrivalChoice.NO_BUILD
    if choice is ArrivalChoice.WAIT and early is None:
        joined = _serve_the_build_in_flight(call, identified)
        if joined is not None:
            return joined
    loading = time.monotonic()
    model = early if early is not None else load_canonical_for(identified.skeleton, fp8=call.fp8)
    in_background: BackgroundPublication | None = None
    if behind and choice is ArrivalChoice.NO_BUILD:
        in_background = start_background_publication(
            identified,
            call.runtime,
            canonical_s=time.monotonic() - loading,
            source=_source_name(call, identified.skeleton.source),
        )
    elif behind:
        _LOG.info("%s... is being published by another worker; loaded canonically, publishing nothing", key[:16])
        publish = False
    publication = None
    if publish and in_background is None:
        publication = publish_after_canonical_load(
            call.runtime, identified.context, identified.skeleton.component_name, model, fp8=call.fp8
        )
    return call.stopwatch.finish(
        model,
        ComponentLoadPath.CANONICAL,
        resolution.report,
        identity_key=key,
        publication=publication,
        restore_failure=restore_failure,
        background_publication=in_background,
    )


def _serve_the_build_in_flight(call: _ComponentCall, identified: IdentifiedComponent) -> LoadedComponent | None:
    """Wait (under the lock timeout) for the build another worker runs, then serve its artifact; None: load instead."""
    resolution = resolve_component(identified, call.runtime, stream=True)
    if resolution.lease is None:
        return None
    restored = restore_or_fall_back(identified, resolution.lease, fp8=call.fp8, required=False)
    if restored.model is None:
        return None
    key = identified.context.identity.key
    return call.stopwatch.finish(
        restored.model, ComponentLoadPath.ARTIFACT, resolution.report, identity_key=key, lease=resolution.lease
    )


def _named_load_failed(
    identified: IdentifiedComponent, report: ResolutionReport, restore_failure: HostWeightFailure | None
) -> HostWeightError:
    """A load by name that got no artifact has no checkpoint to load instead: the resolve's failure, typed."""
    problem = restore_failure if restore_failure is not None else report.failure
    key = identified.context.identity.key
    why = problem.message if problem is not None else f"no configured remote holds {key[:16]}..."
    return HostWeightError(
        failure(
            problem.stage if problem is not None else ResolutionStage.REMOTE,
            problem.code if problem is not None else FailureCode.NOT_FOUND,
            f"the checkpoint is not on this node and its artifact {key[:16]}... could not be imported ({why}); "
            "download the checkpoint here, or push the artifact from a node that built it",
            retryable=problem.retryable if problem is not None else False,
            identity_key=key,
        )
    )

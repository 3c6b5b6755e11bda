"""`load_component`: the one call a diffusers user needs.

Resolve the checkpoint files, build the identity on a `meta` skeleton, ask the runtime,
restore from the lease on a hit, and otherwise load canonically with diffusers and
publish the result for the next worker. Every step is reported on the returned value.
"""

from __future__ import annotations

import copy
import enum
import hashlib
import importlib
import json
import logging
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, cast

import torch

from .._exit_wait import wait_at_exit
from ..canonical_json import decode_json, encode_canonical
from ..config import RuntimeMode
from ..failures import (
    FailureCode,
    HostWeightError,
    HostWeightFailure,
    HostWeightUsageError,
    ResolutionStage,
    failure,
    raise_failure,
    usage_error,
)
from ..lease import HostWeightLease
from ..metrics import record_restore
from ..outcomes import (
    AttemptAction,
    AttemptResult,
    PostLoadPublicationReport,
    ResolutionAttempt,
    ResolutionOutcome,
    ResolutionReport,
)
from ..runtime import HostWeightRuntime
from ._load_options import LoadOptions, check_load_arguments, check_parallel
from .contracts import (
    FINAL_LAYOUT_BF16_POLICY,
    FinalLayoutLoaderIdentity,
    FinalLayoutParallelIdentity,
    FinalLayoutRequest,
    FinalLayoutTensorPolicy,
    ImplementationIdentity,
)
from .dtype_policies import ModelFamilyName, dtype_policy
from .family_transformers import TRANSFORMERS_FAMILY, checkpoint_bindings, is_transformers_config, restore_from_lease
from .fp8 import (
    FINAL_LAYOUT_FP8_POLICY,
    FinalLayoutFP8Producer,
    FinalLayoutFP8Restorer,
    fp8_linear_names,
    quantize_to_fp8,
)
from .identity_adapter import FinalLayoutIdentityContext, build_final_layout_identity
from .models import contract_for_model, is_diffusers_model, is_transformers_model
from .producers._checkpoint import CheckpointFormatError, read_safetensors_header
from .producers._shards import ProgressCallback
from .producers.checkpoint_stream import FinalLayoutBF16CheckpointProducer
from .producers.finalized import FinalLayoutBF16Producer
from .restorer import FinalLayoutTensorRestorer
from .source_identity import (
    NodeSourceDigestCache,
    PreparedWeightSource,
    WeightSourceKind,
    is_content_id_known,
    prepare_weight_source,
)

__all__ = [
    "BackgroundPublication",
    "ComponentLoadPath",
    "LoadedComponent",
    "PrewarmResult",
    "load_component",
    "prewarm_component",
]

_LOG = logging.getLogger(__name__)
_LOADER_ID = "host_weight_runtime.diffusion.load_component"
_LOADER_VERSION = "1"
_DEFAULT_COMPONENT = "transformer"
_default_dtype_guard = threading.Lock()
_announced_roots: set[str] = set()
_CONFIG_LIMIT_BYTES = 16 * 2**20
_MAX_LISTED = 5
# What diffusers raises, deep inside from_config or from_pretrained, about a config or checkpoint it cannot use.
_BROKEN_CONFIG_ERRORS = (ValueError, TypeError, KeyError, AttributeError, IndexError, RuntimeError, RecursionError)


class ComponentLoadPath(str, enum.Enum):
    """Where the returned model's weights came from."""

    ARTIFACT = "artifact"
    CANONICAL = "canonical"


class LoadedComponent:
    """A loaded diffusers model with the reports that explain how it was loaded.

    `outcome` is always set: the runtime's answer, or, where the loader did not ask the runtime,
    CANONICAL_DIRECT (runtime DISABLED) or CANONICAL_FALLBACK with one attempt saying why (the
    lookup was skipped, or no identity could be built); then `resolution.identity_key` is "".
    `elapsed_s` is the load itself; `import_s` is what this call spent importing diffusers and the
    model's module (0 once they are imported), so the call took `import_s + elapsed_s`.
    On the ARTIFACT path the model's tensors are views of a lease; the model keeps that lease
    alive, and `close()` releases it once the model is no longer served.
    `domain_root` says where the runtime keeps artifacts (None when it is DISABLED).
    """

    __slots__ = (
        "_lease",
        "background_publication",
        "domain_root",
        "elapsed_s",
        "identity_failure",
        "identity_key",
        "import_s",
        "load_path",
        "model",
        "publication",
        "resolution",
        "restore_failure",
    )

    def __init__(
        self,
        model: torch.nn.Module,
        load_path: ComponentLoadPath,
        *,
        elapsed_s: float,
        resolution: ResolutionReport,
        import_s: float = 0.0,
        domain_root: Path | None = None,
        identity_key: str | None = None,
        publication: PostLoadPublicationReport | None = None,
        identity_failure: HostWeightFailure | None = None,
        restore_failure: HostWeightFailure | None = None,
        lease: HostWeightLease | None = None,
        background_publication: BackgroundPublication | None = None,
    ) -> None:
        self.model = model
        self.background_publication = background_publication
        self.load_path = load_path
        self.elapsed_s = elapsed_s
        self.import_s = import_s
        self.domain_root = domain_root
        self.identity_key = identity_key
        self.resolution = resolution
        self.publication = publication
        self.identity_failure = identity_failure
        self.restore_failure = restore_failure
        self._lease = lease

    @property
    def outcome(self) -> ResolutionOutcome:
        return self.resolution.outcome

    @property
    def lease(self) -> HostWeightLease | None:
        return self._lease

    def close(self) -> None:
        """Release the lease (idempotent); the model must not be used for inference afterwards."""
        if self._lease is not None:
            self._lease.close()

    def __enter__(self) -> LoadedComponent:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def summary(self) -> dict[str, object]:
        """A JSON-friendly account of the load, for logs and `--json` output."""
        return {
            "load_path": self.load_path.value,
            "outcome": self.outcome.value,
            "identity_key": self.identity_key,
            "domain_root": None if self.domain_root is None else str(self.domain_root),
            "elapsed_s": self.elapsed_s,
            "import_s": self.import_s,
            "publication": None if self.publication is None else self.publication.status.value,
            "background_publication": None
            if self.background_publication is None
            else self.background_publication.state(),
            "identity_failure": None if self.identity_failure is None else self.identity_failure.to_dict(),
            "restore_failure": None if self.restore_failure is None else self.restore_failure.to_dict(),
        }


@dataclass(frozen=True, slots=True)
class PrewarmResult:
    """What `prewarm_component` built (or found) for a model."""

    identity_key: str
    resolution: ResolutionReport
    total_bytes: int
    tensor_count: int


BACKGROUND_NICE_INCREMENT = 10
"""How much nicer than the thread that loaded the model the background publication runs."""
_LOWEST_PRIORITY = 19


class BackgroundPublication:
    """The artifact of a canonically loaded model, built from its checkpoint on a thread of its own.

    The thread streams the checkpoint (it never reads the serving model, so nothing the
    caller does to the model can reach the artifact). It runs at nice +10, and so do the hash
    threads it starts, so the caller's first steps with its model come first on a busy node.
    A process that ends waits for it at exit, before thread pools stop taking work, so the
    first worker on a node always leaves an artifact behind. Failures are logged and kept in `failure`; they never raise here.
    """

    __slots__ = ("__weakref__", "_done", "_job", "_thread", "elapsed_s", "failure", "result")

    def __init__(self, job: Callable[[], PrewarmResult]) -> None:
        self._job = job
        self._done = threading.Event()
        self.result: PrewarmResult | None = None
        self.failure: HostWeightFailure | None = None
        self.elapsed_s: float | None = None
        self._thread = threading.Thread(target=self._run, name="hwr-background-publish", daemon=False)
        wait_at_exit(self._thread)
        self._thread.start()

    def _run(self) -> None:
        started = time.monotonic()
        try:
            try:  # this thread only (Linux nice is per thread); threads it starts inherit it
                thread_id = threading.get_native_id()
                nice = os.getpriority(os.PRIO_PROCESS, thread_id)
                os.setpriority(os.PRIO_PROCESS, thread_id, min(_LOWEST_PRIORITY, nice + BACKGROUND_NICE_INCREMENT))
            except OSError as exc:
                _LOG.debug("background publication keeps its priority: %s", exc)
            self.result = self._job()
        except HostWeightError as exc:
            self.failure = exc.failure
            _LOG.warning("background publication failed: [%s] %s", exc.failure.code.value, exc.failure.message)
        except Exception as exc:  # a bug must not kill the serving process; it is recorded instead
            self.failure = failure(
                ResolutionStage.PUBLICATION, FailureCode.PRODUCER_FAILED, f"{type(exc).__name__}: {exc}"
            )
            _LOG.exception("background publication failed")
        finally:
            self.elapsed_s = time.monotonic() - started
            self._job = _finished_job
            self._done.set()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until the publication finished (built, found, or failed); True when it did."""
        return self._done.wait(timeout)

    def state(self) -> dict[str, object]:
        """A JSON-friendly account: running, or how it ended."""
        if not self.done:
            return {"state": "running"}
        if self.failure is not None:
            return {"state": "failed", "failure": self.failure.to_dict(), "elapsed_s": self.elapsed_s}
        assert self.result is not None
        return {
            "state": self.result.resolution.outcome.value,
            "identity_key": self.result.identity_key,
            "elapsed_s": self.elapsed_s,
        }


def _finished_job() -> PrewarmResult:
    raise RuntimeError("this background publication already ran")


_ANCHOR_ATTRIBUTES = ("__deepcopy__", "_host_weight_lease")


def _no_anchor() -> None:
    """What a pickled anchor becomes: nothing, since an unpickled model owns its tensors."""
    return None


class _LeaseAnchor:
    """What a restored model holds, as `_host_weight_lease` and as its own `__deepcopy__`.

    It keeps the lease (and so its shared lock) alive as long as the model lives. `copy.deepcopy`
    looks `__deepcopy__` up on the instance, finds the anchor, and gets a model that owns plain
    tensors and no lease, so closing the lease or removing the artifact never reaches the copy.
    """

    __slots__ = ("_model", "lease")

    def __init__(self, model: torch.nn.Module, lease: HostWeightLease) -> None:
        self.lease = lease
        self._model = weakref.ref(model)  # the model holds the anchor; no cycle keeps either alive

    def __call__(self, memo: dict[int, Any] | None = None) -> torch.nn.Module:
        model = self._model()
        if model is None:
            raise RuntimeError("the model of this lease anchor is gone")
        memo = {} if memo is None else memo
        # Tensor.__deepcopy__ copies a view's whole storage, which for a leased buffer is a whole
        # payload file; compact copies go into the memo first (parameters copy compactly anyway).
        for buffer in model.buffers():
            if id(buffer) not in memo:
                memo[id(buffer)] = buffer.detach().clone().requires_grad_(buffer.requires_grad)
        duplicate: Any = type(model).__new__(type(model))
        memo[id(model)] = duplicate
        state = {name: value for name, value in vars(model).items() if name not in _ANCHOR_ATTRIBUTES}
        duplicate.__setstate__(copy.deepcopy(state, memo))  # nn.Module's: restores __dict__ and hook defaults
        return cast(torch.nn.Module, duplicate)

    def __reduce__(self) -> tuple[Callable[[], None], tuple[()]]:
        return (_no_anchor, ())


def _anchor(model: torch.nn.Module, lease: HostWeightLease) -> None:
    """Let the model keep its lease (and lock) alive, and deep-copy into a model of its own."""
    anchor = _LeaseAnchor(model, lease)
    for name in _ANCHOR_ATTRIBUTES:
        object.__setattr__(model, name, anchor)


class _ImportClock:
    """Seconds one call spends importing diffusers and the model's module, kept out of `elapsed_s`."""

    __slots__ = ("seconds",)

    def __init__(self) -> None:
        self.seconds = 0.0

    @contextmanager
    def measure(self) -> Iterator[None]:
        started = time.monotonic()
        try:
            yield
        finally:
            self.seconds += time.monotonic() - started


_UP_FRONT_MODULES = ("accelerate", "diffusers", "diffusers.models.modeling_utils")


def _import_diffusers(clock: _ImportClock) -> None:
    """Import what every load needs up front, timed on `clock` only when something is not imported yet."""
    if all(name in sys.modules for name in _UP_FRONT_MODULES):
        return
    with clock.measure():
        for name in _UP_FRONT_MODULES:
            importlib.import_module(name)


@contextmanager
def _usage_errors() -> Iterator[None]:
    """A ValueError about the caller's model folder or arguments leaves as a HostWeightUsageError."""
    try:
        yield
    except HostWeightError:
        raise
    except ValueError as exc:
        raise usage_error(str(exc)) from exc


def _report_without_lookup(
    mode: RuntimeMode,
    outcome: ResolutionOutcome,
    attempt: ResolutionAttempt | None = None,
) -> ResolutionReport:
    """The report of a load that did not ask the runtime: no identity key, at most one attempt saying why."""
    return ResolutionReport(
        identity_key="",
        mode=mode.value,
        outcome=outcome,
        attempts=() if attempt is None else (attempt,),
        elapsed_s=0.0 if attempt is None else attempt.elapsed_s,
        failure=None if attempt is None else attempt.failure,
    )


class _ComponentPipeline(torch.nn.Module):
    """A one-component container, so a lone model has the `<dit>.<name>` tensor names of a pipeline."""


@dataclass(frozen=True, slots=True)
class _Skeleton:
    """Everything about a component that needs no hashing: its files, class, skeleton and request."""

    source: PreparedWeightSource
    model_class: type[Any]
    component_name: str
    skeleton: torch.nn.Module
    holder: torch.nn.Module
    request: FinalLayoutRequest
    options: LoadOptions
    policy: FinalLayoutTensorPolicy = FINAL_LAYOUT_BF16_POLICY
    aliases: Mapping[str, str] | None = None
    checkpoint_keys: Mapping[str, str] | None = None


@dataclass(frozen=True, slots=True)
class _Prepared:
    source: PreparedWeightSource
    model_class: type[Any]
    component_name: str
    skeleton: torch.nn.Module
    holder: torch.nn.Module
    context: FinalLayoutIdentityContext
    options: LoadOptions


def _component_name(subfolder: str | None) -> str:
    if subfolder:
        last = Path(subfolder).name
        if last.isidentifier():
            return last
    return _DEFAULT_COMPONENT


def _model_class(resolved_root: Path, clock: _ImportClock | None = None) -> type[Any]:
    """The diffusers class named by the folder's config.json `_class_name`, as diffusers resolves it.

    The config is read bounded (size and nesting) before diffusers sees it, so a hostile or broken
    config.json is a HostWeightUsageError, never a RecursionError or AttributeError from a parser.
    diffusers imports the class's module on first use; `clock` counts that as import time.
    """
    config_path = resolved_root / "config.json"
    try:
        with open(config_path, "rb") as stream:  # a hub snapshot's config.json is a link to its blob: follow it
            config = decode_json(stream.read(_CONFIG_LIMIT_BYTES + 1), max_bytes=_CONFIG_LIMIT_BYTES)
    except (OSError, ValueError) as exc:
        raise usage_error(
            f"cannot read {config_path}: {exc}; point load_component at a diffusers model folder "
            "(its config.json must be one JSON object)"
        ) from exc
    if not isinstance(config, dict):
        raise usage_error(
            f"{config_path} holds a JSON {type(config).__name__}, not an object; it is not a diffusers model config"
        )
    if is_transformers_config(config):
        with clock.measure() if clock is not None else nullcontext():
            return TRANSFORMERS_FAMILY.model_class(config, config_path)
    class_name = config.get("_class_name")
    if not isinstance(class_name, str) or not class_name:
        raise usage_error(
            f"{config_path} has no _class_name (diffusers) and no model_type or architectures (transformers); "
            "it is not a model config"
        )
    if not class_name.isidentifier():
        raise usage_error(f"{config_path} names {class_name!r}, which is not a diffusers model class")
    import diffusers

    model_class = vars(diffusers).get(class_name)  # diffusers keeps a class here once its module is imported
    if model_class is None:
        with clock.measure() if clock is not None else nullcontext():
            model_class = getattr(diffusers, class_name, None)
    if not isinstance(model_class, type) or not is_diffusers_model(model_class):
        raise usage_error(f"{config_path} names {class_name!r}, which is not a diffusers model class")
    return model_class


def _json_config(config: dict[str, Any]) -> dict[str, Any]:
    """The config facts that shape the model: public keys plus the class name, as plain JSON."""
    public = {key: value for key, value in config.items() if not key.startswith("_") or key == "_class_name"}
    loaded: dict[str, Any] = json.loads(json.dumps(public, sort_keys=True, default=str))
    return loaded


def _digest(value: object) -> str:
    return hashlib.sha256(encode_canonical(value)).hexdigest()


def _loader_identity(
    model_class: type[Any],
    config: dict[str, Any],
    keep_fp32: tuple[str, ...],
    safetensors: bool,
    dtype: torch.dtype = torch.bfloat16,
) -> FinalLayoutLoaderIdentity:
    transformers_model = is_transformers_model(model_class)
    if transformers_model:
        versions = TRANSFORMERS_FAMILY.library_versions()
    else:
        import diffusers

        versions = {"diffusers": str(diffusers.__version__), "torch": str(torch.__version__)}
    transform: dict[str, object] = {
        "torch_dtype": str(dtype),
        "keep_in_fp32_modules": list(keep_fp32),
        "key_mapping": "transformers-conversion-mapping" if transformers_model else "identity",
        "checkpoint_format": "safetensors" if safetensors else "pickle",
    }
    implementation = ImplementationIdentity(
        implementation_id=_LOADER_ID,
        version=_LOADER_VERSION,
        fingerprint=_digest({"loader": _LOADER_ID, "version": _LOADER_VERSION, **versions}),
    )
    return FinalLayoutLoaderIdentity(
        implementation=implementation,
        model_config_fingerprint=_digest(
            {"class": f"{model_class.__module__}.{model_class.__qualname__}", "config": _json_config(config)}
        ),
        weight_transform_fingerprint=_digest(transform),
    )


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """diffusers constructs models under `torch_dtype` as the default dtype; so must the skeleton."""
    with _default_dtype_guard:
        previous = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            yield
        finally:
            torch.set_default_dtype(previous)


def build_skeleton(
    model_class: type[Any], resolved_root: Path, name_or_path: str, dtype: torch.dtype = torch.bfloat16
) -> torch.nn.Module:
    """The model built the way diffusers' from_pretrained builds it, with parameters left on `meta`.

    Non-persistent buffers are computed for real (they are not in the artifact), under the
    same default dtype as a canonical load, so a restored model equals a canonical one.
    """
    if is_transformers_model(model_class):
        return TRANSFORMERS_FAMILY.build_skeleton(model_class, resolved_root, name_or_path, dtype)
    import accelerate
    from diffusers.models.modeling_utils import no_init_weights

    try:
        config = model_class.load_config(str(resolved_root))
        with _default_dtype(dtype), no_init_weights(), accelerate.init_empty_weights():
            model = model_class.from_config(config)
    except _BROKEN_CONFIG_ERRORS as exc:
        raise usage_error(
            f"{resolved_root / 'config.json'} does not describe a buildable {model_class.__name__} "
            f"({type(exc).__name__}: {exc}); fix or re-download the model folder"
        ) from exc
    model.eval()
    model.register_to_config(_name_or_path=name_or_path)
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"{model_class.__name__}.from_config returned {type(model).__name__}")
    return model


def _announce(runtime: HostWeightRuntime) -> None:
    root = str(runtime.config.resolved_root)
    if root not in _announced_roots:
        _announced_roots.add(root)
        _LOG.info("host-weight-runtime: mode %s, domain root %s", runtime.config.mode.value, root)


def _digest_cache(runtime: HostWeightRuntime) -> NodeSourceDigestCache | None:
    """The node's source-digest cache under the domain root, only once the domain itself checked out."""
    init_failure = runtime.ensure_store()
    if init_failure is not None:
        _LOG.info("no node source-digest cache (%s); checkpoint files are hashed directly", init_failure.message)
        return None
    return NodeSourceDigestCache(runtime.config.resolved_root, timeout_seconds=runtime.config.lock_timeout_s)


def _source(
    model_or_path: str | os.PathLike[str],
    *,
    subfolder: str | None,
    revision: str | None,
    cache_dir: Path | None,
    options: LoadOptions,
) -> PreparedWeightSource:
    """The checkpoint files diffusers would read; a problem with the folder is a HostWeightUsageError.

    Every safetensors file's header is checked here (offsets inside the file, sizes matching shapes), so a
    truncated or foreign shard is refused up front in every mode, before any hashing, build or load.
    """
    with _usage_errors():
        source = prepare_weight_source(
            model_or_path,
            subfolder=subfolder,
            revision=revision,
            prefix=f"{_component_name(subfolder)}.",
            cache_dir=cache_dir,
            variant=options.variant,
            use_safetensors=options.use_safetensors,
        )
    if source.use_safetensors:
        for path in source.weight_files:
            try:
                read_safetensors_header(path)
            except CheckpointFormatError as exc:
                raise usage_error(
                    f"{exc}; the checkpoint file is damaged, incomplete or not safetensors: re-download or re-save it",
                    file=str(path),
                ) from exc
            except OSError as exc:
                raise usage_error(f"cannot read the checkpoint file {path}: {exc}", file=str(path)) from exc
    return source


def _prepare_skeleton(
    model_or_path: str | os.PathLike[str],
    *,
    subfolder: str | None,
    revision: str | None,
    parallel: FinalLayoutParallelIdentity,
    cache_dir: Path | None,
    options: LoadOptions,
    clock: _ImportClock | None = None,
) -> _Skeleton:
    """The source files, model class, `meta` skeleton and request: everything but the hashing."""
    component_name = _component_name(subfolder)
    source = _source(model_or_path, subfolder=subfolder, revision=revision, cache_dir=cache_dir, options=options)
    model_class = _model_class(source.resolved_root, clock)
    with _usage_errors():
        skeleton = build_skeleton(model_class, source.resolved_root, str(model_or_path), options.dtype)
    holder = _ComponentPipeline()
    holder.add_module(component_name, skeleton)
    contract = contract_for_model(skeleton, options.dtype)
    transformers_model = is_transformers_model(model_class)
    if transformers_model:
        config = TRANSFORMERS_FAMILY.model_config(model_class, source.resolved_root)
    else:
        config = dict(model_class.load_config(str(source.resolved_root)))
    request = FinalLayoutRequest(
        model_id=_model_id(model_or_path, source),
        loader=_loader_identity(
            model_class, config, contract.keep_in_fp32_modules, source.use_safetensors, options.dtype
        ),
        parallel=parallel,
    )
    family = ModelFamilyName.TRANSFORMERS if transformers_model else ModelFamilyName.DIFFUSERS
    policy = dtype_policy(family, options.dtype)
    if not transformers_model:
        return _Skeleton(source, model_class, component_name, skeleton, holder, request, options, policy)
    keys, aliases = checkpoint_bindings(skeleton, source)
    return _Skeleton(
        source,
        model_class,
        component_name,
        skeleton,
        holder,
        request,
        options,
        policy,
        {f"{component_name}.{alias}": f"{component_name}.{owner}" for alias, owner in aliases.items()},
        {f"{component_name}.{name}": key for name, key in keys.items()},
    )


REPRESENTATIONS = ("bf16", "fp8")
"""What `load_component(representation=...)` accepts; "bf16" is the default."""


def check_representation(
    representation: object, *, stream_on_miss: bool | None = None, publish_in_background: bool = False
) -> bool:
    """True for "fp8"; a value or combination the FP8 representation cannot serve is a HostWeightUsageError."""
    if representation not in REPRESENTATIONS:
        raise usage_error(
            f"representation must be one of {list(REPRESENTATIONS)}, got {representation!r}", argument="representation"
        )
    if representation == "bf16":
        return False
    refusals = ((stream_on_miss is True, "stream_on_miss"), (publish_in_background, "publish_in_background"))
    for refused, argument in refusals:
        if refused:
            raise usage_error(
                f"representation='fp8' is published after a canonical load only; drop {argument}=True "
                "(streaming an FP8 artifact from the checkpoint is not supported yet)",
                argument=argument,
            )
    return True


def quantize_model_fp8(model: torch.nn.Module, scales: Mapping[str, torch.Tensor] | None = None) -> None:
    """Swap the model's quantized Linears for `FP8Linear` (on `meta`: shapes only), as the FP8 contract says."""
    try:
        keep = contract_for_model(model).keep_in_fp32_modules
    except HostWeightError:
        keep = tuple(getattr(type(model), "_keep_in_fp32_modules", None) or ())
    quantize_to_fp8(model, fp8_linear_names(model, keep), scales)


def _identify(
    prepared: _Skeleton, runtime: HostWeightRuntime, policy: FinalLayoutTensorPolicy | None = None
) -> _Prepared:
    """Hash the sources (once per node, through the digest cache) and build the identity on the skeleton."""
    context = build_final_layout_identity(
        prepared.holder,
        dit_modules=[(prepared.component_name, prepared.skeleton)],
        prepared_sources=[prepared.source],
        request=prepared.request,
        policy=prepared.policy if policy is None else policy,
        source_digest_cache=_digest_cache(runtime),
        aliases=prepared.aliases,
        checkpoint_keys=prepared.checkpoint_keys,
    )
    return _Prepared(
        prepared.source,
        prepared.model_class,
        prepared.component_name,
        prepared.skeleton,
        prepared.holder,
        context,
        prepared.options,
    )


def _model_id(model_or_path: str | os.PathLike[str], source: PreparedWeightSource) -> str:
    """The model as the manifest shows it (never in the key): a repo id as given, a local folder by its real path."""
    if source.source_kind is WeightSourceKind.HUGGING_FACE_HUB:
        return str(model_or_path)
    return os.path.realpath(model_or_path)


def _canonical(
    model_class: type[Any], source: PreparedWeightSource, name_or_path: str, options: LoadOptions
) -> torch.nn.Module:
    """Exactly what a user gets: from_pretrained(torch_dtype=...) of diffusers or transformers, from local files.

    What the library raises about the folder (a checkpoint that does not match config.json, an unreadable
    file) leaves typed: a HostWeightUsageError, or CANONICAL_SOURCE_FAILED for an OS error.
    """
    if is_transformers_model(model_class):
        return TRANSFORMERS_FAMILY.load_canonical(model_class, source, name_or_path, options)
    try:
        model = model_class.from_pretrained(
            str(source.resolved_root),
            torch_dtype=options.dtype,
            use_safetensors=source.use_safetensors,
            variant=options.variant,
            disable_mmap=options.disable_mmap,
        )
    except HostWeightError:
        raise
    except OSError as exc:
        raise raise_failure(
            ResolutionStage.CANONICAL,
            FailureCode.CANONICAL_SOURCE_FAILED,
            f"diffusers could not read the checkpoint in {source.resolved_root}: {exc}; check the files "
            "(re-download a damaged one) and that they are readable",
            exception=type(exc).__name__,
        ) from exc
    except _BROKEN_CONFIG_ERRORS as exc:
        raise usage_error(
            f"diffusers could not load {source.resolved_root} ({type(exc).__name__}: {exc}); the checkpoint does "
            "not match its config.json: fix or re-download the model folder",
            code=FailureCode.CANONICAL_SOURCE_FAILED,
        ) from exc
    model.register_to_config(_name_or_path=name_or_path)
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"{model_class.__name__}.from_pretrained returned {type(model).__name__}")
    # diffusers only warns about model tensors the checkpoint lacks and leaves them on `meta`: no usable model.
    missing = [name for name, tensor in (*model.named_parameters(), *model.named_buffers()) if tensor.is_meta]
    if missing:
        raise usage_error(
            f"the checkpoint in {source.resolved_root} lacks {len(missing)} tensor(s) the model needs, e.g. "
            f"{missing[:_MAX_LISTED]}; diffusers left them uninitialised, so the weights do not match config.json: "
            "complete the checkpoint (a missing or partial weight index?) or re-download the model folder",
            code=FailureCode.CANONICAL_SOURCE_FAILED,
            missing=len(missing),
        )
    return model


_SKIPPED_LOOKUP = (
    "this node has never hashed these checkpoint files, so no artifact can exist for them here; the lookup is "
    "skipped and the background publication hashes them and builds the artifact"
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
    publish_in_background: bool = False,
    process_group: Any = None,
    representation: str = "bf16",
    **from_pretrained_kwargs: Any,
) -> LoadedComponent:
    """Load a diffusers or transformers model component through the node's host weight artifact.

    The component is a diffusers `ModelMixin` (its config.json has `_class_name`) or a transformers
    `PreTrainedModel` (text and vision encoders: the class `model_index.json` names for the
    subfolder, else the config's `architectures`); either way the result equals that library's
    own `from_pretrained(..., torch_dtype/dtype=...)` in every parameter and buffer, tied weights
    stay tied, and `model_or_path` is a model folder, a pipeline folder with `subfolder`, or a repo id in
    the local Hugging Face cache (never the network). The other arguments are those of
    diffusers' `from_pretrained`: `variant` and `use_safetensors` choose the checkpoint files
    as there (and so the artifact); `torch_dtype`/`dtype` is BF16 (the default), FP16 or FP32
    (a torch dtype or its name), each served as its own representation under its own key (a BF16
    artifact never serves an FP16 load); `device_map` may be None or the CPU; `low_cpu_mem_usage`,
    `local_files_only`, `token` and `proxies` are accepted and change nothing (nothing is
    downloaded; the token is never used, kept or logged); anything else is refused with a
    `HostWeightUsageError` (a ValueError too) naming it.

    `runtime=None` reads `HWR_*` from the environment. On a miss the checkpoint is streamed
    into a new artifact when `stream_on_miss` (default: only in REQUIRED mode); otherwise the
    model is loaded canonically and published after load. In PREFERRED mode any failure falls
    back to the canonical load; in REQUIRED mode it raises `HostWeightError`.

    `publish_in_background=True` (PREFERRED, safetensors checkpoints) returns the canonical
    model as soon as it is loaded and builds the artifact from the checkpoint on a thread
    (`LoadedComponent.background_publication`; the process waits for it at exit). When this
    node has never hashed the checkpoint files and no remote is configured, no artifact can
    exist for them here, so the lookup is skipped (outcome CANONICAL_FALLBACK, one SKIPPED
    attempt), the hashing moves to that thread too, and the first worker starts as fast as a
    plain `from_pretrained`.

    `HWR_REMOTE` (or the runtime's remote providers) makes a local miss import the exact
    artifact from a remote (outcome REMOTE_IMPORT) before any local build or canonical load;
    `HWR_REMOTE_PUBLISH=true` pushes what this node publishes, off the request path.

    With `parallel.tensor_parallel_size > 1` (torch.distributed initialized) this rank loads its
    own artifact and returns a parallelized model; `process_group=` makes the group's ranks
    resolve together (GROUP_COHORT, see `diffusion/parallel/loader.py`).

    `representation="fp8"` serves float8_e4m3fn Linear weights with one FP32 scale per tensor
    (`FP8Linear` modules that dequantize in forward; see `diffusion/fp8.py`), under a key of
    its own; its artifact is published after a canonical load (no streaming, no background).
    """
    del token  # accepted so that a pasted call runs; nothing is downloaded, so it is never used, kept or logged
    clock = _ImportClock()
    fp8 = check_representation(
        representation, stream_on_miss=stream_on_miss, publish_in_background=publish_in_background
    )
    if isinstance(parallel, FinalLayoutParallelIdentity) and parallel.tensor_parallel_size > 1:
        if variant is not None or from_pretrained_kwargs:
            unsupported = "variant" if variant is not None else sorted(from_pretrained_kwargs)[0]
            raise usage_error(
                f"{unsupported} is not supported with tensor_parallel_size > 1 yet; pass it without tensor parallelism",
                argument=unsupported,
            )
        from .parallel.loader import load_tensor_parallel_component

        loaded: LoadedComponent = load_tensor_parallel_component(
            model_or_path,
            parallel=parallel,
            runtime=runtime if runtime is not None else HostWeightRuntime.from_env(),
            subfolder=subfolder,
            revision=revision,
            cache_dir=Path(cache_dir) if cache_dir is not None else None,
            stream_on_miss=stream_on_miss,
            process_group=process_group,
            representation=representation,
        )
        return loaded
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
    if fp8 and options.dtype != torch.bfloat16:
        raise usage_error(
            f"representation='fp8' keeps the unquantized tensors in BF16; drop torch_dtype={options.dtype} "
            "(or load the FP16/FP32 representation without representation='fp8')",
            argument="representation",
        )
    _import_diffusers(clock)
    runtime = runtime if runtime is not None else HostWeightRuntime.from_env()
    _announce(runtime)
    mode = runtime.config.mode
    parallel = parallel if parallel is not None else FinalLayoutParallelIdentity()
    cache_path = Path(cache_dir) if cache_dir is not None else None
    name_or_path = str(model_or_path)
    root = None if mode is RuntimeMode.DISABLED else runtime.config.resolved_root

    def finish(
        model: torch.nn.Module, load_path: ComponentLoadPath, report: ResolutionReport, **reports: Any
    ) -> LoadedComponent:
        return LoadedComponent(
            model,
            load_path,
            elapsed_s=time.monotonic() - started - clock.seconds,
            import_s=clock.seconds,
            domain_root=root,
            resolution=report,
            **reports,
        )

    def canonical_only(report: ResolutionReport, **reports: Any) -> LoadedComponent:
        source = _source(model_or_path, subfolder=subfolder, revision=revision, cache_dir=cache_path, options=options)
        model = _canonical(_model_class(source.resolved_root, clock), source, name_or_path, options)
        if fp8:
            quantize_model_fp8(model)
        return finish(model, ComponentLoadPath.CANONICAL, report, **reports)

    if mode is RuntimeMode.DISABLED:
        return canonical_only(_report_without_lookup(mode, ResolutionOutcome.CANONICAL_DIRECT))

    stream = stream_on_miss if stream_on_miss is not None else mode is RuntimeMode.REQUIRED and not fp8
    background = publish_in_background and mode is RuntimeMode.PREFERRED and not stream
    identify_started = time.monotonic()
    try:
        skeleton = _prepare_skeleton(
            model_or_path,
            subfolder=subfolder,
            revision=revision,
            parallel=parallel,
            cache_dir=cache_path,
            options=options,
            clock=clock,
        )
        # Without a remote, a node that never hashed these files cannot hold their artifact: skip the lookup.
        remote = bool(runtime.remote_providers)
        if background and skeleton.source.use_safetensors and not remote and _needs_hashing(skeleton.source, runtime):
            model = _canonical(skeleton.model_class, skeleton.source, name_or_path, options)
            skipped = ResolutionAttempt(
                ResolutionStage.LOOKUP, AttemptResult.SKIPPED, AttemptAction.FALL_BACK, 0.0, None, _SKIPPED_LOOKUP
            )
            return finish(
                model,
                ComponentLoadPath.CANONICAL,
                _report_without_lookup(mode, ResolutionOutcome.CANONICAL_FALLBACK, skipped),
                background_publication=BackgroundPublication(lambda: _build_artifact(skeleton, runtime, None)),
            )
        if fp8 and is_transformers_model(skeleton.model_class):
            raise usage_error(
                f"representation='fp8' serves diffusers models; {skeleton.model_class.__name__} is a transformers "
                "model: load it without representation='fp8'",
                argument="representation",
            )
        if fp8:
            quantize_model_fp8(skeleton.skeleton)
        prepared = _identify(skeleton, runtime, FINAL_LAYOUT_FP8_POLICY if fp8 else None)
    except HostWeightError as exc:
        if isinstance(exc, HostWeightUsageError) or mode is RuntimeMode.REQUIRED:
            raise
        if exc.failure.code is FailureCode.NOT_FOUND:
            raise
        _LOG.warning("no final-layout identity for %s (%s); loading canonically", name_or_path, exc.failure.message)
        attempt = ResolutionAttempt(
            exc.failure.stage,
            AttemptResult.FAILED,
            AttemptAction.FALL_BACK,
            time.monotonic() - identify_started,
            exc.failure,
            "the final-layout identity could not be built",
        )
        return canonical_only(
            _report_without_lookup(mode, ResolutionOutcome.CANONICAL_FALLBACK, attempt), identity_failure=exc.failure
        )

    context = prepared.context
    key = context.identity.key
    producer = FinalLayoutBF16CheckpointProducer(context) if stream and prepared.source.use_safetensors else None
    resolution = runtime.resolve(context.identity, producer)
    report = resolution.report
    restore_failure: HostWeightFailure | None = None
    if resolution.lease is not None:
        lease = resolution.lease
        restore_started = time.monotonic()
        try:
            if is_transformers_model(prepared.model_class):
                restored = restore_from_lease(
                    context,
                    prepared.holder,
                    lease,
                    model_class=prepared.model_class,
                    source=prepared.source,
                    name_or_path=name_or_path,
                    dtype=options.dtype,
                )
            else:
                restorer = FinalLayoutFP8Restorer(context) if fp8 else FinalLayoutTensorRestorer(context)
                restorer._plan_on_identity_skeleton(prepared.holder, lease).commit()
                restored = prepared.skeleton
        except HostWeightError as exc:
            record_restore(time.monotonic() - restore_started, ok=False)
            lease.close()
            if mode is RuntimeMode.REQUIRED:
                raise
            restore_failure = exc.failure
            _LOG.warning(
                "restoring %s from artifact %s failed (%s); loading canonically", name_or_path, key, exc.failure.message
            )
        else:
            record_restore(time.monotonic() - restore_started, ok=True)
            model = restored
            _anchor(model, lease)
            return finish(model, ComponentLoadPath.ARTIFACT, report, identity_key=key, lease=lease)
    elif resolution.outcome is ResolutionOutcome.FAILED:
        assert report.failure is not None
        raise HostWeightError(report.failure)

    model = _canonical(prepared.model_class, prepared.source, name_or_path, options)
    if fp8:
        quantize_model_fp8(model)
    publication: PostLoadPublicationReport | None = None
    in_background: BackgroundPublication | None = None
    if restore_failure is None and resolution.outcome is ResolutionOutcome.CANONICAL_FALLBACK:
        if background and prepared.source.use_safetensors:
            in_background = BackgroundPublication(lambda: _build_artifact(prepared, runtime, None))
        else:
            producer_class = FinalLayoutFP8Producer if fp8 else FinalLayoutBF16Producer
            producer_after = producer_class(context, [(prepared.component_name, model)])
            publication = runtime.publish_after_load(context.identity, producer_after)
    return finish(
        model,
        ComponentLoadPath.CANONICAL,
        report,
        identity_key=key,
        publication=publication,
        restore_failure=restore_failure,
        background_publication=in_background,
    )


def _needs_hashing(source: PreparedWeightSource, runtime: HostWeightRuntime) -> bool:
    """Whether some checkpoint file's content id is neither a trusted hub blob name nor in the node's digest cache."""
    cache = _digest_cache(runtime)
    return any(not is_content_id_known(path, cache) for path in source.weight_files)


def _required(runtime: HostWeightRuntime) -> HostWeightRuntime:
    """The same runtime in REQUIRED mode with local builds allowed: building is the point, a failure must show."""
    config = replace(runtime.config, mode=RuntimeMode.REQUIRED, allow_local_build=True)
    return runtime if runtime.config == config else HostWeightRuntime(config)


def _build_artifact(
    prepared: _Prepared | _Skeleton, runtime: HostWeightRuntime, progress: ProgressCallback | None
) -> PrewarmResult:
    """Identify (when not yet done) and stream the checkpoint into the artifact; raises HostWeightError."""
    required = _required(runtime)
    identified = prepared if isinstance(prepared, _Prepared) else _identify(prepared, required)
    if not identified.source.use_safetensors:
        raise HostWeightError(
            failure(
                ResolutionStage.PRODUCTION,
                FailureCode.PRODUCER_UNSUPPORTED,
                f"{identified.source.model_or_path} has no safetensors weights; the artifact is streamed from "
                "safetensors only. Load it once with load_component instead: that publishes after a canonical load",
            )
        )
    producer = FinalLayoutBF16CheckpointProducer(identified.context, progress=progress)
    resolution = required.resolve(identified.context.identity, producer)
    if resolution.lease is None:
        assert resolution.report.failure is not None
        raise HostWeightError(resolution.report.failure)
    resolution.lease.close()
    return PrewarmResult(
        identity_key=identified.context.identity.key,
        resolution=resolution.report,
        total_bytes=identified.context.total_bytes,
        tensor_count=len(identified.context.tensors),
    )


def prewarm_component(
    model_or_path: str | os.PathLike[str],
    *,
    subfolder: str | None = None,
    revision: str | None = None,
    variant: str | None = None,
    runtime: HostWeightRuntime | None = None,
    parallel: FinalLayoutParallelIdentity | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    progress: ProgressCallback | None = None,
    torch_dtype: torch.dtype | str = torch.bfloat16,
) -> PrewarmResult:
    """Build (or find) the artifact straight from the checkpoint, without loading the model.

    `variant` picks the checkpoint files and `torch_dtype` the representation as in `load_component`
    (and so the artifact a later `load_component(..., variant=..., torch_dtype=...)` hits). Runs in REQUIRED
    mode with local builds allowed
    whatever the environment says, so a failure raises `HostWeightError` instead of being
    hidden by a fallback; a bad argument or model folder raises `HostWeightUsageError`.
    """
    served = check_load_arguments(
        torch_dtype=torch_dtype,
        dtype=None,
        variant=variant,
        use_safetensors=None,
        low_cpu_mem_usage=None,
        local_files_only=None,
        device_map=None,
        output_loading_info=False,
        disable_mmap=False,
        parallel=None,
        extra={},
    )
    options = LoadOptions(variant=served.variant, dtype=served.dtype)
    check_parallel(parallel)
    required = _required(runtime if runtime is not None else HostWeightRuntime.from_env())
    _announce(required)
    skeleton = _prepare_skeleton(
        model_or_path,
        subfolder=subfolder,
        revision=revision,
        parallel=parallel if parallel is not None else FinalLayoutParallelIdentity(),
        cache_dir=Path(cache_dir) if cache_dir is not None else None,
        options=options,
    )
    return _build_artifact(_identify(skeleton, required), required, progress)

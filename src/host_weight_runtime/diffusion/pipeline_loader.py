"""`load_pipeline`: a whole diffusers pipeline, every weighted component served through `load_component`.

A composition of the component path, not a second loader: model_index.json says which
components there are; each weighted torch component with safetensors weights goes through
`load_component(..., subfolder=name)`; diffusers' own `DiffusionPipeline.from_pretrained`
then assembles the pipeline from those models, loading tokenizers, schedulers, processors and
whatever could not be served exactly as it always does (or, when only tokenizers and schedulers
are left, the same calls are made directly: `_direct_assembly.py`). Every component gets a record saying
how it was loaded and why, so nothing is ever silently left canonical.
"""

from __future__ import annotations

import enum
import os
import time
from collections.abc import Callable, Mapping
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch

from ..config import RuntimeMode
from ..failures import FailureCode, HostWeightError, HostWeightUsageError, usage_error
from ..lease import deferred_verifications
from ..outcomes import ResolutionOutcome
from ..runtime import HostWeightRuntime
from ._direct_assembly import assemble_directly
from ._hub_snapshot import hub_snapshot
from ._load_options import check_dtype
from ._missing_folder import check_folder_or_repo_id
from ._model_index import ClassKind, IndexedComponent, ModelIndex, read_model_index
from ._pipeline_arguments import split_pipeline_arguments
from ._prewarm_plan import check_something_to_prewarm
from ._source_files import select_weight_files
from .background import deferred_publications
from .canonical_warning import warn_canonical_records
from .component_source import ComponentLocation
from .load_reports import PrewarmResult
from .loaded import LoadedComponent
from .loader import load_component
from .named_source import named_pipeline_root, wants_name
from .prewarm_step import prewarm_component

__all__ = [
    "ComponentHandling",
    "LoadedPipeline",
    "PipelineComponentRecord",
    "PipelinePrewarmResult",
    "load_pipeline",
    "pipeline_root",
    "prewarm_pipeline",
]

# What diffusers raises, deep inside from_pretrained, about a folder it cannot assemble.
_ASSEMBLY_ERRORS = (ValueError, TypeError, KeyError, AttributeError, IndexError, RuntimeError, OSError, ImportError)
_SERVED_KINDS = (ClassKind.DIFFUSERS_MODEL, ClassKind.TRANSFORMERS_MODEL)


class ComponentHandling(str, enum.Enum):
    """How `load_pipeline` loaded one component of model_index.json."""

    SERVED = "served"  # through load_component: in LoadedPipeline.components, with its outcome
    CANONICAL = "canonical"  # a weighted component diffusers loaded itself; the record says why
    CALLER = "caller"  # passed by the caller and used as given
    UNWEIGHTED = "unweighted"  # tokenizer, scheduler, processor: loaded by diffusers as always
    ABSENT = "absent"  # [null, null] in model_index.json


@dataclass(frozen=True, slots=True)
class PipelineComponentRecord:
    """One component: its model_index.json entry, how it was loaded, and why when it was not served."""

    name: str
    library: str | None
    class_name: str | None
    handling: ComponentHandling
    reason: str | None = None

    def to_dict(self) -> dict[str, object]:
        return {
            "name": self.name,
            "library": self.library,
            "class_name": self.class_name,
            "handling": self.handling.value,
            "reason": self.reason,
        }


class LoadedPipeline:
    """A diffusers pipeline whose weighted components came through the host weight runtime.

    `pipeline` is the object of the class model_index.json names; `components` holds the
    `LoadedComponent` of every served component (its outcome, key and lease); `records` has one
    entry per component of model_index.json. `close()` releases every lease (idempotent); the
    pipeline must not be used for inference afterwards. A context manager closes on exit.
    """

    __slots__ = ("_components", "_pipeline", "_records", "elapsed_s", "root")

    def __init__(
        self,
        pipeline: Any,
        components: Mapping[str, LoadedComponent],
        records: tuple[PipelineComponentRecord, ...],
        *,
        root: Path,
        elapsed_s: float,
    ) -> None:
        self._pipeline = pipeline
        self._components = MappingProxyType(dict(components))
        self._records = records
        self.root = root
        self.elapsed_s = elapsed_s

    @property
    def pipeline(self) -> Any:
        return self._pipeline

    @property
    def components(self) -> Mapping[str, LoadedComponent]:
        return self._components

    @property
    def records(self) -> tuple[PipelineComponentRecord, ...]:
        return self._records

    def record(self, name: str) -> PipelineComponentRecord:
        for record in self._records:
            if record.name == name:
                return record
        raise KeyError(name)

    @property
    def outcomes(self) -> dict[str, ResolutionOutcome]:
        """The runtime's outcome for every served component, by name."""
        return {name: loaded.outcome for name, loaded in self._components.items()}

    def close(self) -> None:
        for loaded in self._components.values():
            loaded.close()

    def __enter__(self) -> LoadedPipeline:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def summary(self) -> dict[str, object]:
        """A JSON-friendly account: the pipeline class, every component's record and every served load."""
        return {
            "pipeline_class": type(self._pipeline).__name__,
            "root": str(self.root),
            "elapsed_s": self.elapsed_s,
            "components": [
                {
                    **record.to_dict(),
                    "load": None if record.name not in self._components else self._components[record.name].summary(),
                }
                for record in self._records
            ],
        }


def pipeline_root(
    model_or_path: str | os.PathLike[str], *, revision: str | None = None, cache_dir: str | os.PathLike[str] | None
) -> Path:
    """The local folder diffusers reads: the folder itself, or the repo id's snapshot in the local HF cache."""
    text = os.fspath(model_or_path)
    if not isinstance(text, str) or not text:
        raise usage_error(f"model_or_path must be a pipeline folder or 'org/name', got {model_or_path!r}")
    if os.path.isdir(text):
        return Path(os.path.abspath(text))
    check_folder_or_repo_id(text)
    return hub_snapshot(text, revision, Path(cache_dir) if cache_dir is not None else None)


def _pipeline_root_or_named(
    model_or_path: str | os.PathLike[str],
    revision: str | None,
    cache_dir: str | os.PathLike[str] | None,
    runtime: HostWeightRuntime,
) -> tuple[Path, bool]:
    """(root, named): the pipeline folder here; else, with a remote configured, its files from the name index."""
    try:
        return pipeline_root(model_or_path, revision=revision, cache_dir=cache_dir), False
    except HostWeightError as exc:
        location = ComponentLocation(model_or_path, None, revision)
        if not wants_name(location, runtime, exc):
            raise
        return named_pipeline_root(location, runtime, exc), True


def _unservable_reason(
    component: IndexedComponent, root: Path, variant: str | None, use_safetensors: bool | None
) -> str | None:
    """Why this weighted torch component cannot go through load_component (None when it can)."""
    if component.kind not in _SERVED_KINDS:
        return f"{component.class_name} is neither a diffusers nor a transformers model"
    try:
        _files, safetensors = select_weight_files(root / component.name, variant, use_safetensors)
    except ValueError as exc:
        return f"no weights the runtime reads: {exc}"
    if not safetensors:
        return "only pickle (.bin) weights: the runtime serves safetensors checkpoints; convert them to safetensors"
    return None


def _plan(
    index: ModelIndex,
    root: Path,
    caller: Mapping[str, Any],
    *,
    variant: str | None,
    use_safetensors: bool | None,
    dtype_refusal: str | None,
    named: bool = False,
) -> list[PipelineComponentRecord]:
    """One record per component; SERVED ones are still to be loaded. A custom class is an error.

    `named`: the root holds no weights (a load by name), so every model component is served by name.
    """
    records: list[PipelineComponentRecord] = []
    for component in index.components:
        entry = (component.name, component.library, component.class_name)
        if component.kind is ClassKind.CUSTOM:
            raise usage_error(
                f"{index.path}: component {component.name!r} is {component.library}.{component.class_name}, a custom "
                "class from the repository's own code; load_pipeline runs no remote code (and diffusers checks the "
                "library even for a component passed in): load this pipeline with diffusers and serve its standard "
                "components with load_component",
                component=component.name,
            )
        if component.name in caller:
            records.append(PipelineComponentRecord(*entry, ComponentHandling.CALLER))
        elif component.kind is ClassKind.NONE:
            records.append(PipelineComponentRecord(*entry, ComponentHandling.ABSENT))
        elif component.kind is ClassKind.UNWEIGHTED:
            records.append(PipelineComponentRecord(*entry, ComponentHandling.UNWEIGHTED))
        elif component.kind is ClassKind.NOT_TORCH:
            not_torch = f"{component.class_name} is not a torch module; diffusers loads it as always"
            records.append(PipelineComponentRecord(*entry, ComponentHandling.CANONICAL, not_torch))
        else:
            unservable = None if named else _unservable_reason(component, root, variant, use_safetensors)
            why = unservable or dtype_refusal
            handling = ComponentHandling.SERVED if why is None else ComponentHandling.CANONICAL
            records.append(PipelineComponentRecord(*entry, handling, why))
    return records


def _dtype_refusal(torch_dtype: torch.dtype | str) -> str | None:
    """Why load_component cannot serve this dtype (None when it can): its own dtype check says."""
    try:
        check_dtype(torch_dtype)
    except HostWeightUsageError as exc:
        return exc.failure.message
    return None


def _check_required(records: list[PipelineComponentRecord], mode: RuntimeMode, root: Path) -> None:
    canonical = [record for record in records if record.handling is ComponentHandling.CANONICAL]
    if mode is RuntimeMode.REQUIRED and canonical:
        reasons = "; ".join(f"{record.name}: {record.reason}" for record in canonical)
        raise usage_error(
            f"REQUIRED mode serves every weighted component from an artifact, but {root} has components the "
            f"runtime cannot serve ({reasons}); pass them yourself (name=model) or use PREFERRED mode",
            code=FailureCode.UNSUPPORTED,
            components=[record.name for record in canonical],
        )


def _assemble(
    index: ModelIndex,
    root: Path,
    served: Mapping[str, Any],
    caller: Mapping[str, Any],
    torch_dtype: torch.dtype | str,
    **kwargs: Any,
) -> Any:
    """The pipeline of the served and caller components, built directly when the rest is plain, else by
    diffusers' own from_pretrained; either's errors leave typed."""
    from diffusers import DiffusionPipeline

    assemble: Any = DiffusionPipeline.from_pretrained
    try:
        direct = assemble_directly(index, root, served, caller, variant=kwargs.get("variant"))
        if direct is not None:
            return direct
        return assemble(str(root), dtype=torch_dtype, **kwargs, **served, **caller)
    except HostWeightError:
        raise
    except _ASSEMBLY_ERRORS as exc:
        raise usage_error(
            f"diffusers could not assemble {index.pipeline_class_name} from {root} ({type(exc).__name__}: {exc}); "
            "fix or re-download the pipeline folder",
            code=FailureCode.CANONICAL_SOURCE_FAILED,
        ) from exc


def load_pipeline(
    model_or_path: str | os.PathLike[str],
    *,
    torch_dtype: torch.dtype | str = torch.bfloat16,
    dtype: torch.dtype | str | None = None,
    variant: str | None = None,
    revision: str | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    use_safetensors: bool | None = None,
    runtime: HostWeightRuntime | None = None,
    publish_in_background: bool | None = None,
    stream_on_miss: bool | None = None,
    **kwargs: Any,
) -> LoadedPipeline:
    """Load a diffusers pipeline with every weighted component served from the node's artifacts.

    `model_or_path` is a pipeline folder or a repo id in the local Hugging Face cache. Keyword
    arguments named like the pipeline's components (`transformer=my_model`, `text_encoder=None`)
    are used as given, as in diffusers; pipeline options (`force_zeros_for_empty_prompt=...`) go
    to diffusers; the rest are `load_component`'s arguments, given to every served component.
    A component that cannot be served (pickle-only weights, a class load_component does not serve,
    a dtype it does not serve) is loaded by diffusers and its record says why; in REQUIRED mode that
    is a HostWeightUsageError instead. A custom class from remote code is a HostWeightUsageError.
    `dtype` is diffusers' newer spelling of `torch_dtype`; when given, it wins.

    A first worker (PREFERRED, the default) returns the pipeline at canonical speed: each component
    missing here is loaded canonically, and the artifacts are built behind it, one checkpoint at a
    time, only once the pipeline is assembled (see `load_component` for the rule a worker arriving
    meanwhile follows, and for `publish_in_background=False` and `stream_on_miss`).
    """
    started = time.monotonic()
    torch_dtype = dtype if dtype is not None else torch_dtype
    runtime = runtime if runtime is not None else HostWeightRuntime.from_env()
    root, named = _pipeline_root_or_named(model_or_path, revision, cache_dir, runtime)
    index = read_model_index(root)
    caller, component_arguments = split_pipeline_arguments(
        index, kwargs, torch_dtype=torch_dtype, variant=variant, use_safetensors=use_safetensors
    )
    records = _plan(
        index, root, caller, variant=variant, use_safetensors=use_safetensors, dtype_refusal=None, named=named
    )
    _check_required(records, runtime.config.mode, root)
    warn_canonical_records(root, [(r.name, r.reason) for r in records if r.handling is ComponentHandling.CANONICAL])
    served: dict[str, LoadedComponent] = {}
    with deferred_publications(), deferred_verifications(), ExitStack() as undo:
        for record in records:
            if record.handling is not ComponentHandling.SERVED:
                continue
            loaded = load_component(
                model_or_path,
                subfolder=record.name,
                torch_dtype=torch_dtype,
                variant=variant,
                revision=revision,
                cache_dir=cache_dir,
                use_safetensors=use_safetensors,
                runtime=runtime,
                publish_in_background=publish_in_background,
                stream_on_miss=stream_on_miss,
                **component_arguments,
            )
            undo.callback(loaded.close)
            served[record.name] = loaded
        models = {name: loaded.model for name, loaded in served.items()}
        options = {"variant": variant, "use_safetensors": use_safetensors}
        pipeline = _assemble(index, root, models, caller, torch_dtype, **options)
        undo.pop_all()
    return LoadedPipeline(pipeline, served, tuple(records), root=root, elapsed_s=time.monotonic() - started)


@dataclass(frozen=True, slots=True)
class PipelinePrewarmResult:
    """What `prewarm_pipeline` built (or found) per served component, and every component's record."""

    root: Path
    built: Mapping[str, PrewarmResult]
    records: tuple[PipelineComponentRecord, ...]

    @property
    def total_bytes(self) -> int:
        return sum(result.total_bytes for result in self.built.values())

    def to_dict(self) -> dict[str, Any]:
        return {
            "root": str(self.root),
            "total_bytes": self.total_bytes,
            "components": [
                {
                    **record.to_dict(),
                    "identity_key": None if record.name not in self.built else self.built[record.name].identity_key,
                    "outcome": None
                    if record.name not in self.built
                    else self.built[record.name].resolution.outcome.value,
                    "total_bytes": None if record.name not in self.built else self.built[record.name].total_bytes,
                }
                for record in self.records
            ],
        }


PipelineProgress = Callable[[str, int, int], None]
"""Called with (component name, bytes done, bytes total) while a component's checkpoint streams."""


def prewarm_pipeline(
    model_or_path: str | os.PathLike[str],
    *,
    torch_dtype: torch.dtype | str = torch.bfloat16,
    variant: str | None = None,
    revision: str | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    runtime: HostWeightRuntime | None = None,
    progress: PipelineProgress | None = None,
) -> PipelinePrewarmResult:
    """Build (or find) the artifact of every weighted component straight from its checkpoint.

    Each served component streams through `prewarm_component` (REQUIRED, bounded memory) in the
    representation `torch_dtype` names, so afterwards even a first worker's
    `load_pipeline(..., torch_dtype=...)` is all hits. Components the runtime cannot serve are
    skipped and their records say why; a failure raises `HostWeightError`. A pipeline with
    nothing to build, or a `variant` some weighted component lacks, raises `HostWeightUsageError`
    before anything is built (`_prewarm_plan.py`).
    """
    root = pipeline_root(model_or_path, revision=revision, cache_dir=cache_dir)
    index = read_model_index(root)
    refusal = _dtype_refusal(torch_dtype)
    if refusal is not None:
        raise usage_error(refusal, argument="torch_dtype")
    records = _plan(index, root, {}, variant=variant, use_safetensors=None, dtype_refusal=None)
    weighted = {component.name for component in index.components if component.kind in _SERVED_KINDS}
    unbuilt = [(r.name, r.reason) for r in records if r.name in weighted and r.handling is not ComponentHandling.SERVED]
    served = sum(record.handling is ComponentHandling.SERVED for record in records)
    check_something_to_prewarm(root, variant, unbuilt=unbuilt, served=served)
    built: dict[str, PrewarmResult] = {}
    for record in records:
        if record.handling is not ComponentHandling.SERVED:
            continue
        step = None if progress is None else _component_progress(progress, record.name)
        built[record.name] = prewarm_component(
            model_or_path,
            subfolder=record.name,
            torch_dtype=torch_dtype,
            variant=variant,
            revision=revision,
            cache_dir=cache_dir,
            runtime=runtime,
            progress=step,
        )
    return PipelinePrewarmResult(root, MappingProxyType(built), tuple(records))


def _component_progress(progress: PipelineProgress, name: str) -> Callable[[int, int], None]:
    def advance(done: int, total: int) -> None:
        progress(name, done, total)

    return advance

"""Read a pipeline folder's `model_index.json` the way diffusers does, bounded and typed.

Each entry names a component's library and class; the pipeline class names the components
its constructor takes. This module turns that into one `IndexedComponent` per expected
component, with the kind of class it is (a weighted torch model, a tokenizer or scheduler,
something else), so `load_pipeline` can decide per component without guessing.
"""

from __future__ import annotations

import enum
import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..canonical_json import decode_json
from ..failures import usage_error

__all__ = ["ClassKind", "IndexedComponent", "ModelIndex", "read_model_index"]

MODEL_INDEX = "model_index.json"
_INDEX_LIMIT_BYTES = 1 * 2**20
_INDEX_DEPTH = 8
_KNOWN_LIBRARIES = ("diffusers", "transformers")


class ClassKind(str, enum.Enum):
    """What a component's class is, as far as serving its weights goes."""

    DIFFUSERS_MODEL = "diffusers_model"
    TRANSFORMERS_MODEL = "transformers_model"
    OTHER_TORCH_MODULE = "other_torch_module"
    UNWEIGHTED = "unweighted"  # tokenizers, schedulers, processors, configs: diffusers loads them
    NOT_TORCH = "not_torch"
    CUSTOM = "custom"  # a class from the repository's own code (remote code)
    NONE = "none"  # the entry is [null, null]: the component is absent


@dataclass(frozen=True, slots=True)
class IndexedComponent:
    """One component of model_index.json: its name, library and class name, and what kind of class that is."""

    name: str
    library: str | None
    class_name: str | None
    kind: ClassKind
    component_class: Any = None


@dataclass(frozen=True, slots=True)
class ModelIndex:
    """The pipeline class model_index.json names and the components its constructor takes."""

    path: Path
    pipeline_class_name: str
    pipeline_class: Any
    components: tuple[IndexedComponent, ...]
    optional_arguments: tuple[str, ...]
    expected: tuple[str, ...]  # every component the pipeline's constructor takes, listed or not
    settings: tuple[str, ...]  # the optional arguments model_index.json sets (diffusers passes them on)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(component.name for component in self.components)


def _read(path: Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as stream:  # a hub snapshot's file is a link to its blob: follow it
            data = stream.read(_INDEX_LIMIT_BYTES + 1)
        value = decode_json(data, max_bytes=_INDEX_LIMIT_BYTES, max_depth=_INDEX_DEPTH)
    except (OSError, ValueError) as exc:
        raise usage_error(
            f"cannot read {path}: {exc}; a pipeline folder's model_index.json must be one JSON object "
            "(re-download or re-save the pipeline)",
            file=str(path),
        ) from exc
    if not isinstance(value, dict):
        raise usage_error(f"{path} holds a JSON {type(value).__name__}, not an object; it is not a model index")
    return value


def _pipeline_class(path: Path, index: dict[str, Any]) -> Any:
    import diffusers

    name = index.get("_class_name")
    if not isinstance(name, str) or not name.isidentifier():
        raise usage_error(f"{path} has no valid _class_name (got {name!r}); it is not a diffusers model index")
    pipeline_class = getattr(diffusers, name, None)
    if not (isinstance(pipeline_class, type) and issubclass(pipeline_class, diffusers.DiffusionPipeline)):
        raise usage_error(
            f"{path} names the pipeline class {name!r}, which diffusers does not provide (a custom pipeline from "
            "remote code?); load_pipeline runs no remote code: assemble that pipeline yourself with load_component"
        )
    return pipeline_class


def _class_in(library: str, class_name: str) -> Any:
    """The class as diffusers finds it: in diffusers or transformers, or in a diffusers pipeline module."""
    if library in _KNOWN_LIBRARIES:
        module = importlib.import_module(library)
    elif library.isidentifier():
        try:
            module = importlib.import_module(f"diffusers.pipelines.{library}")
        except ImportError:
            return None
    else:
        return None
    found = getattr(module, class_name, None)
    return found if isinstance(found, type) else None


def _kind_of(component_class: Any) -> ClassKind:
    import torch
    import transformers
    from diffusers.configuration_utils import ConfigMixin
    from diffusers.models.modeling_utils import ModelMixin
    from diffusers.schedulers.scheduling_utils import SchedulerMixin

    if issubclass(component_class, torch.nn.Module):
        if issubclass(component_class, ModelMixin):
            return ClassKind.DIFFUSERS_MODEL
        if issubclass(component_class, transformers.PreTrainedModel):
            return ClassKind.TRANSFORMERS_MODEL
        return ClassKind.OTHER_TORCH_MODULE
    unweighted = (
        SchedulerMixin,
        transformers.PreTrainedTokenizerBase,
        transformers.ImageProcessingMixin,
        transformers.FeatureExtractionMixin,
        transformers.ProcessorMixin,
        ConfigMixin,
    )
    return ClassKind.UNWEIGHTED if issubclass(component_class, unweighted) else ClassKind.NOT_TORCH


def _component(path: Path, name: str, entry: object) -> IndexedComponent:
    if not (isinstance(entry, list) and len(entry) == 2):
        raise usage_error(f"{path}: component {name!r} is {entry!r}, not a [library, class] pair", component=name)
    library, class_name = entry
    if library is None and class_name is None:
        return IndexedComponent(name, None, None, ClassKind.NONE)
    if not (isinstance(library, str) and isinstance(class_name, str) and class_name.isidentifier()):
        raise usage_error(
            f"{path}: component {name!r} is {entry!r}; expected [library, ClassName] or [null, null]", component=name
        )
    component_class = _class_in(library, class_name)
    if component_class is None:
        if library in _KNOWN_LIBRARIES:
            raise usage_error(
                f"{path}: component {name!r} names {library}.{class_name}, which the installed {library} does not "
                f"provide; upgrade {library} or fix model_index.json",
                component=name,
            )
        return IndexedComponent(name, library, class_name, ClassKind.CUSTOM)
    return IndexedComponent(name, library, class_name, _kind_of(component_class), component_class)


def read_model_index(root: Path) -> ModelIndex:
    """The model index of the pipeline folder `root`; HostWeightUsageError when it is missing or malformed."""
    path = root / MODEL_INDEX
    if not path.is_file():
        raise usage_error(
            f"{root} has no {MODEL_INDEX}, so it is not a diffusers pipeline folder; load one model with "
            "load_component instead",
            folder=str(root),
        )
    index = _read(path)
    pipeline_class = _pipeline_class(path, index)
    expected, optional = pipeline_class._get_signature_keys(pipeline_class)
    components = tuple(_component(path, name, index[name]) for name in sorted(expected) if name in index)
    settings = tuple(sorted(name for name in optional if name in index))
    return ModelIndex(
        path,
        pipeline_class.__name__,
        pipeline_class,
        components,
        tuple(sorted(optional)),
        expected=tuple(sorted(expected)),
        settings=settings,
    )

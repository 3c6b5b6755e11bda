"""`load_pipeline`'s keyword arguments sorted and checked before anything loads.

diffusers' `DiffusionPipeline.from_pretrained` takes components by name (`None` skips an
optional one; a name the pipeline does not have is ignored with a warning) and pipeline
options; the rest are `load_component`'s arguments. Those are checked here in full, once,
so a refused value (`torch_dtype="auto"`, `device_map="cuda"`) fails the call even when no
component would have been served, instead of silently loading everything canonically.
"""

from __future__ import annotations

import difflib
import logging
from collections.abc import Mapping
from typing import Any

from ..failures import usage_error
from ._load_options import LOAD_ARGUMENTS, check_load_arguments
from ._model_index import ModelIndex

__all__ = ["split_pipeline_arguments"]

_LOG = logging.getLogger("host_weight_runtime.diffusion")
# load_component's arguments that check_load_arguments takes by name (the rest it takes as `extra`).
_NAMED = ("low_cpu_mem_usage", "local_files_only", "device_map", "output_loading_info", "disable_mmap", "parallel")
# load_component's arguments that check_load_arguments does not take (checked where they are used).
_UNCHECKED = frozenset({"token", "process_group", "representation"})


def _pipeline_names(index: ModelIndex) -> set[str]:
    expected = index.pipeline_class._get_signature_keys(index.pipeline_class)[0]
    return set(expected) | set(index.optional_arguments) | set(index.names)


def split_pipeline_arguments(
    index: ModelIndex,
    arguments: Mapping[str, Any],
    *,
    torch_dtype: object,
    variant: object,
    use_safetensors: object,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(components and pipeline options for diffusers, load_component's arguments), every one checked.

    A name that is neither the pipeline's nor load_component's is a pipeline argument the
    pipeline does not take: `None` (skip a component this pipeline does not have) is ignored
    with a WARNING, as diffusers ignores it; any other value is a HostWeightUsageError naming it.
    """
    pipeline_names = _pipeline_names(index)
    caller: dict[str, Any] = {}
    component: dict[str, Any] = {}
    for name, value in arguments.items():
        if name in pipeline_names:
            caller[name] = value
        elif name == "subfolder":
            raise usage_error(
                "load_pipeline loads every component of the pipeline; to load one, call "
                "load_component(model_or_path, subfolder=...)",
                argument=name,
            )
        elif name in LOAD_ARGUMENTS:
            component[name] = value
        elif value is None and not difflib.get_close_matches(name, LOAD_ARGUMENTS, n=1):
            _LOG.warning(
                "load_pipeline: %s=None names no component of %s (its components: %s); ignored, as diffusers "
                "ignores it",
                name,
                index.pipeline_class_name,
                ", ".join(index.names),
            )
        else:
            close = difflib.get_close_matches(name, [*LOAD_ARGUMENTS, *sorted(pipeline_names)], n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise usage_error(
                f"load_pipeline: {name!r} is a pipeline argument {index.pipeline_class_name} does not take{hint}: "
                f"its components are {', '.join(index.names)} (pass a model, or None to skip an optional one), "
                "and the other keyword arguments are load_component's (variant, torch_dtype, device_map='cpu', ...)",
                argument=name,
            )
    named = {key: component.get(key) for key in _NAMED}
    if named["output_loading_info"] is None:
        named["output_loading_info"] = False
    if named["disable_mmap"] is None:
        named["disable_mmap"] = False
    extra = {key: value for key, value in component.items() if key not in _NAMED and key not in _UNCHECKED}
    check_load_arguments(
        torch_dtype=torch_dtype,
        dtype=None,
        variant=variant,
        use_safetensors=use_safetensors,
        extra=extra,
        **named,
    )
    return caller, component

"""A pipeline assembled as diffusers' `from_pretrained` assembles it, when what is left to load is plain.

Once every weighted component is served, `from_pretrained` only loads the tokenizers and the
scheduler, calls the pipeline's constructor and records where it came from; on its way it
checks each passed model's class against every class it can import, which imports modules a
warm worker otherwise never needs (a few milliseconds of a warm load). Here the same calls are
made directly, for the common shape only: tokenizers and schedulers of diffusers or transformers,
no pipeline option from model_index.json or the caller, no variant. Anything else returns None and
diffusers assembles the pipeline itself.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ._model_index import ClassKind, ModelIndex

__all__ = ["assemble_directly"]

_PLAIN_LIBRARIES = ("diffusers", "transformers")


def _plain_class(component_class: Any) -> bool:
    """A tokenizer or a scheduler: loaded by its own `from_pretrained` with no argument, as diffusers does."""
    import transformers
    from diffusers.schedulers.scheduling_utils import SchedulerMixin

    return isinstance(component_class, type) and issubclass(
        component_class, (SchedulerMixin, transformers.PreTrainedTokenizerBase)
    )


def _plain_loads(index: ModelIndex, given: Mapping[str, Any]) -> dict[str, Any] | None:
    """The classes to load per component name, or None when a component needs diffusers' own loading."""
    listed = {component.name: component for component in index.components}
    loads: dict[str, Any] = {}
    for name in index.expected:
        if name in given:
            continue
        component = listed.get(name)
        if component is None or component.kind is ClassKind.NONE:
            if name not in index.pipeline_class._optional_components:
                return None  # diffusers says which component is missing
            continue
        plain = component.kind is ClassKind.UNWEIGHTED and component.library in _PLAIN_LIBRARIES
        if not (plain and _plain_class(component.component_class)):
            return None
        loads[name] = component.component_class
    return loads


def assemble_directly(
    index: ModelIndex, root: Path, served: Mapping[str, Any], caller: Mapping[str, Any], *, variant: str | None
) -> Any:
    """The pipeline from the `served` models plus the tokenizers and schedulers of `root`; None if not plain.

    `caller` may only leave components out (name=None): a model the caller passes is checked by
    diffusers' own assembly, and so is any pipeline option. Each other component is what diffusers
    would load: a listed `[null, null]` or unlisted optional one is None, a tokenizer or scheduler is
    its class's `from_pretrained` of its subfolder (or of `root` when the subfolder is absent). The
    pipeline records `root` as `_name_or_path`, as diffusers does.
    """
    given = {**served, **caller}
    passed = any(value is not None for value in caller.values())
    if variant is not None or index.settings or passed or not set(given) <= set(index.expected):
        return None
    loads = _plain_loads(index, given)
    if loads is None:
        return None
    components: dict[str, Any] = {}
    for name in index.expected:
        if name in given:
            components[name] = given[name]
        elif name in loads:
            folder = os.path.join(root, name)
            components[name] = loads[name].from_pretrained(folder if os.path.isdir(folder) else str(root))
        else:
            components[name] = None
    pipeline = index.pipeline_class(**components)
    pipeline.register_to_config(_name_or_path=str(root))
    return pipeline

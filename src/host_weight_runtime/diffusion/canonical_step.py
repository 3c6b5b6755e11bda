"""The canonical step: the model exactly as its library loads it, in the representation the load serves."""

from __future__ import annotations

from typing import Any

import torch

from .._faults import fault_point
from ._load_options import LoadOptions
from .component_source import ComponentLocation, checkpoint_source, component_model_class
from .model_family import ImportClock, ModelFamily
from .representation import quantize_model_fp8
from .skeleton import ComponentSkeleton
from .source_identity import PreparedWeightSource

__all__ = ["load_canonical_at", "load_canonical_for", "load_canonical_of"]


def load_canonical_for(skeleton: ComponentSkeleton, *, fp8: bool) -> torch.nn.Module:
    """The canonical model of a prepared skeleton's files and class (the skeleton itself is left alone)."""
    model = load_canonical_of(
        skeleton.family, skeleton.model_class, skeleton.source, skeleton.location, skeleton.options
    )
    if fp8:
        quantize_model_fp8(model)
    return model


def load_canonical_of(
    family: ModelFamily,
    model_class: type[Any],
    source: PreparedWeightSource,
    location: ComponentLocation,
    options: LoadOptions,
) -> torch.nn.Module:
    """The canonical model of a resolved class and checkpoint: what every canonical load of a component runs."""
    fault_point("canonical_step.before_load")
    return family.load_canonical(model_class, source, location.name_or_path, options)


def load_canonical_at(
    location: ComponentLocation, options: LoadOptions, family: ModelFamily | None, clock: ImportClock, *, fp8: bool
) -> torch.nn.Module:
    """The canonical model with no skeleton built: for a load that never asks the runtime.

    `family=None` takes the family the folder's config.json names (diffusers or transformers).
    """
    source = checkpoint_source(location, options)
    chosen, model_class = component_model_class(source, family, clock)
    model = chosen.load_canonical(model_class, source, location.name_or_path, options)
    if fp8:
        quantize_model_fp8(model)
    return model

"""The canonical step: the model exactly as its library loads it, in the representation the load serves."""

from __future__ import annotations

import torch

from .._faults import fault_point
from ._load_options import LoadOptions
from .component_source import ComponentLocation, checkpoint_source, component_model_class
from .model_family import ImportClock, ModelFamily
from .representation import quantize_model_fp8
from .skeleton import ComponentSkeleton

__all__ = ["load_canonical_at", "load_canonical_for"]


def load_canonical_for(skeleton: ComponentSkeleton, *, fp8: bool) -> torch.nn.Module:
    """The canonical model of a prepared skeleton's files and class (the skeleton itself is left alone)."""
    fault_point("canonical_step.before_load")
    model = skeleton.family.load_canonical(
        skeleton.model_class, skeleton.source, skeleton.location.name_or_path, skeleton.options
    )
    if fp8:
        quantize_model_fp8(model)
    return model


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

"""The representation a load serves: BF16 (the default) or FP8 Linear weights with one FP32 scale per tensor."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

import torch

from ..failures import HostWeightError, usage_error
from .contracts import FINAL_LAYOUT_BF16_POLICY, FinalLayoutTensorPolicy
from .dtype_policies import ModelFamilyName
from .fp8 import FINAL_LAYOUT_FP8_POLICY, fp8_linear_names, quantize_to_fp8
from .model_contracts import contract_for_model
from .skeleton import ComponentSkeleton

__all__ = [
    "REPRESENTATIONS",
    "check_fp8_dtype",
    "check_representation",
    "fp8_skeleton",
    "quantize_model_fp8",
    "tensor_policy",
]

REPRESENTATIONS = ("bf16", "fp8")
"""What `load_component(representation=...)` accepts; "bf16" is the default."""


def check_representation(representation: object) -> bool:
    """True for "fp8", False for "bf16"; any other value is a HostWeightUsageError naming the choices.

    FP8 streams from the checkpoint wherever BF16 does (one component, or a TP bundle), so no
    load argument is refused with it.
    """
    if representation not in REPRESENTATIONS:
        raise usage_error(
            f"representation must be one of {list(REPRESENTATIONS)}, got {representation!r}", argument="representation"
        )
    return representation == "fp8"


def check_fp8_dtype(dtype: torch.dtype) -> None:
    """FP8 keeps its unquantized tensors in BF16: another `torch_dtype` with it is a HostWeightUsageError."""
    if dtype != torch.bfloat16:
        raise usage_error(
            f"representation='fp8' keeps the unquantized tensors in BF16; drop torch_dtype={dtype} "
            "(or load the FP16/FP32 representation without representation='fp8')",
            argument="representation",
        )


def fp8_skeleton(skeleton: ComponentSkeleton) -> ComponentSkeleton:
    """The skeleton of the FP8 representation: its Linears swapped for `FP8Linear` (on `meta`), FP8 policy.

    Only diffusers models have an FP8 contract; anything else is a HostWeightUsageError, before
    anything is read or written. The returned skeleton identifies (and streams) as FP8.
    """
    if skeleton.family.family_name is not ModelFamilyName.DIFFUSERS:
        raise usage_error(
            f"representation='fp8' serves diffusers models; {skeleton.model_class.__name__} is a "
            f"{skeleton.family.family_name.value} model: load it without representation='fp8'",
            argument="representation",
        )
    quantize_model_fp8(skeleton.model)
    return replace(skeleton, policy=FINAL_LAYOUT_FP8_POLICY)


def tensor_policy(fp8: bool) -> FinalLayoutTensorPolicy:
    """The tensor policy of the representation: it enters the identity and shapes the artifact."""
    return FINAL_LAYOUT_FP8_POLICY if fp8 else FINAL_LAYOUT_BF16_POLICY


def quantize_model_fp8(model: torch.nn.Module, scales: Mapping[str, torch.Tensor] | None = None) -> None:
    """Swap the model's quantized Linears for `FP8Linear` (on `meta`: shapes only), as the FP8 contract says."""
    try:
        keep = contract_for_model(model).keep_in_fp32_modules
    except HostWeightError:
        keep = tuple(getattr(type(model), "_keep_in_fp32_modules", None) or ())
    quantize_to_fp8(model, fp8_linear_names(model, keep), scales)

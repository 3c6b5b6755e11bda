"""The representation a load serves: BF16 (the default) or FP8 Linear weights with one FP32 scale per tensor."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ..failures import HostWeightError, usage_error
from .contracts import FINAL_LAYOUT_BF16_POLICY, FinalLayoutTensorPolicy
from .fp8 import FINAL_LAYOUT_FP8_POLICY, fp8_linear_names, quantize_to_fp8
from .models import contract_for_model

__all__ = ["REPRESENTATIONS", "check_representation", "quantize_model_fp8", "tensor_policy"]

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

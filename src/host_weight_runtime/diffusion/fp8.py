"""Online FP8 per-tensor final layouts: float8_e4m3fn Linear weights with one FP32 scale each.

A second representation beside BF16. Only the weights of `nn.Linear` modules are quantized;
everything the BF16 contract decides (norms, embeddings, biases, `_keep_in_fp32_modules`,
and the modules diffusers lists in `_skip_layerwise_casting_patterns`) stays as it says.
A quantized Linear becomes an `FP8Linear`: its `weight` parameter holds the e4m3 values and
its `weight_scale` buffer the FP32 scale, both bound to the lease (mapped and shared), and its
forward dequantizes on the fly (`weight.float() * weight_scale`, cast to the input dtype).

The scale is per **full** tensor, also at TP > 1: scale = amax(|W|) / 448 over the whole
canonical BF16 weight, q = (W.float() / scale).to(float8_e4m3fn). Quantization is then
elementwise, so rank r's shard is exactly the matching slice of the TP=1 quantized weight,
and every rank dequantizes to the same values a TP=1 server would (one scale per tensor,
replicated on every rank).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch

from ..canonical_json import CanonicalJson, JsonValue
from ..identity import ProducerIdentity, WeightRepresentation
from .contracts import (
    FINAL_LAYOUT_BF16_POLICY,
    FinalLayoutArtifactSpec,
    FinalLayoutRequest,
    implementation_abi_fingerprint,
    keeps_fp32,
)
from .producers.finalized import FinalLayoutBF16Producer
from .restorer import FinalLayoutTensorRestorer

__all__ = [
    "FINAL_LAYOUT_FP8_POLICY",
    "FINAL_LAYOUT_FP8_REPRESENTATION",
    "FINAL_LAYOUT_FP8_SPEC",
    "FP8_E4M3_MAX",
    "FP8Linear",
    "FinalLayoutFP8Policy",
    "FinalLayoutFP8Producer",
    "FinalLayoutFP8Restorer",
    "fp8_linear_names",
    "fp8_scales",
    "quantize_to_fp8",
]

FINAL_LAYOUT_FP8_REPRESENTATION = "final-layout-fp8-e4m3-per-tensor"
FINAL_LAYOUT_FP8_PRODUCER_ID = "host_weight_runtime.diffusion.final_layout_fp8"
FINAL_LAYOUT_FP8_VERSION = "1"
FINAL_LAYOUT_FP8_MANIFEST_SCHEMA = "final-layout-fp8-manifest-v1"
FINAL_LAYOUT_FP8_RESTORER_SCHEMA = "final-layout-fp8-restorer-v1"
FP8_DTYPE = torch.float8_e4m3fn
FP8_E4M3_MAX = 448.0
"""The largest finite float8_e4m3fn value."""
_SCALE = "weight_scale"


class FP8Linear(torch.nn.Linear):
    """A Linear whose weight is float8_e4m3fn with one FP32 scale; forward dequantizes it on the fly.

    An `nn.Linear` subclass, so `parallelize_module`'s Colwise/RowwiseParallel accept it.
    `dequantized_weight()` is the documented hook for code that wants the real-valued weight.
    """

    weight_scale: torch.Tensor

    def __init__(self, in_features: int, out_features: int, *, bias: torch.Tensor | None, device: Any) -> None:
        torch.nn.Module.__init__(self)
        self.in_features = in_features
        self.out_features = out_features
        self.weight = torch.nn.Parameter(
            torch.empty((out_features, in_features), dtype=FP8_DTYPE, device=device), requires_grad=False
        )
        self.register_parameter(
            "bias", None if bias is None else torch.nn.Parameter(bias, requires_grad=bias.requires_grad)
        )
        self.register_buffer(_SCALE, torch.ones((), dtype=torch.float32, device=device), persistent=True)

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """`weight.float() * weight_scale` in `dtype` (this rank's local shard under tensor parallelism)."""
        return (_local(self.weight).to(torch.float32) * _local(self.weight_scale)).to(dtype)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        weight: Any = self.dequantized_weight(input.dtype)
        if hasattr(self.weight, "to_local"):  # a DTensor shard: keep its placement for the TP hooks
            from torch.distributed.tensor import DTensor

            placed: Any = self.weight
            weight = DTensor.from_local(weight, placed.device_mesh, placed.placements, run_check=False)
        return torch.nn.functional.linear(input, weight, self.bias)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, weight=float8_e4m3fn per-tensor"


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (parallelize_module may also wrap the scale buffer); a plain tensor as is."""
    to_local = getattr(tensor, "to_local", None)
    return tensor if to_local is None else cast(torch.Tensor, to_local())


def fp8_linear_names(model: torch.nn.Module, keep_in_fp32_modules: Sequence[str]) -> tuple[str, ...]:
    """The module names of the Linears this representation quantizes, in module order.

    Every `nn.Linear` except those the model keeps in FP32 and those matching the class's
    `_skip_layerwise_casting_patterns` (diffusers' list of precision-sensitive modules).
    """
    patterns = tuple(getattr(type(model), "_skip_layerwise_casting_patterns", None) or ())
    found: list[str] = []
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear) or not name:
            continue
        if keeps_fp32(f"{name}.weight", keep_in_fp32_modules) or any(re.search(p, name) for p in patterns):
            continue
        found.append(name)
    return tuple(found)


def fp8_scale(weight: torch.Tensor) -> torch.Tensor:
    """The per-tensor scale amax(|W|) / 448 in FP32 (1 for an all-zero weight, which then stays zero)."""
    amax = weight.detach().abs().amax().to(torch.float32)
    return torch.where(amax > 0, amax / FP8_E4M3_MAX, torch.ones((), dtype=torch.float32))


def fp8_scales(model: torch.nn.Module, names: Sequence[str]) -> dict[str, torch.Tensor]:
    """Module name -> scale of its full weight; taken before a TP rank is cut so every rank shares it."""
    return {name: fp8_scale(_linear(model, name).weight) for name in names}


def _linear(model: torch.nn.Module, name: str) -> torch.nn.Linear:
    module = model.get_submodule(name)
    if not isinstance(module, torch.nn.Linear):
        raise ValueError(f"{name} is a {type(module).__name__}, not an nn.Linear")
    return module


def quantize_to_fp8(
    model: torch.nn.Module, names: Sequence[str], scales: Mapping[str, torch.Tensor] | None = None
) -> None:
    """Replace each named Linear by an `FP8Linear`, in place; on `meta` only the shapes and dtypes change.

    `scales` (from `fp8_scales` on the full model) is required when the weights are already a
    TP rank's shard, so the rank quantizes with the full tensor's scale.
    """
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        linear = _linear(model, name)
        weight = linear.weight.detach()
        bias: torch.Tensor | None = linear.bias
        replacement = FP8Linear(int(weight.shape[1]), int(weight.shape[0]), bias=bias, device=weight.device)
        replacement.train(linear.training)
        for attribute, value in vars(linear).items():  # TP packing declarations (_tp_packed_*_blocks) and the like
            if attribute.startswith("_tp_"):
                setattr(replacement, attribute, value)
        if weight.device.type != "meta":
            scale = scales[name] if scales is not None else fp8_scale(weight)
            quantized = (weight.to(torch.float32) / scale).to(FP8_DTYPE)
            replacement.weight = torch.nn.Parameter(quantized, requires_grad=False)
            replacement.weight_scale = scale.to(torch.float32).reshape(()).clone()
        setattr(parent, child, replacement)


_FP8_IMPLEMENTATION_ABI = CanonicalJson.from_value(
    {
        "representation": FINAL_LAYOUT_FP8_REPRESENTATION,
        "version": FINAL_LAYOUT_FP8_VERSION,
        "tensor_naming": "<dit-module-name>.<state-dict-name>; a quantized Linear adds <module>.weight_scale",
        "quantized": "nn.Linear weights, except _keep_in_fp32_modules and _skip_layerwise_casting_patterns",
        "scale": "per full tensor, FP32: amax(|W_bf16|) / 448 (1 when amax is 0), replicated on every TP rank",
        "quantize": "(W_bf16.float() / scale).to(torch.float8_e4m3fn)",
        "dequantize": "weight.float() * weight_scale",
        "others": "as final-layout-bf16: BF16, FP32 where kept, non-floating unchanged",
        "restore": "zero-copy binding into FP8Linear modules (weight: float8 parameter, weight_scale: buffer)",
        "manifest_schema": FINAL_LAYOUT_FP8_MANIFEST_SCHEMA,
        "restorer_schema": FINAL_LAYOUT_FP8_RESTORER_SCHEMA,
    }
)

FINAL_LAYOUT_FP8_SPEC = FinalLayoutArtifactSpec(
    representation=WeightRepresentation(
        name=FINAL_LAYOUT_FP8_REPRESENTATION,
        dtype=str(FP8_DTYPE),
        metadata=CanonicalJson.from_value(
            {"format": FINAL_LAYOUT_FP8_REPRESENTATION, "scale": "per-tensor-fp32", "granularity": "full-tensor"}
        ),
    ),
    producer=ProducerIdentity(
        producer_id=FINAL_LAYOUT_FP8_PRODUCER_ID,
        version=FINAL_LAYOUT_FP8_VERSION,
        implementation_fingerprint=implementation_abi_fingerprint(_FP8_IMPLEMENTATION_ABI),
        manifest_schema=FINAL_LAYOUT_FP8_MANIFEST_SCHEMA,
        restorer_schema=FINAL_LAYOUT_FP8_RESTORER_SCHEMA,
    ),
    implementation_abi=_FP8_IMPLEMENTATION_ABI,
)


@dataclass(frozen=True, slots=True)
class FinalLayoutFP8Policy:
    """float8_e4m3fn for quantized Linear weights (already swapped to `FP8Linear`), FP32 scales, BF16 rules else."""

    name: str = "fp8-e4m3-per-tensor-with-bf16-rest"

    @property
    def spec(self) -> FinalLayoutArtifactSpec:
        return FINAL_LAYOUT_FP8_SPEC

    def final_dtype(self, local_name: str, dtype: torch.dtype, keep_in_fp32_modules: Sequence[str]) -> torch.dtype:
        if dtype == FP8_DTYPE:
            return FP8_DTYPE
        if local_name.endswith(f".{_SCALE}") and dtype == torch.float32:
            return torch.float32
        return FINAL_LAYOUT_BF16_POLICY.final_dtype(local_name, dtype, keep_in_fp32_modules)

    @property
    def compute_dtype(self) -> torch.dtype:
        return torch.bfloat16

    def check_request(self, request: FinalLayoutRequest) -> None:
        FINAL_LAYOUT_BF16_POLICY.check_request(request)

    def to_dict(self) -> dict[str, JsonValue]:
        return {
            "name": self.name,
            "dtype": str(FP8_DTYPE),
            "scale": "per-tensor-fp32",
            "rest": FINAL_LAYOUT_BF16_POLICY.to_dict(),
        }


FINAL_LAYOUT_FP8_POLICY = FinalLayoutFP8Policy()


class FinalLayoutFP8Producer(FinalLayoutBF16Producer):
    """Post-load FP8 publication: writes a model already passed through `quantize_to_fp8`, as it serves."""


class FinalLayoutFP8Restorer(FinalLayoutTensorRestorer):
    """Binds an FP8 lease into a model whose quantized Linears are `FP8Linear` (a `quantize_to_fp8` skeleton)."""

    @property
    def schema(self) -> str:
        return FINAL_LAYOUT_FP8_RESTORER_SCHEMA

"""The BF16, FP16 and FP32 final layouts of both model families, each a representation with its own key.

A representation is a dtype policy plus the ABI document its key commits to. diffusers'
rule casts every floating tensor to the requested dtype except the modules a class keeps in
FP32 (a dotted name component); transformers' rule keeps the dtype the model was built with
under the requested dtype, except the names its dtype plan (`_keep_in_fp32_modules` for FP16,
`_keep_in_fp32_modules_strict` for FP16 and BF16) matches by regex search, which become FP32.
No representation is ever converted into another: a BF16 artifact never serves an FP16 load (P04).
"""

from __future__ import annotations

import enum
import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .._digest import DigestAlgorithm
from ..canonical_json import CanonicalJson, JsonValue
from ..identity import ProducerIdentity, WeightRepresentation
from .contracts import (
    FINAL_LAYOUT_BF16_POLICY,
    FINAL_LAYOUT_TENSOR_RESTORER_SCHEMA,
    FinalLayoutArtifactSpec,
    FinalLayoutRequest,
    FinalLayoutTensorPolicy,
    diffusers_final_dtype,
    implementation_abi_fingerprint,
    refuse_unsupported_request,
)

__all__ = [
    "SERVED_DTYPES",
    "TRANSFORMERS_RESTORER_SCHEMA",
    "DiffusersDtypePolicy",
    "ModelFamilyName",
    "TransformersDtypePolicy",
    "dtype_label",
    "dtype_policy",
    "matches_dtype_plan",
]

SERVED_DTYPES: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16, torch.float32)
"""The `torch_dtype`s `load_component` serves, each as its own representation."""
_LABELS = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
_VERSION = "1"
_MANIFEST_SCHEMA = "final-layout-dtype-manifest-v1"
TRANSFORMERS_RESTORER_SCHEMA = "final-layout-transformers-restorer-v1"
"""transformers components restore through `from_pretrained(state_dict=<lease tensors>)`, then a zero-copy check."""


class ModelFamilyName(str, enum.Enum):
    """The library whose loading rules a component follows."""

    DIFFUSERS = "diffusers"
    TRANSFORMERS = "transformers"


def dtype_label(dtype: torch.dtype) -> str:
    """ "bf16", "fp16" or "fp32"; ValueError for a dtype no representation serves."""
    label = _LABELS.get(dtype)
    if label is None:
        raise ValueError(f"no final-layout representation serves {dtype}; use one of {list(_LABELS.values())}")
    return label


def _spec(
    family: ModelFamilyName, dtype: torch.dtype, policy_name: str, cast: dict[str, JsonValue]
) -> FinalLayoutArtifactSpec:
    label = dtype_label(dtype)
    representation = f"final-layout-{label}"
    restorer_schema = (
        TRANSFORMERS_RESTORER_SCHEMA if family is ModelFamilyName.TRANSFORMERS else FINAL_LAYOUT_TENSOR_RESTORER_SCHEMA
    )
    abi = CanonicalJson.from_value(
        {
            "representation": representation,
            "family": family.value,
            "version": _VERSION,
            "tensor_naming": "<component-name>.<state-dict-name>",
            "ownership": "parameters and persistent buffers; aliases only as the model's tied weights declare them, "
            "stored once under the name the checkpoint holds; contiguous",
            "cast": cast,
            "file_format": "safetensors; tensors sorted by element size, naturally aligned",
            "manifest_schema": _MANIFEST_SCHEMA,
            "restorer_schema": restorer_schema,
            "payload_digest": DigestAlgorithm.BLAKE3_TREE_V1.value,
        }
    )
    return FinalLayoutArtifactSpec(
        representation=WeightRepresentation(
            name=representation,
            dtype=str(dtype),
            metadata=CanonicalJson.from_value(
                {"format": representation, "family": family.value, "mixed_precision_policy": policy_name}
            ),
        ),
        producer=ProducerIdentity(
            producer_id=f"host_weight_runtime.diffusion.final_layout_{family.value}_{label}",
            version=_VERSION,
            implementation_fingerprint=implementation_abi_fingerprint(abi),
            manifest_schema=_MANIFEST_SCHEMA,
            restorer_schema=restorer_schema,
        ),
        implementation_abi=abi,
        digest_algorithm=DigestAlgorithm.BLAKE3_TREE_V1,
    )


@dataclass(frozen=True, slots=True)
class DiffusersDtypePolicy:
    """diffusers' rule at FP16 or FP32: floating tensors in `dtype` except kept modules (FP32); integers unchanged."""

    dtype: torch.dtype

    def __post_init__(self) -> None:
        if self.dtype not in (torch.float16, torch.float32):
            raise ValueError(
                f"DiffusersDtypePolicy serves float16 or float32 (BF16 is FINAL_LAYOUT_BF16_POLICY), got {self.dtype}"
            )

    @property
    def name(self) -> str:
        return f"{dtype_label(self.dtype)}-with-preserved-fp32"

    @property
    def spec(self) -> FinalLayoutArtifactSpec:
        return _DIFFUSERS_SPECS[self.dtype]

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.dtype

    def final_dtype(self, local_name: str, dtype: torch.dtype, keep_in_fp32_modules: Sequence[str]) -> torch.dtype:
        return diffusers_final_dtype(local_name, dtype, keep_in_fp32_modules, self.dtype)

    def check_request(self, request: FinalLayoutRequest) -> None:
        refuse_unsupported_request(self.name, request)

    def to_dict(self) -> dict[str, JsonValue]:
        return {"name": self.name, "dtype": str(self.dtype), "preserved": str(torch.float32)}


def matches_dtype_plan(local_name: str, patterns: Sequence[str]) -> bool:
    """transformers' rule: a dtype-plan pattern (`*` a wildcard) found anywhere in the state-dict name."""
    return any(re.search(pattern.replace("*", ".*"), local_name) for pattern in patterns)


@dataclass(frozen=True, slots=True)
class TransformersDtypePolicy:
    """transformers' rule: the dtype the model built under `dtype=`, or FP32 where the dtype plan matches.

    `keep_in_fp32_modules` are the model's dtype-plan patterns for this dtype (empty for FP32 and,
    without `_keep_in_fp32_modules_strict`, for BF16), exactly as `from_pretrained` computes them.
    """

    dtype: torch.dtype

    def __post_init__(self) -> None:
        dtype_label(self.dtype)

    @property
    def name(self) -> str:
        return f"transformers-{dtype_label(self.dtype)}-dtype-plan"

    @property
    def spec(self) -> FinalLayoutArtifactSpec:
        return _TRANSFORMERS_SPECS[self.dtype]

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.dtype

    def final_dtype(self, local_name: str, dtype: torch.dtype, keep_in_fp32_modules: Sequence[str]) -> torch.dtype:
        return torch.float32 if matches_dtype_plan(local_name, keep_in_fp32_modules) else dtype

    def final_dtype_from_checkpoint(
        self,
        local_name: str,
        checkpoint_dtype: torch.dtype,
        built_dtype: torch.dtype,
        keep_in_fp32_modules: Sequence[str],
    ) -> torch.dtype:
        return self.final_dtype(local_name, built_dtype, keep_in_fp32_modules)

    def check_request(self, request: FinalLayoutRequest) -> None:
        refuse_unsupported_request(self.name, request)

    def to_dict(self) -> dict[str, JsonValue]:
        return {"name": self.name, "dtype": str(self.dtype), "preserved": str(torch.float32)}


_DIFFUSERS_CAST = "torch.Tensor.to({dtype}) (round to nearest even)"
_DIFFUSERS_SPECS = {
    dtype: _spec(
        ModelFamilyName.DIFFUSERS,
        dtype,
        f"{dtype_label(dtype)}-with-preserved-fp32",
        {
            "floating": _DIFFUSERS_CAST.format(dtype=dtype),
            "floating_kept": "torch.Tensor.to(torch.float32) when a _keep_in_fp32_modules name is a dotted component",
            "non_floating": "unchanged",
        },
    )
    for dtype in (torch.float16, torch.float32)
}
_TRANSFORMERS_SPECS = {
    dtype: _spec(
        ModelFamilyName.TRANSFORMERS,
        dtype,
        f"transformers-{dtype_label(dtype)}-dtype-plan",
        {
            "every_tensor": f"torch.Tensor.to(the dtype the model builds under dtype={dtype})",
            "dtype_plan": "torch.Tensor.to(torch.float32) where a pattern of model._get_dtype_plan(dtype) is found "
            "by re.search in the state-dict name",
        },
    )
    for dtype in SERVED_DTYPES
}
_DIFFUSERS_POLICIES: dict[torch.dtype, FinalLayoutTensorPolicy] = {
    torch.bfloat16: FINAL_LAYOUT_BF16_POLICY,
    torch.float16: DiffusersDtypePolicy(torch.float16),
    torch.float32: DiffusersDtypePolicy(torch.float32),
}
_TRANSFORMERS_POLICIES: dict[torch.dtype, FinalLayoutTensorPolicy] = {
    dtype: TransformersDtypePolicy(dtype) for dtype in SERVED_DTYPES
}


def dtype_policy(family: ModelFamilyName, dtype: torch.dtype) -> FinalLayoutTensorPolicy:
    """The one policy (and so representation) of `family` at `dtype`; BF16 diffusers is the original one."""
    dtype_label(dtype)
    table = _TRANSFORMERS_POLICIES if family is ModelFamilyName.TRANSFORMERS else _DIFFUSERS_POLICIES
    return table[dtype]

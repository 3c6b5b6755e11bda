"""Typed semantic contracts shared by final-layout artifact representations.

Everything here is a value: identities that go into an artifact key, the BF16 policy
that decides final dtypes, and the spec that names producer, restorer and ABI.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

from .._digest import DEFAULT_DIGEST_ALGORITHM, DigestAlgorithm
from .._strict import require_int_field, require_str_field
from ..canonical_json import CanonicalJson, JsonValue
from ..failures import FailureCode, HostWeightError, HostWeightFailure, ResolutionStage
from ..identity import BASE_ADAPTATION, AdaptationIdentity, ProducerIdentity, WeightRepresentation

__all__ = [
    "FINAL_LAYOUT_BF16_MANIFEST_SCHEMA",
    "FINAL_LAYOUT_BF16_POLICY",
    "FINAL_LAYOUT_BF16_PRODUCER_ID",
    "FINAL_LAYOUT_BF16_REPRESENTATION",
    "FINAL_LAYOUT_BF16_SPEC",
    "FINAL_LAYOUT_BF16_VERSION",
    "FINAL_LAYOUT_TENSOR_MODEL_CONTRACT_SCHEMA",
    "FINAL_LAYOUT_TENSOR_RESTORER_SCHEMA",
    "FinalLayoutArtifactSpec",
    "FinalLayoutBF16Policy",
    "FinalLayoutLoaderIdentity",
    "FinalLayoutModelContract",
    "FinalLayoutParallelIdentity",
    "FinalLayoutRequest",
    "FinalLayoutTensorPolicy",
    "ImplementationIdentity",
    "implementation_abi_fingerprint",
    "policy_compute_dtype",
    "streamed_final_dtype",
]

FINAL_LAYOUT_BF16_REPRESENTATION = "final-layout-bf16"
FINAL_LAYOUT_BF16_PRODUCER_ID = "host_weight_runtime.diffusion.final_layout_bf16"
FINAL_LAYOUT_BF16_VERSION = "1"
FINAL_LAYOUT_BF16_MANIFEST_SCHEMA = "final-layout-bf16-manifest-v2"  # v2: blake3-tree-v1 payload digests
FINAL_LAYOUT_TENSOR_RESTORER_SCHEMA = "final-layout-tensor-restorer-v1"
FINAL_LAYOUT_TENSOR_MODEL_CONTRACT_SCHEMA = "final-layout-tensor-model-contract-v1"


def implementation_abi_fingerprint(abi: CanonicalJson) -> str:
    """The fingerprint of an ABI document: the SHA-256 of its canonical bytes."""
    if not isinstance(abi, CanonicalJson):
        raise ValueError(f"an implementation ABI must be CanonicalJson, got {type(abi).__name__}")
    return hashlib.sha256(abi.data).hexdigest()


def _configuration_error(message: str, **details: JsonValue) -> HostWeightError:
    return HostWeightError(
        HostWeightFailure(
            ResolutionStage.CONFIGURATION, FailureCode.UNSUPPORTED, False, message, CanonicalJson.from_value(details)
        )
    )


@dataclass(frozen=True, slots=True)
class ImplementationIdentity:
    """Explicit stable identity for one semantic implementation boundary."""

    implementation_id: str
    version: str
    fingerprint: str

    def __post_init__(self) -> None:
        require_str_field(self.implementation_id, "ImplementationIdentity.implementation_id")
        require_str_field(self.version, "ImplementationIdentity.version")
        require_str_field(self.fingerprint, "ImplementationIdentity.fingerprint")

    def to_dict(self) -> dict[str, str]:
        return {"implementation_id": self.implementation_id, "version": self.version, "fingerprint": self.fingerprint}


@dataclass(frozen=True, slots=True)
class FinalLayoutLoaderIdentity:
    """Loader ABI and exact configuration facts that may change final bytes."""

    implementation: ImplementationIdentity
    model_config_fingerprint: str
    weight_transform_fingerprint: str

    def __post_init__(self) -> None:
        if not isinstance(self.implementation, ImplementationIdentity):
            raise ValueError("FinalLayoutLoaderIdentity.implementation must be an ImplementationIdentity")
        require_str_field(self.model_config_fingerprint, "FinalLayoutLoaderIdentity.model_config_fingerprint")
        require_str_field(self.weight_transform_fingerprint, "FinalLayoutLoaderIdentity.weight_transform_fingerprint")

    def to_dict(self) -> dict[str, object]:
        return {
            "implementation": self.implementation.to_dict(),
            "model_config_fingerprint": self.model_config_fingerprint,
            "weight_transform_fingerprint": self.weight_transform_fingerprint,
        }


@dataclass(frozen=True, slots=True)
class FinalLayoutParallelIdentity:
    """Semantic parallel layout with DP and SP rank intentionally absent."""

    tensor_parallel_size: int = 1
    tensor_parallel_rank: int = 0
    sequence_parallel_size: int = 1
    ulysses_degree: int = 1
    ring_degree: int = 1
    ulysses_mode: str = "strict"
    allgather_degree: int = 1
    cfg_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    use_hsdp: bool = False
    enable_expert_parallel: bool = False

    def __post_init__(self) -> None:
        for name in (
            "tensor_parallel_size",
            "sequence_parallel_size",
            "ulysses_degree",
            "ring_degree",
            "allgather_degree",
            "cfg_parallel_size",
            "pipeline_parallel_size",
        ):
            require_int_field(getattr(self, name), f"FinalLayoutParallelIdentity.{name}", minimum=1)
        require_int_field(self.tensor_parallel_rank, "FinalLayoutParallelIdentity.tensor_parallel_rank", minimum=0)
        if self.tensor_parallel_rank >= self.tensor_parallel_size:
            raise ValueError(
                f"tensor_parallel_rank {self.tensor_parallel_rank} must be below "
                f"tensor_parallel_size {self.tensor_parallel_size}"
            )
        if self.sequence_parallel_size != self.ulysses_degree * self.ring_degree:
            raise ValueError(
                f"sequence_parallel_size {self.sequence_parallel_size} must equal ulysses_degree "
                f"{self.ulysses_degree} x ring_degree {self.ring_degree}"
            )
        require_str_field(self.ulysses_mode, "FinalLayoutParallelIdentity.ulysses_mode")
        for name in ("use_hsdp", "enable_expert_parallel"):
            if type(getattr(self, name)) is not bool:
                raise ValueError(f"FinalLayoutParallelIdentity.{name} must be a bool")

    @property
    def sequence_parallel_backend(self) -> str:
        """`none`, `ulysses`, `ring`, or `usp` (both), derived from the two degrees."""
        if self.ulysses_degree > 1 and self.ring_degree > 1:
            return "usp"
        if self.ulysses_degree > 1:
            return "ulysses"
        if self.ring_degree > 1:
            return "ring"
        return "none"

    def to_dict(self) -> dict[str, object]:
        return {
            "tensor_parallel_size": self.tensor_parallel_size,
            "tensor_parallel_rank": self.tensor_parallel_rank,
            "sequence_parallel_size": self.sequence_parallel_size,
            "sequence_parallel_backend": self.sequence_parallel_backend,
            "ulysses_degree": self.ulysses_degree,
            "ring_degree": self.ring_degree,
            "ulysses_mode": self.ulysses_mode,
            "allgather_degree": self.allgather_degree,
            "cfg_parallel_size": self.cfg_parallel_size,
            "pipeline_parallel_size": self.pipeline_parallel_size,
            "use_hsdp": self.use_hsdp,
            "enable_expert_parallel": self.enable_expert_parallel,
        }

    def layout_metadata(self) -> dict[str, JsonValue]:
        """The sequence-parallel facts that enter the layout; empty without sequence parallelism."""
        if self.sequence_parallel_size == 1:
            return {}
        return {
            "ulysses_degree": self.ulysses_degree,
            "ring_degree": self.ring_degree,
            "ulysses_mode": self.ulysses_mode,
            "allgather_degree": self.allgather_degree,
        }


@dataclass(frozen=True, slots=True)
class FinalLayoutRequest:
    """Representation-independent semantic request assembled by the loader."""

    model_id: str
    loader: FinalLayoutLoaderIdentity
    load_format: str = "default"
    parallel: FinalLayoutParallelIdentity = field(default_factory=FinalLayoutParallelIdentity)
    adaptation: AdaptationIdentity = field(default_factory=AdaptationIdentity)

    def __post_init__(self) -> None:
        require_str_field(self.model_id, "FinalLayoutRequest.model_id")
        if not isinstance(self.loader, FinalLayoutLoaderIdentity):
            raise ValueError("FinalLayoutRequest.loader must be a FinalLayoutLoaderIdentity")
        require_str_field(self.load_format, "FinalLayoutRequest.load_format")
        if not isinstance(self.parallel, FinalLayoutParallelIdentity):
            raise ValueError("FinalLayoutRequest.parallel must be a FinalLayoutParallelIdentity")
        if not isinstance(self.adaptation, AdaptationIdentity):
            raise ValueError("FinalLayoutRequest.adaptation must be an AdaptationIdentity")


@dataclass(frozen=True, slots=True)
class FinalLayoutArtifactSpec:
    """Concrete representation, layout, producer, and restoration ABI."""

    representation: WeightRepresentation
    producer: ProducerIdentity
    implementation_abi: CanonicalJson
    component_name: str = "diffusion-dit"
    component_ownership: str = "complete-final-layout-tensors"
    layout_name: str = "diffusion-final-module-layout-v1"
    model_contract_schema: str = FINAL_LAYOUT_TENSOR_MODEL_CONTRACT_SCHEMA
    digest_algorithm: DigestAlgorithm = DEFAULT_DIGEST_ALGORITHM

    def __post_init__(self) -> None:
        if not isinstance(self.representation, WeightRepresentation):
            raise ValueError("FinalLayoutArtifactSpec.representation must be a WeightRepresentation")
        if not isinstance(self.producer, ProducerIdentity):
            raise ValueError("FinalLayoutArtifactSpec.producer must be a ProducerIdentity")
        expected = implementation_abi_fingerprint(self.implementation_abi)
        if self.producer.implementation_fingerprint != expected:
            raise ValueError(
                "the producer's implementation_fingerprint does not match its ABI document "
                f"({self.producer.implementation_fingerprint!r} != {expected!r}); bump the version and "
                "recompute the fingerprint with implementation_abi_fingerprint()"
            )
        for name in ("component_name", "component_ownership", "layout_name", "model_contract_schema"):
            require_str_field(getattr(self, name), f"FinalLayoutArtifactSpec.{name}")
        if not isinstance(self.digest_algorithm, DigestAlgorithm):
            raise ValueError("FinalLayoutArtifactSpec.digest_algorithm must be a DigestAlgorithm")
        abi = self.implementation_abi.to_value()
        declared = abi.get("payload_digest", DEFAULT_DIGEST_ALGORITHM.value) if isinstance(abi, dict) else None
        if declared != self.digest_algorithm.value:
            # The key commits to the ABI document, so it must name the digest: two formats never share a key.
            raise ValueError(
                f"the ABI document's payload_digest {declared!r} differs from digest_algorithm "
                f"{self.digest_algorithm.value!r}; declare it in the ABI document and bump the version"
            )


def refuse_unsupported_request(policy_name: str, request: FinalLayoutRequest) -> None:
    """The refusals every dtype final layout shares: a typed UNSUPPORTED error naming what it cannot express (D06)."""
    parallel = request.parallel
    refusals: list[tuple[bool, str]] = [
        (request.load_format != "default", f"load_format {request.load_format!r} (only 'default')"),
        (parallel.pipeline_parallel_size > 1, "pipeline parallelism"),
        (parallel.cfg_parallel_size > 1, "CFG parallelism"),
        (parallel.use_hsdp, "HSDP"),
        (parallel.enable_expert_parallel, "expert parallelism"),
        (request.adaptation.kind != BASE_ADAPTATION, f"adaptation {request.adaptation.kind!r} (LoRA/merged)"),
    ]
    for refused, what in refusals:
        if refused:
            raise _configuration_error(
                f"the {policy_name} final-layout representation does not support {what}; "
                "load this model through the ordinary path",
                policy=policy_name,
                refused=what,
            )


ModelValidator = Callable[[torch.nn.Module], None]


def _no_validation(model: torch.nn.Module) -> None:
    return None


@dataclass(frozen=True, slots=True)
class FinalLayoutModelContract:
    """What a model class promises about its final-layout tensors, and how to check a restored one.

    `keep_in_fp32_modules` are module-name components whose floating tensors stay FP32;
    `validator` raises (any exception) when a restored model is not ready to serve.
    """

    implementation: ImplementationIdentity
    model_class_name: str
    keep_in_fp32_modules: tuple[str, ...] = ()
    validator: ModelValidator = field(default=_no_validation, compare=False)
    first_class: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.implementation, ImplementationIdentity):
            raise ValueError("FinalLayoutModelContract.implementation must be an ImplementationIdentity")
        require_str_field(self.model_class_name, "FinalLayoutModelContract.model_class_name")
        if type(self.keep_in_fp32_modules) is not tuple or any(
            type(name) is not str or not name for name in self.keep_in_fp32_modules
        ):
            raise ValueError("FinalLayoutModelContract.keep_in_fp32_modules must be a tuple of non-empty str")

    def to_dict(self) -> dict[str, JsonValue]:
        return {
            "schema": FINAL_LAYOUT_TENSOR_MODEL_CONTRACT_SCHEMA,
            "implementation": dict(self.implementation.to_dict()),
            "model_class_name": self.model_class_name,
            "keep_in_fp32_modules": list(self.keep_in_fp32_modules),
            "first_class": self.first_class,
        }


@runtime_checkable
class FinalLayoutTensorPolicy(Protocol):
    """Decides the final dtype of every owned tensor and which requests the representation supports."""

    @property
    def name(self) -> str: ...

    @property
    def spec(self) -> FinalLayoutArtifactSpec: ...

    def final_dtype(self, local_name: str, dtype: torch.dtype, keep_in_fp32_modules: Sequence[str]) -> torch.dtype: ...

    def check_request(self, request: FinalLayoutRequest) -> None: ...

    def to_dict(self) -> dict[str, JsonValue]: ...


def policy_compute_dtype(policy: FinalLayoutTensorPolicy) -> torch.dtype:
    """The dtype the caller asked for (`torch_dtype`), which the model's contract validates; BF16 by default."""
    dtype = getattr(policy, "compute_dtype", torch.bfloat16)
    return dtype if isinstance(dtype, torch.dtype) else torch.bfloat16


def streamed_final_dtype(
    policy: FinalLayoutTensorPolicy,
    local_name: str,
    checkpoint_dtype: torch.dtype,
    built_dtype: torch.dtype,
    keep_in_fp32_modules: Sequence[str],
) -> torch.dtype:
    """The final dtype of a tensor streamed from the checkpoint: the policy's `final_dtype` of the checkpoint's dtype,
    unless the policy decides it otherwise (`final_dtype_from_checkpoint`, e.g. from the skeleton's dtype)."""
    decide = getattr(policy, "final_dtype_from_checkpoint", None)
    if decide is None:
        return policy.final_dtype(local_name, checkpoint_dtype, keep_in_fp32_modules)
    decided = decide(local_name, checkpoint_dtype, built_dtype, keep_in_fp32_modules)
    assert isinstance(decided, torch.dtype)
    return decided


def keeps_fp32(local_name: str, keep_in_fp32_modules: Sequence[str]) -> bool:
    """diffusers' rule: a tensor stays FP32 when a kept module name is one of its dotted components."""
    components = local_name.split(".")
    return any(module in components for module in keep_in_fp32_modules)


def diffusers_final_dtype(
    local_name: str, dtype: torch.dtype, keep_in_fp32_modules: Sequence[str], target: torch.dtype
) -> torch.dtype:
    """diffusers' cast on load: a floating tensor becomes `target`, or FP32 where the model keeps it; others stay."""
    if not dtype.is_floating_point:
        return dtype
    return torch.float32 if keeps_fp32(local_name, keep_in_fp32_modules) else target


_BF16_IMPLEMENTATION_ABI = CanonicalJson.from_value(
    {
        "representation": FINAL_LAYOUT_BF16_REPRESENTATION,
        "version": FINAL_LAYOUT_BF16_VERSION,
        "tensor_naming": "<dit-module-name>.<state-dict-name>",
        "ownership": "parameters and persistent buffers of the DiT modules; no aliases; contiguous",
        "cast": {
            "floating": "torch.Tensor.to(torch.bfloat16) (round to nearest even)",
            "floating_kept": "torch.Tensor.to(torch.float32) when a _keep_in_fp32_modules name is a dotted component",
            "non_floating": "unchanged",
        },
        "file_format": "safetensors; tensors sorted by element size, naturally aligned",
        "restore": "zero-copy binding of parameters (requires_grad kept) and buffers to lease tensors",
        "manifest_schema": FINAL_LAYOUT_BF16_MANIFEST_SCHEMA,
        "restorer_schema": FINAL_LAYOUT_TENSOR_RESTORER_SCHEMA,
        "payload_digest": DigestAlgorithm.BLAKE3_TREE_V1.value,
    }
)


@dataclass(frozen=True, slots=True)
class FinalLayoutBF16Policy:
    """Floating tensors in BF16 except those the model keeps in FP32; integer tensors unchanged."""

    name: str = "bf16-with-preserved-fp32"

    @property
    def spec(self) -> FinalLayoutArtifactSpec:
        return FINAL_LAYOUT_BF16_SPEC

    def final_dtype(self, local_name: str, dtype: torch.dtype, keep_in_fp32_modules: Sequence[str]) -> torch.dtype:
        return diffusers_final_dtype(local_name, dtype, keep_in_fp32_modules, torch.bfloat16)

    @property
    def compute_dtype(self) -> torch.dtype:
        return torch.bfloat16

    def check_request(self, request: FinalLayoutRequest) -> None:
        """Refuse semantics this representation cannot express, with a typed UNSUPPORTED error (D06)."""
        refuse_unsupported_request(self.name, request)

    def to_dict(self) -> dict[str, JsonValue]:
        return {"name": self.name, "dtype": str(torch.bfloat16), "preserved": str(torch.float32)}


FINAL_LAYOUT_BF16_SPEC = FinalLayoutArtifactSpec(
    representation=WeightRepresentation(
        name=FINAL_LAYOUT_BF16_REPRESENTATION,
        dtype=str(torch.bfloat16),
        metadata=CanonicalJson.from_value(
            {
                "format": FINAL_LAYOUT_BF16_REPRESENTATION,
                "mixed_precision_policy": "bf16-with-preserved-fp32",
            }
        ),
    ),
    producer=ProducerIdentity(
        producer_id=FINAL_LAYOUT_BF16_PRODUCER_ID,
        version=FINAL_LAYOUT_BF16_VERSION,
        implementation_fingerprint=implementation_abi_fingerprint(_BF16_IMPLEMENTATION_ABI),
        manifest_schema=FINAL_LAYOUT_BF16_MANIFEST_SCHEMA,
        restorer_schema=FINAL_LAYOUT_TENSOR_RESTORER_SCHEMA,
    ),
    implementation_abi=_BF16_IMPLEMENTATION_ABI,
    digest_algorithm=DigestAlgorithm.BLAKE3_TREE_V1,
)

FINAL_LAYOUT_BF16_POLICY = FinalLayoutBF16Policy()

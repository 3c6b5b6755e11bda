"""Exact pre-load identity assembly for policy-defined final-layout artifacts.

The identity is computed on whatever module tree the caller has (a `meta` skeleton
before loading, or a loaded CPU model) and depends only on what changes the bytes:
source content, loader and transform, parallel layout, tensor contract, model contracts
and the artifact spec. The repo id, revision and folder a load went through are not in
it (D05): `FinalLayoutIdentityContext.built_from` records them for the manifest instead.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from ..canonical_json import CanonicalJson, JsonValue
from ..identity import (
    IDENTITY_SCHEMA_VERSION,
    ComponentIdentity,
    RuntimeWeightLayout,
    WeightArtifactIdentity,
    WeightRepresentation,
    WeightSourceIdentity,
)
from .contracts import (
    FinalLayoutArtifactSpec,
    FinalLayoutModelContract,
    FinalLayoutParallelIdentity,
    FinalLayoutRequest,
    FinalLayoutTensorPolicy,
    policy_compute_dtype,
)
from .model_contracts import contract_for_model
from .parallel.plan import TensorParallelPlan, TensorShard
from .source_identity import (
    FinalLayoutSourceContext,
    NodeSourceDigestCache,
    PreparedWeightSource,
    bind_tensors_to_sources,
    resolved_revision,
    snapshot_sources,
)
from .tensor_layout import FinalLayoutTensor, TensorOwnership, discover_owned_tensors, discover_tensor_ownership

__all__ = ["FinalLayoutIdentityContext", "build_final_layout_identity", "discover_final_layout", "model_contracts"]


@dataclass(frozen=True, slots=True)
class FinalLayoutIdentityContext:
    """Exact semantic identity plus process-local transaction guards."""

    identity: WeightArtifactIdentity
    request: FinalLayoutRequest
    policy: FinalLayoutTensorPolicy
    spec: FinalLayoutArtifactSpec
    source: FinalLayoutSourceContext
    pipeline_type: type[torch.nn.Module]
    dit_names: tuple[str, ...]
    dit_types: tuple[type[torch.nn.Module], ...]
    model_contracts: tuple[FinalLayoutModelContract, ...]
    tensor_names: frozenset[str]
    tensors: tuple[FinalLayoutTensor, ...]
    tensor_sources: Mapping[str, tuple[int, str]]
    tensor_shards: Mapping[str, TensorShard] = field(default_factory=dict)
    """Final-layout name -> this rank's shard, for tensors a tensor-parallel plan splits (empty at TP=1)."""
    aliases: Mapping[str, str] = field(default_factory=dict)
    """Final-layout name -> the owned name it is tied to, as the model's tied-weights mechanism declares (keyed)."""

    def ensure_sources_unchanged(self) -> None:
        """Raise CANONICAL_SOURCE_FAILED when a source file changed since the identity was built."""
        self.source.ensure_unchanged()

    def sources_unchanged(self) -> bool:
        return self.source.unchanged()

    def built_from(self) -> dict[str, JsonValue]:
        """Where this load read the checkpoint, for people: the manifest shows it; the key never holds it."""
        sources: list[JsonValue] = [
            {
                "model_or_path": source.model_or_path,
                "source_kind": source.source_kind.value,
                "requested_revision": source.requested_revision,
                "revision": resolved_revision(source),
                "subfolder": source.subfolder,
                "path": str(source.resolved_root),
            }
            for source in self.source.sources
        ]
        return {"model_id": self.request.model_id, "sources": sources}

    @property
    def total_bytes(self) -> int:
        return sum(tensor.nbytes for tensor in self.tensors)


def model_contracts(
    dit_modules: Sequence[tuple[str, torch.nn.Module]], policy: FinalLayoutTensorPolicy
) -> tuple[FinalLayoutModelContract, ...]:
    """Each DiT's contract as registered now (a validator may have been replaced since an earlier load)."""
    return tuple(contract_for_model(module, policy_compute_dtype(policy)) for _name, module in dit_modules)


def discover_final_layout(
    dit_modules: Sequence[tuple[str, torch.nn.Module]],
    policy: FinalLayoutTensorPolicy,
    aliases: Mapping[str, str] | None = None,
) -> tuple[TensorOwnership, tuple[FinalLayoutModelContract, ...]]:
    """Ownership with policy dtypes, and each DiT's contract; a model without a contract is refused (D08)."""
    contracts = model_contracts(dit_modules, policy)
    keep_by_dit = {
        name: contract.keep_in_fp32_modules for (name, _module), contract in zip(dit_modules, contracts, strict=True)
    }

    def final_dtype(dit_name: str, local_name: str, dtype: torch.dtype) -> torch.dtype:
        return policy.final_dtype(local_name, dtype, keep_by_dit[dit_name])

    return discover_tensor_ownership(dit_modules, final_dtype, aliases), contracts


def discover_final_layout_tensors(
    dit_modules: Sequence[tuple[str, torch.nn.Module]],
    policy: FinalLayoutTensorPolicy,
    aliases: Mapping[str, str] | None = None,
) -> tuple[FinalLayoutTensor, ...]:
    """The owned tensors with policy dtypes, as `discover_final_layout` finds them, without the contract digest."""
    contracts = tuple(contract_for_model(module, policy_compute_dtype(policy)) for _name, module in dit_modules)
    keep_by_dit = {
        name: contract.keep_in_fp32_modules for (name, _module), contract in zip(dit_modules, contracts, strict=True)
    }

    def final_dtype(dit_name: str, local_name: str, dtype: torch.dtype) -> torch.dtype:
        return policy.final_dtype(local_name, dtype, keep_by_dit[dit_name])

    return discover_owned_tensors(dit_modules, final_dtype, aliases)


def _qualified(klass: type[object]) -> str:
    return f"{klass.__module__}.{klass.__qualname__}"


def build_final_layout_identity(
    pipeline: torch.nn.Module,
    *,
    dit_modules: Sequence[tuple[str, torch.nn.Module]],
    prepared_sources: Sequence[PreparedWeightSource],
    request: FinalLayoutRequest,
    policy: FinalLayoutTensorPolicy,
    source_digest_cache: NodeSourceDigestCache | None = None,
    tensor_parallel_plan: TensorParallelPlan | None = None,
    tensor_shards: Mapping[str, TensorShard] | None = None,
    aliases: Mapping[str, str] | None = None,
    checkpoint_keys: Mapping[str, str] | None = None,
    discovered: tuple[TensorOwnership, tuple[FinalLayoutModelContract, ...]] | None = None,
) -> FinalLayoutIdentityContext:
    """Build exact source, representation, layout, and implementation identity.

    For a tensor-parallel rank, `dit_modules` are already localized (split parameters hold the
    rank's shape), `tensor_shards` say where each split tensor comes from, and the plan enters
    the layout, so a different plan or TP size is a different key (D05). `aliases` (final-layout
    name -> owned name) are the ties the model declares; they enter the tensor contract, so the key.
    `checkpoint_keys` (final-layout name -> checkpoint key) bind tensors the checkpoint stores under
    another name (a family's own key renaming); the rest are bound by their source prefix.
    `discovered` is `discover_final_layout`'s result for these very modules, where the caller kept it.
    """
    if not isinstance(pipeline, torch.nn.Module):
        raise ValueError(f"pipeline must be a torch.nn.Module, got {type(pipeline).__name__}")
    if not isinstance(request, FinalLayoutRequest):
        raise ValueError("request must be a FinalLayoutRequest")
    policy.check_request(request)
    spec = policy.spec
    ownership, contracts = discovered if discovered is not None else discover_final_layout(dit_modules, policy, aliases)
    bindings = bind_tensors_to_sources(ownership.names, prepared_sources)
    for name, key in (checkpoint_keys or {}).items():
        if name in bindings:
            bindings[name] = (bindings[name][0], key)
    source = snapshot_sources(prepared_sources, cache=source_digest_cache)

    source_identity = WeightSourceIdentity(
        # Content only (D05): the DiT classes name what the bytes are. The repo id, revision and
        # path are spellings of where they were read; `built_from` keeps them for display.
        model_id=",".join(type(module).__name__ for _name, module in dit_modules),
        revision=None,
        fingerprint=source.fingerprint,
        metadata=CanonicalJson.from_value(source.to_metadata()),
    )
    component = _component_identity(spec, dit_modules, contracts, request, ownership)
    representation = WeightRepresentation(
        name=spec.representation.name,
        dtype=spec.representation.dtype,
        metadata=CanonicalJson.from_value({**_mapping(spec.representation.metadata), "policy": policy.to_dict()}),
    )
    layout = _layout(spec, request.parallel, tensor_parallel_plan)
    identity = WeightArtifactIdentity(
        schema_version=IDENTITY_SCHEMA_VERSION,
        source=source_identity,
        component=component,
        representation=representation,
        layout=layout,
        adaptation=request.adaptation,
        producer=spec.producer,
    )
    return FinalLayoutIdentityContext(
        identity=identity,
        request=request,
        policy=policy,
        spec=spec,
        source=source,
        pipeline_type=type(pipeline),
        dit_names=tuple(name for name, _module in dit_modules),
        dit_types=tuple(type(module) for _name, module in dit_modules),
        model_contracts=contracts,
        tensor_names=ownership.names,
        tensors=ownership.tensors,
        tensor_sources=bindings,
        tensor_shards=dict(tensor_shards or {}),
        aliases={alias.name: alias.owner for alias in ownership.aliases},
    )


def _component_identity(
    spec: FinalLayoutArtifactSpec,
    dit_modules: Sequence[tuple[str, torch.nn.Module]],
    contracts: Sequence[FinalLayoutModelContract],
    request: FinalLayoutRequest,
    ownership: TensorOwnership,
) -> ComponentIdentity:
    """What the artifact serves: each DiT's contract, the loader, and the tensor contract."""
    dits: list[JsonValue] = [
        {"name": name, "contract": contract.to_dict()}
        for (name, _module), contract in zip(dit_modules, contracts, strict=True)
    ]
    return ComponentIdentity(
        name=spec.component_name,
        ownership=spec.component_ownership,
        metadata=CanonicalJson.from_value(
            {
                "dits": dits,
                "loader": _json(request.loader.to_dict()),
                "load_format": request.load_format,
                "model_contract_schema": spec.model_contract_schema,
                "tensor_contract": ownership.contract_digest,
                "tensor_count": len(ownership.tensors),
            }
        ),
    )


def _layout(
    spec: FinalLayoutArtifactSpec, parallel: FinalLayoutParallelIdentity, plan: TensorParallelPlan | None
) -> RuntimeWeightLayout:
    """How the tensors are laid out at run time; a tensor-parallel plan enters it, so it keys the artifact."""
    return RuntimeWeightLayout(
        name=spec.layout_name,
        tensor_parallel_size=parallel.tensor_parallel_size,
        tensor_parallel_rank=parallel.tensor_parallel_rank,
        sequence_parallel_size=parallel.sequence_parallel_size,
        sequence_parallel_backend=parallel.sequence_parallel_backend,
        metadata=CanonicalJson.from_value(
            {**parallel.layout_metadata(), "tensor_parallel_plan": plan.to_dict()}
            if plan is not None
            else parallel.layout_metadata()
        ),
    )


def _json(value: Mapping[str, object]) -> JsonValue:
    return CanonicalJson.from_value(dict(value)).to_value()


def _mapping(metadata: CanonicalJson) -> dict[str, JsonValue]:
    value = metadata.to_value()
    if not isinstance(value, dict):
        raise ValueError("representation metadata must be a JSON object")
    return value

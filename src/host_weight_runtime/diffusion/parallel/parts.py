"""A TP rank's final layout stored as two artifacts: the replicated part, once per node, and the rank's shard.

A rank's layout (the per-rank identity `identify_ranks` builds) is split by the plan: every
tensor the plan splits goes into the rank's *shard part*; every other tensor is the same
bytes on every rank and goes into the *replicated part*, whose key every rank computes
alike. Both keys are the rank identity with one layout fact added (`part`), so they keep
every factor that changes the bytes (source, representation, plan, TP size, tensor contract)
and never share a key with the one-artifact-per-rank layout or with each other. The shard
part names its replicated part's key, so the pairing is keyed too.

Payload files carry their part in their name, so the two manifests never name the same
file and a rank's lease over both can list them side by side.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, replace

from ...canonical_json import CanonicalJson, JsonValue
from ...identity import RuntimeWeightLayout, WeightArtifactIdentity
from ..identity_adapter import FinalLayoutIdentityContext
from ..producers._shards import plan_shards
from ..tensor_layout import FinalLayoutTensor
from .plan import plan_error

__all__ = ["PartKind", "RankParts", "part_file_plan", "split_rank"]

PART_FIELD = "part"
"""The layout metadata field that marks an artifact as one part of a rank's layout."""


class PartKind(str, enum.Enum):
    """Which part of a rank's layout an artifact holds."""

    REPLICATED = "replicated"
    SHARD = "shard"


@dataclass(frozen=True, slots=True)
class RankParts:
    """One rank's layout (`rank`, what the restorer checks against) and the two artifacts that store it."""

    rank: FinalLayoutIdentityContext
    replicated: FinalLayoutIdentityContext
    shard: FinalLayoutIdentityContext

    @property
    def rank_index(self) -> int:
        return self.rank.request.parallel.tensor_parallel_rank

    def part(self, kind: PartKind) -> FinalLayoutIdentityContext:
        return self.replicated if kind is PartKind.REPLICATED else self.shard


def _layout_with_part(layout: RuntimeWeightLayout, part: dict[str, JsonValue], rank: int) -> RuntimeWeightLayout:
    metadata = layout.metadata.to_value()
    if not isinstance(metadata, dict) or PART_FIELD in metadata:
        raise ValueError("a rank layout's metadata must be a JSON object without a 'part' field")
    return replace(
        layout, tensor_parallel_rank=rank, metadata=CanonicalJson.from_value({**metadata, PART_FIELD: part})
    )


def part_identity(identity: WeightArtifactIdentity, kind: PartKind, replicated_key: str = "") -> WeightArtifactIdentity:
    """The key of one part of the rank layout `identity`: rank-free for the replicated part (rank 0 for all)."""
    if kind is PartKind.REPLICATED:
        layout = _layout_with_part(identity.layout, {"kind": kind.value}, 0)
    else:
        part: dict[str, JsonValue] = {"kind": kind.value, "replicated": replicated_key}
        layout = _layout_with_part(identity.layout, part, identity.layout.tensor_parallel_rank)
    return replace(identity, layout=layout)


def _subset(
    context: FinalLayoutIdentityContext, identity: WeightArtifactIdentity, tensors: Sequence[FinalLayoutTensor]
) -> FinalLayoutIdentityContext:
    names = frozenset(tensor.name for tensor in tensors)
    return replace(
        context,
        identity=identity,
        tensors=tuple(tensors),
        tensor_names=names,
        tensor_shards={name: shard for name, shard in context.tensor_shards.items() if name in names},
        tensor_sources={name: source for name, source in context.tensor_sources.items() if name in names},
        aliases={},
    )


def split_rank(context: FinalLayoutIdentityContext) -> RankParts:
    """The two parts of one rank's layout; a plan that splits a tensor the rank does not own, names a tied
    tensor, or leaves either part empty is refused (typed UNSUPPORTED) before anything is read or written."""
    if context.request.parallel.tensor_parallel_size < 2:
        raise ValueError("only a tensor-parallel rank (tensor_parallel_size >= 2) has parts")
    owned = {tensor.name for tensor in context.tensors}
    strays = sorted(set(context.tensor_shards) - owned)
    if strays:
        raise plan_error(
            f"the tensor-parallel plan splits {strays[:5]}, which the model does not own as separate tensors; "
            "a tensor is either split or replicated, never both: fix the plan's rules",
            tensors=list[JsonValue](strays[:5]),
        )
    if context.aliases:
        raise plan_error(
            f"tensor-parallel parts do not store tied tensors (e.g. {sorted(context.aliases)[:5]}); "
            "load this model without parallel=",
        )
    split = [tensor for tensor in context.tensors if tensor.name in context.tensor_shards]
    whole = [tensor for tensor in context.tensors if tensor.name not in context.tensor_shards]
    if not split or not whole:
        raise plan_error(
            f"a tensor-parallel plan must split some tensors and replicate others; this one splits {len(split)} "
            f"of {len(context.tensors)}",
        )
    replicated_identity = part_identity(context.identity, PartKind.REPLICATED)
    shard_identity = part_identity(context.identity, PartKind.SHARD, replicated_identity.key)
    return RankParts(
        rank=context,
        replicated=_subset(context, replicated_identity, whole),
        shard=_subset(context, shard_identity, split),
    )


def part_file_plan(
    tensors: Sequence[FinalLayoutTensor], shard_bytes: int, kind: PartKind
) -> list[tuple[str, list[FinalLayoutTensor]]]:
    """Payload files of one part, named after it (`replicated-final-layout-00001-of-00001.safetensors`)."""
    return [(f"{kind.value}-{name}", group) for name, group in plan_shards(tensors, shard_bytes)]

"""Post-load publication of a rank's two parts from its localized, finalized model (any representation).

After a canonical load a rank publishes its shard part and, unless another rank already has,
the replicated part: each is its own post-load publication, so a rank that finds one part
present publishes only the other. The model's tensors are written as they serve (BF16, FP8
with scales, or any other policy's final dtypes), checked against the rank's full layout first.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ...failures import FailureCode
from ...outcomes import PostLoadPublicationReport, PostLoadPublicationStatus
from ...protocols import ArtifactWriter, ProductionMetadata, ProductionSourceMode, WeightProductionSpec
from ...runtime import HostWeightRuntime
from ..identity_adapter import discover_final_layout
from ..producers._shards import DEFAULT_SHARD_BYTES, producer_error, production_metadata, production_spec
from ..producers.finalized import publish_live
from .parts import PartKind, RankParts, part_file_plan

__all__ = ["FinalLayoutPartProducer", "publish_parts_after_load"]


class FinalLayoutPartProducer:
    """One part (replicated or shard) of a rank's layout, written from the rank's finalized CPU model."""

    def __init__(
        self,
        parts: RankParts,
        kind: PartKind,
        dit_modules: Sequence[tuple[str, torch.nn.Module]],
        *,
        shard_bytes: int = DEFAULT_SHARD_BYTES,
    ) -> None:
        self._parts = parts
        self._kind = kind
        self._dit_modules = tuple(dit_modules)
        self._shard_bytes = shard_bytes
        self._spec = production_spec(parts.part(kind), ProductionSourceMode.FINALIZED_MODEL)

    @property
    def spec(self) -> WeightProductionSpec:
        return self._spec

    def produce(self, writer: ArtifactWriter) -> ProductionMetadata:
        rank, part = self._parts.rank, self._parts.part(self._kind)
        rank.ensure_sources_unchanged()
        ownership, _contracts = discover_final_layout(self._dit_modules, rank.policy, rank.aliases)
        if ownership.tensors != rank.tensors:
            raise producer_error(
                FailureCode.PRODUCER_FAILED,
                "the loaded model does not match this rank's layout (localize it to the rank first); it cannot be "
                "published under this key",
            )
        publish_live(writer, part_file_plan(part.tensors, self._shard_bytes, self._kind), self._dit_modules)
        rank.ensure_sources_unchanged()
        return production_metadata(part, ProductionSourceMode.FINALIZED_MODEL.value)


def publish_parts_after_load(
    runtime: HostWeightRuntime, parts: RankParts, component_name: str, model: torch.nn.Module
) -> PostLoadPublicationReport:
    """Publish both parts (a present one reports ALREADY_PRESENT); the report of a failed part, else the shard's."""
    reports = [
        runtime.publish_after_load(
            parts.part(kind).identity, FinalLayoutPartProducer(parts, kind, [(component_name, model)])
        )
        for kind in (PartKind.REPLICATED, PartKind.SHARD)
    ]
    failed = [report for report in reports if report.status is PostLoadPublicationStatus.FAILED]
    return failed[0] if failed else reports[1]

"""Producer, writer, restorer and store protocols: this runtime's own (the reference's shapes)."""

from __future__ import annotations

from ...protocols import (
    ArtifactWriter,
    BuildRequest,
    CoordinationScope,
    HostWeightStore,
    LookupPhase,
    ProductionMetadata,
    ProductionSourceMode,
    RemoteArtifactDescriptor,
    RemoteArtifactProvider,
    TensorFileWriter,
    TensorWriteSpec,
    WeightProducer,
    WeightProductionSpec,
    WeightRestorePlan,
    WeightRestorer,
)

__all__ = [
    "ArtifactWriter",
    "BuildRequest",
    "CoordinationScope",
    "HostWeightStore",
    "LookupPhase",
    "ProductionMetadata",
    "ProductionSourceMode",
    "RemoteArtifactDescriptor",
    "RemoteArtifactProvider",
    "TensorFileWriter",
    "TensorWriteSpec",
    "WeightProducer",
    "WeightProductionSpec",
    "WeightRestorePlan",
    "WeightRestorer",
]

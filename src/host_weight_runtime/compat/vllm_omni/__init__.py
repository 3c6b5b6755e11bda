"""vLLM-Omni's Host Weight Runtime API (`vllm_omni.host_weight_runtime` 0.30.0) on this runtime.

Every public name of the reference, with its signature, defaults and fields. Identities, leases,
failures and protocols are this runtime's own types (one store, one implementation); the reference's
policies, reports, store results and manifest records are thin translations of this runtime's. `install()`
makes `import vllm_omni.host_weight_runtime` give this module. Differences: docs/vllm-omni.md.
"""

from __future__ import annotations

from ._install import install, installed
from .config import (
    CapacityPolicy,
    HostWeightRuntimeConfig,
    IntegrityPolicy,
    ProductionPolicy,
    RemoteImportPolicy,
    RemoteOnMiss,
    RuntimeMode,
    StorageClass,
    StorageDomainPolicy,
    StorageScope,
    ValidationLevel,
    WaitPolicy,
)
from .errors import FailureCode, HostWeightError, HostWeightFailure, ResolutionAction, ResolutionStage
from .identity import (
    AdaptationIdentity,
    CanonicalJson,
    ComponentIdentity,
    IdentityValidationError,
    ProducerIdentity,
    RuntimeWeightLayout,
    WeightArtifactIdentity,
    WeightRepresentation,
    WeightSourceIdentity,
)
from .inspection import (
    ArtifactInspection,
    ArtifactInventoryEntry,
    ArtifactInventoryState,
    DomainInspection,
    HostWeightInspector,
)
from .lease import HostWeightLease, HostWeightLeaseCarrier, LeaseProvenance, MappedHostRegion
from .manifest import (
    FileManifestEntry,
    ManifestValidationError,
    PublicationMarker,
    TensorKind,
    TensorManifestEntry,
    WeightManifest,
)
from .outcomes import (
    AttemptResult,
    HostWeightResolution,
    PostLoadPublicationOutcome,
    PostLoadPublicationReport,
    ResolutionAttempt,
    ResolutionOutcome,
    ResolutionReport,
    StoreResult,
    StoreStatus,
)
from .protocols import (
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
from .runtime import HostWeightRuntime

REFERENCE_VERSION = "0.30.0"
"""The vllm-omni release whose public API this module presents."""

__all__ = [
    "REFERENCE_VERSION",
    "AdaptationIdentity",
    "ArtifactInspection",
    "ArtifactInventoryEntry",
    "ArtifactInventoryState",
    "ArtifactWriter",
    "AttemptResult",
    "BuildRequest",
    "CanonicalJson",
    "CapacityPolicy",
    "ComponentIdentity",
    "CoordinationScope",
    "DomainInspection",
    "FailureCode",
    "FileManifestEntry",
    "HostWeightError",
    "HostWeightFailure",
    "HostWeightInspector",
    "HostWeightLease",
    "HostWeightLeaseCarrier",
    "HostWeightResolution",
    "HostWeightRuntime",
    "HostWeightRuntimeConfig",
    "HostWeightStore",
    "IdentityValidationError",
    "IntegrityPolicy",
    "LeaseProvenance",
    "LookupPhase",
    "ManifestValidationError",
    "MappedHostRegion",
    "PostLoadPublicationOutcome",
    "PostLoadPublicationReport",
    "ProducerIdentity",
    "ProductionMetadata",
    "ProductionPolicy",
    "ProductionSourceMode",
    "PublicationMarker",
    "RemoteArtifactDescriptor",
    "RemoteArtifactProvider",
    "RemoteImportPolicy",
    "RemoteOnMiss",
    "ResolutionAction",
    "ResolutionAttempt",
    "ResolutionOutcome",
    "ResolutionReport",
    "ResolutionStage",
    "RuntimeMode",
    "RuntimeWeightLayout",
    "StorageClass",
    "StorageDomainPolicy",
    "StorageScope",
    "StoreResult",
    "StoreStatus",
    "TensorFileWriter",
    "TensorKind",
    "TensorManifestEntry",
    "TensorWriteSpec",
    "ValidationLevel",
    "WaitPolicy",
    "WeightArtifactIdentity",
    "WeightManifest",
    "WeightProducer",
    "WeightProductionSpec",
    "WeightRepresentation",
    "WeightRestorePlan",
    "WeightRestorer",
    "WeightSourceIdentity",
    "install",
    "installed",
]

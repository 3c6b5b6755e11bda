"""host-weight-runtime: one immutable, hashed, memory-mapped weight artifact per node.

The first worker publishes a model's final-layout tensors; every later worker on the
node gets a validated lease of memory-mapped CPU tensors that share the same pages.
"""

from ._digest import DigestAlgorithm
from .canonical_json import CanonicalJson
from .config import CapacityPolicy, HostWeightRuntimeConfig, RuntimeMode, StorageClass, default_root
from .failures import FailureCode, HostWeightError, HostWeightFailure, HostWeightUsageError, ResolutionStage
from .filesystem.domain import MountEntry, MountTable, read_mount_table
from .filesystem.inspection import ArtifactInspection, ArtifactState, DomainInspection, LockActivity
from .filesystem.store import FilesystemHostWeightStore
from .identity import (
    IDENTITY_SCHEMA_VERSION,
    AdaptationIdentity,
    ComponentIdentity,
    ProducerIdentity,
    RuntimeWeightLayout,
    WeightArtifactIdentity,
    WeightRepresentation,
    WeightSourceIdentity,
)
from .lease import HostWeightLease, HostWeightLeaseCarrier, LeaseProvenance, LeaseSource, MappedHostRegion
from .manifest import FileManifestEntry, PublicationMarker, TensorManifestEntry, WeightManifest
from .outcomes import (
    AttemptAction,
    AttemptResult,
    CleanupResult,
    CleanupStatus,
    HostWeightResolution,
    PostLoadPublicationReport,
    PostLoadPublicationStatus,
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
from .remote import (
    FsspecArtifactProvider,
    PushResult,
    PushStatus,
    RemoteArtifactListing,
    RemoteArtifactState,
    import_remote_artifact,
    list_remote,
    providers_from_urls,
    push_artifact,
    storage_options_for,
)
from .runtime import HostWeightRuntime
from .tensors import TensorKind, ValidationLevel

# isort: split
# Operating a domain: eviction, usage, gc and metrics.
from .config import EvictionPolicy
from .filesystem.garbage import (
    GcItem,
    GcItemKind,
    GcItemResult,
    GcItemStatus,
    GcKeepReason,
    GcKept,
    GcPlan,
    GcReason,
    GcResult,
)
from .filesystem.inspection import DomainUsage
from .metrics import HostWeightMetrics, MetricsUnavailableError, register_metrics, start_metrics_server
from .version import __version__

__all__ = [
    "IDENTITY_SCHEMA_VERSION",
    "AdaptationIdentity",
    "ArtifactInspection",
    "ArtifactState",
    "ArtifactWriter",
    "AttemptAction",
    "AttemptResult",
    "BuildRequest",
    "CanonicalJson",
    "CapacityPolicy",
    "DigestAlgorithm",
    "CleanupResult",
    "CleanupStatus",
    "ComponentIdentity",
    "CoordinationScope",
    "DomainInspection",
    "FailureCode",
    "FileManifestEntry",
    "FilesystemHostWeightStore",
    "FsspecArtifactProvider",
    "HostWeightError",
    "HostWeightFailure",
    "HostWeightLease",
    "HostWeightLeaseCarrier",
    "HostWeightResolution",
    "HostWeightRuntime",
    "HostWeightRuntimeConfig",
    "HostWeightStore",
    "HostWeightUsageError",
    "LeaseProvenance",
    "LeaseSource",
    "LockActivity",
    "LookupPhase",
    "MappedHostRegion",
    "MountEntry",
    "MountTable",
    "PostLoadPublicationReport",
    "PostLoadPublicationStatus",
    "ProducerIdentity",
    "ProductionMetadata",
    "ProductionSourceMode",
    "PublicationMarker",
    "PushResult",
    "PushStatus",
    "RemoteArtifactDescriptor",
    "RemoteArtifactListing",
    "RemoteArtifactProvider",
    "RemoteArtifactState",
    "ResolutionAttempt",
    "ResolutionOutcome",
    "ResolutionReport",
    "ResolutionStage",
    "RuntimeMode",
    "RuntimeWeightLayout",
    "StorageClass",
    "StoreResult",
    "StoreStatus",
    "TensorFileWriter",
    "TensorKind",
    "TensorManifestEntry",
    "TensorWriteSpec",
    "ValidationLevel",
    "WeightArtifactIdentity",
    "WeightManifest",
    "WeightProducer",
    "WeightProductionSpec",
    "WeightRepresentation",
    "WeightRestorePlan",
    "WeightRestorer",
    "WeightSourceIdentity",
    "__version__",
    "default_root",
    "import_remote_artifact",
    "list_remote",
    "providers_from_urls",
    "push_artifact",
    "read_mount_table",
    # Operating a domain: eviction, usage, gc and metrics.
    "DomainUsage",
    "EvictionPolicy",
    "GcItem",
    "GcItemKind",
    "GcItemResult",
    "GcItemStatus",
    "GcKeepReason",
    "GcKept",
    "GcPlan",
    "GcReason",
    "GcResult",
    "HostWeightMetrics",
    "MetricsUnavailableError",
    "register_metrics",
    "start_metrics_server",
    "storage_options_for",
]

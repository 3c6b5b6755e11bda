"""Provider and consumer protocols for Host Weight Runtime extensions.

Producers write through a store-scoped `ArtifactWriter`; restorers validate a lease
against a model before mutating it once; stores give exact artifact access whose
deadlines bound lock acquisition only.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from ._digest import DEFAULT_DIGEST_ALGORITHM, DigestAlgorithm
from .canonical_json import CanonicalJson
from .identity import WeightArtifactIdentity
from .tensors import TensorKind, ValidationLevel, dtype_itemsize, numel_of

if TYPE_CHECKING:
    import torch

    from .lease import HostWeightLease
    from .outcomes import StoreResult

__all__ = [
    "ArtifactWriter",
    "BuildRequest",
    "BundleWriter",
    "CoordinationScope",
    "HostWeightStore",
    "LookupPhase",
    "ProductionMetadata",
    "ProductionSourceMode",
    "RemoteArtifactDescriptor",
    "RemoteArtifactProvider",
    "RowCopyingTensorFileWriter",
    "TensorFileWriter",
    "TensorKind",
    "TensorWriteSpec",
    "ValidationLevel",
    "WeightBundleProducer",
    "WeightProducer",
    "WeightProductionSpec",
    "WeightRestorePlan",
    "WeightRestorer",
]


class CoordinationScope(str, enum.Enum):
    """Who cooperates to produce an artifact."""

    ARTIFACT_BUNDLE = "artifact_bundle"
    GROUP_COHORT = "group_cohort"
    SINGLE_PROCESS = "single_process"


class LookupPhase(str, enum.Enum):
    """When a producer may run: before the model loads, or only from a loaded model."""

    POST_LOAD_ONLY = "post_load_only"
    PRE_LOAD_SAFE = "pre_load_safe"


class ProductionSourceMode(str, enum.Enum):
    """What a producer reads: the checkpoint directly, or a finalized model."""

    CHECKPOINT_STREAM = "checkpoint_stream"
    FINALIZED_MODEL = "finalized_model"


@dataclass(frozen=True, slots=True)
class TensorWriteSpec:
    """One tensor a producer declares before writing it."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    kind: TensorKind = TensorKind.PARAMETER
    role: str = "weight"

    def __post_init__(self) -> None:
        if type(self.name) is not str or not self.name:
            raise ValueError("TensorWriteSpec.name must be a non-empty str")
        if type(self.shape) is not tuple or any(type(d) is not int or d < 0 for d in self.shape):
            raise ValueError(f"TensorWriteSpec.shape must be a tuple of non-negative ints, got {self.shape!r}")
        import torch  # whoever builds a spec holds a torch dtype, so torch is loaded already

        if not isinstance(self.dtype, torch.dtype):
            raise ValueError(f"TensorWriteSpec.dtype must be a torch.dtype, got {self.dtype!r}")
        if not isinstance(self.kind, TensorKind):
            raise ValueError("TensorWriteSpec.kind must be a TensorKind")
        if type(self.role) is not str or not self.role:
            raise ValueError("TensorWriteSpec.role must be a non-empty str")

    @property
    def numel(self) -> int:
        return numel_of(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * dtype_itemsize(self.dtype)


@runtime_checkable
class TensorFileWriter(Protocol):
    """Writes the declared tensors of one payload file at their fixed offsets."""

    def write_tensor(self, name: str, tensor: torch.Tensor) -> None: ...

    def write_rows(self, name: str, start_row: int, tensor: torch.Tensor) -> None: ...

    def close(self) -> None: ...

    def __enter__(self) -> TensorFileWriter:
        """`with writer.open_tensor_file(...) as f:` closes the file when the block succeeds."""
        ...

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None: ...


@runtime_checkable
class RowCopyingTensorFileWriter(TensorFileWriter, Protocol):
    """A payload file that also converts rows straight into its own bytes (one pass, nothing read back).

    `copy_rows` takes rows of any dtype and writes them converted to the declared dtype with
    `Tensor.copy_` rounding, in an ordered file's layout order like `write_rows`.
    """

    def copy_rows(self, name: str, start_row: int, rows: torch.Tensor) -> None: ...


@runtime_checkable
class ArtifactWriter(Protocol):
    """A store-scoped writer: the only way a producer puts bytes into an artifact."""

    def open_tensor_file(
        self,
        relative_name: str,
        specs: tuple[TensorWriteSpec, ...],
        *,
        ordered: bool = False,
    ) -> TensorFileWriter: ...


@dataclass(frozen=True, slots=True)
class ProductionMetadata:
    """What a producer reports about the artifact it wrote."""

    producer_schema: str
    restorer_schema: str
    format_metadata: CanonicalJson = field(default_factory=CanonicalJson.empty)


@dataclass(frozen=True, slots=True)
class WeightProductionSpec:
    """What a producer makes, when it may run and who must cooperate.

    `digest_algorithm` is how the store digests the payloads (recorded in the manifest). It is
    part of the producer's ABI: a producer that changes it must change its identity (for
    example its manifest schema), so that artifacts of either format never share a key.
    """

    producer_id: str
    outputs: tuple[WeightArtifactIdentity, ...]
    source_mode: ProductionSourceMode
    lookup_phase: LookupPhase = LookupPhase.PRE_LOAD_SAFE
    coordination_scope: CoordinationScope = CoordinationScope.SINGLE_PROCESS
    digest_algorithm: DigestAlgorithm = DEFAULT_DIGEST_ALGORITHM

    def __post_init__(self) -> None:
        if not isinstance(self.digest_algorithm, DigestAlgorithm):
            raise ValueError(
                f"WeightProductionSpec.digest_algorithm must be a DigestAlgorithm, got {self.digest_algorithm!r}"
            )


@runtime_checkable
class WeightProducer(Protocol):
    """Synchronous V1 producer; callers do not preempt an active build."""

    @property
    def spec(self) -> WeightProductionSpec: ...

    def produce(self, writer: ArtifactWriter) -> ProductionMetadata:
        """Produce one exact artifact synchronously or raise."""
        ...


@runtime_checkable
class BundleWriter(Protocol):
    """The writers of one ARTIFACT_BUNDLE build: one staging `ArtifactWriter` per output still to publish.

    Outputs already published when the bundle started are absent from `outputs`; a producer
    writes every output listed there and nothing else.
    """

    @property
    def outputs(self) -> tuple[WeightArtifactIdentity, ...]: ...

    def writer_for(self, identity: WeightArtifactIdentity) -> ArtifactWriter: ...


@runtime_checkable
class WeightBundleProducer(Protocol):
    """An ARTIFACT_BUNDLE producer: one pass over its source writes every listed output.

    It returns each written output's metadata keyed by identity key; the store seals and
    publishes each output atomically, so a crash leaves none or a consistent subset.
    """

    @property
    def spec(self) -> WeightProductionSpec: ...

    def produce(self, writer: ArtifactWriter) -> ProductionMetadata: ...

    def produce_bundle(self, writers: BundleWriter) -> dict[str, ProductionMetadata]: ...


@dataclass(frozen=True, slots=True)
class BuildRequest:
    """A request to build (or join the build of) one exact artifact."""

    identity: WeightArtifactIdentity


@runtime_checkable
class HostWeightStore(Protocol):
    """Exact artifact access whose deadlines bound lock acquisition only."""

    def get_or_build(
        self,
        request: BuildRequest,
        producer: WeightProducer,
        *,
        validation: ValidationLevel,
        deadline: float,
    ) -> StoreResult: ...

    def lookup(
        self,
        identity: WeightArtifactIdentity,
        *,
        validation: ValidationLevel,
        deadline: float | None = None,
    ) -> StoreResult: ...


@runtime_checkable
class WeightRestorePlan(Protocol):
    """A validated, one-shot model mutation plan."""

    def commit(self) -> None:
        """Mutate the target model exactly once or raise."""
        ...


@runtime_checkable
class WeightRestorer(Protocol):
    """Validate a lease-to-model restore without mutating either input."""

    @property
    def schema(self) -> str: ...

    def plan_restore(self, model: object, lease: HostWeightLease) -> WeightRestorePlan:
        """Return a validated plan; all model mutation is deferred to commit()."""
        ...


@dataclass(frozen=True, slots=True)
class RemoteArtifactDescriptor:
    """An exact artifact offered by a remote provider, with the digests to check on import."""

    provider_id: str
    identity: WeightArtifactIdentity
    manifest_sha256: str
    content_sha256: str


@runtime_checkable
class RemoteArtifactProvider(Protocol):
    """A source of exact artifacts beyond this node, tried after a local miss.

    `FsspecArtifactProvider` (remote/provider.py) implements it over fsspec URLs: the store's
    writer hashes every fetched byte, and a digest that differs from the remote manifest fails the import.
    """

    @property
    def provider_id(self) -> str: ...

    def probe(self, identity: WeightArtifactIdentity) -> RemoteArtifactDescriptor | None: ...

    def fetch(self, descriptor: RemoteArtifactDescriptor, writer: ArtifactWriter) -> ProductionMetadata: ...

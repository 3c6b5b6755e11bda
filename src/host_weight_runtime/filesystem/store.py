"""FilesystemHostWeightStore: the node-local store of immutable, hashed artifacts.

One process builds a given key while holding its build lock; readers hold the
artifact lock shared for a lease's whole life; publication and removal take the
artifact lock exclusively. The final `rename` into `artifacts/` is the guarantee:
if builders ever raced past the lock, the worst outcome is a join or a typed
collision, never a torn artifact.

The store is the front door; each of its jobs lives in one private module:

- `_lookup`: validate a published artifact and map it into a lease (`ArtifactLookup.make_lease`);
- `_build`: the build lock, join, quarantine-and-rebuild, and running the producer into staging;
- `_publication`: sealing staging (manifest, READY, permissions, fsync) and the commit rename;
- `_deny`: deny markers for artifacts that failed validation;
- `_maintenance`: cleanup and inspection.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from ..config import CapacityPolicy, HostWeightRuntimeConfig, StorageClass
from ..failures import FailureCode, HostWeightError, ResolutionStage, failure
from ..identity import WeightArtifactIdentity
from ..lease import LeaseSource
from ..outcomes import CleanupResult, StoreResult
from ..protocols import BuildRequest, CoordinationScope, WeightProducer
from ..tensors import ValidationLevel
from ._build import ArtifactBuilder
from ._deny import DenyMarkers
from ._layout import DomainLayout
from ._lookup import ArtifactLookup
from ._maintenance import DomainMaintenance
from .capacity import CapacityGuard
from .domain import DomainInfo, MountTable, open_domain
from .inspection import ArtifactInspection, DomainInspection

__all__ = ["FilesystemHostWeightStore"]


class FilesystemHostWeightStore:
    """A `HostWeightStore` on one node-local directory (tmpfs or local disk)."""

    def __init__(
        self,
        root: Path,
        *,
        storage_class: StorageClass = StorageClass.AUTO,
        capacity: CapacityPolicy | None = None,
        scope: CoordinationScope = CoordinationScope.SINGLE_PROCESS,
        init_timeout_s: float = 30.0,
        mount_table: MountTable | None = None,
        hash_threads: int | None = None,
    ) -> None:
        if scope is not CoordinationScope.SINGLE_PROCESS:
            raise HostWeightError(
                failure(
                    ResolutionStage.DOMAIN,
                    FailureCode.UNSUPPORTED,
                    f"coordination scope {scope.value} is not implemented yet; use single_process",
                    scope=scope.value,
                )
            )
        self._domain: DomainInfo = open_domain(
            Path(root),
            storage_class=storage_class,
            capacity=capacity,
            scope=scope,
            init_timeout_s=init_timeout_s,
            mount_table=mount_table,
        )
        self._layout = DomainLayout(self._domain.root)
        capacity_guard = CapacityGuard(self._layout, self._domain.capacity, self._domain.storage_class)
        deny = DenyMarkers(self._layout)
        self._lookup = ArtifactLookup(self._domain.domain_id, self._layout, deny, hash_threads)
        self._builder = ArtifactBuilder(self._layout, capacity_guard, self._lookup, deny, hash_threads)
        self._maintenance = DomainMaintenance(self._domain, self._layout, capacity_guard, deny, hash_threads)

    @classmethod
    def from_config(cls, config: HostWeightRuntimeConfig) -> FilesystemHostWeightStore:
        return cls(
            config.resolved_root,
            storage_class=config.storage_class,
            capacity=config.capacity,
            init_timeout_s=min(config.lock_timeout_s, 60.0),
        )

    @property
    def domain(self) -> DomainInfo:
        return self._domain

    @property
    def root(self) -> Path:
        return self._domain.root

    @property
    def layout(self) -> DomainLayout:
        return self._layout

    # ------------------------------------------------------------------ lookup and build

    def lookup(
        self,
        identity: WeightArtifactIdentity,
        *,
        validation: ValidationLevel,
        deadline: float | None = None,
    ) -> StoreResult:
        """Validated lease of a published artifact, or MISS / INVALID / FAILED; never builds."""
        return self._lookup.lookup(identity, validation=validation, deadline=deadline, source=LeaseSource.LOCAL_HIT)

    def get_or_build(
        self,
        request: BuildRequest,
        producer: WeightProducer,
        *,
        validation: ValidationLevel,
        deadline: float,
        lease_source: LeaseSource = LeaseSource.BUILT,
    ) -> StoreResult:
        """HIT if published; else build once under the build lock (BUILT) or join another builder (JOINED).

        `lease_source` is the provenance a lease of an artifact this call built carries
        (a remote import passes REMOTE_IMPORT); hits and joins keep their own.
        """
        return self._builder.get_or_build(
            request, producer, validation=validation, deadline=deadline, lease_source=lease_source
        )

    def _build_locked(
        self,
        identity: WeightArtifactIdentity,
        producer: WeightProducer,
        *,
        validation: ValidationLevel,
        deadline: float,
    ) -> StoreResult:
        """The build without taking the build lock (tests call it bare to race two builders)."""
        return self._builder.build_locked(identity, producer, validation=validation, deadline=deadline)

    # ------------------------------------------------------------------ maintenance

    def cleanup(self, key: str, *, dry_run: bool = False) -> CleanupResult:
        """Remove one key's artifact, deny marker, temporaries and quarantined copies; never waits for a lock.

        With `dry_run` nothing is removed and the result (status PLANNED) lists what would be.
        """
        return self._maintenance.cleanup(key, dry_run=dry_run)

    def inspect_artifact(
        self,
        key: str | WeightArtifactIdentity,
        *,
        validation: ValidationLevel = ValidationLevel.MANIFEST_AND_METADATA,
        deadline: float | None = None,
        progress: Callable[[int], None] | None = None,
    ) -> ArtifactInspection:
        """Validate one artifact read-only; reports problems but never denies or quarantines."""
        return self._maintenance.inspect_artifact(key, validation=validation, deadline=deadline, progress=progress)

    def inspect_domain(self) -> DomainInspection:
        """Inventory of ready, denied, quarantined and temporary artifacts, with capacity."""
        return self._maintenance.inspect_domain()

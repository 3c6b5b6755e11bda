"""FilesystemHostWeightStore: the node-local store of immutable, hashed artifacts.

One process builds a given key while holding its build lock; readers hold the
artifact lock shared for a lease's whole life; publication and removal take the
artifact lock exclusively. The final `rename` into `artifacts/` is the guarantee:
if builders ever raced past the lock, the worst outcome is a join or a typed
collision, never a torn artifact.

The store is the front door; each of its jobs lives in one private module:

- `_lookup`: validate a published artifact and map it into a lease (`ArtifactLookup.make_lease`);
- `_build`: the build lock, join, quarantine-and-rebuild, and running the producer into staging;
- `_bundle`: ARTIFACT_BUNDLE builds, one producer pass for several outputs, each published atomically;
- `_staging`: the steps both build paths share (stale staging, a new staging directory, the manifest);
- `_publication`: sealing staging (manifest, READY, permissions, fsync) and the commit rename;
- `_deny`: deny markers for artifacts that failed validation;
- `_verify`: the background full verification of each publication once per node (HWR_BACKGROUND_VERIFY);
- `_maintenance`: cleanup and inspection;
- `_eviction`, `_usage`, `garbage`: the usage ledger, LRU eviction that honours leases, and `gc`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from ..config import CapacityPolicy, EvictionPolicy, HostWeightRuntimeConfig, StorageClass
from ..failures import FailureCode, HostWeightError, ResolutionStage, failure
from ..identity import WeightArtifactIdentity
from ..lease import LeaseSource
from ..outcomes import CleanupResult, StoreResult
from ..protocols import BuildRequest, CoordinationScope, WeightBundleProducer, WeightProducer
from ..tensors import ValidationLevel
from ._build import ArtifactBuilder
from ._bundle import BundleBuilder
from ._deny import DenyMarkers
from ._eviction import Evictor
from ._layout import DomainLayout
from ._lookup import ArtifactLookup
from ._maintenance import DomainMaintenance
from ._prefault import prefault_enabled
from ._verify import BackgroundVerifyMode, VerificationLedger, VerificationRecord, background_verify_mode
from .capacity import CapacityGuard
from .domain import DomainInfo, MountTable, open_domain
from .garbage import DEFAULT_QUARANTINE_RETENTION_S, GarbageCollector, GcPlan, GcResult
from .inspection import ArtifactInspection, DomainInspection, DomainUsage

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
        eviction: EvictionPolicy = EvictionPolicy.LRU,
        background_verify: BackgroundVerifyMode | None = None,
        prefault: bool | None = None,
    ) -> None:
        """`background_verify=None` reads HWR_BACKGROUND_VERIFY (default `once`, see `_verify`) and
        `prefault=None` reads HWR_PREFAULT (default on, see `_prefault`), both through `from_env`."""
        if not isinstance(eviction, EvictionPolicy):
            raise ValueError(f"eviction must be an EvictionPolicy, got {eviction!r}")
        if background_verify is None:
            background_verify = background_verify_mode()
        elif not isinstance(background_verify, BackgroundVerifyMode):
            raise ValueError(f"background_verify must be a BackgroundVerifyMode or None, got {background_verify!r}")
        if prefault is None:
            prefault = prefault_enabled()
        elif type(prefault) is not bool:
            raise ValueError(f"prefault must be a bool or None, got {prefault!r}")
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
        self._eviction = eviction
        storage = self._domain.storage_class.value
        capacity_guard = CapacityGuard(self._layout, self._domain.capacity, self._domain.storage_class)
        deny = DenyMarkers(self._layout)
        evictor = Evictor(self._layout, storage)
        self._lookup = ArtifactLookup(
            self._domain.domain_id,
            self._layout,
            deny,
            hash_threads,
            storage,
            verify_mode=background_verify,
            prefault=prefault,
        )
        self._builder = ArtifactBuilder(
            self._layout,
            capacity_guard,
            self._lookup,
            deny,
            hash_threads,
            evictor=evictor if eviction is EvictionPolicy.LRU else None,
            storage_class=storage,
        )
        self._bundles = BundleBuilder(self._layout, capacity_guard, self._lookup, hash_threads)
        self._maintenance = DomainMaintenance(self._domain, self._layout, capacity_guard, deny, hash_threads)
        self._garbage = GarbageCollector(self._layout, capacity_guard, evictor)

    @classmethod
    def from_config(cls, config: HostWeightRuntimeConfig) -> FilesystemHostWeightStore:
        return cls(
            config.resolved_root,
            storage_class=config.storage_class,
            capacity=config.capacity,
            init_timeout_s=min(config.lock_timeout_s, 60.0),
            eviction=config.eviction,
            background_verify=config.background_verify,
            prefault=config.prefault,
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

    @property
    def eviction(self) -> EvictionPolicy:
        """What a build does when the domain is full (HWR_EVICTION)."""
        return self._eviction

    # ------------------------------------------------------------------ lookup and build

    def lookup(
        self,
        identity: WeightArtifactIdentity,
        *,
        validation: ValidationLevel,
        deadline: float | None = None,
        prefault: bool = True,
    ) -> StoreResult:
        """Validated lease of a published artifact, or MISS / INVALID / FAILED; never builds.

        `prefault=False` leaves the lease's pages unmapped until read (a caller that only holds the
        artifact in place, or reads it with system calls, as a push does, saves the page-table work).
        """
        return self._lookup.lookup(
            identity, validation=validation, deadline=deadline, source=LeaseSource.LOCAL_HIT, prefault=prefault
        )

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
        An ARTIFACT_BUNDLE `WeightBundleProducer` builds all its missing outputs in one pass.
        """
        if producer.spec.coordination_scope is CoordinationScope.ARTIFACT_BUNDLE and isinstance(
            producer, WeightBundleProducer
        ):
            return self._bundles.get_or_build(request, producer, validation=validation, deadline=deadline)
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

    def background_verification(self, key: str) -> VerificationRecord | None:
        """This node's record that a publication of `key` was fully re-hashed and matched (S08), if any.

        Compare its `publication_id` with the artifact's: a record of an earlier publication says nothing
        about the current one.
        """
        return VerificationLedger(self._layout).read(key)

    def inspect_domain(self) -> DomainInspection:
        """Inventory of ready, denied, quarantined and temporary artifacts, with capacity."""
        return self._maintenance.inspect_domain()

    def usage(self) -> DomainUsage:
        """A cheap summary (counts, bytes, live leases) without validating or hashing anything."""
        return self._maintenance.usage()

    # ------------------------------------------------------------------ garbage collection

    def plan_gc(
        self,
        *,
        max_bytes: int | None = None,
        older_than_s: float | None = None,
        quarantine_older_than_s: float = DEFAULT_QUARANTINE_RETENTION_S,
    ) -> GcPlan:
        """What `execute_gc` would free: unleased artifacts (LRU down to `max_bytes`, or unused for longer
        than `older_than_s`), stale deny markers, old quarantined copies and dead builds' leftovers. Read-only."""
        return self._garbage.plan(
            max_bytes=max_bytes, older_than_s=older_than_s, quarantine_older_than_s=quarantine_older_than_s
        )

    def execute_gc(self, plan: GcPlan, *, deadline: float | None = None) -> GcResult:
        """Remove exactly the planned items that are still as planned; a lease that appeared keeps its artifact.

        `deadline` bounds the wait for the domain's capacity lock (held while a build reserves space).
        """
        return self._garbage.execute(plan, deadline=deadline)

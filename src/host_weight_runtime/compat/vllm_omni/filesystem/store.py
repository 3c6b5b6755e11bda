"""The reference's `FilesystemHostWeightStore` constructor and results over this runtime's one store."""

from __future__ import annotations

from pathlib import Path

from ....canonical_json import CanonicalJson, JsonValue
from ....config import EvictionPolicy, StorageClass
from ....failures import FailureCode, HostWeightError, HostWeightFailure, ResolutionStage, failure
from ....filesystem import DomainLayout
from ....filesystem.domain import classify_filesystem, read_mount_table
from ....filesystem.store import FilesystemHostWeightStore as NativeStore
from ....identity import WeightArtifactIdentity
from ....lease import HostWeightLease
from ....outcomes import CleanupStatus, StoreStatus
from ....outcomes import StoreResult as NativeStoreResult
from ....protocols import BuildRequest, WeightProducer
from ..config import (
    CapacityPolicy,
    IntegrityPolicy,
    StorageDomainPolicy,
    ValidationLevel,
    WaitPolicy,
    native_validation,
)
from ..inspection import ArtifactInspection, DomainInspection, inventory_entry_of
from ..manifest import WeightManifest
from ..outcomes import StoreResult, store_result_of

__all__ = [
    "FilesystemHostWeightStore",
    "detect_filesystem_type",
    "detect_storage_class",
    "native_store_result",
]


def detect_filesystem_type(path: Path) -> str:
    """The filesystem type of the mount holding `path` (or its nearest existing ancestor)."""
    return read_mount_table().find(path).fs_type


def detect_storage_class(path: Path) -> StorageClass:
    """TMPFS or DISK for a node-local filesystem; a typed DOMAIN failure for one that cannot back a domain."""
    fs_type = detect_filesystem_type(path)
    found = classify_filesystem(fs_type)
    if found is None:
        raise ValueError(f"{path} is on {fs_type}, which is not node-local: a domain needs tmpfs or a local disk")
    return found


_DEFAULT_WAIT = WaitPolicy()


def _domain_failure(found: HostWeightFailure, root: Path) -> HostWeightFailure:
    """The reference's words for two domain failures.

    A root on a filesystem that is not node-local is its DOMAIN_POLICY_MISMATCH; a domain whose init lock
    stays held is its DOMAIN_UNAVAILABLE (retryable), naming the lock.
    """
    if found.code is FailureCode.UNSUPPORTED_FILESYSTEM:
        return HostWeightFailure(found.stage, FailureCode.DOMAIN_POLICY_CONFLICT, False, found.message, found.details)
    if found.stage is not ResolutionStage.DOMAIN or found.code is not FailureCode.LOCK_TIMEOUT:
        return found
    lock = DomainLayout(root).domain_init_lock
    message = f"timed out waiting for {lock}: {found.message}"
    return HostWeightFailure(ResolutionStage.DOMAIN, FailureCode.DOMAIN_UNAVAILABLE, True, message, found.details)


def _require_node_local(root: Path) -> None:
    """Refuse a root whose filesystem is not node-local before anything is created.

    Asked through this module's `detect_filesystem_type`, as the reference's store does, so code that
    substitutes it (to simulate NFS, say) sees the same refusal; the store checks the mount table again.
    """
    fs_type = detect_filesystem_type(root)
    if classify_filesystem(fs_type) is None:
        message = f"the domain root {root} is on {fs_type}, which is not node-local: a domain needs tmpfs or local disk"
        code = FailureCode.DOMAIN_POLICY_CONFLICT
        raise HostWeightError(failure(ResolutionStage.DOMAIN, code, message, root=str(root), fs_type=fs_type))


def _fs_verity_unsupported() -> StoreResult:
    found = failure(ResolutionStage.CONFIGURATION, FailureCode.UNSUPPORTED, "fs-verity validation is not implemented")
    return StoreResult(StoreStatus.FAILED, failure=found)


def _unsupported(message: str) -> HostWeightError:
    return HostWeightError(failure(ResolutionStage.CONFIGURATION, FailureCode.UNSUPPORTED, message))


class FilesystemHostWeightStore:
    """This runtime's filesystem store, opened from the reference's policies; `native` is the store itself."""

    def __init__(
        self,
        domain: StorageDomainPolicy,
        capacity: CapacityPolicy,
        integrity: IntegrityPolicy,
        *,
        wait: WaitPolicy = _DEFAULT_WAIT,
    ) -> None:
        if integrity.local_lookup is ValidationLevel.FS_VERITY:
            raise _unsupported("filesystem-verity validation is not implemented")
        if domain.numa_prefault or domain.verify_numa_residency:
            raise _unsupported("enforced NUMA placement and residency verification are not implemented")
        if integrity.background_scrub:
            raise _unsupported("background integrity scrubbing is not implemented; see HWR_BACKGROUND_VERIFY")
        self.domain_policy = domain
        self.capacity_policy = capacity
        self.integrity_policy = integrity
        self.root = domain.root.expanduser().resolve()
        _require_node_local(self.root)
        try:
            self.native = NativeStore(
                self.root,
                storage_class=domain.storage_class,
                capacity=capacity.native(),
                init_timeout_s=float(wait.coordination_timeout_seconds),
                eviction=EvictionPolicy(capacity.eviction),
            )
        except HostWeightError as exc:
            raise HostWeightError(_domain_failure(exc.failure, self.root)) from exc
        layout = self.native.layout
        self.locks_dir, self.artifacts_dir, self.tmp_dir = layout.locks, layout.artifacts, layout.tmp
        self.quarantine_dir, self.deny_dir = layout.quarantine, layout.deny
        self.filesystem_type = self.native.domain.fs_type
        self.domain_uuid = self.native.domain.domain_id

    def lookup(
        self, identity: WeightArtifactIdentity, *, validation: ValidationLevel, deadline: float | None = None
    ) -> StoreResult:
        if ValidationLevel(validation) is ValidationLevel.FS_VERITY:
            return _fs_verity_unsupported()
        level = native_validation(ValidationLevel(validation))
        return store_result_of(self.native.lookup(identity, validation=level, deadline=deadline))

    def get_or_build(
        self, request: BuildRequest, producer: WeightProducer, *, validation: ValidationLevel, deadline: float
    ) -> StoreResult:
        if ValidationLevel(validation) is ValidationLevel.FS_VERITY:
            return _fs_verity_unsupported()
        # First through this object's own `lookup`, as the reference's store does, so what a subclass or a
        # caller puts in its place is asked too; a hit ends here, anything else goes to the native build.
        found = self.lookup(request.identity, validation=validation, deadline=deadline)
        if found.status is StoreStatus.HIT:
            return found
        level = native_validation(ValidationLevel(validation))
        return store_result_of(self.native.get_or_build(request, producer, validation=level, deadline=deadline))

    def cleanup(self, identity: WeightArtifactIdentity) -> HostWeightFailure | None:
        """Remove the artifact if nobody uses it; the reason it was not removed, else None."""
        result = self.native.cleanup(identity.key)
        if result.status in (CleanupStatus.REMOVED, CleanupStatus.NOT_PRESENT, CleanupStatus.PLANNED):
            return None
        if result.failure is not None:
            return result.failure
        code = FailureCode.ACTIVE_BUILD if result.status is CleanupStatus.ACTIVE_BUILD else FailureCode.ACTIVE_LEASE
        return failure(
            ResolutionStage.CLEANUP, code, f"{identity.key} is in use ({result.status.value})", retryable=True
        )

    def inspect_domain(self) -> DomainInspection:
        found = self.native.inspect_domain()
        entries = tuple(entry for entry in map(inventory_entry_of, found.artifacts) if entry is not None)
        policy = found.capacity.policy
        return DomainInspection(
            domain_uuid=found.domain_id,
            scope=self.domain_policy.scope.value,
            domain_id=self.domain_policy.domain_id,
            storage_class=found.storage_class,
            filesystem_type=found.fs_type,
            policy_version=1,
            store_bytes=found.capacity.store_bytes,
            filesystem_free_bytes=found.capacity.free_bytes,
            max_artifact_bytes=policy.max_artifact_bytes,
            max_store_bytes=policy.max_store_bytes,
            min_free_bytes=policy.min_free_bytes,
            inventory=entries,
        )

    def inspect_artifact(self, identity: WeightArtifactIdentity, *, validation: ValidationLevel) -> ArtifactInspection:
        """A lookup that reports what it found (and closes the lease it took)."""
        found = self.native.inspect_artifact(identity.key)
        result = self.lookup(identity, validation=validation)
        manifest = fingerprint = None
        if result.lease is not None:
            manifest = WeightManifest.from_native(result.lease.manifest)
            fingerprint = result.lease.provenance.backing_fingerprint
            result.lease.close()
        return ArtifactInspection(
            artifact_key=identity.key,
            status=result.status,
            size_bytes=found.size_bytes,
            manifest=manifest,
            publication_id=found.publication_id,
            backing_fingerprint=fingerprint,
            failure=result.failure,
            build_lock_active=found.locks.build_active,
            artifact_lock_active=found.locks.lease_active,
        )


def native_store_result(
    result: object, identity: WeightArtifactIdentity, *, stage: ResolutionStage = ResolutionStage.LOOKUP
) -> NativeStoreResult:
    """This runtime's result for a store written to the reference's protocol (either result shape)."""
    if isinstance(result, NativeStoreResult):
        return result
    if not isinstance(result, StoreResult):
        raise TypeError(f"the store returned {type(result).__name__}, not a StoreResult")
    status = result.status
    if status is StoreStatus.TIMEOUT and result.failure is None:  # pragma: no cover - StoreResult refuses it
        raise ValueError("a TIMEOUT store result needs a failure")
    lease: object = result.lease
    if lease is not None and not isinstance(lease, HostWeightLease):
        return _foreign_lease(status, identity, lease, stage)
    return NativeStoreResult(status, identity, result.lease, result.failure)


def _foreign_lease(
    status: StoreStatus, identity: WeightArtifactIdentity, lease: object, stage: ResolutionStage
) -> NativeStoreResult:
    """A store's lease that is not this runtime's is closed and refused (UNEXPECTED_STATUS): never handed out."""
    details: dict[str, JsonValue] = {"status": status.value, "lease_type": type(lease).__name__}
    close = getattr(lease, "close", None)
    try:
        if callable(close):
            close()
    except Exception as exc:  # the refusal stands; the close failure is reported with it
        details["lease_close_exception_type"] = type(exc).__name__
    message = f"the store returned a {type(lease).__name__} as its lease, not a HostWeightLease; it was closed"
    found = HostWeightFailure(stage, FailureCode.UNEXPECTED_STATUS, False, message, CanonicalJson.from_value(details))
    return NativeStoreResult(StoreStatus.FAILED, identity, None, found)

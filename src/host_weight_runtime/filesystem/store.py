"""FilesystemHostWeightStore: the node-local store of immutable, hashed artifacts.

One process builds a given key while holding its build lock; readers hold the
artifact lock shared for a lease's whole life; publication and removal take the
artifact lock exclusively. The final `rename` into `artifacts/` is the guarantee:
if builders ever raced past the lock, the worst outcome is a join or a typed
collision, never a torn artifact.
"""

from __future__ import annotations

import contextlib
import errno
import os
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from .._digest import DIGEST_ALGORITHM, content_digest
from .._faults import fault_point
from ..canonical_json import encode_canonical
from ..config import CapacityPolicy, HostWeightRuntimeConfig, StorageClass
from ..failures import FailureCode, HostWeightError, HostWeightFailure, ResolutionStage, failure
from ..identity import WeightArtifactIdentity
from ..lease import HostWeightLease, LeaseProvenance, LeaseSource
from ..manifest import (
    MANIFEST_FILE_NAME,
    READY_FILE_NAME,
    PublicationMarker,
    WeightManifest,
    manifest_sha256,
)
from ..outcomes import CleanupResult, CleanupStatus, StoreResult, StoreStatus
from ..protocols import BuildRequest, CoordinationScope, ProductionMetadata, WeightProducer
from ..tensors import ValidationLevel
from ._fsutil import fsync_dir, remove_tree, tree_bytes, write_file_atomic, write_new_file
from ._layout import DomainLayout, check_key
from ._prefault import BackgroundPrefault, prefault_enabled
from .capacity import CapacityGuard, failure_from_os_error
from .domain import DomainInfo, MountTable, open_domain
from .inspection import ArtifactInspection, ArtifactState, DomainInspection, LockActivity
from .locks import FileLock, acquire_lock, lock_in_use, try_lock
from .reader import ArtifactReadError, InvalidArtifactError, ValidatedArtifact, open_artifact
from .writer import StagingArtifactWriter, WrittenFile

_PRIVATE_DIR_MODE = 0o700


class _BuildFailedError(Exception):
    """Internal: a build step failed with a typed failure; staging is removed by the caller."""

    def __init__(self, failure: HostWeightFailure) -> None:
        super().__init__(failure.message)
        self.failure = failure


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
        self._capacity = CapacityGuard(self._layout, self._domain.capacity, self._domain.storage_class)
        self._hash_threads = hash_threads

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

    def _artifact_lock(
        self, key: str, *, exclusive: bool, deadline: float | None, stage: ResolutionStage, what: str
    ) -> FileLock:
        """Take `key`'s artifact lock: shared to read or lease, exclusive to publish or move it."""
        return acquire_lock(
            self._layout.artifact_lock(key), exclusive=exclusive, deadline=deadline, stage=stage, what=what
        )

    # ------------------------------------------------------------------ lookup

    def lookup(
        self,
        identity: WeightArtifactIdentity,
        *,
        validation: ValidationLevel,
        deadline: float | None = None,
    ) -> StoreResult:
        """Validated lease of a published artifact, or MISS / INVALID / FAILED; never builds."""
        return self._lookup(identity, validation=validation, deadline=deadline, source=LeaseSource.LOCAL_HIT)

    def _lookup(
        self,
        identity: WeightArtifactIdentity,
        *,
        validation: ValidationLevel,
        deadline: float | None,
        source: LeaseSource,
    ) -> StoreResult:
        started = time.monotonic()
        key = identity.key
        try:
            lock = self._artifact_lock(
                key, exclusive=False, deadline=deadline, stage=ResolutionStage.LOOKUP, what="the artifact lock"
            )
        except HostWeightError as exc:
            return StoreResult(StoreStatus.FAILED, identity, failure=exc.failure, elapsed_s=time.monotonic() - started)
        lease: HostWeightLease | None = None
        try:
            status, lease, problem = self._lookup_locked(identity, lock, validation=validation, source=source)
            return StoreResult(
                status,
                identity,
                lease=lease,
                failure=problem,
                publication_id=None if lease is None else lease.publication_id,
                elapsed_s=time.monotonic() - started,
            )
        finally:
            if lease is None:
                lock.release()

    def _lookup_locked(
        self,
        identity: WeightArtifactIdentity,
        lock: FileLock,
        *,
        validation: ValidationLevel,
        source: LeaseSource,
    ) -> tuple[StoreStatus, HostWeightLease | None, HostWeightFailure | None]:
        key = identity.key
        artifact_dir = self._layout.artifact_dir(key)
        if not os.path.lexists(artifact_dir):
            return StoreStatus.MISS, None, None
        if self._denied(key):
            return StoreStatus.INVALID, None, self._denied_failure(key)
        try:
            validated = open_artifact(
                artifact_dir, key, identity=identity, validation=validation, hash_threads=self._hash_threads
            )
        except ArtifactReadError as exc:
            return StoreStatus.FAILED, None, exc.failure
        except InvalidArtifactError as exc:
            deny_failure = self._write_deny(key, exc.failure)
            if deny_failure is not None:
                return StoreStatus.FAILED, None, deny_failure
            return StoreStatus.INVALID, None, exc.failure
        lease = self._make_lease(identity, validated, lock, validation=validation, source=source)
        fault_point("lookup.before_deny_recheck")
        if self._denied(key):
            # A stronger concurrent lookup denied the artifact after we validated it.
            lease.close()
            return StoreStatus.INVALID, None, self._denied_failure(key)
        return StoreStatus.HIT, lease, None

    def _make_lease(
        self,
        identity: WeightArtifactIdentity,
        validated: ValidatedArtifact,
        lock: FileLock,
        *,
        validation: ValidationLevel,
        source: LeaseSource,
    ) -> HostWeightLease:
        provenance = LeaseProvenance(
            source=source,
            domain_id=self._domain.domain_id,
            artifact_dir=str(self._layout.artifact_dir(identity.key)),
            publication_id=validated.marker.publication_id,
            validation=validation,
            pid=os.getpid(),
            acquired_at_ns=time.time_ns(),
        )
        regions = validated.regions()
        mappings = validated.mappings()
        prefault = (
            BackgroundPrefault([(region.address, region.length) for region in regions], mappings)
            if prefault_enabled()
            else None
        )
        return HostWeightLease(
            identity=identity,
            manifest=validated.manifest,
            tensors=validated.tensors(),
            regions=regions,
            provenance=provenance,
            mappings=mappings,
            lock=lock,
            background=prefault,
        )

    def _denied(self, key: str) -> bool:
        return os.path.lexists(self._layout.deny_marker(key))

    def _denied_failure(self, key: str) -> HostWeightFailure:
        return failure(
            ResolutionStage.LOOKUP,
            FailureCode.ARTIFACT_DENIED,
            f"artifact {key[:16]}... failed validation earlier and is denied; "
            "the next build quarantines and rebuilds it",
            key=key,
        )

    def _write_deny(self, key: str, problem: HostWeightFailure) -> HostWeightFailure | None:
        """Write the deny marker; return a retryable failure if that write itself failed."""
        record = {
            "key": key,
            "code": problem.code.value,
            "message": problem.message,
            "pid": os.getpid(),
            "denied_at_ns": time.time_ns(),
        }
        try:
            fault_point("store.write_deny")
            write_file_atomic(self._layout.deny_marker(key), encode_canonical(record))
        except OSError as exc:
            io_failure = failure_from_os_error(exc, stage=ResolutionStage.LOOKUP, what="writing the deny marker")
            return HostWeightFailure(
                ResolutionStage.LOOKUP,
                io_failure.code,
                True,
                f"the artifact is invalid ({problem.code.value}) but its deny marker could not be written: "
                f"{io_failure.message}",
                io_failure.details,
            )
        return None

    # ------------------------------------------------------------------ build

    def get_or_build(
        self,
        request: BuildRequest,
        producer: WeightProducer,
        *,
        validation: ValidationLevel,
        deadline: float,
    ) -> StoreResult:
        """HIT if published; else build once under the build lock (BUILT) or join another builder (JOINED)."""
        started = time.monotonic()
        identity = request.identity
        first = self.lookup(identity, validation=validation, deadline=deadline)
        if first.status in (StoreStatus.HIT, StoreStatus.FAILED):
            return first
        spec_problem = self._check_producer(identity, producer)
        if spec_problem is not None:
            return StoreResult(StoreStatus.FAILED, identity, failure=spec_problem, elapsed_s=time.monotonic() - started)
        try:
            fault_point("build.waiting_for_lock")
            build_lock = acquire_lock(
                self._layout.build_lock(identity.key),
                exclusive=True,
                deadline=deadline,
                stage=ResolutionStage.PRODUCTION,
                what="the build lock (another process is building this artifact)",
            )
        except HostWeightError as exc:
            return StoreResult(StoreStatus.FAILED, identity, failure=exc.failure, elapsed_s=time.monotonic() - started)
        try:
            result = self._build_locked(identity, producer, validation=validation, deadline=deadline)
        finally:
            build_lock.release()
        return StoreResult(
            result.status,
            identity,
            lease=result.lease,
            failure=result.failure,
            publication_id=result.publication_id,
            elapsed_s=time.monotonic() - started,
        )

    def _check_producer(self, identity: WeightArtifactIdentity, producer: WeightProducer) -> HostWeightFailure | None:
        spec = producer.spec
        if spec.coordination_scope is not CoordinationScope.SINGLE_PROCESS:
            return failure(
                ResolutionStage.PRODUCTION,
                FailureCode.UNSUPPORTED,
                f"coordination scope {spec.coordination_scope.value} is not implemented yet; "
                "use a single_process producer",
                scope=spec.coordination_scope.value,
            )
        if identity not in spec.outputs:
            return failure(
                ResolutionStage.PRODUCTION,
                FailureCode.INVALID_CONFIGURATION,
                f"producer {spec.producer_id} does not declare the requested identity among its outputs",
            )
        return None

    def _build_locked(
        self,
        identity: WeightArtifactIdentity,
        producer: WeightProducer,
        *,
        validation: ValidationLevel,
        deadline: float,
    ) -> StoreResult:
        """The build itself. The caller holds the build lock (tests call it bare to race two builders)."""
        key = identity.key
        own_prefix = f"{key}.{os.getpid()}."
        for stale in self._layout.staging_dirs(key):
            # Holding the build lock, any other staging directory of this key is a dead builder's;
            # our own process's may belong to a concurrent lockless call and is left alone.
            if not stale.name.startswith(own_prefix):
                remove_tree(stale)
        joined = self._lookup(identity, validation=validation, deadline=deadline, source=LeaseSource.JOINED)
        if joined.status is StoreStatus.HIT:
            assert joined.lease is not None
            return StoreResult(StoreStatus.JOINED, identity, lease=joined.lease, publication_id=joined.publication_id)
        if joined.status is StoreStatus.FAILED:
            return joined
        if joined.status is StoreStatus.INVALID:
            problem = self._quarantine_published(key, deadline=deadline)
            if problem is not None:
                return StoreResult(StoreStatus.FAILED, identity, failure=problem)
        else:
            self._remove_orphan_deny(key)
        staging = self._layout.new_staging_dir(key)
        try:
            os.mkdir(staging, _PRIVATE_DIR_MODE)
        except OSError as exc:
            problem = failure_from_os_error(
                exc, stage=ResolutionStage.PRODUCTION, what="creating the staging directory"
            )
            return StoreResult(StoreStatus.FAILED, identity, failure=problem)
        try:
            fault_point("build.staging_created")
            manifest = self._produce_into(staging, identity, producer)
            marker = self._seal(staging, manifest)
            return self._publish(staging, identity, manifest, marker, deadline=deadline)
        except _BuildFailedError as exc:
            self._discard(staging)
            return StoreResult(StoreStatus.FAILED, identity, failure=exc.failure)
        except OSError as exc:
            self._discard(staging)
            problem = failure_from_os_error(exc, stage=ResolutionStage.PUBLICATION, what="publishing the artifact")
            return StoreResult(StoreStatus.FAILED, identity, failure=problem)
        except BaseException:
            self._discard(staging)
            raise

    def _produce_into(
        self, staging: Path, identity: WeightArtifactIdentity, producer: WeightProducer
    ) -> WeightManifest:
        reserved = 0

        def reserve(nbytes: int) -> None:
            nonlocal reserved
            self._capacity.check(artifact_bytes=reserved + nbytes, additional_bytes=nbytes)
            reserved += nbytes

        writer = StagingArtifactWriter(staging, reserve=reserve, hash_threads=self._hash_threads)
        try:
            try:
                metadata = producer.produce(writer)
            except HostWeightError as exc:
                raise _BuildFailedError(writer.failure or exc.failure.with_stage(ResolutionStage.PRODUCTION)) from exc
            except Exception as exc:
                if writer.failure is not None:
                    raise _BuildFailedError(writer.failure) from exc
                raise _BuildFailedError(
                    failure(
                        ResolutionStage.PRODUCTION,
                        FailureCode.PRODUCER_FAILED,
                        f"producer {producer.spec.producer_id} raised {type(exc).__name__}: {exc}",
                        exception=type(exc).__name__,
                    )
                ) from exc
            if writer.failure is not None:
                # The producer swallowed a writer failure; the artifact cannot be trusted.
                raise _BuildFailedError(writer.failure)
            if not isinstance(metadata, ProductionMetadata):
                raise _BuildFailedError(
                    failure(
                        ResolutionStage.PRODUCTION,
                        FailureCode.PRODUCER_FAILED,
                        f"producer {producer.spec.producer_id} returned {type(metadata).__name__}, "
                        "not ProductionMetadata",
                    )
                )
            expected = identity.producer
            if (metadata.producer_schema, metadata.restorer_schema) != (
                expected.manifest_schema,
                expected.restorer_schema,
            ):
                raise _BuildFailedError(
                    failure(
                        ResolutionStage.PRODUCTION,
                        FailureCode.PRODUCER_FAILED,
                        f"producer reported schemas ({metadata.producer_schema}, {metadata.restorer_schema}) but the "
                        f"identity requires ({expected.manifest_schema}, {expected.restorer_schema})",
                    )
                )
            try:
                files = writer.finish()
            except HostWeightError as exc:
                raise _BuildFailedError(exc.failure) from exc
        finally:
            writer.abort()
        return self._compose_manifest(identity, metadata, files, writer.chunk_bytes)

    @staticmethod
    def _compose_manifest(
        identity: WeightArtifactIdentity,
        metadata: ProductionMetadata,
        files: tuple[WrittenFile, ...],
        chunk_bytes: int,
    ) -> WeightManifest:
        tensors = tuple(entry for written in files for entry in written.tensors)
        return WeightManifest(
            identity=identity,
            producer_schema=metadata.producer_schema,
            restorer_schema=metadata.restorer_schema,
            format_metadata=metadata.format_metadata,
            digest_algorithm=DIGEST_ALGORITHM,
            digest_chunk_bytes=chunk_bytes,
            files=tuple(written.manifest_entry() for written in files),
            tensors=tensors,
            content_digest=content_digest((t.name, t.dtype, t.shape, t.digest) for t in tensors),
        )

    def _seal(self, staging: Path, manifest: WeightManifest) -> PublicationMarker:
        """Write manifest then READY (last), harden permissions and fsync everything."""
        fault_point("publication.before_manifest")
        manifest_bytes = manifest.to_bytes()
        write_new_file(staging / MANIFEST_FILE_NAME, manifest_bytes)
        fault_point("publication.after_manifest")
        marker = PublicationMarker(
            identity_key=manifest.identity_key,
            publication_id=uuid.uuid4().hex,
            manifest_sha256=manifest_sha256(manifest_bytes),
            content_digest=manifest.content_digest,
            published_at_ns=time.time_ns(),
        )
        write_new_file(staging / READY_FILE_NAME, marker.to_bytes())
        fault_point("publication.after_ready")
        for name in os.listdir(staging):
            os.chmod(staging / name, 0o444)
        os.chmod(staging, 0o555)
        fsync_dir(staging)
        fault_point("publication.after_harden")
        return marker

    def _publish(
        self,
        staging: Path,
        identity: WeightArtifactIdentity,
        manifest: WeightManifest,
        marker: PublicationMarker,
        *,
        deadline: float,
    ) -> StoreResult:
        key = identity.key
        target = self._layout.artifact_dir(key)
        try:
            lock = self._artifact_lock(
                key,
                exclusive=True,
                deadline=deadline,
                stage=ResolutionStage.PUBLICATION,
                what="the artifact lock (leases of an older copy are still open)",
            )
        except HostWeightError as exc:
            raise _BuildFailedError(exc.failure) from exc
        handed_over = False
        try:
            try:
                os.rename(staging, target)
            except OSError as exc:
                if exc.errno in (errno.EEXIST, errno.ENOTEMPTY):
                    return self._resolve_collision(staging, identity, manifest, lock)
                if exc.errno == errno.EXDEV:
                    raise _BuildFailedError(
                        failure(
                            ResolutionStage.PUBLICATION,
                            FailureCode.PUBLICATION_FAILED,
                            "staging and artifacts/ are on different filesystems; the domain root must be one "
                            "filesystem",
                        )
                    ) from exc
                raise
            fault_point("publication.after_rename")
            fsync_dir(self._layout.artifacts)
            fault_point("publication.after_commit")
            lock.downgrade()
            validated = open_artifact(
                target,
                key,
                identity=identity,
                validation=ValidationLevel.MANIFEST_AND_METADATA,
                hash_threads=self._hash_threads,
            )
            lease = self._make_lease(
                identity, validated, lock, validation=ValidationLevel.MANIFEST_AND_METADATA, source=LeaseSource.BUILT
            )
            handed_over = True
            return StoreResult(StoreStatus.BUILT, identity, lease=lease, publication_id=marker.publication_id)
        except (InvalidArtifactError, ArtifactReadError) as exc:
            raise _BuildFailedError(
                failure(
                    ResolutionStage.PUBLICATION,
                    FailureCode.PUBLICATION_FAILED,
                    f"the artifact just published does not read back: {exc.failure.message}",
                )
            ) from exc
        finally:
            if not handed_over:
                lock.release()

    def _resolve_collision(
        self,
        staging: Path,
        identity: WeightArtifactIdentity,
        manifest: WeightManifest,
        lock: FileLock,
    ) -> StoreResult:
        """Someone published this key while we built without the lock. The first copy stays authoritative."""
        key = identity.key
        target = self._layout.artifact_dir(key)
        try:
            existing = open_artifact(
                target,
                key,
                identity=identity,
                validation=ValidationLevel.MANIFEST_AND_METADATA,
                hash_threads=self._hash_threads,
            )
        except (InvalidArtifactError, ArtifactReadError):
            existing = None
        if existing is not None and existing.manifest.content_digest == manifest.content_digest:
            self._discard(staging)
            lock.downgrade()
            lease = self._make_lease(
                identity, existing, lock, validation=ValidationLevel.MANIFEST_AND_METADATA, source=LeaseSource.JOINED
            )
            return StoreResult(StoreStatus.JOINED, identity, lease=lease, publication_id=lease.publication_id)
        quarantined = self._move_to_quarantine(staging, key)
        lock.release()
        return StoreResult(
            StoreStatus.FAILED,
            identity,
            failure=failure(
                ResolutionStage.PUBLICATION,
                FailureCode.IDENTITY_COLLISION,
                f"a different artifact was already published under key {key[:16]}...; the first publication stays "
                "authoritative and this build was quarantined. Check that the producer is deterministic and that "
                "its identity covers every input that changes the bytes",
                quarantined=str(quarantined),
            ),
        )

    def _move_to_quarantine(self, path: Path, key: str) -> Path:
        destination = self._layout.new_quarantine_dir(key)
        os.chmod(path, _PRIVATE_DIR_MODE)
        os.rename(path, destination)
        fsync_dir(self._layout.quarantine)
        fsync_dir(path.parent)
        return destination

    def _quarantine_published(self, key: str, *, deadline: float) -> HostWeightFailure | None:
        """Move a denied or invalid artifact to quarantine/ under the exclusive artifact lock."""
        try:
            lock = self._artifact_lock(
                key,
                exclusive=True,
                deadline=deadline,
                stage=ResolutionStage.PUBLICATION,
                what="the artifact lock (leases of the invalid copy are still open)",
            )
        except HostWeightError as exc:
            return exc.failure
        try:
            artifact_dir = self._layout.artifact_dir(key)
            if os.path.lexists(artifact_dir):
                self._move_to_quarantine(artifact_dir, key)
            self._remove_orphan_deny(key)
        except OSError as exc:
            return failure_from_os_error(exc, stage=ResolutionStage.PUBLICATION, what="quarantining the artifact")
        finally:
            lock.release()
        return None

    def _remove_orphan_deny(self, key: str) -> None:
        marker = self._layout.deny_marker(key)
        if os.path.lexists(marker):
            marker.unlink()
            fsync_dir(marker.parent)

    def _discard(self, staging: Path) -> None:
        # If this fails, the next builder of this key removes the stale staging directory.
        with contextlib.suppress(OSError):
            remove_tree(staging)

    # ------------------------------------------------------------------ cleanup

    def cleanup(self, key: str, *, dry_run: bool = False) -> CleanupResult:
        """Remove one key's artifact, deny marker, temporaries and quarantined copies; never waits for a lock.

        With `dry_run` nothing is removed and the result (status PLANNED) lists what would be.
        """
        check_key(key)
        build_lock = try_lock(self._layout.build_lock(key), exclusive=True)
        if build_lock is None:
            return CleanupResult(
                key,
                CleanupStatus.ACTIVE_BUILD,
                failure=failure(
                    ResolutionStage.CLEANUP,
                    FailureCode.ACTIVE_BUILD,
                    "a build of this artifact is in progress; nothing was removed, try again after it finishes",
                    retryable=True,
                ),
            )
        try:
            artifact_lock = try_lock(self._layout.artifact_lock(key), exclusive=True)
            if artifact_lock is None:
                return CleanupResult(
                    key,
                    CleanupStatus.ACTIVE_LEASE,
                    failure=failure(
                        ResolutionStage.CLEANUP,
                        FailureCode.ACTIVE_LEASE,
                        "a live lease holds this artifact; nothing was removed, close the workers using it first",
                        retryable=True,
                    ),
                )
            try:
                return self._cleanup_locked(key, dry_run=dry_run)
            finally:
                artifact_lock.release()
        finally:
            build_lock.release()

    def _cleanup_locked(self, key: str, *, dry_run: bool) -> CleanupResult:
        targets = [
            path
            for path in (
                self._layout.artifact_dir(key),
                self._layout.deny_marker(key),
                *self._layout.staging_dirs(key),
                *self._layout.quarantined_dirs(key),
            )
            if os.path.lexists(path)
        ]
        if not targets:
            return CleanupResult(key, CleanupStatus.NOT_PRESENT)
        size = sum(tree_bytes(path) if path.is_dir() else path.lstat().st_size for path in targets)
        if dry_run:
            return CleanupResult(key, CleanupStatus.PLANNED, size, tuple(str(path) for path in targets), dry_run=True)
        try:
            artifact_dir = self._layout.artifact_dir(key)
            if os.path.lexists(artifact_dir):
                # Disappear atomically first, then delete at leisure.
                doomed = self._layout.tmp / f"{key}.removing.{uuid.uuid4().hex[:12]}"
                os.chmod(artifact_dir, _PRIVATE_DIR_MODE)
                os.rename(artifact_dir, doomed)
                fsync_dir(self._layout.artifacts)
                remove_tree(doomed)
            for path in targets:
                if path == artifact_dir:
                    continue
                remove_tree(path)
        except OSError as exc:
            return CleanupResult(
                key,
                CleanupStatus.FAILED,
                failure=failure_from_os_error(exc, stage=ResolutionStage.CLEANUP, what="removing the artifact"),
            )
        return CleanupResult(key, CleanupStatus.REMOVED, size, tuple(str(path) for path in targets))

    # ------------------------------------------------------------------ inspection

    def _lock_activity(self, key: str) -> LockActivity:
        return LockActivity(
            build_active=lock_in_use(self._layout.build_lock(key)),
            lease_active=lock_in_use(self._layout.artifact_lock(key)),
        )

    def inspect_artifact(
        self,
        key: str | WeightArtifactIdentity,
        *,
        validation: ValidationLevel = ValidationLevel.MANIFEST_AND_METADATA,
        deadline: float | None = None,
        progress: Callable[[int], None] | None = None,
    ) -> ArtifactInspection:
        """Validate one artifact read-only; reports problems but never denies or quarantines."""
        identity = key if isinstance(key, WeightArtifactIdentity) else None
        key = check_key(key.key if isinstance(key, WeightArtifactIdentity) else key)
        artifact_dir = self._layout.artifact_dir(key)
        activity = self._lock_activity(key)
        if not os.path.lexists(artifact_dir):
            staging = self._layout.staging_dirs(key)
            if staging:
                return ArtifactInspection(
                    key, ArtifactState.TEMPORARY, str(staging[0]), sum(tree_bytes(p) for p in staging), activity
                )
            return ArtifactInspection(key, ArtifactState.MISSING, str(artifact_dir), 0, activity)
        size = tree_bytes(artifact_dir)
        try:
            lock = self._artifact_lock(
                key, exclusive=False, deadline=deadline, stage=ResolutionStage.LOOKUP, what="the artifact lock"
            )
        except HostWeightError as exc:
            return ArtifactInspection(
                key, ArtifactState.UNVERIFIED, str(artifact_dir), size, activity, problem=exc.failure
            )
        try:
            validated = open_artifact(
                artifact_dir,
                key,
                identity=identity,
                validation=validation,
                hash_threads=self._hash_threads,
                progress=progress,
            )
        except (InvalidArtifactError, ArtifactReadError) as exc:
            state = ArtifactState.DENIED if self._denied(key) else ArtifactState.INVALID
            return ArtifactInspection(key, state, str(artifact_dir), size, activity, problem=exc.failure)
        finally:
            lock.release()
        manifest = validated.manifest
        denied = self._denied(key)
        return ArtifactInspection(
            key,
            ArtifactState.DENIED if denied else ArtifactState.READY,
            str(artifact_dir),
            size,
            activity,
            publication_id=validated.marker.publication_id,
            model_id=_display_model_id(manifest),
            tensor_count=len(manifest.tensors),
            problem=self._denied_failure(key) if denied else None,
        )

    def inspect_domain(self) -> DomainInspection:
        """Inventory of ready, denied, quarantined and temporary artifacts, with capacity."""
        entries: list[ArtifactInspection] = []
        for name in sorted(_list(self._layout.artifacts)):
            try:
                entries.append(self.inspect_artifact(name, deadline=time.monotonic() + 5.0))
            except ValueError:
                entries.append(
                    ArtifactInspection(
                        name, ArtifactState.INVALID, str(self._layout.artifacts / name), 0, LockActivity(False, False)
                    )
                )
        for name in sorted(_list(self._layout.deny)):
            key = name.removesuffix(".json")
            if not name.endswith(".json") or not _is_key(key):
                continue  # a crashed atomic write's temporary, not a marker
            if not os.path.lexists(self._layout.artifacts / key):
                entries.append(
                    ArtifactInspection(
                        key, ArtifactState.DENIED, str(self._layout.deny / name), 0, LockActivity(False, False)
                    )
                )
        for name in sorted(_list(self._layout.quarantine)):
            path = self._layout.quarantine / name
            entries.append(
                ArtifactInspection(
                    name.split(".", 1)[0],
                    ArtifactState.QUARANTINED,
                    str(path),
                    tree_bytes(path),
                    LockActivity(False, False),
                )
            )
        for name in sorted(_list(self._layout.tmp)):
            path = self._layout.tmp / name
            key = name.split(".", 1)[0]
            if os.path.lexists(self._layout.artifacts / key):
                continue
            entries.append(
                ArtifactInspection(
                    key,
                    ArtifactState.TEMPORARY,
                    str(path),
                    tree_bytes(path),
                    self._lock_activity(key) if _is_key(key) else LockActivity(False, False),
                )
            )
        return DomainInspection(
            root=str(self._domain.root),
            domain_id=self._domain.domain_id,
            scope=self._domain.scope.value,
            storage_class=self._domain.storage_class.value,
            fs_type=self._domain.fs_type,
            huge_pages=self._domain.huge_pages,
            mount_point=self._domain.mount_point,
            capacity=self._capacity.snapshot(),
            artifacts=tuple(entries),
        )


def _display_model_id(manifest: WeightManifest) -> str:
    """The model the artifact was built from: `format_metadata.built_from.model_id` when the producer
    recorded one (a content-keyed identity holds no repo id or path), else the identity's model_id."""
    metadata = manifest.format_metadata.to_value()
    built_from = metadata.get("built_from") if isinstance(metadata, dict) else None
    model_id = built_from.get("model_id") if isinstance(built_from, dict) else None
    return model_id if isinstance(model_id, str) and model_id else manifest.identity.source.model_id


def _list(path: Path) -> list[str]:
    try:
        return os.listdir(path)
    except FileNotFoundError:
        return []


def _is_key(name: str) -> bool:
    try:
        check_key(name)
    except ValueError:
        return False
    return True

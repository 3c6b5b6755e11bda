"""Building: one builder per key under its build lock; it joins a finished build, quarantines an invalid copy,
runs the producer into a private staging directory, then seals and publishes it.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from .. import _telemetry
from .._faults import fault_point
from ..failures import FailureCode, HostWeightError, HostWeightFailure, ResolutionStage, failure
from ..identity import WeightArtifactIdentity
from ..lease import LeaseSource
from ..manifest import WeightManifest
from ..outcomes import StoreResult, StoreStatus
from ..protocols import BuildRequest, CoordinationScope, ProductionMetadata, WeightProducer
from ..tensors import ValidationLevel
from ._deny import DenyMarkers
from ._eviction import Evictor
from ._fsutil import failure_from_os_error
from ._layout import DomainLayout
from ._lookup import ArtifactLookup
from ._publication import BuildFailedError, Publisher, discard, move_to_quarantine, publication_lock, seal
from ._staging import as_joined, clear_stale_staging, compose_manifest, new_staging_dir, timed
from .capacity import CapacityGuard
from .locks import acquire_lock
from .writer import StagingArtifactWriter

__all__ = ["ArtifactBuilder"]


class ArtifactBuilder:
    """Builds and publishes missing or invalid artifacts, at most one builder per key at a time."""

    __slots__ = (
        "_capacity",
        "_deny",
        "_evictor",
        "_hash_threads",
        "_layout",
        "_lookup",
        "_publisher",
        "_storage_class",
    )

    def __init__(
        self,
        layout: DomainLayout,
        capacity: CapacityGuard,
        lookup: ArtifactLookup,
        deny: DenyMarkers,
        hash_threads: int | None,
        *,
        evictor: Evictor | None = None,
        storage_class: str = "",
    ) -> None:
        self._layout = layout
        self._capacity = capacity
        self._evictor = evictor
        self._storage_class = storage_class
        self._lookup = lookup
        self._deny = deny
        self._hash_threads = hash_threads
        self._publisher = Publisher(layout, lookup, hash_threads)

    def get_or_build(
        self,
        request: BuildRequest,
        producer: WeightProducer,
        *,
        validation: ValidationLevel,
        deadline: float,
        lease_source: LeaseSource = LeaseSource.BUILT,
    ) -> StoreResult:
        """HIT if published; else build once under the build lock (BUILT) or join another builder (JOINED)."""
        started = time.monotonic()
        identity = request.identity
        first = self._lookup.lookup(identity, validation=validation, deadline=deadline, source=LeaseSource.LOCAL_HIT)
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
            result = self.build_locked(
                identity, producer, validation=validation, deadline=deadline, lease_source=lease_source
            )
        finally:
            build_lock.release()
        return timed(result, identity, started)

    @staticmethod
    def _check_producer(identity: WeightArtifactIdentity, producer: WeightProducer) -> HostWeightFailure | None:
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

    def build_locked(
        self,
        identity: WeightArtifactIdentity,
        producer: WeightProducer,
        *,
        validation: ValidationLevel,
        deadline: float,
        lease_source: LeaseSource = LeaseSource.BUILT,
    ) -> StoreResult:
        """The build itself. The caller holds the build lock (tests call it bare to race two builders)."""
        key = identity.key
        # Our own process's staging directories may belong to a concurrent lockless call: left alone.
        clear_stale_staging(self._layout, key, keep_prefix=f"{key}.{os.getpid()}.")
        joined = self._lookup.lookup(identity, validation=validation, deadline=deadline, source=LeaseSource.JOINED)
        if joined.status in (StoreStatus.HIT, StoreStatus.FAILED):
            return as_joined(joined)
        if joined.status is StoreStatus.INVALID:
            problem = self._quarantine_published(key, deadline=deadline)
            if problem is not None:
                return StoreResult(StoreStatus.FAILED, identity, failure=problem)
        else:
            self._deny.remove_orphan(key)
        try:
            staging = new_staging_dir(self._layout, key, what="creating the staging directory")
        except BuildFailedError as exc:
            return StoreResult(StoreStatus.FAILED, identity, failure=exc.failure)
        try:
            fault_point("build.staging_created")
            manifest = self._produce_into(staging, identity, producer, deadline=deadline)
            marker = seal(staging, manifest)
            published = self._publisher.publish(
                staging, identity, manifest, marker, deadline=deadline, lease_source=lease_source
            )
            if published.status is StoreStatus.BUILT:
                nbytes = sum(entry.size for entry in manifest.files)
                event = _telemetry.TelemetryEvent(_telemetry.TelemetryKind.PUBLISHED, self._storage_class, nbytes)
                _telemetry.emit(event)
            return published
        except BuildFailedError as exc:
            discard(staging)
            return StoreResult(StoreStatus.FAILED, identity, failure=exc.failure)
        except OSError as exc:
            discard(staging)
            problem = failure_from_os_error(exc, stage=ResolutionStage.PUBLICATION, what="publishing the artifact")
            return StoreResult(StoreStatus.FAILED, identity, failure=problem)
        except BaseException:
            discard(staging)
            raise

    def _produce_into(
        self, staging: Path, identity: WeightArtifactIdentity, producer: WeightProducer, *, deadline: float
    ) -> WeightManifest:
        reserved = 0

        def reserve(nbytes: int) -> None:
            nonlocal reserved
            self._capacity.reserve(artifact_bytes=reserved + nbytes, additional_bytes=nbytes, evictor=self._evictor)
            reserved += nbytes

        writer = StagingArtifactWriter(
            staging,
            reserve=reserve,
            hash_threads=self._hash_threads,
            digest_algorithm=producer.spec.digest_algorithm,
            reservation_guard=lambda: self._capacity.reservation(deadline),
            sparse_files=self._capacity.is_memory,
        )
        try:
            try:
                metadata = producer.produce(writer)
            except HostWeightError as exc:
                raise BuildFailedError(writer.failure or exc.failure.with_stage(ResolutionStage.PRODUCTION)) from exc
            except Exception as exc:
                if writer.failure is not None:
                    raise BuildFailedError(writer.failure) from exc
                raise BuildFailedError(
                    failure(
                        ResolutionStage.PRODUCTION,
                        FailureCode.PRODUCER_FAILED,
                        f"producer {producer.spec.producer_id} raised {type(exc).__name__}: {exc}",
                        exception=type(exc).__name__,
                    )
                ) from exc
            if writer.failure is not None:
                # The producer swallowed a writer failure; the artifact cannot be trusted.
                raise BuildFailedError(writer.failure)
            if not isinstance(metadata, ProductionMetadata):
                raise BuildFailedError(
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
                raise BuildFailedError(
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
                raise BuildFailedError(exc.failure) from exc
        finally:
            writer.abort()
        return compose_manifest(identity, metadata, files, writer.chunk_bytes, writer.digest_algorithm)

    def _quarantine_published(self, key: str, *, deadline: float) -> HostWeightFailure | None:
        """Move a denied or invalid artifact to quarantine/ under the exclusive artifact lock."""
        try:
            lock = publication_lock(self._layout, key, deadline, "leases of the invalid copy are still open")
        except HostWeightError as exc:
            return exc.failure
        try:
            artifact_dir = self._layout.artifact_dir(key)
            if os.path.lexists(artifact_dir):
                move_to_quarantine(self._layout, artifact_dir, key)
            self._deny.remove_orphan(key)
        except OSError as exc:
            return failure_from_os_error(exc, stage=ResolutionStage.PUBLICATION, what="quarantining the artifact")
        finally:
            lock.release()
        return None

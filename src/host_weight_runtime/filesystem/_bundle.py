"""ARTIFACT_BUNDLE builds: one producer pass writes several outputs, each published atomically.

The bundle takes the build lock of every output (sorted by key, so two bundles over
overlapping outputs cannot deadlock), skips outputs already published, runs the producer
once into one staging directory per missing output, then seals and publishes each one
with the ordinary commit rename. A joiner of any output waits on that output's build
lock, so it waits for the bundle. A crash before the first rename publishes nothing; a
crash between renames leaves a subset of complete, sealed artifacts, never a torn one.

Every output it writes records in its manifest the content digest of every output of the
pass, built now or found published (`bundle_record.py`), so outputs meant to be used
together (a TP rank's replicated and shard parts) can be checked to hold one build's bytes.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from pathlib import Path

from .._faults import fault_point
from ..failures import FailureCode, HostWeightError, HostWeightFailure, ResolutionStage, failure
from ..identity import WeightArtifactIdentity
from ..lease import LeaseSource
from ..outcomes import StoreResult, StoreStatus
from ..protocols import ArtifactWriter, BuildRequest, CoordinationScope, ProductionMetadata, WeightBundleProducer
from ..tensors import ValidationLevel
from ._fsutil import failure_from_os_error
from ._layout import DomainLayout
from ._lookup import ArtifactLookup
from ._publication import BuildFailedError, Publisher, discard, seal
from ._staging import as_joined, clear_stale_staging, compose_manifest, new_staging_dir, timed
from .bundle_record import with_bundle_outputs
from .capacity import CapacityGuard
from .locks import FileLock, acquire_lock
from .writer import StagingArtifactWriter

__all__ = ["BundleBuilder"]


class _Writers:
    """The `BundleWriter` handed to the producer: one staging writer per output still to publish."""

    __slots__ = ("_by_key", "_outputs")

    def __init__(self, writers: dict[str, tuple[WeightArtifactIdentity, StagingArtifactWriter]]) -> None:
        self._by_key = writers
        self._outputs = tuple(identity for identity, _writer in writers.values())

    @property
    def outputs(self) -> tuple[WeightArtifactIdentity, ...]:
        return self._outputs

    def writer_for(self, identity: WeightArtifactIdentity) -> ArtifactWriter:
        entry = self._by_key.get(identity.key)
        if entry is None:
            raise ValueError(f"identity {identity.key} is not an output this bundle writes")
        return entry[1]


class BundleBuilder:
    """Builds every missing output of a `WeightBundleProducer` in one producer call."""

    __slots__ = ("_capacity", "_hash_threads", "_layout", "_lookup", "_publisher")

    def __init__(
        self, layout: DomainLayout, capacity: CapacityGuard, lookup: ArtifactLookup, hash_threads: int | None
    ) -> None:
        self._layout = layout
        self._capacity = capacity
        self._lookup = lookup
        self._hash_threads = hash_threads
        self._publisher = Publisher(layout, lookup, hash_threads)

    def get_or_build(
        self,
        request: BuildRequest,
        producer: WeightBundleProducer,
        *,
        validation: ValidationLevel,
        deadline: float,
    ) -> StoreResult:
        """HIT, BUILT (this call ran the bundle) or JOINED (another process's bundle published it), or FAILED."""
        started = time.monotonic()
        identity = request.identity

        def done(result: StoreResult) -> StoreResult:
            return timed(result, identity, started)

        first = self._lookup.lookup(identity, validation=validation, deadline=deadline, source=LeaseSource.LOCAL_HIT)
        if first.status in (StoreStatus.HIT, StoreStatus.FAILED):
            return first
        problem = _check_bundle(identity, producer)
        if problem is not None:
            return done(StoreResult(StoreStatus.FAILED, identity, failure=problem))
        outputs = sorted({output.key: output for output in producer.spec.outputs}.values(), key=lambda o: o.key)
        locks: list[FileLock] = []
        try:
            for output in outputs:
                fault_point("bundle.waiting_for_lock")
                locks.append(
                    acquire_lock(
                        self._layout.build_lock(output.key),
                        exclusive=True,
                        deadline=deadline,
                        stage=ResolutionStage.PRODUCTION,
                        what="a bundle build lock (another process is building this bundle)",
                    )
                )
            return done(self._build_locked(identity, outputs, producer, validation=validation, deadline=deadline))
        except HostWeightError as exc:
            return done(StoreResult(StoreStatus.FAILED, identity, failure=exc.failure))
        finally:
            for lock in reversed(locks):
                lock.release()

    def _missing(
        self,
        outputs: Sequence[WeightArtifactIdentity],
        present: dict[str, str],
        *,
        validation: ValidationLevel,
        deadline: float,
    ) -> list[WeightArtifactIdentity]:
        """Outputs without a valid published artifact (the others' content digests go into `present`)."""
        missing: list[WeightArtifactIdentity] = []
        for output in outputs:
            found = self._lookup.lookup(output, validation=validation, deadline=deadline, source=LeaseSource.JOINED)
            if found.lease is not None:
                present[output.key] = found.lease.manifest.content_digest
                found.lease.close()
                continue
            if found.status is StoreStatus.FAILED:
                assert found.failure is not None
                raise HostWeightError(found.failure)
            missing.append(output)
        return missing

    def _build_locked(
        self,
        identity: WeightArtifactIdentity,
        outputs: Sequence[WeightArtifactIdentity],
        producer: WeightBundleProducer,
        *,
        validation: ValidationLevel,
        deadline: float,
    ) -> StoreResult:
        for output in outputs:
            clear_stale_staging(self._layout, output.key)  # holding every build lock
        digests: dict[str, str] = {}
        missing = self._missing(outputs, digests, validation=validation, deadline=deadline)
        if identity.key not in {output.key for output in missing}:
            joined = self._lookup.lookup(identity, validation=validation, deadline=deadline, source=LeaseSource.JOINED)
            return as_joined(joined)
        stagings: dict[str, Path] = {}
        writers: dict[str, tuple[WeightArtifactIdentity, StagingArtifactWriter]] = {}
        reserved = 0

        def reserve(nbytes: int) -> None:
            nonlocal reserved
            self._capacity.check(artifact_bytes=reserved + nbytes, additional_bytes=nbytes)
            reserved += nbytes

        try:
            for output in missing:
                staging = new_staging_dir(self._layout, output.key, what="creating a bundle staging directory")
                stagings[output.key] = staging
                writers[output.key] = (
                    output,
                    StagingArtifactWriter(
                        staging,
                        reserve=reserve,
                        hash_threads=self._hash_threads,
                        digest_algorithm=producer.spec.digest_algorithm,
                    ),
                )
            fault_point("bundle.staging_created")
            metadata = self._run(producer, writers)
            manifests = {
                key: compose_manifest(
                    output, metadata[key], writer.finish(), writer.chunk_bytes, writer.digest_algorithm
                )
                for key, (output, writer) in writers.items()
            }
            digests.update((key, manifest.content_digest) for key, manifest in manifests.items())
            sealed = []
            for key, (output, _writer) in writers.items():
                manifest = dataclasses.replace(
                    manifests[key], format_metadata=with_bundle_outputs(manifests[key].format_metadata, digests)
                )
                sealed.append((output, manifest, seal(stagings[key], manifest)))
            result: StoreResult | None = None
            for output, manifest, marker in sealed:
                fault_point("bundle.before_publish")
                published = self._publisher.publish(stagings[output.key], output, manifest, marker, deadline=deadline)
                del stagings[output.key]
                if output.key == identity.key:
                    result = published
                elif published.lease is not None:
                    published.lease.close()
                if published.status is StoreStatus.FAILED:
                    return published
            assert result is not None
            return result
        except BuildFailedError as exc:
            return StoreResult(StoreStatus.FAILED, identity, failure=exc.failure)
        except HostWeightError as exc:
            return StoreResult(StoreStatus.FAILED, identity, failure=exc.failure)
        except OSError as exc:
            problem = failure_from_os_error(exc, stage=ResolutionStage.PUBLICATION, what="publishing a bundle output")
            return StoreResult(StoreStatus.FAILED, identity, failure=problem)
        finally:
            for _output, writer in writers.values():
                writer.abort()
            for staging in stagings.values():
                discard(staging)

    @staticmethod
    def _run(
        producer: WeightBundleProducer, writers: dict[str, tuple[WeightArtifactIdentity, StagingArtifactWriter]]
    ) -> dict[str, ProductionMetadata]:
        """Call the producer once; every writer failure, bad return value or schema mismatch is typed."""
        producer_id = producer.spec.producer_id

        def writer_failure() -> HostWeightFailure | None:
            return next((w.failure for _o, w in writers.values() if w.failure is not None), None)

        try:
            metadata = producer.produce_bundle(_Writers(writers))
        except HostWeightError as exc:
            raise BuildFailedError(writer_failure() or exc.failure.with_stage(ResolutionStage.PRODUCTION)) from exc
        except Exception as exc:
            raise BuildFailedError(
                writer_failure()
                or failure(
                    ResolutionStage.PRODUCTION,
                    FailureCode.PRODUCER_FAILED,
                    f"bundle producer {producer_id} raised {type(exc).__name__}: {exc}",
                    exception=type(exc).__name__,
                )
            ) from exc
        swallowed = writer_failure()
        if swallowed is not None:
            raise BuildFailedError(swallowed)
        if not isinstance(metadata, dict) or set(metadata) != set(writers):
            raise BuildFailedError(
                failure(
                    ResolutionStage.PRODUCTION,
                    FailureCode.PRODUCER_FAILED,
                    f"bundle producer {producer_id} must return ProductionMetadata for exactly the outputs it was "
                    "given, keyed by identity key",
                )
            )
        for key, (output, _writer) in writers.items():
            value = metadata[key]
            expected = (output.producer.manifest_schema, output.producer.restorer_schema)
            if not isinstance(value, ProductionMetadata) or (value.producer_schema, value.restorer_schema) != expected:
                raise BuildFailedError(
                    failure(
                        ResolutionStage.PRODUCTION,
                        FailureCode.PRODUCER_FAILED,
                        f"bundle producer {producer_id} reported metadata for {key} that does not match the "
                        f"identity's schemas {expected}",
                    )
                )
        return metadata


def _check_bundle(identity: WeightArtifactIdentity, producer: WeightBundleProducer) -> HostWeightFailure | None:
    spec = producer.spec
    if spec.coordination_scope is not CoordinationScope.ARTIFACT_BUNDLE:
        return failure(
            ResolutionStage.PRODUCTION,
            FailureCode.INVALID_CONFIGURATION,
            f"producer {spec.producer_id} is built as a bundle but declares scope {spec.coordination_scope.value}",
        )
    if all(output.key != identity.key for output in spec.outputs):
        return failure(
            ResolutionStage.PRODUCTION,
            FailureCode.INVALID_CONFIGURATION,
            f"bundle producer {spec.producer_id} does not declare the requested identity among its outputs",
        )
    return None

"""Lookup: validate a published artifact under its shared lock and turn its mapped files into a lease.

`make_lease` is the one place a lease is built from the mappings `reader.open_artifact` made.
"""

from __future__ import annotations

import logging
import os
import time

from .._faults import fault_point
from ..failures import HostWeightError, HostWeightFailure, ResolutionStage
from ..identity import WeightArtifactIdentity
from ..lease import HostWeightLease, LeaseProvenance, LeaseSource, backing_fingerprint
from ..outcomes import StoreResult, StoreStatus
from ..tensors import ValidationLevel
from ._deny import DenyMarkers
from ._layout import DomainLayout
from ._prefault import BackgroundPrefault
from ._usage import UsageRecordingLock, touch_lock_file
from ._verify import BackgroundVerification, BackgroundVerifyMode, VerificationLedger
from .locks import FileLock, acquire_lock
from .reader import ArtifactReadError, InvalidArtifactError, ValidatedArtifact, open_artifact

__all__ = ["ArtifactLookup", "artifact_lock"]

_LOG = logging.getLogger("host_weight_runtime")


def artifact_lock(
    layout: DomainLayout, key: str, *, exclusive: bool, deadline: float | None, stage: ResolutionStage, what: str
) -> FileLock:
    """Take `key`'s artifact lock: shared to read or lease, exclusive to publish or move it."""
    return acquire_lock(layout.artifact_lock(key), exclusive=exclusive, deadline=deadline, stage=stage, what=what)


class ArtifactLookup:
    """Validated leases of published artifacts; never builds, denies what fails validation."""

    __slots__ = (
        "_deny",
        "_domain_id",
        "_hash_threads",
        "_layout",
        "_ledger",
        "_prefault",
        "_storage_class",
        "_verify_mode",
    )

    def __init__(
        self,
        domain_id: str,
        layout: DomainLayout,
        deny: DenyMarkers,
        hash_threads: int | None,
        storage_class: str = "",
        *,
        verify_mode: BackgroundVerifyMode = BackgroundVerifyMode.OFF,
        prefault: bool = True,
    ) -> None:
        self._domain_id = domain_id
        self._prefault = prefault
        self._verify_mode = verify_mode
        self._ledger = VerificationLedger(layout)
        self._layout = layout
        self._deny = deny
        self._hash_threads = hash_threads
        self._storage_class = storage_class

    def lookup(
        self,
        identity: WeightArtifactIdentity,
        *,
        validation: ValidationLevel,
        deadline: float | None,
        source: LeaseSource,
        prefault: bool = True,
    ) -> StoreResult:
        """HIT with a lease (which then holds the shared lock), or MISS / INVALID / FAILED."""
        started = time.monotonic()
        key = identity.key
        try:
            lock = artifact_lock(
                self._layout,
                key,
                exclusive=False,
                deadline=deadline,
                stage=ResolutionStage.LOOKUP,
                what="the artifact lock",
            )
        except HostWeightError as exc:
            return StoreResult(StoreStatus.FAILED, identity, failure=exc.failure, elapsed_s=time.monotonic() - started)
        lease: HostWeightLease | None = None
        try:
            status, lease, problem = self._lookup_locked(
                identity, lock, validation=validation, source=source, prefault=prefault
            )
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
        prefault: bool,
    ) -> tuple[StoreStatus, HostWeightLease | None, HostWeightFailure | None]:
        key = identity.key
        artifact_dir = self._layout.artifact_dir(key)
        if not os.path.lexists(artifact_dir):
            return StoreStatus.MISS, None, None
        if self._deny.present(key):
            return StoreStatus.INVALID, None, self._deny.failure(key)
        try:
            validated = open_artifact(
                artifact_dir, key, identity=identity, validation=validation, hash_threads=self._hash_threads
            )
        except ArtifactReadError as exc:
            return StoreStatus.FAILED, None, exc.failure
        except InvalidArtifactError as exc:
            deny_failure = self._deny.write(key, exc.failure)
            if deny_failure is not None:
                return StoreStatus.FAILED, None, deny_failure
            return StoreStatus.INVALID, None, exc.failure
        lease = self.make_lease(
            identity, validated, lock, validation=validation, source=source, start_verification=False, prefault=prefault
        )
        fault_point("lookup.before_deny_recheck")
        if self._deny.present(key):
            # A stronger concurrent lookup denied the artifact after we validated it.
            lease.close()
            return StoreStatus.INVALID, None, self._deny.failure(key)
        if isinstance(lease.verification, BackgroundVerification):
            lease.verification.start()  # only now: this lease is served, whatever the verifier finds
        return StoreStatus.HIT, lease, None

    def make_lease(
        self,
        identity: WeightArtifactIdentity,
        validated: ValidatedArtifact,
        lock: FileLock,
        *,
        validation: ValidationLevel,
        source: LeaseSource,
        start_verification: bool = True,
        prefault: bool = True,
    ) -> HostWeightLease:
        """Hand a validated artifact's mappings and its held artifact lock over to a new lease.

        The lease's start and end are recorded as the artifact's last use (the usage ledger).
        A hit on a publication not yet fully hashed on this node starts its background
        verification (`_verify`); a FULL_CHECKSUM lease records that it was.
        """
        key = identity.key  # computed, not cached: hash it once
        touch_lock_file(lock.path)
        regions = validated.regions()
        provenance = LeaseProvenance(
            source=source,
            domain_id=self._domain_id,
            artifact_dir=str(self._layout.artifact_dir(key)),
            publication_id=validated.marker.publication_id,
            validation=validation,
            pid=os.getpid(),
            acquired_at_ns=time.time_ns(),
            backing_fingerprint=backing_fingerprint(self._domain_id, validated.marker.publication_id, regions),
        )
        mappings = validated.mappings()
        background = (
            BackgroundPrefault([(region.address, region.length) for region in regions], mappings)
            if self._prefault and prefault
            else None
        )
        verification = self._verification_for(key, validated, validation=validation, source=source)
        if verification is not None and start_verification:
            verification.start()
        return HostWeightLease(
            identity=identity,
            manifest=validated.manifest,
            tensors=validated.tensors(),
            regions=regions,
            provenance=provenance,
            mappings=mappings,
            lock=UsageRecordingLock(lock, self._storage_class),
            background=background,
            verification=verification,
        )

    def _verification_for(
        self, key: str, validated: ValidatedArtifact, *, validation: ValidationLevel, source: LeaseSource
    ) -> BackgroundVerification | None:
        """The (unstarted) background full verification this lease owes the node, if any (HWR_BACKGROUND_VERIFY).

        Builds and imports hashed every byte in this process, so only hits and joins verify.
        """
        publication_id = validated.marker.publication_id
        if self._verify_mode is BackgroundVerifyMode.OFF:
            return None
        if validation is ValidationLevel.FULL_CHECKSUM:
            if not self._ledger.is_verified(key, publication_id):
                try:
                    self._ledger.record(key, publication_id, sum(p.entry.size for p in validated.payloads))
                except OSError as exc:  # only a record of work already done; the lease does not depend on it
                    _LOG.debug("could not record the full verification of %s...: %s", key[:16], exc)
            return None
        if source not in (LeaseSource.LOCAL_HIT, LeaseSource.JOINED):
            return None
        if self._ledger.is_verified(key, publication_id):
            return None
        return BackgroundVerification(
            layout=self._layout,
            ledger=self._ledger,
            deny=self._deny,
            key=key,
            manifest=validated.manifest,
            publication_id=publication_id,
            inodes={payload.entry.name: (payload.device, payload.inode) for payload in validated.payloads},
            storage_class=self._storage_class,
        )

"""Publication: seal a complete staging directory (manifest, READY last, read-only, fsynced), then commit it.

The commit is one `rename` into `artifacts/` followed by an fsync of `artifacts/` (`Publisher.publish`).
"""

from __future__ import annotations

import contextlib
import errno
import os
import time
import uuid
from pathlib import Path

from .._faults import fault_point
from ..failures import FailureCode, HostWeightError, HostWeightFailure, ResolutionStage, failure
from ..identity import WeightArtifactIdentity
from ..lease import LeaseSource
from ..manifest import (
    MANIFEST_FILE_NAME,
    PARSED_MANIFESTS,
    READY_FILE_NAME,
    PublicationMarker,
    WeightManifest,
    manifest_sha256,
)
from ..outcomes import StoreResult, StoreStatus
from ..tensors import ValidationLevel
from ._fsutil import fsync_dir, remove_tree, write_new_file
from ._layout import DomainLayout
from ._lookup import ArtifactLookup, artifact_lock
from .locks import FileLock
from .reader import ArtifactReadError, InvalidArtifactError, open_artifact

__all__ = ["PRIVATE_DIR_MODE", "BuildFailedError", "Publisher", "discard", "move_to_quarantine", "seal"]

PRIVATE_DIR_MODE = 0o700  # staging, and anything taken out of artifacts/ to be moved or removed
_SEALED_FILE_MODE = 0o444
_SEALED_DIR_MODE = 0o555


class BuildFailedError(Exception):
    """Internal: a build step failed with a typed failure; staging is removed by the caller."""

    def __init__(self, failure: HostWeightFailure) -> None:
        super().__init__(failure.message)
        self.failure = failure


def seal(staging: Path, manifest: WeightManifest) -> PublicationMarker:
    """Write manifest then READY (last), harden permissions and fsync everything."""
    fault_point("publication.before_manifest")
    manifest_bytes = manifest.to_bytes()
    write_new_file(staging / MANIFEST_FILE_NAME, manifest_bytes, seam="publication.write_manifest")
    PARSED_MANIFESTS.remember(manifest_bytes, manifest)  # the read-back after the rename needs no parse
    fault_point("publication.after_manifest")
    marker = PublicationMarker(
        identity_key=manifest.identity_key,
        publication_id=uuid.uuid4().hex,
        manifest_sha256=manifest_sha256(manifest_bytes),
        content_digest=manifest.content_digest,
        published_at_ns=time.time_ns(),
    )
    write_new_file(staging / READY_FILE_NAME, marker.to_bytes(), seam="publication.write_ready")
    fault_point("publication.after_ready")
    for name in os.listdir(staging):
        os.chmod(staging / name, _SEALED_FILE_MODE)
    os.chmod(staging, _SEALED_DIR_MODE)
    fault_point("publication.fsync_sealed")
    fsync_dir(staging)
    fault_point("publication.after_harden")
    return marker


def discard(staging: Path) -> None:
    """Remove a build's staging directory; never raises."""
    # If this fails, the next builder of this key removes the stale staging directory.
    with contextlib.suppress(OSError):
        remove_tree(staging)


def move_to_quarantine(layout: DomainLayout, path: Path, key: str) -> Path:
    """Move a directory of `key` (staging or published) to quarantine/, durably; returns where it went."""
    destination = layout.new_quarantine_dir(key)
    if not path.is_symlink():  # a planted link is moved as it is: never change what it points at
        os.chmod(path, PRIVATE_DIR_MODE)
    os.rename(path, destination)
    fsync_dir(layout.quarantine)
    fsync_dir(path.parent)
    return destination


def publication_lock(layout: DomainLayout, key: str, deadline: float, why_waiting: str) -> FileLock:
    """The exclusive lock of `key`'s artifact, which publishing or quarantining a copy takes; it waits
    (`why_waiting` says for what) until `deadline`, then raises a typed PUBLICATION failure."""
    return artifact_lock(
        layout,
        key,
        exclusive=True,
        deadline=deadline,
        stage=ResolutionStage.PUBLICATION,
        what=f"the artifact lock ({why_waiting})",
    )


class Publisher:
    """Commits sealed staging directories into `artifacts/` and leases the result to the builder."""

    __slots__ = ("_hash_threads", "_layout", "_lookup")

    def __init__(self, layout: DomainLayout, lookup: ArtifactLookup, hash_threads: int | None) -> None:
        self._layout = layout
        self._lookup = lookup
        self._hash_threads = hash_threads

    def publish(
        self,
        staging: Path,
        identity: WeightArtifactIdentity,
        manifest: WeightManifest,
        marker: PublicationMarker,
        *,
        deadline: float,
        lease_source: LeaseSource = LeaseSource.BUILT,
    ) -> StoreResult:
        """Rename the sealed `staging` into place under the exclusive artifact lock; BUILT, JOINED or FAILED."""
        key = identity.key
        target = self._layout.artifact_dir(key)
        try:
            lock = publication_lock(self._layout, key, deadline, "leases of an older copy are still open")
        except HostWeightError as exc:
            raise BuildFailedError(exc.failure) from exc
        handed_over = False
        try:
            try:
                os.rename(staging, target)
            except OSError as exc:
                if exc.errno in (errno.EEXIST, errno.ENOTEMPTY):
                    return self._resolve_collision(staging, identity, manifest, lock)
                if exc.errno == errno.EXDEV:
                    raise BuildFailedError(
                        failure(
                            ResolutionStage.PUBLICATION,
                            FailureCode.PUBLICATION_FAILED,
                            "staging and artifacts/ are on different filesystems; the domain root must be one "
                            "filesystem",
                        )
                    ) from exc
                raise
            try:
                fault_point("publication.after_rename")
                fsync_dir(self._layout.artifacts)
                fault_point("publication.after_commit")
            except OSError:
                self._withdraw(target, key)
                raise
            lock.downgrade()
            validated = open_artifact(
                target,
                key,
                identity=identity,
                validation=ValidationLevel.MANIFEST_AND_METADATA,
                hash_threads=self._hash_threads,
            )
            lease = self._lookup.make_lease(
                identity, validated, lock, validation=ValidationLevel.MANIFEST_AND_METADATA, source=lease_source
            )
            handed_over = True
            return StoreResult(StoreStatus.BUILT, identity, lease=lease, publication_id=marker.publication_id)
        except (InvalidArtifactError, ArtifactReadError) as exc:
            raise BuildFailedError(
                failure(
                    ResolutionStage.PUBLICATION,
                    FailureCode.PUBLICATION_FAILED,
                    f"the artifact just published does not read back: {exc.failure.message}",
                )
            ) from exc
        finally:
            if not handed_over:
                lock.release()

    def _withdraw(self, target: Path, key: str) -> None:
        """Take back a just-renamed artifact whose commit failed, so a failed build leaves nothing in artifacts/.

        The exclusive artifact lock is still held, so nobody leased it. Best effort: if this fails
        too, the complete, sealed copy stays where it is and every lookup validates it as usual.
        """
        with contextlib.suppress(OSError):
            aside = self._layout.new_staging_dir(key)
            os.chmod(target, PRIVATE_DIR_MODE)  # moving a directory to another parent needs write access to it
            os.rename(target, aside)
            discard(aside)
            fsync_dir(self._layout.artifacts)

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
            discard(staging)
            lock.downgrade()
            lease = self._lookup.make_lease(
                identity, existing, lock, validation=ValidationLevel.MANIFEST_AND_METADATA, source=LeaseSource.JOINED
            )
            return StoreResult(StoreStatus.JOINED, identity, lease=lease, publication_id=lease.publication_id)
        quarantined = move_to_quarantine(self._layout, staging, key)
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

"""Steps every build path shares (a single artifact, a bundle of them): clearing a dead builder's staging,
making a new staging directory, composing the manifest of what was written, and reporting the result.

A staging directory lives in `tmp/`, private to this user, until `Publisher.publish` renames it
into `artifacts/`; nothing in it is ever visible as an artifact before that rename.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from .._digest import DigestAlgorithm, content_digest
from ..failures import ResolutionStage
from ..identity import WeightArtifactIdentity
from ..manifest import WeightManifest
from ..outcomes import StoreResult, StoreStatus
from ..protocols import ProductionMetadata
from ._fsutil import failure_from_os_error, remove_tree
from ._layout import DomainLayout
from ._publication import PRIVATE_DIR_MODE, BuildFailedError
from .writer import WrittenFile

__all__ = ["as_joined", "clear_stale_staging", "compose_manifest", "new_staging_dir", "timed"]


def clear_stale_staging(layout: DomainLayout, key: str, *, keep_prefix: str | None = None) -> None:
    """Remove every staging directory of `key` but those named with `keep_prefix`. Only a holder of the
    key's build lock may call it: any other builder's staging is then a dead builder's."""
    for stale in layout.staging_dirs(key):
        if keep_prefix is None or not stale.name.startswith(keep_prefix):
            remove_tree(stale)


def new_staging_dir(layout: DomainLayout, key: str, *, what: str) -> Path:
    """A new, private staging directory for `key`; an OS error is a BuildFailedError saying it was `what`."""
    staging = layout.new_staging_dir(key)
    try:
        os.mkdir(staging, PRIVATE_DIR_MODE)
    except OSError as exc:
        raise BuildFailedError(failure_from_os_error(exc, stage=ResolutionStage.PRODUCTION, what=what)) from exc
    return staging


def compose_manifest(
    identity: WeightArtifactIdentity,
    metadata: ProductionMetadata,
    files: tuple[WrittenFile, ...],
    chunk_bytes: int,
    algorithm: DigestAlgorithm,
) -> WeightManifest:
    """The manifest of a finished build: the producer's metadata and every written file's digests."""
    tensors = tuple(entry for written in files for entry in written.tensors)
    return WeightManifest(
        identity=identity,
        producer_schema=metadata.producer_schema,
        restorer_schema=metadata.restorer_schema,
        format_metadata=metadata.format_metadata,
        digest_algorithm=algorithm.value,
        digest_chunk_bytes=chunk_bytes,
        files=tuple(written.manifest_entry() for written in files),
        tensors=tensors,
        content_digest=content_digest((t.name, t.dtype, t.shape, t.digest) for t in tensors),
    )


def as_joined(found: StoreResult) -> StoreResult:
    """A hit found while holding the build lock: another builder published it, so this call JOINED."""
    if found.status is not StoreStatus.HIT:
        return found
    return StoreResult(StoreStatus.JOINED, found.identity, lease=found.lease, publication_id=found.publication_id)


def timed(result: StoreResult, identity: WeightArtifactIdentity, started: float) -> StoreResult:
    """`result` for `identity`, with the time since `started` (time.monotonic) as its elapsed time."""
    return StoreResult(
        result.status,
        identity,
        lease=result.lease,
        failure=result.failure,
        publication_id=result.publication_id,
        elapsed_s=time.monotonic() - started,
    )

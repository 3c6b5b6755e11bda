"""Pull by name: a node that holds nothing of a model imports its artifact through the remote's name index.

`index_artifact_name` is what `push` calls once an artifact is complete on the remote (the
descriptor is written first, so a name never points at an artifact a reader cannot import).
`pull_by_name` reads the index object for a name, then imports that key exactly as the REMOTE
stage does: the descriptor's identity must carry the key, every byte is re-hashed against the
manifest before the atomic rename. See `names` for what the index is trusted with.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..failures import FailureCode, HostWeightError, ResolutionStage, failure, usage_error
from ..filesystem.store import FilesystemHostWeightStore
from ..manifest import WeightManifest
from ..outcomes import StoreResult
from ..tensors import ValidationLevel
from ._descriptor import MAX_DESCRIPTOR_BYTES
from ._location import DEFAULT_TIMEOUT_S, RemoteLocation, remote_failed
from .importer import import_remote_artifact
from .names import ArtifactName, NameIndexEntry, name_of_manifest_metadata
from .provider import FsspecArtifactProvider
from .snapshot_files import checkpoint_records, local_snapshot_of, publish_snapshot_files

__all__ = ["PulledArtifact", "index_artifact_name", "pull_by_name", "read_name_entry"]


def index_artifact_name(location: RemoteLocation, manifest: WeightManifest) -> ArtifactName | None:
    """Point the manifest's name (if it was built from a pinned hub snapshot) at its key; None when it has none.

    When this node still holds the snapshot, the entry also lists the checkpoint files (sizes, content ids,
    tensor names) and the snapshot's non-weight files go up with it, so another node can load by name.
    """
    dtype = manifest.identity.representation.dtype
    format_metadata = manifest.format_metadata.to_value()
    source_metadata = manifest.identity.source.metadata.to_value()
    layout = manifest.identity.layout.to_dict()
    name = name_of_manifest_metadata(format_metadata, dtype, source_metadata, layout)
    if name is None:
        return None
    built_from = format_metadata.get("built_from") if isinstance(format_metadata, dict) else None
    snapshot = local_snapshot_of(name, built_from)
    checkpoint = checkpoint_records(snapshot, name, source_metadata) if snapshot is not None else ()
    if checkpoint and snapshot is not None:
        publish_snapshot_files(location, name.repo_id, name.revision, snapshot)
    entry = NameIndexEntry(
        name=name,
        key=manifest.identity_key,
        representation=manifest.identity.representation.name,
        content_sha256=manifest.content_digest,
        uploaded_at_ns=time.time_ns(),
        checkpoint=checkpoint,
    )
    current = read_name_entry(location, name)
    if current is not None and current.same_target(entry):
        return name  # already says this: leave the object (and its timestamp) alone
    if (
        current is not None
        and not checkpoint
        and (current.key, current.content_sha256) == (entry.key, entry.content_sha256)
    ):
        return name  # a node without the snapshot does not erase what one with it recorded
    location.write(name.object_path(), entry.to_bytes())
    return name


def read_name_entry(location: RemoteLocation, name: ArtifactName) -> NameIndexEntry | None:
    """The index object for `name`, None when the remote has none; a malformed one, or one that is another name's
    entry, is a typed failure."""
    relative = name.object_path()
    size = location.size_of(relative)
    if size is None:
        return None
    if not 0 < size <= MAX_DESCRIPTOR_BYTES:
        raise remote_failed(
            f"the name index object for {name} at {location.name} is {size} bytes; push the artifact again",
            retryable=False,
            provider_id=location.name,
            object=relative,
        )
    try:
        entry = NameIndexEntry.from_bytes(location.read(relative))
    except ValueError as exc:
        raise remote_failed(
            f"the name index object for {name} at {location.name} is invalid ({exc}); push the artifact again",
            retryable=False,
            provider_id=location.name,
            object=relative,
        ) from None
    if entry.name != name:  # an entry copied or moved under another name's path: never another layout's key
        raise remote_failed(
            f"the name index object for {name} at {location.name} is the entry of {entry.name}; push the artifact "
            "again",
            retryable=False,
            provider_id=location.name,
            object=relative,
        )
    return entry


@dataclass(frozen=True, slots=True)
class PulledArtifact:
    """What a pull found and did: the name, the key the index gave, and the store's result."""

    name: ArtifactName
    key: str
    result: StoreResult


def pull_by_name(
    store: FilesystemHostWeightStore,
    url: str,
    name: ArtifactName,
    *,
    allow_unpinned_revision: bool = False,
    storage_options: Mapping[str, Any] | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    lock_timeout_s: float = 600.0,
) -> PulledArtifact:
    """Import the artifact the remote's index names for `name` into `store`.

    Raises a usage error for an unpinned revision (unless allowed) or a URL that names nothing,
    NOT_FOUND (HostWeightError) when the index has no such name or the remote lacks the key it
    gives; the import's own failures come back in the result, typed, with nothing partial visible.
    """
    if not name.pinned and not allow_unpinned_revision:
        raise usage_error(
            f"revision {name.revision!r} is not a commit hash: a branch or tag may move, so the artifact it names "
            "may not be the checkpoint you mean. Give the 40-hex commit (huggingface_hub's model_info(...).sha), "
            "or allow it explicitly (--allow-unpinned-revision)",
            revision=name.revision,
        )
    provider = FsspecArtifactProvider(url, storage_options=storage_options, timeout_s=timeout_s)
    location = provider.location
    location.check_target(for_write=False)
    entry = read_name_entry(location, name)
    if entry is None:
        raise HostWeightError(
            failure(
                ResolutionStage.REMOTE,
                FailureCode.NOT_FOUND,
                f"{location.name} has no artifact named {name}; push it from a node that built it (hwr push --all), "
                "or check the repo id, revision, subfolder, variant and dtype",
                name=name.to_dict(),
            )
        )
    read = provider.read_descriptor(entry.key)
    if read is None:
        raise HostWeightError(
            failure(
                ResolutionStage.REMOTE,
                FailureCode.NOT_FOUND,
                f"{location.name} names {entry.key[:16]}... for {name} but holds no complete artifact under it; "
                "push it again",
                key=entry.key,
            )
        )
    identity = read[0].identity
    if identity.key != entry.key or read[0].content_sha256 != entry.content_sha256:
        raise remote_failed(
            f"the name index of {location.name} points {name} at {entry.key[:16]}..., whose descriptor disagrees; "
            "push the artifact again",
            retryable=False,
            provider_id=location.name,
            key=entry.key,
        )
    result = import_remote_artifact(
        store,
        identity,
        provider,
        validation=ValidationLevel.MANIFEST_AND_METADATA,
        deadline=time.monotonic() + lock_timeout_s,
    )
    if result is None:  # the descriptor vanished between the two reads
        raise remote_failed(
            f"the artifact {entry.key[:16]}... disappeared from {location.name} during the pull; retry",
            retryable=True,
            provider_id=location.name,
            key=entry.key,
        )
    return PulledArtifact(name, entry.key, result)

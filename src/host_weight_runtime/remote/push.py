"""Export: upload a verified local artifact to a remote, descriptor last; list what a remote holds.

`push_artifact` leases the artifact with FULL_CHECKSUM (every byte re-hashed against
its manifest) and keeps the lease, so the artifact cannot be removed, while it uploads
the payloads and the manifest, checks their remote sizes, and finally writes
DESCRIPTOR.json: the one object whose presence makes the upload visible. A remote that
already holds the same artifact is left alone; one that holds a different artifact
under the key is refused (the first publication stays authoritative, as locally).
"""

from __future__ import annotations

import enum
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._exit_wait import wait_at_exit
from ..canonical_json import JsonValue
from ..failures import FailureCode, HostWeightError, HostWeightFailure, ResolutionStage, failure
from ..filesystem import read_small_file
from ..filesystem.store import FilesystemHostWeightStore
from ..identity import WeightArtifactIdentity
from ..manifest import MANIFEST_FILE_NAME, WeightManifest, manifest_sha256
from ..tensors import ValidationLevel
from ..version import __version__
from ._descriptor import DESCRIPTOR_FILE_NAME, MAX_MANIFEST_BYTES, RemoteDescriptorRecord, RemoteFileRecord
from ._location import DEFAULT_TIMEOUT_S, RemoteLocation, remote_failed
from .provider import FsspecArtifactProvider

__all__ = [
    "PushResult",
    "PushStatus",
    "RemoteArtifactListing",
    "RemoteArtifactState",
    "list_remote",
    "push_artifact",
    "push_in_background",
]

_KEY_LENGTH = 64
_HEX_DIGITS = frozenset("0123456789abcdef")


class PushStatus(str, enum.Enum):
    """UPLOADED: this call wrote the artifact; ALREADY_PRESENT: the remote held the same bytes."""

    UPLOADED = "uploaded"
    ALREADY_PRESENT = "already_present"


@dataclass(frozen=True, slots=True)
class PushResult:
    """What one push did; safe to print or serialise (no secrets)."""

    key: str
    remote: str
    status: PushStatus
    bytes_uploaded: int
    total_bytes: int
    manifest_sha256: str
    content_sha256: str
    elapsed_s: float

    def to_dict(self) -> dict[str, JsonValue]:
        return {
            "key": self.key,
            "remote": self.remote,
            "status": self.status.value,
            "bytes_uploaded": self.bytes_uploaded,
            "total_bytes": self.total_bytes,
            "manifest_sha256": self.manifest_sha256,
            "content_sha256": self.content_sha256,
            "elapsed_s": self.elapsed_s,
        }


class RemoteArtifactState(str, enum.Enum):
    """COMPLETE: importable; INCOMPLETE: no descriptor yet (an upload running or dead); INVALID: unusable."""

    COMPLETE = "complete"
    INCOMPLETE = "incomplete"
    INVALID = "invalid"


@dataclass(frozen=True, slots=True)
class RemoteArtifactListing:
    """One key folder on a remote, as `hwr remote ls` shows it."""

    key: str
    state: RemoteArtifactState
    model_id: str | None = None
    total_bytes: int = 0
    file_count: int = 0
    manifest_sha256: str | None = None
    content_sha256: str | None = None
    uploaded_at_ns: int | None = None
    problem: HostWeightFailure | None = None

    def to_dict(self) -> dict[str, JsonValue]:
        return {
            "key": self.key,
            "state": self.state.value,
            "model_id": self.model_id,
            "total_bytes": self.total_bytes,
            "file_count": self.file_count,
            "manifest_sha256": self.manifest_sha256,
            "content_sha256": self.content_sha256,
            "uploaded_at_ns": self.uploaded_at_ns,
            "problem": None if self.problem is None else self.problem.to_dict(),
        }


def _is_key(name: str) -> bool:
    return len(name) == _KEY_LENGTH and set(name) <= _HEX_DIGITS


def _local_identity(store: FilesystemHostWeightStore, artifact: str | WeightArtifactIdentity) -> WeightArtifactIdentity:
    """The identity of a published artifact named by key (read from its manifest) or given directly."""
    if isinstance(artifact, WeightArtifactIdentity):
        return artifact
    if type(artifact) is not str or not _is_key(artifact):
        raise ValueError("push_artifact needs an identity or a 64-character lowercase hex key")
    path = store.layout.artifact_dir(artifact) / MANIFEST_FILE_NAME
    try:
        manifest = WeightManifest.from_bytes(read_small_file(path, MAX_MANIFEST_BYTES))
    except FileNotFoundError:
        raise HostWeightError(
            failure(
                ResolutionStage.REMOTE,
                FailureCode.NOT_FOUND,
                f"no published artifact {artifact[:16]}... in {store.root}; build or prewarm it first",
                key=artifact,
            )
        ) from None
    except (OSError, ValueError) as exc:
        raise HostWeightError(
            failure(
                ResolutionStage.REMOTE,
                FailureCode.MANIFEST_INVALID,
                f"the local manifest of {artifact[:16]}... cannot be read ({type(exc).__name__}); run hwr verify",
                key=artifact,
            )
        ) from None
    if manifest.identity_key != artifact:
        raise HostWeightError(
            failure(
                ResolutionStage.REMOTE,
                FailureCode.MANIFEST_INVALID,
                f"the local manifest under {artifact[:16]}... names another key; run hwr verify",
                key=artifact,
            )
        )
    return manifest.identity


def push_artifact(
    store: FilesystemHostWeightStore,
    artifact: str | WeightArtifactIdentity,
    url: str,
    *,
    storage_options: Mapping[str, Any] | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    deadline: float | None = None,
) -> PushResult:
    """Verify a published local artifact fully, upload it to `url`, write its descriptor last.

    Raises `HostWeightError`: NOT_FOUND / an invalid-artifact code when the local copy
    is missing or fails FULL_CHECKSUM, IDENTITY_COLLISION when the remote holds other
    bytes under the key, REMOTE_FAILED for network and remote errors.
    """
    started = time.monotonic()
    identity = _local_identity(store, artifact)
    key = identity.key
    reader = FsspecArtifactProvider(url, storage_options=storage_options, timeout_s=timeout_s)
    location = reader.location
    location.require_writable(key)  # before any work: an http(s) remote is read-only
    local = store.lookup(identity, validation=ValidationLevel.FULL_CHECKSUM, deadline=deadline)
    if local.lease is None:
        problem = local.failure or failure(
            ResolutionStage.REMOTE,
            FailureCode.NOT_FOUND,
            f"no published artifact {key[:16]}... in {store.root}; build or prewarm it first",
            key=key,
        )
        raise HostWeightError(problem)
    with local.lease as lease:
        manifest = lease.manifest
        artifact_dir = Path(lease.provenance.artifact_dir)
        manifest_bytes = read_small_file(artifact_dir / MANIFEST_FILE_NAME, MAX_MANIFEST_BYTES)
        if manifest_bytes != manifest.to_bytes():  # pragma: no cover - FULL_CHECKSUM read these very bytes
            raise HostWeightError(
                failure(ResolutionStage.REMOTE, FailureCode.MANIFEST_INVALID, "the local manifest changed", key=key)
            )
        record = RemoteDescriptorRecord(
            identity=identity,
            manifest_sha256=manifest_sha256(manifest_bytes),
            manifest_size=len(manifest_bytes),
            content_sha256=manifest.content_digest,
            files=tuple(RemoteFileRecord(entry.name, entry.size) for entry in manifest.files),
            provider_id=location.name,
            uploader=f"host-weight-runtime/{__version__}",
            uploaded_at_ns=time.time_ns(),
        )
        existing = _existing(reader, key)
        if existing is not None and not _same_digests(existing, record):
            raise HostWeightError(
                failure(
                    ResolutionStage.REMOTE,
                    FailureCode.IDENTITY_COLLISION,
                    f"{location.name} already holds a different artifact under key {key[:16]}...; the first "
                    "publication stays authoritative. Check that the producer is deterministic, or remove the "
                    "remote folder by hand",
                    key=key,
                    provider_id=location.name,
                )
            )
        if existing is not None and _complete(reader, key):
            return PushResult(
                key,
                location.name,
                PushStatus.ALREADY_PRESENT,
                0,
                record.total_bytes,
                record.manifest_sha256,
                record.content_sha256,
                time.monotonic() - started,
            )
        _upload(location, key, record, artifact_dir, manifest_bytes)
    return PushResult(
        key,
        location.name,
        PushStatus.UPLOADED,
        record.total_bytes + record.manifest_size,
        record.total_bytes,
        record.manifest_sha256,
        record.content_sha256,
        time.monotonic() - started,
    )


def push_in_background(
    store: FilesystemHostWeightStore,
    identity: WeightArtifactIdentity,
    url: str,
    *,
    storage_options: Mapping[str, Any] | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    report: Callable[[PushResult | HostWeightFailure], None] | None = None,
) -> threading.Thread:
    """Push off the request path (HWR_REMOTE_PUBLISH): a thread that reports a result or a failure.

    The thread never raises: a typed failure (or an unexpected error, typed here) goes
    to `report`. Interpreter exit waits for it (like a background publication). If the
    process dies first, the upload stops before its descriptor, so the remote offers
    nothing from it and the next push completes it.
    """

    def run() -> None:
        outcome: PushResult | HostWeightFailure
        try:
            outcome = push_artifact(store, identity, url, storage_options=storage_options, timeout_s=timeout_s)
        except HostWeightError as exc:
            outcome = exc.failure
        except Exception as exc:
            outcome = failure(
                ResolutionStage.REMOTE,
                FailureCode.REMOTE_FAILED,
                f"pushing {identity.key[:16]}... failed with {type(exc).__name__}; push it again with hwr push",
                retryable=True,
                key=identity.key,
                exception=type(exc).__name__,
            )
        if report is not None:
            report(outcome)

    thread = threading.Thread(target=run, name=f"hwr-push-{identity.key[:12]}", daemon=True)
    wait_at_exit(thread)
    thread.start()
    return thread


def _existing(reader: FsspecArtifactProvider, key: str) -> RemoteDescriptorRecord | None:
    """The remote's descriptor for `key`; an unreadable one is refused rather than overwritten."""
    read = reader.read_descriptor(key)
    return None if read is None else read[0]


def _same_digests(existing: RemoteDescriptorRecord, record: RemoteDescriptorRecord) -> bool:
    return (existing.manifest_sha256, existing.content_sha256) == (record.manifest_sha256, record.content_sha256)


def _complete(reader: FsspecArtifactProvider, key: str) -> bool:
    """Every object the remote's descriptor promises is in place (else a new upload repairs the copy)."""
    read = reader.read_descriptor(key)
    if read is None:
        return False
    try:
        reader.check_objects(key, read[0], read[1])
    except HostWeightError as exc:
        if exc.failure.retryable:
            raise
        return False
    return True


def _upload(
    location: RemoteLocation, key: str, record: RemoteDescriptorRecord, artifact_dir: Path, manifest_bytes: bytes
) -> None:
    """Upload in the order that keeps readers safe: no descriptor while anything changes, descriptor last.

    A damaged copy's descriptor and a dead upload's leftovers go first, then payloads and
    manifest, whose remote sizes are checked before the descriptor is written.
    """
    expected = record.expected_objects()
    if location.size_of(f"{key}/{DESCRIPTOR_FILE_NAME}") is not None:
        location.remove(f"{key}/{DESCRIPTOR_FILE_NAME}")
    if location.listable:
        for leftover in location.list_folder(key) or ():
            if leftover.is_dir:
                raise remote_failed(
                    f"{location.name}/{key[:16]}... holds a folder {leftover.name}; remove it by hand and push again",
                    retryable=False,
                    provider_id=location.name,
                    key=key,
                )
            if leftover.name not in expected:
                location.remove(f"{key}/{leftover.name}")
    for item in record.files:
        location.upload(os.fspath(artifact_dir / item.name), f"{key}/{item.name}")
    location.write(f"{key}/{MANIFEST_FILE_NAME}", manifest_bytes)
    for name, size in sorted(expected.items()):
        found = location.size_of(f"{key}/{name}")
        if found != size:
            raise remote_failed(
                f"after uploading, {name} at {location.name} is {found} bytes instead of {size}; retry the push",
                retryable=True,
                provider_id=location.name,
                key=key,
                object=name,
            )
    location.write(f"{key}/{DESCRIPTOR_FILE_NAME}", record.to_bytes())


def list_remote(
    url: str,
    *,
    storage_options: Mapping[str, Any] | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> tuple[RemoteArtifactListing, ...]:
    """Every key folder under `url`, each COMPLETE, INCOMPLETE or INVALID (with the problem); sorted by key."""
    reader = FsspecArtifactProvider(url, storage_options=storage_options, timeout_s=timeout_s)
    location = reader.location
    if not location.listable:
        raise HostWeightError(
            failure(
                ResolutionStage.REMOTE,
                FailureCode.UNSUPPORTED,
                f"{location.name} cannot be listed (http/https); list the s3://, gs:// or file:// URL behind it",
                provider_id=location.name,
            )
        )
    listings: list[RemoteArtifactListing] = []
    for entry in location.list_folder("") or ():
        if not entry.is_dir or not _is_key(entry.name):
            continue
        key = entry.name
        try:
            read = reader.read_descriptor(key)
            if read is None:
                listings.append(RemoteArtifactListing(key, RemoteArtifactState.INCOMPLETE))
                continue
            record, objects = read
            reader.check_objects(key, record, objects)
        except HostWeightError as exc:
            if exc.failure.retryable:
                raise
            listings.append(RemoteArtifactListing(key, RemoteArtifactState.INVALID, problem=exc.failure))
            continue
        listings.append(
            RemoteArtifactListing(
                key,
                RemoteArtifactState.COMPLETE,
                model_id=record.identity.source.model_id,
                total_bytes=record.total_bytes,
                file_count=len(record.files),
                manifest_sha256=record.manifest_sha256,
                content_sha256=record.content_sha256,
                uploaded_at_ns=record.uploaded_at_ns,
            )
        )
    return tuple(listings)

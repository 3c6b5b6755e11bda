"""Export: upload a verified local artifact to a remote, descriptor last; list what a remote holds.

`push_artifact` leases the artifact (so it cannot be removed) and makes sure every byte it
uploads was hashed on this node against its manifest: a publication this node already
hashed in full (its verification ledger says so) whose payload files have not changed since
they were published is trusted; anything else is re-hashed (FULL_CHECKSUM) on a thread while
the upload runs. It uploads the payloads in one call (concurrently on object stores, by the
kernel on local folders) and the manifest, checks the remote sizes with one listing and, only
once the local check agreed, writes DESCRIPTOR.json: the one object whose presence makes the
upload visible. A remote that already holds the same artifact is left alone; one that holds a
different artifact under the key is refused (the first publication stays authoritative, as
locally).
"""

from __future__ import annotations

import enum
import os
import stat
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from .._exit_wait import wait_at_exit
from .._faults import fault_point
from ..canonical_json import JsonValue
from ..failures import FailureCode, HostWeightError, HostWeightFailure, ResolutionStage, failure
from ..filesystem import read_small_file
from ..filesystem.store import FilesystemHostWeightStore
from ..identity import WeightArtifactIdentity
from ..manifest import MANIFEST_FILE_NAME, WeightManifest, manifest_sha256
from ..outcomes import StoreResult
from ..tensors import ValidationLevel
from ..version import __version__
from ._descriptor import DESCRIPTOR_FILE_NAME, MAX_MANIFEST_BYTES, RemoteDescriptorRecord, RemoteFileRecord
from ._location import DEFAULT_TIMEOUT_S, RemoteLocation, RemoteObject, remote_failed
from .provider import FsspecArtifactProvider
from .pull import index_artifact_name

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
    name: str | None = None  # the name the remote's index maps to this key (pinned hub builds only)
    rehashed: bool = False  # whether this push re-hashed the local copy (False: the node's ledger vouched for it)

    def to_dict(self) -> dict[str, JsonValue]:
        return {
            "name": self.name,
            "key": self.key,
            "remote": self.remote,
            "status": self.status.value,
            "bytes_uploaded": self.bytes_uploaded,
            "total_bytes": self.total_bytes,
            "manifest_sha256": self.manifest_sha256,
            "content_sha256": self.content_sha256,
            "elapsed_s": self.elapsed_s,
            "rehashed": self.rehashed,
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


_LocalManifest = tuple[bytes, WeightManifest]


def _local_identity(
    store: FilesystemHostWeightStore, artifact: str | WeightArtifactIdentity
) -> tuple[WeightArtifactIdentity, _LocalManifest | None]:
    """The identity of a published artifact named by key (read from its manifest) or given directly, and the
    manifest read for a key (read once)."""
    if isinstance(artifact, WeightArtifactIdentity):
        return artifact, None
    if type(artifact) is not str or not _is_key(artifact):
        raise ValueError("push_artifact needs an identity or a 64-character lowercase hex key")
    path = store.layout.artifact_dir(artifact) / MANIFEST_FILE_NAME
    try:
        manifest_bytes = read_small_file(path, MAX_MANIFEST_BYTES)
        manifest = WeightManifest.from_bytes(manifest_bytes)
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
    return manifest.identity, (manifest_bytes, manifest)


def push_artifact(
    store: FilesystemHostWeightStore,
    artifact: str | WeightArtifactIdentity,
    url: str,
    *,
    storage_options: Mapping[str, Any] | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    deadline: float | None = None,
) -> PushResult:
    """Upload a published local artifact whose bytes this node verified to `url`, its descriptor last.

    Raises `HostWeightError`: NOT_FOUND / an invalid-artifact code when the local copy
    is missing or fails FULL_CHECKSUM, IDENTITY_COLLISION when the remote holds other
    bytes under the key, REMOTE_FAILED for network and remote errors (E08).
    """
    started = time.monotonic()
    identity, local = _local_identity(store, artifact)
    key = identity.key
    reader = FsspecArtifactProvider(url, storage_options=storage_options, timeout_s=timeout_s)
    location = reader.location
    location.require_writable(key)  # before any work: an http(s) remote is read-only
    location.check_target(for_write=True)  # a mistyped folder or a missing bucket, before anything is written
    artifact_dir = store.layout.artifact_dir(key)
    if local is None:
        try:
            data = read_small_file(artifact_dir / MANIFEST_FILE_NAME, MAX_MANIFEST_BYTES)
            local = data, WeightManifest.from_bytes(data)
        except (OSError, ValueError):
            _raise_unpublished(store, identity, deadline)
    manifest_bytes, manifest = local
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
    objects = location.list_folder(key)  # one listing: a descriptor already there, a dead upload's leftovers
    existing = _existing(reader, key, objects)
    if existing is not None and not _same_digests(existing[0], record):
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
    if existing is not None and _complete(reader, key, existing):
        # Nothing is uploaded, so the local bytes need no verification.
        name = index_artifact_name(location, manifest)
        return PushResult(
            key,
            location.name,
            PushStatus.ALREADY_PRESENT,
            0,
            record.total_bytes,
            record.manifest_sha256,
            record.content_sha256,
            time.monotonic() - started,
            None if name is None else str(name),
        )
    # The local check (a ledger record, or a full re-hash on a thread beside the upload) holds the
    # artifact's lease until the block ends; the descriptor is written only once it agreed with the
    # very manifest uploaded.
    with _LocalVerification(store, identity, artifact_dir, deadline) as verification:
        _upload(
            location,
            key,
            record,
            artifact_dir,
            manifest_bytes,
            objects=objects or (),
            before_descriptor=lambda: verification.result(manifest_bytes),
        )
        name = index_artifact_name(location, manifest)  # after the descriptor: a name never points at nothing
    return PushResult(
        key,
        location.name,
        PushStatus.UPLOADED,
        record.total_bytes + record.manifest_size,
        record.total_bytes,
        record.manifest_sha256,
        record.content_sha256,
        time.monotonic() - started,
        None if name is None else str(name),
        rehashed=verification.rehashed,
    )


def _raise_unpublished(
    store: FilesystemHostWeightStore, identity: WeightArtifactIdentity, deadline: float | None
) -> NoReturn:
    """The local manifest cannot be read: raise the lookup's own failure (denied, invalid), else NOT_FOUND."""
    outcome = store.lookup(identity, validation=ValidationLevel.MANIFEST_AND_METADATA, deadline=deadline)
    if outcome.lease is not None:
        outcome.lease.close()  # published in the meantime: the caller pushes again
    raise HostWeightError(
        outcome.failure
        or failure(
            ResolutionStage.REMOTE,
            FailureCode.NOT_FOUND,
            f"no published artifact {identity.key[:16]}... in {store.root}; build or prewarm it first",
            key=identity.key,
        )
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


_RemoteRead = tuple[RemoteDescriptorRecord, dict[str, int] | None]


def _existing(reader: FsspecArtifactProvider, key: str, objects: tuple[RemoteObject, ...] | None) -> _RemoteRead | None:
    """The remote's descriptor for `key` when the listing shows one; an unreadable one is refused, not overwritten."""
    if objects is None or all(item.name != DESCRIPTOR_FILE_NAME for item in objects):
        return None
    return reader.read_descriptor(key)


def _same_digests(existing: RemoteDescriptorRecord, record: RemoteDescriptorRecord) -> bool:
    return (existing.manifest_sha256, existing.content_sha256) == (record.manifest_sha256, record.content_sha256)


def _complete(reader: FsspecArtifactProvider, key: str, read: _RemoteRead) -> bool:
    """Every object the remote's descriptor promises is in place (else a new upload repairs the copy)."""
    try:
        reader.check_objects(key, read[0], read[1])
    except HostWeightError as exc:
        if exc.failure.retryable:
            raise
        return False
    return True


def unchanged_since_publication(artifact_dir: Path, manifest: WeightManifest) -> bool:
    """No payload file was written, truncated or re-permissioned after its folder was published.

    Publication changes each payload's mode before it renames the sealed folder into place,
    so a payload whose change time (or modification time) is later than its folder's was
    changed afterwards. A payload that is not a plain file, or that cannot be stat'ed, fails.
    """
    try:
        folder = os.stat(artifact_dir).st_ctime_ns
        for entry in manifest.files:
            info = os.lstat(artifact_dir / entry.name)
            if not stat.S_ISREG(info.st_mode) or max(info.st_ctime_ns, info.st_mtime_ns) > folder:
                return False
    except OSError:
        return False
    return True


class _LocalVerification:
    """Makes sure, on a thread while the upload runs, that the bytes pushed are bytes this node hashed.

    Trusted without re-hashing: a publication that this node's verification ledger records
    as fully hashed and matched (the same publication id) and whose payloads have not
    changed since they were published (`unchanged_since_publication`). Anything else is
    re-hashed in full (FULL_CHECKSUM); a mismatch denies the local copy, as any FULL_CHECKSUM
    lookup does, and the push fails before its descriptor, removing what it uploaded. The
    lease is held until the block ends, so the artifact cannot be removed while the
    descriptor is written.
    """

    def __init__(
        self,
        store: FilesystemHostWeightStore,
        identity: WeightArtifactIdentity,
        artifact_dir: Path,
        deadline: float | None,
    ) -> None:
        self._store = store
        self._identity = identity
        self._artifact_dir = artifact_dir
        self._deadline = deadline
        self._outcome: StoreResult | None = None
        self._leased_manifest: bytes | None = None  # encoded on the thread, beside the upload
        self._problem: HostWeightFailure | None = None
        self.rehashed = False
        self._thread = threading.Thread(target=self._run, name=f"hwr-push-verify-{identity.key[:12]}", daemon=True)

    def __enter__(self) -> _LocalVerification:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._thread.join()
        if self._outcome is not None and self._outcome.lease is not None:
            self._outcome.lease.close()

    def _run(self) -> None:
        try:
            trusted = self._trusted()
            if trusted is None:
                self.rehashed = True
                trusted = self._store.lookup(
                    self._identity, validation=ValidationLevel.FULL_CHECKSUM, deadline=self._deadline, prefault=False
                )
            self._outcome = trusted
            if trusted.lease is not None:
                self._leased_manifest = trusted.lease.manifest.to_bytes()
        except HostWeightError as exc:
            self._problem = exc.failure
        except Exception as exc:  # recorded and raised by result(): never lost on this thread
            self._problem = failure(
                ResolutionStage.REMOTE,
                FailureCode.REMOTE_FAILED,
                f"verifying {self._identity.key[:16]}... before the push failed with {type(exc).__name__}",
                key=self._identity.key,
                exception=type(exc).__name__,
            )

    def _trusted(self) -> StoreResult | None:
        """A metadata lease of a publication this node hashed already and nobody changed since; None: re-hash."""
        record = self._store.background_verification(self._identity.key)
        if record is None:
            return None
        outcome = self._store.lookup(
            self._identity, validation=ValidationLevel.MANIFEST_AND_METADATA, deadline=self._deadline, prefault=False
        )
        lease = outcome.lease
        if lease is None:
            return outcome  # denied, invalid or gone: result() raises the lookup's own failure
        if lease.provenance.publication_id == record.publication_id and unchanged_since_publication(
            self._artifact_dir, lease.manifest
        ):
            return outcome
        lease.close()
        return None

    def result(self, manifest_bytes: bytes) -> None:
        """Wait for the verification; raise unless it leased the artifact whose manifest is `manifest_bytes`."""
        self._thread.join()
        key = self._identity.key
        if self._problem is not None:
            raise HostWeightError(self._problem)
        assert self._outcome is not None
        lease = self._outcome.lease
        if lease is None:
            raise HostWeightError(
                self._outcome.failure
                or failure(
                    ResolutionStage.REMOTE,
                    FailureCode.NOT_FOUND,
                    f"no published artifact {key[:16]}... in {self._store.root}; build or prewarm it first",
                    key=key,
                )
            )
        if self._leased_manifest != manifest_bytes:
            raise HostWeightError(
                failure(
                    ResolutionStage.REMOTE,
                    FailureCode.MANIFEST_INVALID,
                    f"the local artifact {key[:16]}... was replaced while it was pushed; push it again",
                    key=key,
                )
            )


def _upload(
    location: RemoteLocation,
    key: str,
    record: RemoteDescriptorRecord,
    artifact_dir: Path,
    manifest_bytes: bytes,
    *,
    objects: tuple[RemoteObject, ...],
    before_descriptor: Callable[[], None] = lambda: None,
) -> None:
    """Upload in the order that keeps readers safe: no descriptor while anything changes, descriptor last.

    `objects` is the key folder as listed before: a damaged copy's descriptor and a dead
    upload's leftovers go first, then the payloads (one call) and the manifest, whose remote
    sizes one listing checks before the descriptor is written. When `before_descriptor`
    raises (the local copy failed its full re-hash), what this upload wrote is removed again
    and nothing becomes visible. A process killed anywhere in between leaves no descriptor.
    """
    expected = record.expected_objects()
    for leftover in objects:
        if leftover.is_dir:
            raise remote_failed(
                f"{location.name}/{key[:16]}... holds a folder {leftover.name}; remove it by hand and push again",
                retryable=False,
                provider_id=location.name,
                key=key,
            )
    if any(item.name == DESCRIPTOR_FILE_NAME for item in objects):
        location.remove(f"{key}/{DESCRIPTOR_FILE_NAME}")  # first: the copy stops being offered
    for leftover in objects:
        if leftover.name not in expected and leftover.name != DESCRIPTOR_FILE_NAME:
            location.remove(f"{key}/{leftover.name}")
    location.upload_files([(os.fspath(artifact_dir / item.name), f"{key}/{item.name}") for item in record.files])
    fault_point("push.after_payloads")
    location.write(f"{key}/{MANIFEST_FILE_NAME}", manifest_bytes)
    listed = {item.name: item.size for item in location.list_folder(key) or ()}
    for name, size in sorted(expected.items()):
        found = listed.get(name)
        if found != size:
            raise remote_failed(
                f"after uploading, {name} at {location.name} is {found} bytes instead of {size}; retry the push",
                retryable=True,
                provider_id=location.name,
                key=key,
                object=name,
            )
    try:
        before_descriptor()
    except HostWeightError:
        for name in sorted(expected):
            location.remove_if_present(f"{key}/{name}")
        location.remove_empty_folder(key)
        raise
    fault_point("push.before_descriptor")
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
    location.check_target(for_write=False)  # a mistyped URL is an error, not an empty remote
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

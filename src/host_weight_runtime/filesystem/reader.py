"""Validation of a published artifact directory and mapping of its payloads.

Everything is opened relative to the artifact directory's descriptor without
following symlinks. Problems with the artifact itself raise `InvalidArtifactError`
(the caller denies it); I/O errors that say nothing about the artifact raise
`ArtifactReadError` (retryable, nothing is denied).

The directory may have been edited by a hostile or broken process of the same user, so
every parser here is bounded (bytes, nesting, counts) and anything a parser raises on bad
bytes becomes `InvalidArtifactError`. After a payload is mapped, its descriptor and name
are checked again (size and inode), so a payload truncated or replaced between
validation and the lease is an invalid artifact rather than a SIGBUS on first touch.
"""

from __future__ import annotations

import errno
import mmap
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from .._digest import DigestAlgorithm, content_digest, file_digest, tree_digests_parallel
from .._faults import fault_point
from ..canonical_json import decode_json
from ..failures import FailureCode, HostWeightFailure, ResolutionStage, failure
from ..identity import WeightArtifactIdentity
from ..lease import MappedHostRegion
from ..manifest import (
    MANIFEST_FILE_NAME,
    PARSED_MANIFESTS,
    READY_FILE_NAME,
    FileManifestEntry,
    PublicationMarker,
    TensorManifestEntry,
    WeightManifest,
    manifest_sha256,
)
from ..tensors import ValidationLevel, dtype_from_code, itemsize_of_code

if TYPE_CHECKING:
    import torch

MAX_METADATA_FILE_BYTES = 64 * 1024 * 1024
MAX_READY_FILE_BYTES = 64 * 1024
MAX_HEADER_BYTES = 100 * 1024 * 1024

# What a parser may raise on hostile bytes; each one means "this artifact is invalid".
_PARSE_ERRORS = (ValueError, TypeError, KeyError, IndexError, OverflowError, RecursionError)
PUBLISHED_DIR_MODE = 0o555
PUBLISHED_FILE_MODE = 0o444


class InvalidArtifactError(Exception):
    """The artifact is wrong: the caller must deny it."""

    def __init__(self, failure: HostWeightFailure) -> None:
        super().__init__(failure.message)
        self.failure = failure


class ArtifactReadError(Exception):
    """Reading failed for a reason that says nothing about the artifact (EIO): retryable."""

    def __init__(self, failure: HostWeightFailure) -> None:
        super().__init__(failure.message)
        self.failure = failure


@dataclass(frozen=True, slots=True)
class MappedPayload:
    """One mapped payload file."""

    entry: FileManifestEntry
    mapping: mmap.mmap
    device: int
    inode: int

    def base(self) -> torch.Tensor:
        """The mapping as a flat uint8 tensor; only here does the reader import torch, so validating,
        hashing and inspecting an artifact (`hwr verify`, `hwr inspect`) never do."""
        import torch

        return torch.frombuffer(self.mapping, dtype=torch.uint8)


@dataclass(frozen=True, slots=True)
class ValidatedArtifact:
    """An artifact that passed validation, with its payloads mapped copy-on-write."""

    manifest: WeightManifest
    marker: PublicationMarker
    payloads: tuple[MappedPayload, ...]

    def tensors(self) -> dict[str, torch.Tensor]:
        """Zero-copy views of every tensor, in manifest order, each over its own storage.

        One storage per tensor (not one per file): a consumer that tells tensors apart by storage, as
        vLLM-Omni's restorer does to refuse aliases, sees distinct tensors; the bytes are the mapping's.
        """
        import torch

        by_file = {payload.entry.name: payload for payload in self.payloads}
        views: dict[str, torch.Tensor] = {}
        for entry in self.manifest.tensors:
            payload = by_file[entry.file]
            start = payload.entry.header_size + entry.data_offsets[0]
            dtype = dtype_from_code(entry.dtype)
            count = (entry.data_offsets[1] - entry.data_offsets[0]) // dtype.itemsize
            if count:
                flat = torch.frombuffer(payload.mapping, dtype=dtype, offset=start, count=count)
            else:  # frombuffer refuses an empty range; an empty tensor has no bytes to share
                flat = payload.base()[start:start].view(dtype)
            views[entry.name] = flat.reshape(entry.shape)
        return views

    def regions(self) -> tuple[MappedHostRegion, ...]:
        return tuple(
            MappedHostRegion(
                file=payload.entry.name,
                address=payload.base().data_ptr(),
                length=payload.entry.size,
                device=payload.device,
                inode=payload.inode,
            )
            for payload in self.payloads
        )

    def mappings(self) -> tuple[object, ...]:
        return tuple(payload.mapping for payload in self.payloads)


def _invalid(code: FailureCode, message: str, **details: object) -> InvalidArtifactError:
    return InvalidArtifactError(failure(ResolutionStage.LOOKUP, code, message, **details))  # type: ignore[arg-type]


def read_error(exc: OSError, what: str) -> ArtifactReadError:
    """An OS error while reading `what`: retryable IO_ERROR, never a verdict on the artifact (S13)."""
    name = errno.errorcode.get(exc.errno or 0, str(exc.errno))
    return ArtifactReadError(
        failure(
            ResolutionStage.LOOKUP,
            FailureCode.IO_ERROR,
            f"reading {what} failed with {name}: {exc.strerror}; the artifact was not judged, retry later",
            retryable=True,
            errno=name,
            what=what,
        )
    )


def _stat_member(dir_fd: int, name: str) -> os.stat_result:
    """lstat of a member, refusing anything but a regular file before it is ever opened.

    Opening a planted FIFO would block and opening a device node may have side effects.
    """
    try:
        info = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except OSError as exc:
        if exc.errno == errno.ENOENT:
            raise _invalid(FailureCode.PAYLOAD_INVALID, f"{name} is missing", file=name) from None
        raise read_error(exc, name) from exc
    if stat.S_ISLNK(info.st_mode):
        raise _invalid(
            FailureCode.PAYLOAD_INVALID, f"{name} is a symlink; artifacts contain only regular files", file=name
        )
    if not stat.S_ISREG(info.st_mode):
        raise _invalid(FailureCode.PAYLOAD_INVALID, f"{name} is not a regular file", file=name)
    return info


def open_member(dir_fd: int, name: str) -> tuple[int, os.stat_result]:
    """Open a regular file of the artifact directory without following links; the fd and its stat."""
    listed = _stat_member(dir_fd, name)
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise _invalid(
                FailureCode.PAYLOAD_INVALID, f"{name} is a symlink; artifacts contain only regular files", file=name
            ) from None
        if exc.errno == errno.ENOENT:
            raise _invalid(FailureCode.PAYLOAD_INVALID, f"{name} is missing", file=name) from None
        raise read_error(exc, name) from exc
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or (info.st_dev, info.st_ino) != (listed.st_dev, listed.st_ino):
            raise _invalid(FailureCode.PAYLOAD_INVALID, f"{name} is not a regular file", file=name)
        if info.st_nlink != 1:
            raise _invalid(FailureCode.PAYLOAD_INVALID, f"{name} has {info.st_nlink} hard links; expected 1", file=name)
        if stat.S_IMODE(info.st_mode) != PUBLISHED_FILE_MODE:
            raise _invalid(
                FailureCode.PAYLOAD_INVALID,
                f"{name} has mode {oct(stat.S_IMODE(info.st_mode))}; published files are 0444",
                file=name,
            )
        if info.st_uid != os.geteuid():
            raise _invalid(FailureCode.PAYLOAD_INVALID, f"{name} belongs to another user", file=name)
    except BaseException:
        os.close(fd)
        raise
    return fd, info


def _read_exact(fd: int, size: int, offset: int, what: str) -> bytes:
    chunks: list[bytes] = []
    remaining = size
    position = offset
    while remaining:
        try:
            chunk = os.pread(fd, remaining, position)
        except OSError as exc:
            raise read_error(exc, what) from exc
        if not chunk:
            raise _invalid(FailureCode.PAYLOAD_INVALID, f"{what} is truncated", what=what)
        chunks.append(chunk)
        remaining -= len(chunk)
        position += len(chunk)
    return b"".join(chunks)


def _read_metadata_file(dir_fd: int, name: str, limit: int) -> bytes:
    fd, info = open_member(dir_fd, name)
    try:
        if info.st_size > limit:
            raise _invalid(
                FailureCode.MANIFEST_INVALID, f"{name} is implausibly large ({info.st_size} bytes; limit {limit})"
            )
        fault_point("reader.read_metadata")
        return _read_exact(fd, info.st_size, 0, name)
    except OSError as exc:
        raise read_error(exc, name) from exc
    finally:
        os.close(fd)


def _check_directory(dir_fd: int, artifact_dir: Path) -> None:
    info = os.fstat(dir_fd)
    if stat.S_IMODE(info.st_mode) != PUBLISHED_DIR_MODE:
        raise _invalid(
            FailureCode.PAYLOAD_INVALID,
            f"{artifact_dir} has mode {oct(stat.S_IMODE(info.st_mode))}; published directories are 0555",
        )
    if info.st_uid != os.geteuid():
        raise _invalid(FailureCode.PAYLOAD_INVALID, f"{artifact_dir} belongs to another user")


def _parse_marker_and_manifest(
    dir_fd: int, key: str, identity: WeightArtifactIdentity | None
) -> tuple[PublicationMarker, WeightManifest]:
    ready_bytes = _read_metadata_file(dir_fd, READY_FILE_NAME, MAX_READY_FILE_BYTES)
    try:
        marker = PublicationMarker.from_bytes(ready_bytes)
    except _PARSE_ERRORS as exc:
        raise _invalid(FailureCode.MANIFEST_INVALID, f"READY.json is invalid: {_reason(exc)}") from None
    manifest_bytes = _read_metadata_file(dir_fd, MANIFEST_FILE_NAME, MAX_METADATA_FILE_BYTES)
    if manifest_sha256(manifest_bytes) != marker.manifest_sha256:
        raise _invalid(FailureCode.MANIFEST_INVALID, "manifest.json does not match the digest in READY.json")
    try:
        # parsed once per process per exact bytes; our own identity object is kept when the manifest holds it
        _digest, manifest = PARSED_MANIFESTS.parse(manifest_bytes, identity=identity)
    except _PARSE_ERRORS as exc:
        raise _invalid(FailureCode.MANIFEST_INVALID, f"manifest.json is invalid: {_reason(exc)}") from None
    if marker.identity_key != key or manifest.identity_key != key:
        raise _invalid(FailureCode.IDENTITY_COLLISION, "the artifact's identity does not hash to its key")
    if identity is not None and manifest.identity != identity:
        raise _invalid(FailureCode.IDENTITY_COLLISION, "the artifact's identity differs from the requested one")
    expected = manifest.identity.producer
    if manifest.producer_schema != expected.manifest_schema or manifest.restorer_schema != expected.restorer_schema:
        raise _invalid(
            FailureCode.MANIFEST_INCOMPATIBLE,
            f"manifest schemas ({manifest.producer_schema}, {manifest.restorer_schema}) differ from the identity's "
            f"({expected.manifest_schema}, {expected.restorer_schema})",
        )
    try:
        DigestAlgorithm.from_name(manifest.digest_algorithm)
    except ValueError:
        problem = f"unknown digest algorithm {manifest.digest_algorithm!r}"
        raise _invalid(FailureCode.MANIFEST_INCOMPATIBLE, problem) from None
    if marker.content_digest != manifest.content_digest:
        raise _invalid(FailureCode.MANIFEST_INVALID, "READY.json and manifest.json disagree on the content digest")
    return marker, manifest


def _shown(names: set[str]) -> list[str]:
    """At most ten names, as printable ASCII: planted names may be anything the filesystem allows."""
    return [ascii(name)[1:-1][:120] for name in sorted(names)[:10]]


def _reason(exc: BaseException) -> str:
    """A parser's complaint, short enough for a message (hostile input can make it huge)."""
    text = str(exc) or type(exc).__name__
    return text if len(text) <= 300 else text[:300] + "..."


def check_content_digest(manifest: WeightManifest) -> None:
    """The content digest must follow from the tensor digests (a FULL_CHECKSUM check: the manifest's own
    bytes are already pinned by READY.json, so this only catches a publisher that lied about them)."""
    recomputed = content_digest((t.name, t.dtype, t.shape, t.digest) for t in manifest.tensors)
    if recomputed != manifest.content_digest:
        raise _invalid(FailureCode.MANIFEST_INVALID, "the manifest's content digest does not match its tensors")


def _check_header(fd: int, entry: FileManifestEntry, manifest: WeightManifest) -> None:
    try:
        fault_point("reader.read_payload_header")
    except OSError as exc:
        raise read_error(exc, entry.name) from exc
    length_bytes = _read_exact(fd, 8, 0, entry.name)
    header_length = int.from_bytes(length_bytes, "little")
    if header_length > MAX_HEADER_BYTES or 8 + header_length != entry.header_size:
        raise _invalid(FailureCode.PAYLOAD_INVALID, f"{entry.name}: header length disagrees with the manifest")
    raw = _read_exact(fd, header_length, 8, entry.name).rstrip(b" ")
    # A header holds no floats (rejected while parsing) and no booleans; only when `true` or `false`
    # appears at all must the entries be compared type by type (Python's True == 1).
    loose_types = b"true" in raw or b"false" in raw
    try:
        # The header's shape is checked entry by entry against the manifest below.
        header = decode_json(raw, max_depth=None, floats=False)
    except _PARSE_ERRORS as exc:
        raise _invalid(
            FailureCode.PAYLOAD_INVALID, f"{entry.name}: malformed safetensors header: {_reason(exc)}"
        ) from None
    if not isinstance(header, dict):
        raise _invalid(FailureCode.PAYLOAD_INVALID, f"{entry.name}: safetensors header is not an object")
    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict) or any(type(value) is not str for value in metadata.values()):
        raise _invalid(FailureCode.PAYLOAD_INVALID, f"{entry.name}: __metadata__ must map strings to strings")
    if len(header) != len(entry.tensors) or set(header) != set(entry.tensors):
        raise _invalid(FailureCode.PAYLOAD_INVALID, f"{entry.name}: header tensors differ from the manifest")
    data_size = entry.size - entry.header_size
    spans: list[tuple[int, int]] = []
    for name in entry.tensors:
        tensor = manifest.tensor(name)
        described = header[name]
        if not (
            _describes(described, tensor)
            if loose_types
            else described
            == {"dtype": tensor.dtype, "shape": list(tensor.shape), "data_offsets": list(tensor.data_offsets)}
        ):
            raise _invalid(
                FailureCode.PAYLOAD_INVALID, f"{entry.name}: header entry for {name} differs from manifest", tensor=name
            )
        if tensor.file != entry.name:
            raise _invalid(FailureCode.MANIFEST_INVALID, f"tensor {name} is listed under the wrong file")
        if (entry.header_size + tensor.data_offsets[0]) % itemsize_of_code(tensor.dtype):
            raise _invalid(FailureCode.PAYLOAD_INVALID, f"{entry.name}: tensor {name} is not aligned", tensor=name)
        spans.append(tensor.data_offsets)
    spans.sort()
    position = 0
    for begin, end in spans:
        if begin != position:
            raise _invalid(FailureCode.PAYLOAD_INVALID, f"{entry.name}: tensor data has a gap or overlap")
        position = end
    if position != data_size:
        raise _invalid(FailureCode.PAYLOAD_INVALID, f"{entry.name}: tensor data does not cover the file exactly")


def _exact_ints(value: object, expected: tuple[int, ...]) -> bool:
    """A JSON list equal to `expected` holding exact ints (Python would let 1.0 or True compare equal to 1)."""
    return (
        type(value) is list
        and len(value) == len(expected)
        and all(type(item) is int and item == want for item, want in zip(value, expected, strict=True))
    )


def _describes(described: object, tensor: TensorManifestEntry) -> bool:
    """Whether a header entry says exactly what the manifest says about `tensor`, types included."""
    return (
        type(described) is dict
        and described.keys() == {"dtype", "shape", "data_offsets"}
        and type(described["dtype"]) is str
        and described["dtype"] == tensor.dtype
        and _exact_ints(described["shape"], tensor.shape)
        and _exact_ints(described["data_offsets"], tensor.data_offsets)
    )


def _recheck_mapped(
    dir_fd: int, entry: FileManifestEntry, mapped: tuple[int, int], opened: os.stat_result | None
) -> None:
    """After mapping: the file still has the manifest's size and its name still names the mapped inode.

    A payload truncated between validation and mapping would otherwise raise SIGBUS on first
    touch; one renamed over would be served as the validated artifact. `mapped` is the
    (device, inode) that was mapped and `opened` a fresh fstat of its descriptor, if still open.
    """
    try:
        named = os.stat(entry.name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        raise _invalid(
            FailureCode.PAYLOAD_INVALID, f"{entry.name} disappeared while it was being mapped", file=entry.name
        ) from None
    except OSError as exc:
        raise read_error(exc, entry.name) from exc
    current = opened if opened is not None else named
    if current.st_size != entry.size or named.st_size != entry.size:
        raise _invalid(
            FailureCode.PAYLOAD_INVALID,
            f"{entry.name} changed size to {min(current.st_size, named.st_size)} bytes while it was being mapped; "
            f"the manifest says {entry.size}. Something is modifying published artifacts",
            file=entry.name,
        )
    if (current.st_dev, current.st_ino) != mapped or (named.st_dev, named.st_ino) != mapped:
        raise _invalid(
            FailureCode.PAYLOAD_INVALID,
            f"{entry.name} was replaced while it was being mapped. Something is modifying published artifacts",
            file=entry.name,
        )
    if current.st_nlink != 1 or stat.S_IMODE(current.st_mode) != PUBLISHED_FILE_MODE:
        raise _invalid(
            FailureCode.PAYLOAD_INVALID,
            f"{entry.name} gained a link or lost its read-only mode while it was being mapped",
            file=entry.name,
        )


def _map_payload(fd: int, info: os.stat_result, entry: FileManifestEntry) -> MappedPayload:
    try:
        mapping = mmap.mmap(fd, entry.size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except ValueError:  # the file is now shorter than the manifest says: it shrank after validation
        raise _invalid(
            FailureCode.PAYLOAD_INVALID,
            f"{entry.name} shrank while it was being mapped. Something is modifying published artifacts",
            file=entry.name,
        ) from None
    except OSError as exc:
        raise read_error(exc, entry.name) from exc
    return MappedPayload(entry=entry, mapping=mapping, device=info.st_dev, inode=info.st_ino)


def _verify_checksums(
    manifest: WeightManifest,
    payloads: tuple[MappedPayload, ...],
    *,
    hash_threads: int | None,
    progress: Callable[[int], None] | None,
) -> None:
    buffers: list[memoryview] = []
    labels: list[tuple[str, str]] = []
    for payload in payloads:
        view = memoryview(payload.mapping)
        buffers.append(view[: payload.entry.header_size])
        labels.append((payload.entry.name, ""))
        for name in payload.entry.tensors:
            tensor = manifest.tensor(name)
            start = payload.entry.header_size + tensor.data_offsets[0]
            buffers.append(view[start : payload.entry.header_size + tensor.data_offsets[1]])
            labels.append((payload.entry.name, name))
    try:
        digests = tree_digests_parallel(
            buffers,
            chunk_bytes=manifest.digest_chunk_bytes,
            threads=hash_threads,
            progress=progress,
            algorithm=DigestAlgorithm.from_name(manifest.digest_algorithm),
        )
    finally:
        for buffer in buffers:
            buffer.release()
    position = 0
    for payload in payloads:
        header_digest = digests[position]
        position += 1
        tensor_digests: list[str] = []
        for name in payload.entry.tensors:
            digest = digests[position]
            position += 1
            tensor_digests.append(digest)
            if digest != manifest.tensor(name).digest:
                raise _invalid(
                    FailureCode.CHECKSUM_MISMATCH,
                    f"tensor {name} in {payload.entry.name} does not match its recorded digest",
                    file=payload.entry.name,
                    tensor=name,
                )
        if file_digest(header_digest, tensor_digests) != payload.entry.digest:
            raise _invalid(
                FailureCode.CHECKSUM_MISMATCH,
                f"{payload.entry.name} does not match its recorded digest",
                file=payload.entry.name,
            )


def open_artifact(
    artifact_dir: Path,
    key: str,
    *,
    identity: WeightArtifactIdentity | None,
    validation: ValidationLevel,
    hash_threads: int | None = None,
    progress: Callable[[int], None] | None = None,
) -> ValidatedArtifact:
    """Validate `artifact_dir` at `validation` and map its payloads, or raise."""
    try:
        dir_fd = os.open(artifact_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise _invalid(FailureCode.PAYLOAD_INVALID, f"{artifact_dir} is not a real directory") from None
        raise read_error(exc, str(artifact_dir)) from exc
    try:
        _check_directory(dir_fd, artifact_dir)
        marker, manifest = _parse_marker_and_manifest(dir_fd, key, identity)
        try:
            present = set(os.listdir(dir_fd))
        except OSError as exc:
            raise read_error(exc, str(artifact_dir)) from exc
        expected = {READY_FILE_NAME, MANIFEST_FILE_NAME} | {entry.name for entry in manifest.files}
        if present != expected:
            raise _invalid(
                FailureCode.PAYLOAD_INVALID,
                "the artifact directory does not hold exactly the listed files",
                extra=_shown(present - expected),
                missing=_shown(expected - present),
            )
        payloads: list[MappedPayload] = []
        for entry in manifest.files:
            fd, info = open_member(dir_fd, entry.name)
            try:
                if info.st_size != entry.size:
                    raise _invalid(
                        FailureCode.PAYLOAD_INVALID,
                        f"{entry.name} is {info.st_size} bytes; the manifest says {entry.size}",
                        file=entry.name,
                    )
                _check_header(fd, entry, manifest)
                try:
                    fault_point("reader.after_validate")
                except OSError as exc:
                    raise read_error(exc, entry.name) from exc
                payloads.append(_map_payload(fd, info, entry))
                _recheck_mapped(dir_fd, entry, (info.st_dev, info.st_ino), os.fstat(fd))
            finally:
                os.close(fd)
        # Once more for every payload, under the caller's shared lock and before anything touches
        # the mapped bytes: the name still names the mapped inode, which still has the manifest's size.
        for payload in payloads:
            _recheck_mapped(dir_fd, payload.entry, (payload.device, payload.inode), None)
        mapped = tuple(payloads)
        if validation is ValidationLevel.FULL_CHECKSUM:
            check_content_digest(manifest)
            _verify_checksums(manifest, mapped, hash_threads=hash_threads, progress=progress)
        return ValidatedArtifact(manifest=manifest, marker=marker, payloads=mapped)
    finally:
        os.close(dir_fd)

"""Validation of a published artifact directory and mapping of its payloads.

Everything is opened relative to the artifact directory's descriptor without
following symlinks. Problems with the artifact itself raise `InvalidArtifactError`
(the caller denies it); I/O errors that say nothing about the artifact raise
`ArtifactReadError` (retryable, nothing is denied).
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

from .._digest import DIGEST_ALGORITHM, content_digest, file_digest, tree_digests_parallel
from .._faults import fault_point
from ..canonical_json import decode_json
from ..failures import FailureCode, HostWeightFailure, ResolutionStage, failure
from ..identity import WeightArtifactIdentity
from ..lease import MappedHostRegion
from ..manifest import (
    MANIFEST_FILE_NAME,
    READY_FILE_NAME,
    FileManifestEntry,
    PublicationMarker,
    WeightManifest,
    manifest_sha256,
)
from ..tensors import ValidationLevel, dtype_from_code, itemsize_of_code

if TYPE_CHECKING:
    import torch

MAX_METADATA_FILE_BYTES = 64 * 1024 * 1024
MAX_HEADER_BYTES = 100 * 1024 * 1024
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
        """Zero-copy views of every tensor, in manifest order."""
        by_file = {payload.entry.name: (payload, payload.base()) for payload in self.payloads}
        views: dict[str, torch.Tensor] = {}
        for entry in self.manifest.tensors:
            payload, base = by_file[entry.file]
            start = payload.entry.header_size + entry.data_offsets[0]
            end = payload.entry.header_size + entry.data_offsets[1]
            dtype = dtype_from_code(entry.dtype)
            views[entry.name] = base[start:end].view(dtype).reshape(entry.shape)
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


def _read_error(exc: OSError, what: str) -> ArtifactReadError:
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


def _open_member(dir_fd: int, name: str) -> tuple[int, os.stat_result]:
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise _invalid(
                FailureCode.PAYLOAD_INVALID, f"{name} is a symlink; artifacts contain only regular files", file=name
            ) from None
        if exc.errno == errno.ENOENT:
            raise _invalid(FailureCode.PAYLOAD_INVALID, f"{name} is missing", file=name) from None
        raise _read_error(exc, name) from exc
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
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
            raise _read_error(exc, what) from exc
        if not chunk:
            raise _invalid(FailureCode.PAYLOAD_INVALID, f"{what} is truncated", what=what)
        chunks.append(chunk)
        remaining -= len(chunk)
        position += len(chunk)
    return b"".join(chunks)


def _read_metadata_file(dir_fd: int, name: str) -> bytes:
    fd, info = _open_member(dir_fd, name)
    try:
        if info.st_size > MAX_METADATA_FILE_BYTES:
            raise _invalid(FailureCode.MANIFEST_INVALID, f"{name} is implausibly large ({info.st_size} bytes)")
        fault_point("reader.read_metadata")
        return _read_exact(fd, info.st_size, 0, name)
    except OSError as exc:
        raise _read_error(exc, name) from exc
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
    ready_bytes = _read_metadata_file(dir_fd, READY_FILE_NAME)
    try:
        marker = PublicationMarker.from_bytes(ready_bytes)
    except ValueError as exc:
        raise _invalid(FailureCode.MANIFEST_INVALID, f"READY.json is invalid: {exc}") from None
    manifest_bytes = _read_metadata_file(dir_fd, MANIFEST_FILE_NAME)
    if manifest_sha256(manifest_bytes) != marker.manifest_sha256:
        raise _invalid(FailureCode.MANIFEST_INVALID, "manifest.json does not match the digest in READY.json")
    try:
        manifest = WeightManifest.from_bytes(manifest_bytes)
    except (ValueError, KeyError) as exc:
        raise _invalid(FailureCode.MANIFEST_INVALID, f"manifest.json is invalid: {exc}") from None
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
    if manifest.digest_algorithm != DIGEST_ALGORITHM:
        raise _invalid(FailureCode.MANIFEST_INCOMPATIBLE, f"unknown digest algorithm {manifest.digest_algorithm!r}")
    if marker.content_digest != manifest.content_digest:
        raise _invalid(FailureCode.MANIFEST_INVALID, "READY.json and manifest.json disagree on the content digest")
    return marker, manifest


def _check_content_digest(manifest: WeightManifest) -> None:
    """The content digest must follow from the tensor digests (a FULL_CHECKSUM check: the manifest's own
    bytes are already pinned by READY.json, so this only catches a publisher that lied about them)."""
    recomputed = content_digest((t.name, t.dtype, t.shape, t.digest) for t in manifest.tensors)
    if recomputed != manifest.content_digest:
        raise _invalid(FailureCode.MANIFEST_INVALID, "the manifest's content digest does not match its tensors")


def _check_header(fd: int, entry: FileManifestEntry, manifest: WeightManifest) -> None:
    try:
        fault_point("reader.read_payload_header")
    except OSError as exc:
        raise _read_error(exc, entry.name) from exc
    length_bytes = _read_exact(fd, 8, 0, entry.name)
    header_length = int.from_bytes(length_bytes, "little")
    if header_length > MAX_HEADER_BYTES or 8 + header_length != entry.header_size:
        raise _invalid(FailureCode.PAYLOAD_INVALID, f"{entry.name}: header length disagrees with the manifest")
    try:
        header = decode_json(_read_exact(fd, header_length, 8, entry.name).rstrip(b" "))
    except ValueError as exc:
        raise _invalid(FailureCode.PAYLOAD_INVALID, f"{entry.name}: malformed safetensors header: {exc}") from None
    if not isinstance(header, dict):
        raise _invalid(FailureCode.PAYLOAD_INVALID, f"{entry.name}: safetensors header is not an object")
    header.pop("__metadata__", None)
    if set(header) != set(entry.tensors):
        raise _invalid(FailureCode.PAYLOAD_INVALID, f"{entry.name}: header tensors differ from the manifest")
    data_size = entry.size - entry.header_size
    spans: list[tuple[int, int]] = []
    for name in entry.tensors:
        described = header[name]
        tensor = manifest.tensor(name)
        if not isinstance(described, dict) or described != {
            "dtype": tensor.dtype,
            "shape": list(tensor.shape),
            "data_offsets": list(tensor.data_offsets),
        }:
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


def _map_payload(fd: int, info: os.stat_result, entry: FileManifestEntry) -> MappedPayload:
    try:
        mapping = mmap.mmap(fd, entry.size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except OSError as exc:
        raise _read_error(exc, entry.name) from exc
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
            buffers, chunk_bytes=manifest.digest_chunk_bytes, threads=hash_threads, progress=progress
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
        raise _read_error(exc, str(artifact_dir)) from exc
    try:
        _check_directory(dir_fd, artifact_dir)
        marker, manifest = _parse_marker_and_manifest(dir_fd, key, identity)
        try:
            present = set(os.listdir(dir_fd))
        except OSError as exc:
            raise _read_error(exc, str(artifact_dir)) from exc
        expected = {READY_FILE_NAME, MANIFEST_FILE_NAME} | {entry.name for entry in manifest.files}
        if present != expected:
            raise _invalid(
                FailureCode.PAYLOAD_INVALID,
                "the artifact directory does not hold exactly the listed files",
                extra=sorted(present - expected),
                missing=sorted(expected - present),
            )
        payloads: list[MappedPayload] = []
        for entry in manifest.files:
            fd, info = _open_member(dir_fd, entry.name)
            try:
                if info.st_size != entry.size:
                    raise _invalid(
                        FailureCode.PAYLOAD_INVALID,
                        f"{entry.name} is {info.st_size} bytes; the manifest says {entry.size}",
                        file=entry.name,
                    )
                _check_header(fd, entry, manifest)
                payloads.append(_map_payload(fd, info, entry))
            finally:
                os.close(fd)
        mapped = tuple(payloads)
        if validation is ValidationLevel.FULL_CHECKSUM:
            _check_content_digest(manifest)
            _verify_checksums(manifest, mapped, hash_threads=hash_threads, progress=progress)
        return ValidatedArtifact(manifest=manifest, marker=marker, payloads=mapped)
    finally:
        os.close(dir_fd)

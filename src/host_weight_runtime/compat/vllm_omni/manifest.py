"""Manifest records in the reference's shape, translated from this runtime's (never its on-disk format).

The reference's `WeightManifest`, `TensorManifestEntry`, `FileManifestEntry` and `PublicationMarker` are
plain records with its field names and `to_dict`/`from_dict`; `from_native` gives one from this runtime's
manifest (digests are this runtime's, named by its `digest_algorithm`). What this store writes and reads
on disk is always this runtime's `manifest.json` and `READY.json`; leases carry this runtime's manifest.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import PurePosixPath

from ... import manifest as native
from ...canonical_json import CanonicalJson, JsonValue, encode_canonical
from ...identity import WeightArtifactIdentity
from ...tensors import TensorKind, dtype_from_code

__all__ = [
    "FileManifestEntry",
    "ManifestValidationError",
    "PublicationMarker",
    "TensorKind",
    "TensorManifestEntry",
    "WeightManifest",
]

ManifestValidationError = ValueError
"""This runtime rejects a bad manifest with ValueError (the reference's error is a ValueError subclass)."""

_DIGEST = re.compile(r"[0-9a-f]{64}")


def _text(where: str, value: object) -> str:
    if not isinstance(value, str) or not value:
        raise ManifestValidationError(f"{where} must be a non-empty string")
    return value


def _integer(where: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ManifestValidationError(f"{where} must be an integer")
    return value


def _digest(where: str, value: object) -> str:
    if not isinstance(value, str) or _DIGEST.fullmatch(value) is None:
        raise ManifestValidationError(f"{where} must be a lowercase SHA-256 digest")
    return value


def _basename(value: object) -> str:
    if not isinstance(value, str):
        raise ManifestValidationError("artifact file name must be a string")
    parts = PurePosixPath(value).parts
    if value in ("", ".", "..") or len(parts) != 1 or parts[0] != value:
        raise ManifestValidationError(f"artifact file name must be one safe relative basename: {value!r}")
    return value


def _integers(where: str, value: object) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise ManifestValidationError(f"{where} must be an array")
    return tuple(_integer(f"{where}[{index}]", item) for index, item in enumerate(value))


def _fields(value: object, names: tuple[str, ...], what: str) -> dict[str, object]:
    """The record's fields, exactly `names` (missing and unexpected keys named)."""
    if not isinstance(value, dict) or any(not isinstance(key, str) for key in value):
        raise ManifestValidationError(f"{what} must be an object")
    missing, unexpected = sorted(set(names) - set(value)), sorted(set(value) - set(names))
    if missing or unexpected:
        raise ManifestValidationError(f"{what} fields differ: missing={missing}, unexpected={unexpected}")
    return value


def _dims(name: str, label: str, value: object) -> None:
    if not isinstance(value, tuple) or any(isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in value):
        raise ManifestValidationError(f"tensor {name!r} has an invalid {label}")


@dataclass(frozen=True)
class TensorManifestEntry:
    """One tensor in the reference's words (`storage_key` is its key in the payload file)."""

    name: str
    kind: TensorKind
    role: str
    file_name: str
    storage_key: str
    shape: tuple[int, ...]
    dtype: str
    stride: tuple[int, ...]
    nbytes: int
    sha256: str

    _NAMES = ("name", "kind", "role", "file_name", "storage_key", "shape", "dtype", "stride", "nbytes", "sha256")

    def __post_init__(self) -> None:
        for label in ("name", "role", "storage_key", "dtype"):
            _text(f"tensor.{label}", getattr(self, label))
        if not isinstance(self.kind, TensorKind):
            raise ManifestValidationError("tensor kind must use TensorKind")
        _basename(self.file_name)
        _dims(self.name, "shape", self.shape)
        _dims(self.name, "stride", self.stride)
        if len(self.stride) != len(self.shape):
            raise ManifestValidationError(f"tensor {self.name!r} has an invalid stride")
        if _integer(f"tensors[{self.name!r}].nbytes", self.nbytes) < 0:
            raise ManifestValidationError(f"tensor {self.name!r} has negative nbytes")
        _digest(f"tensors[{self.name!r}].sha256", self.sha256)

    def to_dict(self) -> dict[str, JsonValue]:
        value: dict[str, JsonValue] = {name: getattr(self, name) for name in self._NAMES}
        value.update(kind=self.kind.value, shape=list(self.shape), stride=list(self.stride))
        return value

    @classmethod
    def from_dict(cls, value: object) -> TensorManifestEntry:
        found = _fields(value, cls._NAMES, "tensor manifest entry")
        try:
            kind = TensorKind(_text("tensor.kind", found["kind"]))
        except ValueError as exc:
            raise ManifestValidationError(f"unknown tensor kind {found['kind']!r}") from exc
        return cls(
            name=_text("tensor.name", found["name"]),
            kind=kind,
            role=_text("tensor.role", found["role"]),
            file_name=_basename(found["file_name"]),
            storage_key=_text("tensor.storage_key", found["storage_key"]),
            shape=_integers("tensor.shape", found["shape"]),
            dtype=_text("tensor.dtype", found["dtype"]),
            stride=_integers("tensor.stride", found["stride"]),
            nbytes=_integer("tensor.nbytes", found["nbytes"]),
            sha256=_digest("tensor.sha256", found["sha256"]),
        )


@dataclass(frozen=True)
class FileManifestEntry:
    """One payload file in the reference's words."""

    file_name: str
    size: int
    sha256: str

    def __post_init__(self) -> None:
        _basename(self.file_name)
        if _integer(f"files[{self.file_name!r}].size", self.size) < 0:
            raise ManifestValidationError(f"artifact file {self.file_name!r} has negative size")
        _digest(f"files[{self.file_name!r}].sha256", self.sha256)

    def to_dict(self) -> dict[str, JsonValue]:
        return {"file_name": self.file_name, "size": self.size, "sha256": self.sha256}

    @classmethod
    def from_dict(cls, value: object) -> FileManifestEntry:
        found = _fields(value, ("file_name", "size", "sha256"), "file manifest entry")
        return cls(
            _basename(found["file_name"]), _integer("file.size", found["size"]), _digest("file.sha256", found["sha256"])
        )


def _sorted_unique(names: list[str], what: str) -> None:
    if names != sorted(names) or len(set(names)) != len(names):
        raise ManifestValidationError(f"manifest {what} must have unique names in canonical order")


@dataclass(frozen=True)
class WeightManifest:
    """An artifact's manifest in the reference's words; `from_native` translates this runtime's."""

    schema_version: int
    artifact_key: str
    identity: WeightArtifactIdentity
    producer_schema: str
    restorer_schema: str
    tensors: tuple[TensorManifestEntry, ...]
    files: tuple[FileManifestEntry, ...]
    artifact_content_sha256: str
    format_metadata: CanonicalJson = field(default_factory=CanonicalJson.empty)

    _NAMES = (
        "schema_version",
        "artifact_key",
        "identity",
        "producer_schema",
        "restorer_schema",
        "tensors",
        "files",
        "artifact_content_sha256",
        "format_metadata",
    )

    def __post_init__(self) -> None:
        if _integer("manifest.schema_version", self.schema_version) < 1:
            raise ManifestValidationError("manifest schema_version must be positive")
        _digest("artifact_key", self.artifact_key)
        _digest("artifact_content_sha256", self.artifact_content_sha256)
        if not isinstance(self.identity, WeightArtifactIdentity):
            raise ManifestValidationError("manifest identity must use WeightArtifactIdentity")
        if self.artifact_key != self.identity.key:
            raise ManifestValidationError("manifest artifact_key does not match its identity")
        _text("manifest.producer_schema", self.producer_schema)
        _text("manifest.restorer_schema", self.restorer_schema)
        if not isinstance(self.format_metadata, CanonicalJson):
            raise ManifestValidationError("manifest format_metadata must use CanonicalJson")
        tensors_ok = isinstance(self.tensors, tuple) and all(isinstance(e, TensorManifestEntry) for e in self.tensors)
        files_ok = isinstance(self.files, tuple) and all(isinstance(e, FileManifestEntry) for e in self.files)
        if not (tensors_ok and files_ok and self.tensors and self.files):
            raise ManifestValidationError("an artifact must contain at least one tensor and one file")
        _sorted_unique([entry.name for entry in self.tensors], "tensors")
        _sorted_unique([entry.file_name for entry in self.files], "files")
        declared = {entry.file_name for entry in self.files}
        if any(entry.file_name not in declared for entry in self.tensors):
            raise ManifestValidationError("a tensor names a file the manifest does not declare")
        bindings = {(entry.file_name, entry.storage_key) for entry in self.tensors}
        if len(bindings) != len(self.tensors):
            raise ManifestValidationError("two tensors share one storage key in one file")

    @property
    def total_tensor_bytes(self) -> int:
        return sum(entry.nbytes for entry in self.tensors)

    @property
    def canonical_bytes(self) -> bytes:
        return encode_canonical(self.to_dict())

    def to_dict(self) -> dict[str, JsonValue]:
        return {
            "schema_version": self.schema_version,
            "artifact_key": self.artifact_key,
            "identity": self.identity.to_dict(),
            "producer_schema": self.producer_schema,
            "restorer_schema": self.restorer_schema,
            "tensors": [entry.to_dict() for entry in self.tensors],
            "files": [entry.to_dict() for entry in self.files],
            "artifact_content_sha256": self.artifact_content_sha256,
            "format_metadata": self.format_metadata.to_value(),
        }

    @classmethod
    def from_dict(cls, value: object) -> WeightManifest:
        found = _fields(value, cls._NAMES, "weight manifest")
        tensors, files = found["tensors"], found["files"]
        if not isinstance(tensors, list) or not isinstance(files, list):
            raise ManifestValidationError("manifest tensors and files must be arrays of objects")
        return cls(
            schema_version=_integer("manifest.schema_version", found["schema_version"]),
            artifact_key=_digest("manifest.artifact_key", found["artifact_key"]),
            identity=WeightArtifactIdentity.from_dict(found["identity"]),
            producer_schema=_text("manifest.producer_schema", found["producer_schema"]),
            restorer_schema=_text("manifest.restorer_schema", found["restorer_schema"]),
            tensors=tuple(TensorManifestEntry.from_dict(item) for item in tensors),
            files=tuple(FileManifestEntry.from_dict(item) for item in files),
            artifact_content_sha256=_digest("manifest.artifact_content_sha256", found["artifact_content_sha256"]),
            format_metadata=CanonicalJson.from_value(found["format_metadata"]),
        )

    @classmethod
    def from_native(cls, manifest: native.WeightManifest) -> WeightManifest:
        """This runtime's manifest in the reference's words: the same tensors, files and digests."""
        tensors = tuple(
            TensorManifestEntry(
                name=entry.name,
                kind=entry.kind,
                role=entry.role or entry.kind.value,
                file_name=entry.file,
                storage_key=entry.name,
                shape=entry.shape,
                dtype=str(dtype_from_code(entry.dtype)),
                stride=entry.strides,
                nbytes=entry.nbytes,
                sha256=entry.digest,
            )
            for entry in sorted(manifest.tensors, key=lambda item: item.name)
        )
        files = tuple(
            FileManifestEntry(entry.name, entry.size, entry.digest)
            for entry in sorted(manifest.files, key=lambda item: item.name)
        )
        return cls(
            schema_version=manifest.schema_version,
            artifact_key=manifest.identity.key,
            identity=manifest.identity,
            producer_schema=manifest.producer_schema,
            restorer_schema=manifest.restorer_schema,
            tensors=tensors,
            files=files,
            artifact_content_sha256=manifest.content_digest,
            format_metadata=manifest.format_metadata,
        )


@dataclass(frozen=True)
class PublicationMarker:
    """A publication marker in the reference's words; `from_native` translates this runtime's READY.json."""

    schema_version: int
    publication_id: str
    manifest_sha256: str
    artifact_content_sha256: str
    integrity_mode: str

    _NAMES = ("schema_version", "publication_id", "manifest_sha256", "artifact_content_sha256", "integrity_mode")

    def __post_init__(self) -> None:
        if _integer("publication.schema_version", self.schema_version) < 1:
            raise ManifestValidationError("publication schema_version must be positive")
        _text("publication.publication_id", self.publication_id)
        _text("publication.integrity_mode", self.integrity_mode)
        _digest("publication.manifest_sha256", self.manifest_sha256)
        _digest("publication.artifact_content_sha256", self.artifact_content_sha256)

    @property
    def canonical_bytes(self) -> bytes:
        return encode_canonical(self.to_dict())

    def to_dict(self) -> dict[str, JsonValue]:
        return {name: getattr(self, name) for name in self._NAMES}

    @classmethod
    def from_dict(cls, value: object) -> PublicationMarker:
        found = _fields(value, cls._NAMES, "publication marker")
        return cls(
            schema_version=_integer("publication.schema_version", found["schema_version"]),
            publication_id=_text("publication.publication_id", found["publication_id"]),
            manifest_sha256=_digest("publication.manifest_sha256", found["manifest_sha256"]),
            artifact_content_sha256=_digest("publication.artifact_content_sha256", found["artifact_content_sha256"]),
            integrity_mode=_text("publication.integrity_mode", found["integrity_mode"]),
        )

    @classmethod
    def from_native(cls, marker: native.PublicationMarker, integrity_mode: str) -> PublicationMarker:
        """This runtime's READY record in the reference's words (`integrity_mode`: how it was checked)."""
        return cls(
            marker.schema_version, marker.publication_id, marker.manifest_sha256, marker.content_digest, integrity_mode
        )

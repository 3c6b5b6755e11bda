"""DESCRIPTOR.json: the small object written last that makes an uploaded artifact visible on a remote.

Canonical JSON, strictly parsed (exact keys, no coercion, bounded size)::

    {
      "schema": "hwr-remote-descriptor",      fixed
      "schema_version": 1,
      "identity": {...},                      the artifact's full identity
      "identity_key": "<64 hex>",             must equal identity.key and the folder name
      "manifest_sha256": "<64 hex>",          SHA-256 of manifest.json's bytes
      "manifest_size": 12345,                 size of manifest.json
      "content_sha256": "<64 hex>",           the manifest's content_digest
      "files": [{"name": "...", "size": n}],  every payload file, in manifest order
      "total_bytes": n,                       sum of the payload sizes
      "provider_id": "s3://bucket/prefix",    where the uploader pushed (secret-free, informational)
      "uploader": "host-weight-runtime/0.1.0",
      "uploaded_at_ns": n
    }

Nothing secret is ever written into it: the provider id is a URL without user info or
query, and no storage option reaches it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .._strict import get_int, get_list, get_str, require_exact_keys, require_object
from ..canonical_json import JsonValue, decode_json, encode_canonical, is_canonical
from ..identity import WeightArtifactIdentity
from ..manifest import MANIFEST_FILE_NAME, validate_file_name

__all__ = [
    "DESCRIPTOR_FILE_NAME",
    "DESCRIPTOR_SCHEMA",
    "DESCRIPTOR_SCHEMA_VERSION",
    "MAX_DESCRIPTOR_BYTES",
    "MAX_MANIFEST_BYTES",
    "RemoteDescriptorRecord",
    "RemoteFileRecord",
]

DESCRIPTOR_FILE_NAME = "DESCRIPTOR.json"
DESCRIPTOR_SCHEMA = "hwr-remote-descriptor"
DESCRIPTOR_SCHEMA_VERSION = 1
MAX_DESCRIPTOR_BYTES = 1 << 20
MAX_MANIFEST_BYTES = 64 << 20

_HEX = re.compile(r"[0-9a-f]{64}")
_KEYS = frozenset(
    {
        "schema",
        "schema_version",
        "identity",
        "identity_key",
        "manifest_sha256",
        "manifest_size",
        "content_sha256",
        "files",
        "total_bytes",
        "provider_id",
        "uploader",
        "uploaded_at_ns",
    }
)


def _hex(value: str, label: str) -> str:
    if type(value) is not str or _HEX.fullmatch(value) is None:
        raise ValueError(f"descriptor {label} must be a 64-character lowercase hex digest")
    return value


@dataclass(frozen=True, slots=True)
class RemoteFileRecord:
    """One payload object the descriptor promises, with its exact size."""

    name: str
    size: int

    def __post_init__(self) -> None:
        validate_file_name(self.name)
        if type(self.size) is not int or self.size < 8:
            raise ValueError(f"descriptor file {self.name}: size must be an integer of at least 8 bytes")

    def to_dict(self) -> dict[str, JsonValue]:
        return {"name": self.name, "size": self.size}

    @classmethod
    def from_dict(cls, value: object) -> RemoteFileRecord:
        where = "descriptor.files[]"
        obj = require_object(value, where)
        require_exact_keys(obj, frozenset({"name", "size"}), where)
        return cls(name=get_str(obj, "name", where), size=get_int(obj, "size", where))


@dataclass(frozen=True, slots=True)
class RemoteDescriptorRecord:
    """The parsed descriptor object; `to_bytes` and `from_bytes` round-trip exactly."""

    identity: WeightArtifactIdentity
    manifest_sha256: str
    manifest_size: int
    content_sha256: str
    files: tuple[RemoteFileRecord, ...]
    provider_id: str
    uploader: str
    uploaded_at_ns: int
    schema_version: int = DESCRIPTOR_SCHEMA_VERSION

    def __post_init__(self) -> None:
        if type(self.schema_version) is not int or self.schema_version != DESCRIPTOR_SCHEMA_VERSION:
            raise ValueError(f"descriptor schema_version {self.schema_version!r} is not supported")
        if not isinstance(self.identity, WeightArtifactIdentity):
            raise ValueError("descriptor identity must be a WeightArtifactIdentity")
        _hex(self.manifest_sha256, "manifest_sha256")
        _hex(self.content_sha256, "content_sha256")
        if type(self.manifest_size) is not int or not 0 < self.manifest_size <= MAX_MANIFEST_BYTES:
            raise ValueError(f"descriptor manifest_size must be an integer in 1..{MAX_MANIFEST_BYTES}")
        files_ok = type(self.files) is tuple and all(isinstance(item, RemoteFileRecord) for item in self.files)
        if not files_ok or not self.files:
            raise ValueError("descriptor files must be a non-empty tuple of RemoteFileRecord")
        names = [record.name for record in self.files]
        if len(set(names)) != len(names):
            raise ValueError("descriptor lists a payload file twice")
        for label in ("provider_id", "uploader"):
            value = getattr(self, label)
            if type(value) is not str or not value or len(value) > 1024:
                raise ValueError(f"descriptor {label} must be a non-empty string of at most 1024 characters")
        if type(self.uploaded_at_ns) is not int or self.uploaded_at_ns < 0:
            raise ValueError("descriptor uploaded_at_ns must be a non-negative integer")

    @property
    def identity_key(self) -> str:
        return self.identity.key

    @property
    def total_bytes(self) -> int:
        return sum(record.size for record in self.files)

    def expected_objects(self) -> dict[str, int]:
        """Every object the artifact's folder must hold besides the descriptor, with its size."""
        sizes = {record.name: record.size for record in self.files}
        sizes[MANIFEST_FILE_NAME] = self.manifest_size
        return sizes

    def to_dict(self) -> dict[str, JsonValue]:
        return {
            "schema": DESCRIPTOR_SCHEMA,
            "schema_version": self.schema_version,
            "identity": self.identity.to_dict(),
            "identity_key": self.identity_key,
            "manifest_sha256": self.manifest_sha256,
            "manifest_size": self.manifest_size,
            "content_sha256": self.content_sha256,
            "files": [record.to_dict() for record in self.files],
            "total_bytes": self.total_bytes,
            "provider_id": self.provider_id,
            "uploader": self.uploader,
            "uploaded_at_ns": self.uploaded_at_ns,
        }

    def to_bytes(self) -> bytes:
        return encode_canonical(self.to_dict())

    @classmethod
    def from_bytes(cls, data: bytes) -> RemoteDescriptorRecord:
        """Parse descriptor bytes: canonical JSON, exact keys, every cross-field fact checked; ValueError if not."""
        if len(data) > MAX_DESCRIPTOR_BYTES:
            raise ValueError(f"the descriptor is {len(data)} bytes, more than the {MAX_DESCRIPTOR_BYTES}-byte limit")
        value = decode_json(data)
        if not is_canonical(data, value):
            raise ValueError("descriptor bytes are not canonical JSON")
        obj = require_object(value, "descriptor")
        require_exact_keys(obj, _KEYS, "descriptor")
        if get_str(obj, "schema", "descriptor") != DESCRIPTOR_SCHEMA:
            raise ValueError(f"descriptor schema must be {DESCRIPTOR_SCHEMA!r}")
        record = cls(
            schema_version=get_int(obj, "schema_version", "descriptor"),
            identity=WeightArtifactIdentity.from_dict(obj["identity"]),
            manifest_sha256=get_str(obj, "manifest_sha256", "descriptor"),
            manifest_size=get_int(obj, "manifest_size", "descriptor"),
            content_sha256=get_str(obj, "content_sha256", "descriptor"),
            files=tuple(RemoteFileRecord.from_dict(item) for item in get_list(obj, "files", "descriptor")),
            provider_id=get_str(obj, "provider_id", "descriptor"),
            uploader=get_str(obj, "uploader", "descriptor"),
            uploaded_at_ns=get_int(obj, "uploaded_at_ns", "descriptor"),
        )
        if get_str(obj, "identity_key", "descriptor") != record.identity_key:
            raise ValueError("descriptor identity_key does not match its identity")
        if get_int(obj, "total_bytes", "descriptor") != record.total_bytes:
            raise ValueError("descriptor total_bytes does not match its files")
        return record

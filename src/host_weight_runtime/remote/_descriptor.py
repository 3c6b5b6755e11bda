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
from typing import ClassVar

from .._records import Field, Integer, Nested, Records, RecordSpec, Text
from .._strict import require_object
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
def _hex(value: str, label: str) -> str:
    if type(value) is not str or _HEX.fullmatch(value) is None:
        raise ValueError(f"descriptor {label} must be a 64-character lowercase hex digest")
    return value


@dataclass(frozen=True, slots=True)
class RemoteFileRecord:
    """One payload object the descriptor promises, with its exact size (types checked below, by name)."""

    SPEC: ClassVar[RecordSpec] = RecordSpec(
        "RemoteFileRecord", "descriptor.files[]", (Field("name", Text()), Field("size", Integer()))
    )

    name: str
    size: int

    def __post_init__(self) -> None:
        validate_file_name(self.name)
        if type(self.size) is not int or self.size < 8:
            raise ValueError(f"descriptor file {self.name}: size must be an integer of at least 8 bytes")

    def to_dict(self) -> dict[str, JsonValue]:
        return self.SPEC.encode(self)

    @classmethod
    def from_dict(cls, value: object) -> RemoteFileRecord:
        return cls(**cls.SPEC.decode(value))


@dataclass(frozen=True, slots=True)
class RemoteDescriptorRecord:
    """The parsed descriptor object; `to_bytes` and `from_bytes` round-trip exactly.

    `schema`, `identity_key` and `total_bytes` are derived: written from the record and checked on reading.
    """

    SPEC: ClassVar[RecordSpec] = RecordSpec(
        "RemoteDescriptorRecord",
        "descriptor",
        (
            Field("schema", Text(), derived=True),
            Field("schema_version", Integer()),
            Field("identity", Nested(WeightArtifactIdentity)),
            Field("identity_key", Text(), derived=True),
            Field("manifest_sha256", Text()),
            Field("manifest_size", Integer()),
            Field("content_sha256", Text()),
            Field("files", Records(RemoteFileRecord)),
            Field("total_bytes", Integer(), derived=True),
            Field("provider_id", Text()),
            Field("uploader", Text()),
            Field("uploaded_at_ns", Integer()),
        ),
    )

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
    def schema(self) -> str:
        return DESCRIPTOR_SCHEMA

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
        return self.SPEC.encode(self)

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
        values = cls.SPEC.decode(require_object(value, "descriptor"))
        if values["schema"] != DESCRIPTOR_SCHEMA:
            raise ValueError(f"descriptor schema must be {DESCRIPTOR_SCHEMA!r}")
        record = cls(**cls.SPEC.arguments(values))
        if values["identity_key"] != record.identity_key:
            raise ValueError("descriptor identity_key does not match its identity")
        if values["total_bytes"] != record.total_bytes:
            raise ValueError("descriptor total_bytes does not match its files")
        return record

"""The manifest and READY marker: the two files that make an artifact directory an artifact.

Both are canonical JSON. The manifest lists every file and tensor with its digest;
READY.json is written last and names the manifest's digest, so a reader that finds
READY.json knows which manifest bytes it must see.
"""

from __future__ import annotations

import functools
import gc
import hashlib
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import ClassVar

from ._records import EnumValue, Field, Integer, IntPair, Ints, Json, Nested, Records, RecordSpec, Text, Texts
from ._strict import get_list, require_json_field, require_object, require_record
from .canonical_json import (
    CanonicalJson,
    JsonValue,
    decode_canonical_json,
    decode_json,
    encode_canonical,
    encode_canonical_trusted,
)
from .identity import WeightArtifactIdentity
from .tensors import TensorKind, contiguous_strides, itemsize_of_code, numel_of

MANIFEST_SCHEMA_VERSION = 1
READY_SCHEMA_VERSION = 1
MANIFEST_FILE_NAME = "manifest.json"
READY_FILE_NAME = "READY.json"
PAYLOAD_SUFFIX = ".safetensors"
RESERVED_FILE_NAMES = frozenset({MANIFEST_FILE_NAME, READY_FILE_NAME})
MAX_FILE_NAME_LENGTH = 200
# Bounds on what a manifest may describe, so hostile bytes cannot make parsing slow or huge.
MAX_TENSOR_RANK = 64
MAX_MANIFEST_FILES = 10_000
MAX_MANIFEST_TENSORS = 1_000_000
MAX_BYTE_COUNT = 2**63 - 1


@functools.lru_cache(maxsize=4096)
def _checked_file_name(name: str) -> str:
    return _validate_file_name(name)


def validate_file_name(name: str) -> str:
    """Accept exactly one safe basename ending in .safetensors; raise ValueError otherwise."""
    if type(name) is not str:
        raise ValueError("a payload file name must be a non-empty string")
    return _checked_file_name(name)


def _validate_file_name(name: str) -> str:
    """Accept exactly one safe basename ending in .safetensors; raise ValueError otherwise."""
    if type(name) is not str or not name:
        raise ValueError("a payload file name must be a non-empty string")
    if name in (".", "..") or "/" in name or "\\" in name or "\x00" in name:
        raise ValueError(f"payload file name {name!r} must be one plain basename (no '/', '.' or '..')")
    if name.startswith("."):
        raise ValueError(f"payload file name {name!r} must not start with '.'")
    if any(ord(char) < 32 or ord(char) == 127 for char in name):
        raise ValueError(f"payload file name {name!r} must not contain control characters")
    if len(name) > MAX_FILE_NAME_LENGTH:
        raise ValueError(f"payload file name is longer than {MAX_FILE_NAME_LENGTH} characters")
    if name in RESERVED_FILE_NAMES:
        raise ValueError(f"payload file name {name!r} is reserved")
    if not name.endswith(PAYLOAD_SUFFIX) or name == PAYLOAD_SUFFIX:
        raise ValueError(f"payload file name {name!r} must end with {PAYLOAD_SUFFIX}")
    return name


_HEX_DIGEST = re.compile(r"[0-9a-f]{64}")


def _hex_digest(value: str, where: str) -> str:
    if type(value) is not str or _HEX_DIGEST.fullmatch(value) is None:
        raise ValueError(f"{where} must be a 64-character lowercase hex digest")
    return value


@dataclass(frozen=True, slots=True)
class TensorManifestEntry:
    """One tensor: where it lives, what it is, and the digest of its bytes.

    The field types are checked by the invariants below, which name the tensor (a manifest holds many).
    """

    SPEC: ClassVar[RecordSpec] = RecordSpec(
        "TensorManifestEntry",
        "manifest.tensors[]",
        (
            Field("name", Text()),
            Field("file", Text()),
            Field("dtype", Text()),
            Field("shape", Ints()),
            Field("strides", Ints()),
            Field("data_offsets", IntPair()),
            Field("kind", EnumValue(TensorKind)),
            Field("role", Text(allow_empty=True)),
            Field("digest", Text()),
        ),
    )

    name: str
    file: str
    dtype: str
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    data_offsets: tuple[int, int]
    kind: TensorKind
    role: str
    digest: str

    def __post_init__(self) -> None:
        if type(self.name) is not str or not self.name:
            raise ValueError("tensor name must be a non-empty string")
        if not self.name.isprintable():
            raise ValueError(f"tensor name {self.name[:200]!r} must not contain control or unprintable characters")
        validate_file_name(self.file)
        if type(self.dtype) is not str:
            raise ValueError(f"tensor {self.name}: dtype must be a safetensors dtype code string")
        itemsize = itemsize_of_code(self.dtype)
        for label in ("shape", "strides", "data_offsets"):
            if type(getattr(self, label)) is not tuple:
                raise ValueError(f"tensor {self.name}: {label} must be a tuple")
        if len(self.data_offsets) != 2:
            raise ValueError(f"tensor {self.name}: data_offsets must be (begin, end)")
        if len(self.shape) > MAX_TENSOR_RANK:
            raise ValueError(f"tensor {self.name}: rank {len(self.shape)} is above the limit of {MAX_TENSOR_RANK}")
        if any(type(d) is not int or d < 0 or d > MAX_BYTE_COUNT for d in self.shape):
            raise ValueError(f"tensor {self.name}: shape must hold non-negative integers below 2**63")
        if self.strides != contiguous_strides(self.shape):
            raise ValueError(f"tensor {self.name}: strides {self.strides} are not contiguous for {self.shape}")
        begin, end = self.data_offsets
        if type(begin) is not int or type(end) is not int or begin < 0 or end < begin or end > MAX_BYTE_COUNT:
            raise ValueError(f"tensor {self.name}: bad data_offsets {self.data_offsets}")
        if end - begin != numel_of(self.shape) * itemsize:
            raise ValueError(f"tensor {self.name}: data_offsets do not match shape and dtype")
        if not isinstance(self.kind, TensorKind):
            raise ValueError(f"tensor {self.name}: kind must be a TensorKind")
        if type(self.role) is not str:
            raise ValueError(f"tensor {self.name}: role must be a string")
        _hex_digest(self.digest, f"tensor {self.name} digest")

    @property
    def nbytes(self) -> int:
        return self.data_offsets[1] - self.data_offsets[0]

    def to_dict(self) -> dict[str, JsonValue]:
        return self.SPEC.encode(self)

    @classmethod
    def from_dict(cls, value: object) -> TensorManifestEntry:
        # A manifest holds thousands of entries: the well-formed case is read in one pass (the constructor
        # still checks every field); anything else goes through the spec, whose errors name the field.
        if type(value) is dict and value.keys() == _TENSOR_ENTRY_KEYS:
            shape, strides, offsets, kind = value["shape"], value["strides"], value["data_offsets"], value["kind"]
            if (
                type(shape) is list
                and type(strides) is list
                and type(offsets) is list
                and type(kind) is str
                and kind in _TENSOR_KINDS
                and all(type(step) is int for step in strides)
            ):
                return cls(
                    value["name"],  # each field's type is checked by __post_init__
                    value["file"],
                    value["dtype"],
                    tuple(shape),
                    tuple(strides),
                    tuple(offsets),
                    _TENSOR_KINDS[kind],
                    value["role"],
                    value["digest"],
                )
        return cls(**cls.SPEC.decode(value))


_TENSOR_ENTRY_KEYS = TensorManifestEntry.SPEC.keys
_TENSOR_KINDS = {kind.value: kind for kind in TensorKind}


@dataclass(frozen=True, slots=True)
class FileManifestEntry:
    """One payload file: exact size, header size and the digest of all its bytes (types checked below, by name)."""

    SPEC: ClassVar[RecordSpec] = RecordSpec(
        "FileManifestEntry",
        "manifest.files[]",
        (
            Field("name", Text()),
            Field("size", Integer()),
            Field("header_size", Integer()),
            Field("digest", Text()),
            Field("tensors", Texts()),
        ),
    )

    name: str
    size: int
    header_size: int
    digest: str
    tensors: tuple[str, ...]

    def __post_init__(self) -> None:
        validate_file_name(self.name)
        if type(self.size) is not int or type(self.header_size) is not int:
            raise ValueError(f"file {self.name}: size and header_size must be integers")
        if self.header_size < 8 or self.size < self.header_size or self.size > MAX_BYTE_COUNT:
            raise ValueError(f"file {self.name}: inconsistent size {self.size} / header {self.header_size}")
        _hex_digest(self.digest, f"file {self.name} digest")
        if type(self.tensors) is not tuple or any(type(item) is not str for item in self.tensors):
            raise ValueError(f"file {self.name}: tensors must be a tuple of tensor names")

    def to_dict(self) -> dict[str, JsonValue]:
        return self.SPEC.encode(self)

    @classmethod
    def from_dict(cls, value: object) -> FileManifestEntry:
        return cls(**cls.SPEC.decode(value))


@dataclass(frozen=True, slots=True)
class WeightManifest:
    """Everything a reader needs to validate an artifact and map its tensors.

    `identity_key` and `total_bytes` are derived: written from the identity and the files, and checked on reading.
    """

    SPEC: ClassVar[RecordSpec] = RecordSpec(
        "WeightManifest",
        "manifest",
        (
            Field("schema_version", Integer()),
            Field("identity", Nested(WeightArtifactIdentity)),
            Field("identity_key", Text(), derived=True),
            Field("producer_schema", Text()),
            Field("restorer_schema", Text()),
            Field("format_metadata", Json()),
            Field("digest_algorithm", Text()),
            Field("digest_chunk_bytes", Integer()),
            Field("files", Records(FileManifestEntry)),
            Field("tensors", Records(TensorManifestEntry)),
            Field("content_digest", Text()),
            Field("total_bytes", Integer(), derived=True),
        ),
    )

    identity: WeightArtifactIdentity
    producer_schema: str
    restorer_schema: str
    digest_algorithm: str
    digest_chunk_bytes: int
    files: tuple[FileManifestEntry, ...]
    tensors: tuple[TensorManifestEntry, ...]
    content_digest: str
    format_metadata: CanonicalJson = field(default_factory=CanonicalJson.empty)
    schema_version: int = MANIFEST_SCHEMA_VERSION
    _by_name: dict[str, TensorManifestEntry] = field(init=False, repr=False, compare=False, hash=False)
    _encoded: bytes | None = field(init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_by_name", {entry.name: entry for entry in self.tensors})
        object.__setattr__(self, "_encoded", None)
        if type(self.schema_version) is not int or self.schema_version != MANIFEST_SCHEMA_VERSION:
            raise ValueError(f"manifest schema_version {self.schema_version!r} is not supported")
        if not isinstance(self.identity, WeightArtifactIdentity):
            raise ValueError("manifest identity must be a WeightArtifactIdentity")
        for label in ("producer_schema", "restorer_schema", "digest_algorithm"):
            if type(getattr(self, label)) is not str or not getattr(self, label):
                raise ValueError(f"manifest {label} must be a non-empty string")
        if type(self.digest_chunk_bytes) is not int or self.digest_chunk_bytes <= 0:
            raise ValueError(f"manifest digest_chunk_bytes must be a positive integer, got {self.digest_chunk_bytes!r}")
        require_json_field(self.format_metadata, "manifest format_metadata")
        if type(self.files) is not tuple or any(not isinstance(e, FileManifestEntry) for e in self.files):
            raise ValueError("manifest files must be a tuple of FileManifestEntry")
        if type(self.tensors) is not tuple or any(not isinstance(e, TensorManifestEntry) for e in self.tensors):
            raise ValueError("manifest tensors must be a tuple of TensorManifestEntry")
        _hex_digest(self.content_digest, "manifest content_digest")
        file_names = [entry.name for entry in self.files]
        if len(set(file_names)) != len(file_names):
            raise ValueError("manifest lists a payload file twice")
        tensor_names = [entry.name for entry in self.tensors]
        if len(set(tensor_names)) != len(tensor_names):
            raise ValueError("manifest lists a tensor twice")
        known_files = set(file_names)
        for entry in self.tensors:
            if entry.file not in known_files:
                raise ValueError(f"tensor {entry.name} lives in unlisted file {entry.file}")
        listed = sorted((name, entry.name) for entry in self.files for name in entry.tensors)
        if listed != sorted((entry.name, entry.file) for entry in self.tensors):
            raise ValueError("the files' tensor lists do not match the manifest's tensors and their files")

    @property
    def identity_key(self) -> str:
        return self.identity.key

    @property
    def total_bytes(self) -> int:
        return sum(entry.size for entry in self.files)

    def tensor(self, name: str) -> TensorManifestEntry:
        return self._by_name[name]

    def to_dict(self) -> dict[str, JsonValue]:
        return self.SPEC.encode(self)

    def to_bytes(self) -> bytes:
        """The canonical bytes, encoded once per manifest: a build seals them and an import then checks their
        SHA-256 against the descriptor, and the value is frozen, so the second encoding is the first's bytes.
        Every field was type-checked when the manifest was made (its identity's by its SPEC, its free-form
        metadata by CanonicalJson), so the bytes skip `encode_canonical`'s walk of the value."""
        encoded = self._encoded
        if encoded is None:
            encoded = encode_canonical_trusted(self.to_dict())
            object.__setattr__(self, "_encoded", encoded)
        return encoded

    @classmethod
    def from_dict(cls, value: object, *, identity: WeightArtifactIdentity | None = None) -> WeightManifest:
        spec = cls.SPEC
        obj = require_record(value, spec.keys, spec.where)
        files = get_list(obj, "files", spec.where)
        tensors = get_list(obj, "tensors", spec.where)
        if len(files) > MAX_MANIFEST_FILES or len(tensors) > MAX_MANIFEST_TENSORS:
            raise ValueError(
                f"manifest lists {len(files)} files and {len(tensors)} tensors; the limits are "
                f"{MAX_MANIFEST_FILES} and {MAX_MANIFEST_TENSORS}"
            )
        # Compared as canonical bytes, so a document that only equals in Python (1 == true) is decoded as ever.
        if identity is not None and encode_canonical_trusted(obj["identity"]) == identity.canonical_bytes:  # type: ignore[arg-type]
            values = _MANIFEST_BODY.read(obj)
            values["identity"] = identity
        else:
            values = spec.read(obj)
        manifest = cls(**spec.arguments(values))
        if values["identity_key"] != manifest.identity_key:
            raise ValueError("manifest identity_key does not match its identity")
        if values["total_bytes"] != manifest.total_bytes:
            raise ValueError("manifest total_bytes does not match its files")
        return manifest

    @classmethod
    def from_bytes(cls, data: bytes, *, identity: WeightArtifactIdentity | None = None) -> WeightManifest:
        """Parse manifest bytes, which must be canonical JSON.

        `identity`: the identity the reader expects; when the manifest's is exactly its document, that
        (validated, already keyed) object is used instead of decoding and hashing the same fields again.
        """
        # Parsing allocates several objects per tensor and frees none; a cyclic GC pass over
        # them would only cost time on the warm path, so collection waits until the end.
        collecting = gc.isenabled()
        gc.disable()
        try:
            # Every field's type is checked below and free-form fields go through CanonicalJson,
            # which bounds their depth, so the generic depth walk is skipped on this hot path.
            try:
                value = decode_canonical_json(data)
            except ValueError as exc:
                raise ValueError(f"manifest bytes are not canonical JSON: {exc}") from None
            return cls.from_dict(value, identity=identity)
        finally:
            if collecting:
                gc.enable()


_MANIFEST_BODY = RecordSpec(
    "WeightManifest", "manifest", tuple(f for f in WeightManifest.SPEC.fields if f.name != "identity")
)
"""The manifest's fields but its identity: what is read when the identity is the reader's own."""


@dataclass(frozen=True, slots=True)
class PublicationMarker:
    """READY.json: written last; names the exact manifest bytes of this publication."""

    SPEC: ClassVar[RecordSpec] = RecordSpec(
        "PublicationMarker",
        "READY",
        (
            Field("schema_version", Integer()),
            Field("identity_key", Text()),
            Field("publication_id", Text()),
            Field("manifest_sha256", Text()),
            Field("content_digest", Text()),
            Field("published_at_ns", Integer()),
        ),
    )

    identity_key: str
    publication_id: str
    manifest_sha256: str
    content_digest: str
    published_at_ns: int
    schema_version: int = READY_SCHEMA_VERSION

    def __post_init__(self) -> None:
        if type(self.schema_version) is not int or self.schema_version != READY_SCHEMA_VERSION:
            raise ValueError(f"READY schema_version {self.schema_version!r} is not supported")
        _hex_digest(self.identity_key, "READY identity_key")
        _hex_digest(self.manifest_sha256, "READY manifest_sha256")
        _hex_digest(self.content_digest, "READY content_digest")
        if type(self.publication_id) is not str or not self.publication_id:
            raise ValueError("READY publication_id must be a non-empty string")
        if type(self.published_at_ns) is not int or self.published_at_ns < 0:
            raise ValueError("READY published_at_ns must be a non-negative integer")

    def to_dict(self) -> dict[str, JsonValue]:
        return self.SPEC.encode(self)

    def to_bytes(self) -> bytes:
        return encode_canonical(self.to_dict())

    @classmethod
    def from_bytes(cls, data: bytes) -> PublicationMarker:
        obj = require_object(decode_json(CanonicalJson(data).data), "READY")
        return cls(**cls.SPEC.decode(obj))


def manifest_sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


PARSED_MANIFESTS_KEPT = 64
"""How many parsed manifests one process keeps (least recently used go first)."""


class ParsedManifests:
    """Manifests parsed once per process, keyed by the SHA-256 of their exact bytes.

    A warm load reads READY.json and manifest.json every time and checks the manifest's
    digest against READY; only the parse (a few objects per tensor) is skipped when the
    same bytes were parsed before. The key is the content itself, so other bytes (another
    artifact, another publication, a tampered file) can never be answered from here, and
    a `WeightManifest` is immutable, so sharing one is safe. Parse errors are not kept.
    """

    __slots__ = ("_guard", "_kept", "_limit", "hits", "parses")

    def __init__(self, limit: int = PARSED_MANIFESTS_KEPT) -> None:
        self._limit = limit
        self._kept: OrderedDict[str, WeightManifest] = OrderedDict()
        self._guard = threading.Lock()
        self.hits = 0
        self.parses = 0

    def parse(self, data: bytes, *, identity: WeightArtifactIdentity | None = None) -> tuple[str, WeightManifest]:
        """(SHA-256 hex of `data`, its manifest); raises as `WeightManifest.from_bytes` does (`identity`: its hint)."""
        digest = manifest_sha256(data)
        with self._guard:
            found = self._kept.get(digest)
            if found is not None:
                self._kept.move_to_end(digest)
                self.hits += 1
                return digest, found
        manifest = WeightManifest.from_bytes(data, identity=identity)
        with self._guard:
            self.parses += 1
            self._kept[digest] = manifest
            while len(self._kept) > self._limit:
                self._kept.popitem(last=False)
        return digest, manifest

    def remember(self, data: bytes, manifest: WeightManifest) -> None:
        """Keep `manifest` as the parse of `data`, the bytes this process just serialized it to (`to_bytes`).

        A build reads back the manifest it has just sealed; this spares that parse. Still keyed by the
        bytes' SHA-256, so what is read back must be exactly these bytes to be answered from here. A
        manifest over the parse limits is not kept, so reading it back fails as a parse would.
        """
        if len(manifest.files) > MAX_MANIFEST_FILES or len(manifest.tensors) > MAX_MANIFEST_TENSORS:
            return
        digest = manifest_sha256(data)
        with self._guard:
            self._kept[digest] = manifest
            self._kept.move_to_end(digest)
            while len(self._kept) > self._limit:
                self._kept.popitem(last=False)

    def clear(self) -> None:
        with self._guard:
            self._kept.clear()


PARSED_MANIFESTS = ParsedManifests()
"""This process's parsed manifests (what a lookup of an artifact loaded before skips)."""

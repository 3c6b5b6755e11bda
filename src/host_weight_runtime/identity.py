"""Exact artifact identity: everything that can change the bytes, and nothing else.

There is deliberately no data-parallel rank and no sequence-parallel rank: replicas
that hold the same bytes must find the same artifact.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from ._records import Field, Integer, Json, Nested, RecordSpec, Text
from ._strict import get_str, require_int_field, require_str_field
from .canonical_json import CanonicalJson, JsonValue, canonical_sha256, encode_canonical

IDENTITY_SCHEMA_VERSION = 1
BASE_ADAPTATION = "base"


@dataclass(frozen=True, slots=True)
class WeightSourceIdentity:
    """Which checkpoint content the artifact derives from."""

    SPEC: ClassVar[RecordSpec] = RecordSpec(
        "WeightSourceIdentity",
        "source",
        (
            Field("model_id", Text()),
            Field("revision", Text(optional=True)),
            Field("fingerprint", Text()),
            Field("metadata", Json()),
        ),
    )

    model_id: str
    revision: str | None
    fingerprint: str
    metadata: CanonicalJson = field(default_factory=CanonicalJson.empty)

    def __post_init__(self) -> None:
        self.SPEC.check(self)

    def to_dict(self) -> dict[str, JsonValue]:
        return self.SPEC.encode(self)

    @classmethod
    def from_dict(cls, value: object) -> WeightSourceIdentity:
        return cls(**cls.SPEC.decode(value))


@dataclass(frozen=True, slots=True)
class ComponentIdentity:
    """Which part of the model the artifact covers and how ownership was decided."""

    SPEC: ClassVar[RecordSpec] = RecordSpec(
        "ComponentIdentity",
        "component",
        (Field("name", Text()), Field("ownership", Text()), Field("metadata", Json())),
    )

    name: str
    ownership: str
    metadata: CanonicalJson = field(default_factory=CanonicalJson.empty)

    def __post_init__(self) -> None:
        self.SPEC.check(self)

    def to_dict(self) -> dict[str, JsonValue]:
        return self.SPEC.encode(self)

    @classmethod
    def from_dict(cls, value: object) -> ComponentIdentity:
        return cls(**cls.SPEC.decode(value))


@dataclass(frozen=True, slots=True)
class WeightRepresentation:
    """The representation of the bytes: format name, dtype and policy facts."""

    SPEC: ClassVar[RecordSpec] = RecordSpec(
        "WeightRepresentation",
        "representation",
        (Field("name", Text()), Field("dtype", Text()), Field("metadata", Json())),
    )

    name: str
    dtype: str
    metadata: CanonicalJson = field(default_factory=CanonicalJson.empty)

    def __post_init__(self) -> None:
        self.SPEC.check(self)

    def to_dict(self) -> dict[str, JsonValue]:
        return self.SPEC.encode(self)

    @classmethod
    def from_dict(cls, value: object) -> WeightRepresentation:
        return cls(**cls.SPEC.decode(value))


@dataclass(frozen=True, slots=True)
class RuntimeWeightLayout:
    """Parallel coordinates that change bytes (TP size and rank; SP only when it matters)."""

    SPEC: ClassVar[RecordSpec] = RecordSpec(
        "RuntimeWeightLayout",
        "layout",
        (
            Field("name", Text()),
            Field("tensor_parallel_size", Integer(minimum=1)),
            Field("tensor_parallel_rank", Integer(minimum=0)),
            Field("sequence_parallel_size", Integer(minimum=1)),
            Field("sequence_parallel_backend", Text()),
            Field("metadata", Json()),
        ),
    )

    name: str
    tensor_parallel_size: int = 1
    tensor_parallel_rank: int = 0
    sequence_parallel_size: int = 1
    sequence_parallel_backend: str = "none"
    metadata: CanonicalJson = field(default_factory=CanonicalJson.empty)

    def __post_init__(self) -> None:
        self.SPEC.check(self)
        if self.sequence_parallel_size == 1 and self.sequence_parallel_backend != "none":
            raise ValueError(
                "sequence_parallel_backend must be 'none' when sequence_parallel_size is 1: without sequence "
                "parallelism the backend cannot change the bytes, and it must not split the key"
            )
        if self.tensor_parallel_rank >= self.tensor_parallel_size:
            raise ValueError(
                f"tensor_parallel_rank {self.tensor_parallel_rank} must be below "
                f"tensor_parallel_size {self.tensor_parallel_size}"
            )

    def to_dict(self) -> dict[str, JsonValue]:
        return self.SPEC.encode(self)

    @classmethod
    def from_dict(cls, value: object) -> RuntimeWeightLayout:
        return cls(**cls.SPEC.decode(value))


@dataclass(frozen=True, slots=True)
class _AdapterFingerprint:
    """A merged adapter's fingerprint: None for base weights, written as "" so keys stay as they were."""

    def check(self, value: object, name: str) -> None:
        if value is not None:
            require_str_field(value, name, allow_empty=True)

    def encode(self, value: Any) -> JsonValue:
        return "" if value is None else value

    def decode(self, obj: Mapping[str, object], key: str, where: str) -> object:
        return get_str(obj, key, where)


@dataclass(frozen=True, slots=True)
class AdaptationIdentity:
    """Base weights, or a statically merged adapter identified by its fingerprint."""

    SPEC: ClassVar[RecordSpec] = RecordSpec(
        "AdaptationIdentity",
        "adaptation",
        (Field("kind", Text()), Field("fingerprint", _AdapterFingerprint()), Field("metadata", Json())),
    )

    kind: str = BASE_ADAPTATION
    fingerprint: str | None = None
    """None (or "", normalised to None) for base weights; the canonical form writes it as ""."""
    metadata: CanonicalJson = field(default_factory=CanonicalJson.empty)

    def __post_init__(self) -> None:
        if self.fingerprint == "":
            object.__setattr__(self, "fingerprint", None)
        self.SPEC.check(self)
        if self.kind == BASE_ADAPTATION and self.fingerprint:
            raise ValueError("a base AdaptationIdentity carries no fingerprint")
        if self.kind != BASE_ADAPTATION and not self.fingerprint:
            raise ValueError(
                f"adaptation kind {self.kind!r} needs the merged adapter's fingerprint"
            )

    def to_dict(self) -> dict[str, JsonValue]:
        return self.SPEC.encode(self)

    @classmethod
    def from_dict(cls, value: object) -> AdaptationIdentity:
        return cls(**cls.SPEC.decode(value))


@dataclass(frozen=True, slots=True)
class ProducerIdentity:
    """The producer ABI: who writes the bytes and which schemas read them back."""

    SPEC: ClassVar[RecordSpec] = RecordSpec(
        "ProducerIdentity",
        "producer",
        (
            Field("producer_id", Text()),
            Field("version", Text()),
            Field("implementation_fingerprint", Text()),
            Field("manifest_schema", Text()),
            Field("restorer_schema", Text()),
        ),
    )

    producer_id: str
    version: str
    implementation_fingerprint: str
    manifest_schema: str
    restorer_schema: str

    def __post_init__(self) -> None:
        self.SPEC.check(self)

    def to_dict(self) -> dict[str, JsonValue]:
        return self.SPEC.encode(self)

    @classmethod
    def from_dict(cls, value: object) -> ProducerIdentity:
        return cls(**cls.SPEC.decode(value))


@dataclass(frozen=True, slots=True)
class WeightArtifactIdentity:
    """The exact identity of one artifact; `.key` names it in every store."""

    SPEC: ClassVar[RecordSpec] = RecordSpec(
        "WeightArtifactIdentity",
        "identity",
        (
            Field("schema_version", Integer()),
            Field("source", Nested(WeightSourceIdentity)),
            Field("component", Nested(ComponentIdentity)),
            Field("representation", Nested(WeightRepresentation)),
            Field("layout", Nested(RuntimeWeightLayout)),
            Field("adaptation", Nested(AdaptationIdentity)),
            Field("producer", Nested(ProducerIdentity)),
        ),
    )

    schema_version: int
    source: WeightSourceIdentity
    component: ComponentIdentity
    representation: WeightRepresentation
    layout: RuntimeWeightLayout
    adaptation: AdaptationIdentity
    producer: ProducerIdentity
    _key: str | None = field(default=None, init=False, repr=False, compare=False)
    """The key, computed on first use: every field is a frozen value, so it can never change."""

    def __post_init__(self) -> None:
        require_int_field(self.schema_version, "WeightArtifactIdentity.schema_version")
        if self.schema_version != IDENTITY_SCHEMA_VERSION:
            raise ValueError(
                f"identity schema_version {self.schema_version} is not supported; "
                f"this library reads version {IDENTITY_SCHEMA_VERSION}"
            )
        self.SPEC.check(self)

    def to_dict(self) -> dict[str, JsonValue]:
        return self.SPEC.encode(self)

    @classmethod
    def from_dict(cls, value: object) -> WeightArtifactIdentity:
        return cls(**cls.SPEC.decode(value))

    def canonical_json(self) -> CanonicalJson:
        return CanonicalJson(encode_canonical(self.to_dict()))

    @property
    def canonical_bytes(self) -> bytes:
        """The canonical JSON bytes `key` hashes: equal bytes, same artifact."""
        return encode_canonical(self.to_dict())

    @classmethod
    def from_canonical_json(cls, data: CanonicalJson | bytes) -> WeightArtifactIdentity:
        canonical = data if isinstance(data, CanonicalJson) else CanonicalJson(data)
        return cls.from_dict(canonical.to_value())

    @property
    def key(self) -> str:
        """Hex SHA-256 of the canonical identity bytes (hashed once per identity object)."""
        key = self._key
        if key is None:
            key = canonical_sha256(self.to_dict())
            object.__setattr__(self, "_key", key)
        return key

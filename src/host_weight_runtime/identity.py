"""Exact artifact identity: everything that can change the bytes, and nothing else.

There is deliberately no data-parallel rank and no sequence-parallel rank: replicas
that hold the same bytes must find the same artifact.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from ._strict import (
    get_int,
    get_json,
    get_optional_str,
    get_str,
    require_int_field,
    require_json_field,
    require_record,
    require_str_field,
)
from .canonical_json import CanonicalJson, JsonValue, encode_canonical

IDENTITY_SCHEMA_VERSION = 1
BASE_ADAPTATION = "base"


@dataclass(frozen=True, slots=True)
class WeightSourceIdentity:
    """Which checkpoint content the artifact derives from."""

    model_id: str
    revision: str | None
    fingerprint: str
    metadata: CanonicalJson = field(default_factory=CanonicalJson.empty)

    def __post_init__(self) -> None:
        require_str_field(self.model_id, "WeightSourceIdentity.model_id")
        if self.revision is not None:
            require_str_field(self.revision, "WeightSourceIdentity.revision")
        require_str_field(self.fingerprint, "WeightSourceIdentity.fingerprint")
        require_json_field(self.metadata, "WeightSourceIdentity.metadata")

    def to_dict(self) -> dict[str, JsonValue]:
        return {
            "model_id": self.model_id,
            "revision": self.revision,
            "fingerprint": self.fingerprint,
            "metadata": self.metadata.to_value(),
        }

    @classmethod
    def from_dict(cls, value: object) -> WeightSourceIdentity:
        where = "source"
        obj = require_record(value, frozenset({"model_id", "revision", "fingerprint", "metadata"}), where)
        return cls(
            model_id=get_str(obj, "model_id", where),
            revision=get_optional_str(obj, "revision", where),
            fingerprint=get_str(obj, "fingerprint", where),
            metadata=get_json(obj, "metadata", where),
        )


@dataclass(frozen=True, slots=True)
class ComponentIdentity:
    """Which part of the model the artifact covers and how ownership was decided."""

    name: str
    ownership: str
    metadata: CanonicalJson = field(default_factory=CanonicalJson.empty)

    def __post_init__(self) -> None:
        require_str_field(self.name, "ComponentIdentity.name")
        require_str_field(self.ownership, "ComponentIdentity.ownership")
        require_json_field(self.metadata, "ComponentIdentity.metadata")

    def to_dict(self) -> dict[str, JsonValue]:
        return {"name": self.name, "ownership": self.ownership, "metadata": self.metadata.to_value()}

    @classmethod
    def from_dict(cls, value: object) -> ComponentIdentity:
        where = "component"
        obj = require_record(value, frozenset({"name", "ownership", "metadata"}), where)
        return cls(
            name=get_str(obj, "name", where),
            ownership=get_str(obj, "ownership", where),
            metadata=get_json(obj, "metadata", where),
        )


@dataclass(frozen=True, slots=True)
class WeightRepresentation:
    """The representation of the bytes: format name, dtype and policy facts."""

    name: str
    dtype: str
    metadata: CanonicalJson = field(default_factory=CanonicalJson.empty)

    def __post_init__(self) -> None:
        require_str_field(self.name, "WeightRepresentation.name")
        require_str_field(self.dtype, "WeightRepresentation.dtype")
        require_json_field(self.metadata, "WeightRepresentation.metadata")

    def to_dict(self) -> dict[str, JsonValue]:
        return {"name": self.name, "dtype": self.dtype, "metadata": self.metadata.to_value()}

    @classmethod
    def from_dict(cls, value: object) -> WeightRepresentation:
        where = "representation"
        obj = require_record(value, frozenset({"name", "dtype", "metadata"}), where)
        return cls(
            name=get_str(obj, "name", where),
            dtype=get_str(obj, "dtype", where),
            metadata=get_json(obj, "metadata", where),
        )


@dataclass(frozen=True, slots=True)
class RuntimeWeightLayout:
    """Parallel coordinates that change bytes (TP size and rank; SP only when it matters)."""

    name: str
    tensor_parallel_size: int = 1
    tensor_parallel_rank: int = 0
    sequence_parallel_size: int = 1
    sequence_parallel_backend: str = "none"
    metadata: CanonicalJson = field(default_factory=CanonicalJson.empty)

    def __post_init__(self) -> None:
        require_str_field(self.name, "RuntimeWeightLayout.name")
        require_int_field(self.tensor_parallel_size, "RuntimeWeightLayout.tensor_parallel_size", minimum=1)
        require_int_field(self.tensor_parallel_rank, "RuntimeWeightLayout.tensor_parallel_rank", minimum=0)
        require_int_field(
            self.sequence_parallel_size, "RuntimeWeightLayout.sequence_parallel_size", minimum=1
        )
        require_str_field(self.sequence_parallel_backend, "RuntimeWeightLayout.sequence_parallel_backend")
        require_json_field(self.metadata, "RuntimeWeightLayout.metadata")
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
        return {
            "name": self.name,
            "tensor_parallel_size": self.tensor_parallel_size,
            "tensor_parallel_rank": self.tensor_parallel_rank,
            "sequence_parallel_size": self.sequence_parallel_size,
            "sequence_parallel_backend": self.sequence_parallel_backend,
            "metadata": self.metadata.to_value(),
        }

    @classmethod
    def from_dict(cls, value: object) -> RuntimeWeightLayout:
        where = "layout"
        keys = frozenset(
            {
                "name",
                "tensor_parallel_size",
                "tensor_parallel_rank",
                "sequence_parallel_size",
                "sequence_parallel_backend",
                "metadata",
            }
        )
        obj = require_record(value, keys, where)
        return cls(
            name=get_str(obj, "name", where),
            tensor_parallel_size=get_int(obj, "tensor_parallel_size", where),
            tensor_parallel_rank=get_int(obj, "tensor_parallel_rank", where),
            sequence_parallel_size=get_int(obj, "sequence_parallel_size", where),
            sequence_parallel_backend=get_str(obj, "sequence_parallel_backend", where),
            metadata=get_json(obj, "metadata", where),
        )


@dataclass(frozen=True, slots=True)
class AdaptationIdentity:
    """Base weights, or a statically merged adapter identified by its fingerprint."""

    kind: str = BASE_ADAPTATION
    fingerprint: str | None = None
    """None (or "", normalised to None) for base weights; the canonical form writes it as ""."""
    metadata: CanonicalJson = field(default_factory=CanonicalJson.empty)

    def __post_init__(self) -> None:
        require_str_field(self.kind, "AdaptationIdentity.kind")
        if self.fingerprint is not None:
            require_str_field(self.fingerprint, "AdaptationIdentity.fingerprint", allow_empty=True)
        if self.fingerprint == "":
            object.__setattr__(self, "fingerprint", None)
        require_json_field(self.metadata, "AdaptationIdentity.metadata")
        if self.kind == BASE_ADAPTATION and self.fingerprint:
            raise ValueError("a base AdaptationIdentity carries no fingerprint")
        if self.kind != BASE_ADAPTATION and not self.fingerprint:
            raise ValueError(
                f"adaptation kind {self.kind!r} needs the merged adapter's fingerprint"
            )

    def to_dict(self) -> dict[str, JsonValue]:
        return {"kind": self.kind, "fingerprint": self.fingerprint or "", "metadata": self.metadata.to_value()}

    @classmethod
    def from_dict(cls, value: object) -> AdaptationIdentity:
        where = "adaptation"
        obj = require_record(value, frozenset({"kind", "fingerprint", "metadata"}), where)
        return cls(
            kind=get_str(obj, "kind", where),
            fingerprint=get_str(obj, "fingerprint", where),
            metadata=get_json(obj, "metadata", where),
        )


@dataclass(frozen=True, slots=True)
class ProducerIdentity:
    """The producer ABI: who writes the bytes and which schemas read them back."""

    producer_id: str
    version: str
    implementation_fingerprint: str
    manifest_schema: str
    restorer_schema: str

    def __post_init__(self) -> None:
        require_str_field(self.producer_id, "ProducerIdentity.producer_id")
        require_str_field(self.version, "ProducerIdentity.version")
        require_str_field(self.implementation_fingerprint, "ProducerIdentity.implementation_fingerprint")
        require_str_field(self.manifest_schema, "ProducerIdentity.manifest_schema")
        require_str_field(self.restorer_schema, "ProducerIdentity.restorer_schema")

    def to_dict(self) -> dict[str, JsonValue]:
        return {
            "producer_id": self.producer_id,
            "version": self.version,
            "implementation_fingerprint": self.implementation_fingerprint,
            "manifest_schema": self.manifest_schema,
            "restorer_schema": self.restorer_schema,
        }

    @classmethod
    def from_dict(cls, value: object) -> ProducerIdentity:
        where = "producer"
        keys = frozenset(
            {"producer_id", "version", "implementation_fingerprint", "manifest_schema", "restorer_schema"}
        )
        obj = require_record(value, keys, where)
        return cls(**{key: get_str(obj, key, where) for key in sorted(keys)})


_IDENTITY_KEYS = frozenset(
    {"schema_version", "source", "component", "representation", "layout", "adaptation", "producer"}
)


@dataclass(frozen=True, slots=True)
class WeightArtifactIdentity:
    """The exact identity of one artifact; `.key` names it in every store."""

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
        for name, expected in (
            ("source", WeightSourceIdentity),
            ("component", ComponentIdentity),
            ("representation", WeightRepresentation),
            ("layout", RuntimeWeightLayout),
            ("adaptation", AdaptationIdentity),
            ("producer", ProducerIdentity),
        ):
            if not isinstance(getattr(self, name), expected):
                raise ValueError(f"WeightArtifactIdentity.{name} must be a {expected.__name__}")

    def to_dict(self) -> dict[str, JsonValue]:
        return {
            "schema_version": self.schema_version,
            "source": self.source.to_dict(),
            "component": self.component.to_dict(),
            "representation": self.representation.to_dict(),
            "layout": self.layout.to_dict(),
            "adaptation": self.adaptation.to_dict(),
            "producer": self.producer.to_dict(),
        }

    @classmethod
    def from_dict(cls, value: object) -> WeightArtifactIdentity:
        obj = require_record(value, _IDENTITY_KEYS, "identity")
        return cls(
            schema_version=get_int(obj, "schema_version", "identity"),
            source=WeightSourceIdentity.from_dict(obj["source"]),
            component=ComponentIdentity.from_dict(obj["component"]),
            representation=WeightRepresentation.from_dict(obj["representation"]),
            layout=RuntimeWeightLayout.from_dict(obj["layout"]),
            adaptation=AdaptationIdentity.from_dict(obj["adaptation"]),
            producer=ProducerIdentity.from_dict(obj["producer"]),
        )

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
            key = hashlib.sha256(encode_canonical(self.to_dict())).hexdigest()
            object.__setattr__(self, "_key", key)
        return key


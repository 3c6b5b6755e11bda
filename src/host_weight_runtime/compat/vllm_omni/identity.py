"""Identities: this runtime's own types (the same canonical bytes and keys whichever name imports them)."""

from __future__ import annotations

from ...canonical_json import CanonicalJson, JsonValue, encode_canonical
from ...identity import (
    AdaptationIdentity,
    ComponentIdentity,
    ProducerIdentity,
    RuntimeWeightLayout,
    WeightArtifactIdentity,
    WeightRepresentation,
    WeightSourceIdentity,
)

__all__ = [
    "AdaptationIdentity",
    "CanonicalJson",
    "ComponentIdentity",
    "IdentityValidationError",
    "JsonValue",
    "ProducerIdentity",
    "RuntimeWeightLayout",
    "WeightArtifactIdentity",
    "WeightRepresentation",
    "WeightSourceIdentity",
    "canonical_json",
]

IdentityValidationError = ValueError
"""This runtime rejects a bad identity with ValueError (the reference's error is a ValueError subclass)."""


def canonical_json(value: object) -> bytes:
    """Canonical JSON bytes of a JSON-native value (sorted keys, compact, UTF-8); ValueError otherwise."""
    return encode_canonical(value)

"""Artifact identity: exact keys, exact parsing, no DP or SP-rank coordinates (C03, C04, C05)."""

from __future__ import annotations

import copy
import dataclasses
import hashlib
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from host_weight_runtime.canonical_json import CanonicalJson, encode_canonical
from host_weight_runtime.identity import (
    IDENTITY_SCHEMA_VERSION,
    AdaptationIdentity,
    ComponentIdentity,
    ProducerIdentity,
    RuntimeWeightLayout,
    WeightArtifactIdentity,
    WeightRepresentation,
    WeightSourceIdentity,
)

# Deliberately pinned: any change to the identity encoding must update this on purpose,
# because every published artifact on every node is named by it.
GOLDEN_KEY = "a4287eadeac54d0a86ff890d4053d1876073ae2f7a0d1ee1a6dcdd43a2dc8d72"
GOLDEN_BYTES = (
    b'{"adaptation":{"fingerprint":"","kind":"base","metadata":{}},'
    b'"component":{"metadata":{"class":"DiT"},"name":"transformer","ownership":"complete"},'
    b'"layout":{"metadata":{},"name":"tp-sp","sequence_parallel_backend":"none","sequence_parallel_size":1,'
    b'"tensor_parallel_rank":0,"tensor_parallel_size":1},'
    b'"producer":{"implementation_fingerprint":"' + b"e" * 64 + b'","manifest_schema":"manifest-v1",'
    b'"producer_id":"bf16-final-layout","restorer_schema":"restorer-v1","version":"1.0"},'
    b'"representation":{"dtype":"torch.bfloat16","metadata":{},"name":"final-layout"},'
    b'"schema_version":1,'
    b'"source":{"fingerprint":"' + b"f" * 64 + b'",'
    b'"metadata":{"dtype":"bf16","files":["a.safetensors","b.safetensors"]},'
    b'"model_id":"org/model","revision":"0123abcd"}}'
)

HYPOTHESIS = settings(database=None, deadline=None, max_examples=100)


def make_identity(
    *,
    tp_size: int = 1,
    tp_rank: int = 0,
    sp_size: int = 1,
    sp_backend: str = "none",
    adaptation: AdaptationIdentity | None = None,
    source_metadata: object = None,
) -> WeightArtifactIdentity:
    """A fixed, fully populated identity (the golden one with the defaults)."""
    metadata = source_metadata
    if metadata is None:
        metadata = {"files": ["a.safetensors", "b.safetensors"], "dtype": "bf16"}
    return WeightArtifactIdentity(
        schema_version=IDENTITY_SCHEMA_VERSION,
        source=WeightSourceIdentity(
            model_id="org/model",
            revision="0123abcd",
            fingerprint="f" * 64,
            metadata=CanonicalJson.from_value(metadata),
        ),
        component=ComponentIdentity(
            name="transformer", ownership="complete", metadata=CanonicalJson.from_value({"class": "DiT"})
        ),
        representation=WeightRepresentation(name="final-layout", dtype="torch.bfloat16"),
        layout=RuntimeWeightLayout(
            name="tp-sp",
            tensor_parallel_size=tp_size,
            tensor_parallel_rank=tp_rank,
            sequence_parallel_size=sp_size,
            sequence_parallel_backend=sp_backend,
        ),
        adaptation=adaptation if adaptation is not None else AdaptationIdentity(),
        producer=ProducerIdentity(
            producer_id="bf16-final-layout",
            version="1.0",
            implementation_fingerprint="e" * 64,
            manifest_schema="manifest-v1",
            restorer_schema="restorer-v1",
        ),
    )


SECTIONS: dict[str, type[Any]] = {
    "source": WeightSourceIdentity,
    "component": ComponentIdentity,
    "representation": WeightRepresentation,
    "layout": RuntimeWeightLayout,
    "adaptation": AdaptationIdentity,
    "producer": ProducerIdentity,
}


def _leaf_paths(identity_dict: dict[str, Any]) -> Iterator[tuple[str, ...]]:
    """Every field path of an identity dict: top-level keys and each section's keys."""
    for key, value in identity_dict.items():
        yield (key,)
        if key in SECTIONS:
            for inner in value:
                yield (key, inner)


def _get(obj: dict[str, Any], path: tuple[str, ...]) -> Any:
    for part in path:
        obj = obj[part]
    return obj


def _set(obj: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    for part in path[:-1]:
        obj = obj[part]
    obj[path[-1]] = value


def _delete(obj: dict[str, Any], path: tuple[str, ...]) -> None:
    for part in path[:-1]:
        obj = obj[part]
    del obj[path[-1]]


BASE_DICT = make_identity().to_dict()
ALL_PATHS = list(_leaf_paths(BASE_DICT))
OBJECT_PATHS = [()] + [(name,) for name in SECTIONS]


# --- C03 ------------------------------------------------------------------------------------


def test_golden_key_for_a_fixed_identity() -> None:
    """C03: the bytes and key of a fixed identity are pinned; the key is the SHA-256 of those bytes."""
    identity = make_identity()
    data = identity.canonical_json().data
    assert identity.key == hashlib.sha256(data).hexdigest()
    assert data == encode_canonical(identity.to_dict())
    assert data == GOLDEN_BYTES
    assert identity.key == GOLDEN_KEY
    assert WeightArtifactIdentity.from_canonical_json(GOLDEN_BYTES) == identity


# Keys of identities that set every field away from its default, computed before the records shared one codec.
GOLDEN_VARIANT_KEYS = {
    "tp2-rank1": "15e2038849d10ec5853bb8f790a8f474274d837af70c5081535591da53301393",
    "sp2-ulysses": "fb21178025fe9369d0d8ceef84d99605a3b4c8fb0c9b35d952cb3b91edb42694",
    "lora": "e7490630d3995a5403b9d610fc6a599e22b6c308ae6e085f62ae467675b20e27",
    "unicode-meta": "394198d84666aef23126de6a74a630f70f1c7ed028f4e82ecd75c9bddc742247",
}


def _variant(name: str) -> WeightArtifactIdentity:
    if name == "tp2-rank1":
        return make_identity(tp_size=2, tp_rank=1)
    if name == "sp2-ulysses":
        return make_identity(sp_size=2, sp_backend="ulysses")
    if name == "lora":
        merged = AdaptationIdentity(
            kind="lora-merged", fingerprint="d" * 64, metadata=CanonicalJson.from_value({"scale": 1})
        )
        return make_identity(adaptation=merged)
    return make_identity(source_metadata={"n\u00e9": [1, -2, {"z": None, "a": True}], "s": "\u2603"})


@pytest.mark.parametrize("name", sorted(GOLDEN_VARIANT_KEYS))
def test_golden_keys_of_identities_off_the_defaults(name: str) -> None:
    """C03: TP and SP coordinates, a merged adapter and non-ASCII metadata keep their pinned keys, and
    the canonical bytes read back to the same identity."""
    identity = _variant(name)
    assert identity.key == GOLDEN_VARIANT_KEYS[name]
    again = WeightArtifactIdentity.from_canonical_json(identity.canonical_json())
    assert again == identity
    assert again.key == identity.key


def test_key_does_not_depend_on_metadata_dict_order() -> None:
    """C03: metadata given in different insertion orders yields the same key."""
    forward = make_identity(source_metadata={"a": 1, "b": {"x": [1, 2], "y": None}, "c": "z"})
    backward = make_identity(source_metadata={"c": "z", "b": {"y": None, "x": [1, 2]}, "a": 1})
    assert forward.key == backward.key
    assert forward == backward
    different = make_identity(source_metadata={"a": 1, "b": {"x": [2, 1], "y": None}, "c": "z"})
    assert different.key != forward.key


def test_key_does_not_depend_on_to_dict_order() -> None:
    """C03: a to_dict with every level's keys reversed parses to the same identity and key."""
    identity = make_identity()

    def reverse(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: reverse(v) for k, v in reversed(list(value.items()))}
        return value

    reparsed = WeightArtifactIdentity.from_dict(reverse(identity.to_dict()))
    assert reparsed == identity
    assert reparsed.key == identity.key


def test_from_dict_to_dict_round_trips_exactly() -> None:
    """C03: from_dict(to_dict()) gives an equal identity with identical dict, bytes and key."""
    identity = make_identity(tp_size=4, tp_rank=3, sp_size=2, sp_backend="ulysses")
    as_dict = identity.to_dict()
    again = WeightArtifactIdentity.from_dict(as_dict)
    assert again == identity
    assert again.to_dict() == as_dict
    assert again.canonical_json() == identity.canonical_json()
    assert again.key == identity.key


def test_canonical_json_round_trip_and_strict_bytes() -> None:
    """C03: from_canonical_json reads back both CanonicalJson and its bytes, but never non-canonical bytes."""
    identity = make_identity()
    canonical = identity.canonical_json()
    assert WeightArtifactIdentity.from_canonical_json(canonical) == identity
    assert WeightArtifactIdentity.from_canonical_json(canonical.data) == identity
    with pytest.raises(ValueError):
        WeightArtifactIdentity.from_canonical_json(canonical.data + b"\n")
    with pytest.raises(ValueError):
        WeightArtifactIdentity.from_canonical_json(canonical.data.replace(b'":', b'": '))


def test_revision_none_round_trips() -> None:
    """C03: an unpinned revision (None) round-trips as null and differs from a pinned one."""
    pinned = make_identity()
    unpinned = dataclasses.replace(pinned, source=dataclasses.replace(pinned.source, revision=None))
    assert unpinned.to_dict()["source"]["revision"] is None  # type: ignore[index,call-overload]
    assert WeightArtifactIdentity.from_dict(unpinned.to_dict()) == unpinned
    assert unpinned.key != pinned.key


@pytest.mark.parametrize("name", sorted(SECTIONS))
def test_each_part_round_trips(name: str) -> None:
    """C03: every identity part round-trips through its own to_dict/from_dict."""
    part = getattr(make_identity(tp_size=2, tp_rank=1), name)
    assert type(part).from_dict(part.to_dict()) == part
    assert type(part).from_dict(part.to_dict()).to_dict() == part.to_dict()


def test_to_dict_is_a_copy() -> None:
    """C03: mutating a to_dict result does not change the identity or its key."""
    identity = make_identity()
    key = identity.key
    as_dict = identity.to_dict()
    as_dict["source"]["metadata"]["dtype"] = "fp32"  # type: ignore[index,call-overload]
    as_dict["layout"]["tensor_parallel_size"] = 8  # type: ignore[index,call-overload]
    assert identity.key == key
    assert identity.to_dict() == BASE_DICT


_scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text()
_json = st.recursive(
    _scalars,
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=4), children, max_size=3),
    max_leaves=10,
)


@HYPOTHESIS
@given(st.dictionaries(st.text(max_size=6), _json, max_size=5))
def test_round_trip_property_over_metadata(metadata: dict[str, object]) -> None:
    """C03: any JSON-object metadata survives to_dict/from_dict with an unchanged key."""
    identity = make_identity(source_metadata=metadata)
    again = WeightArtifactIdentity.from_dict(identity.to_dict())
    assert again == identity
    assert again.key == identity.key


# --- C04 ------------------------------------------------------------------------------------


def test_five_parallel_and_adapter_variants_have_distinct_keys() -> None:
    """C04: base, TP rank 0/2, TP rank 1/2, SP size 2 and a merged adapter give five distinct keys."""
    variants = {
        "base": make_identity(),
        "tp0of2": make_identity(tp_size=2, tp_rank=0),
        "tp1of2": make_identity(tp_size=2, tp_rank=1),
        "sp2": make_identity(sp_size=2, sp_backend="ulysses"),
        "merged": make_identity(adaptation=AdaptationIdentity(kind="merged_lora", fingerprint="c" * 64)),
    }
    keys = {name: identity.key for name, identity in variants.items()}
    assert len(set(keys.values())) == 5, keys
    for identity in variants.values():
        assert WeightArtifactIdentity.from_dict(identity.to_dict()).key == identity.key


def test_merged_adapters_with_different_fingerprints_differ() -> None:
    """C04: two merged adapters are two identities; the fingerprint is part of the key."""
    first = make_identity(adaptation=AdaptationIdentity(kind="merged_lora", fingerprint="c" * 64))
    second = make_identity(adaptation=AdaptationIdentity(kind="merged_lora", fingerprint="d" * 64))
    assert first.key != second.key


def _field_names(cls: type[Any]) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def test_layout_has_no_data_parallel_or_sequence_parallel_rank_field() -> None:
    """C04: RuntimeWeightLayout has no DP field and no SP-rank field, as a dataclass and in to_dict."""
    names = _field_names(RuntimeWeightLayout)
    assert names == set(RuntimeWeightLayout(name="x").to_dict())
    assert {"tensor_parallel_size", "tensor_parallel_rank", "sequence_parallel_size"} <= names
    for name in names:
        lowered = name.lower()
        assert "data_parallel" not in lowered
        assert not lowered.startswith("dp")
        assert "sequence_parallel_rank" not in lowered
        assert not lowered.startswith("sp_rank")
    with pytest.raises(TypeError):
        RuntimeWeightLayout(name="x", sequence_parallel_rank=1)  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        RuntimeWeightLayout(name="x", data_parallel_rank=1)  # type: ignore[call-arg]


def test_no_part_of_the_identity_carries_dp_or_sp_rank() -> None:
    """C04: no field anywhere in the identity (dataclass fields or dict keys) names a DP or SP rank."""
    names = set(_field_names(WeightArtifactIdentity))
    for cls in SECTIONS.values():
        names |= _field_names(cls)

    def keys(value: Any) -> Iterator[str]:
        if isinstance(value, dict):
            for key, item in value.items():
                yield key
                yield from keys(item)

    names |= set(keys(make_identity(source_metadata={}).to_dict()))
    forbidden = [n for n in names if "data_parallel" in n or "dp_" in n or "sequence_parallel_rank" in n]
    assert forbidden == []


# --- C05 ------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", OBJECT_PATHS, ids=lambda p: "/".join(p) or "identity")
def test_from_dict_rejects_unknown_fields_at_every_level(path: tuple[str, ...]) -> None:
    """C05: an extra field at the top level or inside any section is rejected."""
    data = copy.deepcopy(BASE_DICT)
    target = _get(data, path)
    target["data_parallel_rank"] = 0
    with pytest.raises(ValueError):
        WeightArtifactIdentity.from_dict(data)


@pytest.mark.parametrize("path", ALL_PATHS, ids="/".join)
def test_from_dict_rejects_missing_fields(path: tuple[str, ...]) -> None:
    """C05: removing any one field at any level is rejected."""
    data = copy.deepcopy(BASE_DICT)
    _delete(data, path)
    with pytest.raises(ValueError):
        WeightArtifactIdentity.from_dict(data)


def _coercions(value: Any) -> list[Any]:
    """Values that a lenient parser would coerce into `value`, or that have the wrong type."""
    if type(value) is int:
        return [bool(value), str(value), float(value), None, [value]]
    if type(value) is str:
        return [1, None, [value], {"value": value}, value.encode()]
    if type(value) is dict:
        return [[], "{}", None, list(value.items())]
    raise AssertionError(f"no coercions for {value!r}")


COERCION_CASES = [
    pytest.param(path, bad, id=f"{'/'.join(path)}={bad!r}")
    for path in ALL_PATHS
    if (path[-1] != "revision" and not isinstance(_get(BASE_DICT, path), dict)) or path[-1] == "metadata"
    for bad in _coercions(_get(BASE_DICT, path))
]


@pytest.mark.parametrize(("path", "bad"), COERCION_CASES)
def test_from_dict_rejects_coerced_types(path: tuple[str, ...], bad: Any) -> None:
    """C05: True for an int, "1" for 1, 1.0 for 1, an int for a str, a list for an object: all rejected."""
    data = copy.deepcopy(BASE_DICT)
    _set(data, path, bad)
    with pytest.raises(ValueError):
        WeightArtifactIdentity.from_dict(data)


@pytest.mark.parametrize("bad", [1, True, b"rev", ["rev"], ""])
def test_from_dict_rejects_bad_revision(bad: Any) -> None:
    """C05: revision is a non-empty str or null; nothing else is coerced."""
    data = copy.deepcopy(BASE_DICT)
    data["source"]["revision"] = bad
    with pytest.raises(ValueError):
        WeightArtifactIdentity.from_dict(data)


@pytest.mark.parametrize("name", sorted(SECTIONS))
@pytest.mark.parametrize("bad", [None, [], "section", 1])
def test_from_dict_rejects_sections_that_are_not_objects(name: str, bad: Any) -> None:
    """C05: each section must be a JSON object."""
    data = copy.deepcopy(BASE_DICT)
    data[name] = bad
    with pytest.raises(ValueError):
        WeightArtifactIdentity.from_dict(data)


@pytest.mark.parametrize("bad", [None, [], "identity", 1])
def test_from_dict_rejects_a_non_object(bad: Any) -> None:
    """C05: the identity itself must be a JSON object."""
    with pytest.raises(ValueError):
        WeightArtifactIdentity.from_dict(bad)


def test_from_dict_rejects_unsupported_schema_version() -> None:
    """C05: only the schema version this library reads is accepted."""
    data = copy.deepcopy(BASE_DICT)
    data["schema_version"] = IDENTITY_SCHEMA_VERSION + 1
    with pytest.raises(ValueError):
        WeightArtifactIdentity.from_dict(data)


@pytest.mark.parametrize(
    ("size", "rank"),
    [(2, 2), (2, 3), (1, 1), (2, -1), (0, 0)],
)
def test_tensor_parallel_rank_must_be_below_size(size: int, rank: int) -> None:
    """C05: tp_rank >= tp_size (or a negative rank, or a zero size) is a ValueError, in code and in from_dict."""
    with pytest.raises(ValueError):
        RuntimeWeightLayout(name="x", tensor_parallel_size=size, tensor_parallel_rank=rank)
    data = copy.deepcopy(BASE_DICT)
    data["layout"]["tensor_parallel_size"] = size
    data["layout"]["tensor_parallel_rank"] = rank
    with pytest.raises(ValueError):
        WeightArtifactIdentity.from_dict(data)


def test_sequence_parallel_backend_only_with_sequence_parallelism() -> None:
    """C04: without SP the backend cannot change bytes, so a backend other than 'none' is rejected, never a second key."""
    with pytest.raises(ValueError, match="sequence_parallel_backend"):
        RuntimeWeightLayout(name="x", sequence_parallel_size=1, sequence_parallel_backend="ulysses")
    assert RuntimeWeightLayout(name="x", sequence_parallel_size=2, sequence_parallel_backend="ulysses")


def test_sequence_parallel_size_must_be_positive() -> None:
    """C05: SP size 0 is rejected."""
    with pytest.raises(ValueError):
        RuntimeWeightLayout(name="x", sequence_parallel_size=0)


def test_base_adaptation_rejects_a_fingerprint_and_merged_needs_one() -> None:
    """C05: a base adaptation with a fingerprint, or a merged one without, is a ValueError."""
    with pytest.raises(ValueError):
        AdaptationIdentity(kind="base", fingerprint="c" * 64)
    with pytest.raises(ValueError):
        AdaptationIdentity(kind="merged_lora", fingerprint="")
    data = copy.deepcopy(BASE_DICT)
    data["adaptation"]["fingerprint"] = "c" * 64
    with pytest.raises(ValueError):
        WeightArtifactIdentity.from_dict(data)


@pytest.mark.parametrize(
    "metadata",
    [[1, 2], "text", 3, None, True],
    ids=["list", "str", "int", "null", "bool"],
)
@pytest.mark.parametrize("name", ["source", "component", "representation", "layout", "adaptation"])
def test_metadata_must_be_a_json_object(name: str, metadata: object) -> None:
    """C05: metadata that is not a JSON object is refused at construction, so to_dict always round-trips."""
    part = getattr(make_identity(), name)
    with pytest.raises(ValueError):
        dataclasses.replace(part, metadata=CanonicalJson.from_value(metadata))


@pytest.mark.parametrize("name", ["source", "component", "representation", "layout", "adaptation"])
def test_metadata_must_be_canonical_json_not_a_dict(name: str) -> None:
    """C05: a plain dict is not accepted where CanonicalJson metadata is required."""
    part = getattr(make_identity(), name)
    with pytest.raises(ValueError):
        dataclasses.replace(part, metadata={"a": 1})


@pytest.mark.parametrize(
    ("cls", "kwargs"),
    [
        (WeightSourceIdentity, {"model_id": "", "revision": None, "fingerprint": "f"}),
        (WeightSourceIdentity, {"model_id": "m", "revision": None, "fingerprint": ""}),
        (WeightSourceIdentity, {"model_id": 1, "revision": None, "fingerprint": "f"}),
        (ComponentIdentity, {"name": "", "ownership": "complete"}),
        (WeightRepresentation, {"name": "n", "dtype": ""}),
        (RuntimeWeightLayout, {"name": "x", "tensor_parallel_size": True}),
        (RuntimeWeightLayout, {"name": "x", "tensor_parallel_size": 2.0}),
        (RuntimeWeightLayout, {"name": "x", "sequence_parallel_backend": ""}),
        (ProducerIdentity, {"producer_id": "p", "version": "", "implementation_fingerprint": "f",
                            "manifest_schema": "m", "restorer_schema": "r"}),
    ],
)
def test_constructors_reject_empty_and_coerced_values(cls: type[Any], kwargs: dict[str, Any]) -> None:
    """C05: the dataclasses themselves refuse empty strings and non-exact types."""
    with pytest.raises(ValueError):
        cls(**kwargs)


def test_identity_rejects_parts_of_the_wrong_type() -> None:
    """C05: a section given as a dict (or a different part) is a ValueError."""
    identity = make_identity()
    with pytest.raises(ValueError):
        dataclasses.replace(identity, layout=identity.layout.to_dict())
    with pytest.raises(ValueError):
        dataclasses.replace(identity, source=identity.component)
    with pytest.raises(ValueError):
        dataclasses.replace(identity, schema_version=True)

"""The manifest and READY marker: exact round-trips, strict parsing, safe file names (C06, C07)."""

from __future__ import annotations

import copy
import dataclasses
import json
from typing import Any

import pytest

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
from host_weight_runtime.manifest import (
    MANIFEST_FILE_NAME,
    READY_FILE_NAME,
    FileManifestEntry,
    PublicationMarker,
    TensorManifestEntry,
    WeightManifest,
    manifest_sha256,
    validate_file_name,
)
from host_weight_runtime.tensors import TensorKind

FILE_A = "model-00001-of-00002.safetensors"
FILE_B = "model-00002-of-00002.safetensors"


def small_identity() -> WeightArtifactIdentity:
    return WeightArtifactIdentity(
        schema_version=IDENTITY_SCHEMA_VERSION,
        source=WeightSourceIdentity(model_id="m", revision=None, fingerprint="f"),
        component=ComponentIdentity(name="c", ownership="complete"),
        representation=WeightRepresentation(name="r", dtype="F32"),
        layout=RuntimeWeightLayout(name="l"),
        adaptation=AdaptationIdentity(),
        producer=ProducerIdentity(
            producer_id="p", version="1", implementation_fingerprint="i", manifest_schema="ms", restorer_schema="rs"
        ),
    )


def small_manifest() -> WeightManifest:
    """Two files, three tensors (one zero-sized), fixed digests: the golden manifest."""
    tensors = (
        TensorManifestEntry(
            name="w", file=FILE_A, dtype="F32", shape=(2, 3), strides=(3, 1), data_offsets=(0, 24),
            kind=TensorKind.PARAMETER, role="weight", digest="1" * 64,
        ),
        TensorManifestEntry(
            name="b", file=FILE_A, dtype="BF16", shape=(3,), strides=(1,), data_offsets=(24, 30),
            kind=TensorKind.PARAMETER, role="bias", digest="2" * 64,
        ),
        TensorManifestEntry(
            name="buf", file=FILE_B, dtype="I64", shape=(0, 4), strides=(4, 1), data_offsets=(0, 0),
            kind=TensorKind.BUFFER, role="", digest="3" * 64,
        ),
    )
    files = (
        FileManifestEntry(name=FILE_A, size=158, header_size=128, digest="4" * 64, tensors=("w", "b")),
        FileManifestEntry(name=FILE_B, size=64, header_size=64, digest="5" * 64, tensors=("buf",)),
    )
    return WeightManifest(
        identity=small_identity(),
        producer_schema="ms",
        restorer_schema="rs",
        digest_algorithm="sha256-tree-v1",
        digest_chunk_bytes=1024,
        files=files,
        tensors=tensors,
        content_digest="6" * 64,
        format_metadata=CanonicalJson.from_value({"dtype_policy": "bf16"}),
    )


def small_marker() -> PublicationMarker:
    return PublicationMarker(
        identity_key="a" * 64,
        publication_id="pub-0001",
        manifest_sha256="b" * 64,
        content_digest="c" * 64,
        published_at_ns=1_700_000_000_123_456_789,
    )


GOLDEN_IDENTITY = (
    b'{"adaptation":{"fingerprint":"","kind":"base","metadata":{}},'
    b'"component":{"metadata":{},"name":"c","ownership":"complete"},'
    b'"layout":{"metadata":{},"name":"l","sequence_parallel_backend":"none","sequence_parallel_size":1,'
    b'"tensor_parallel_rank":0,"tensor_parallel_size":1},'
    b'"producer":{"implementation_fingerprint":"i","manifest_schema":"ms","producer_id":"p",'
    b'"restorer_schema":"rs","version":"1"},'
    b'"representation":{"dtype":"F32","metadata":{},"name":"r"},'
    b'"schema_version":1,'
    b'"source":{"fingerprint":"f","metadata":{},"model_id":"m","revision":null}}'
)
GOLDEN_IDENTITY_KEY = "0227e289f9fe174f161d3e87af15e9a1b84a45956531672316f8c2687ad87c96"
GOLDEN_MANIFEST = (
    b'{"content_digest":"' + b"6" * 64 + b'",'
    b'"digest_algorithm":"sha256-tree-v1","digest_chunk_bytes":1024,'
    b'"files":['
    b'{"digest":"' + b"4" * 64 + b'","header_size":128,"name":"model-00001-of-00002.safetensors",'
    b'"size":158,"tensors":["w","b"]},'
    b'{"digest":"' + b"5" * 64 + b'","header_size":64,"name":"model-00002-of-00002.safetensors",'
    b'"size":64,"tensors":["buf"]}],'
    b'"format_metadata":{"dtype_policy":"bf16"},'
    b'"identity":' + GOLDEN_IDENTITY + b","
    b'"identity_key":"' + GOLDEN_IDENTITY_KEY.encode() + b'",'
    b'"producer_schema":"ms","restorer_schema":"rs","schema_version":1,'
    b'"tensors":['
    b'{"data_offsets":[0,24],"digest":"' + b"1" * 64 + b'","dtype":"F32",'
    b'"file":"model-00001-of-00002.safetensors","kind":"parameter","name":"w","role":"weight",'
    b'"shape":[2,3],"strides":[3,1]},'
    b'{"data_offsets":[24,30],"digest":"' + b"2" * 64 + b'","dtype":"BF16",'
    b'"file":"model-00001-of-00002.safetensors","kind":"parameter","name":"b","role":"bias",'
    b'"shape":[3],"strides":[1]},'
    b'{"data_offsets":[0,0],"digest":"' + b"3" * 64 + b'","dtype":"I64",'
    b'"file":"model-00002-of-00002.safetensors","kind":"buffer","name":"buf","role":"",'
    b'"shape":[0,4],"strides":[4,1]}],'
    b'"total_bytes":222}'
)
GOLDEN_MARKER = (
    b'{"content_digest":"' + b"c" * 64 + b'",'
    b'"identity_key":"' + b"a" * 64 + b'",'
    b'"manifest_sha256":"' + b"b" * 64 + b'",'
    b'"publication_id":"pub-0001","published_at_ns":1700000000123456789,"schema_version":1}'
)


def _reencode(value: Any) -> bytes:
    """Canonical bytes for a tampered dict, so only the intended defect is present."""
    return encode_canonical(value)


def _manifest_dict() -> dict[str, Any]:
    value = json.loads(small_manifest().to_bytes())
    assert isinstance(value, dict)
    return value


def _marker_dict() -> dict[str, Any]:
    value = json.loads(small_marker().to_bytes())
    assert isinstance(value, dict)
    return value


# --- C06: golden bytes and round trips ------------------------------------------------------


def test_manifest_golden_bytes() -> None:
    """C06: the manifest encoding of a small fixed manifest is pinned byte for byte."""
    manifest = small_manifest()
    assert manifest.identity.canonical_json().data == GOLDEN_IDENTITY
    assert manifest.identity_key == GOLDEN_IDENTITY_KEY
    assert manifest.to_bytes() == GOLDEN_MANIFEST
    assert WeightManifest.from_bytes(GOLDEN_MANIFEST) == manifest


def test_ready_marker_golden_bytes() -> None:
    """C06: the READY marker encoding is pinned byte for byte."""
    marker = small_marker()
    assert marker.to_bytes() == GOLDEN_MARKER
    assert PublicationMarker.from_bytes(GOLDEN_MARKER) == marker


def test_manifest_round_trips_exactly() -> None:
    """C06: from_bytes(to_bytes()) equals the manifest and re-encodes to the same bytes."""
    manifest = small_manifest()
    data = manifest.to_bytes()
    again = WeightManifest.from_bytes(data)
    assert again == manifest
    assert again.to_bytes() == data
    assert manifest_sha256(again.to_bytes()) == manifest_sha256(data)
    assert again.total_bytes == 222
    assert again.tensor("b") == manifest.tensors[1]
    assert again.tensor("b").nbytes == 6
    with pytest.raises(KeyError):
        again.tensor("missing")


def test_manifest_bytes_are_encoded_once_and_follow_every_new_value() -> None:
    """C06: a manifest's bytes are encoded once and the same object comes back (a build seals them, an import
    hashes them again); a manifest made from it with another value encodes its own value, never the first's."""
    manifest = small_manifest()
    data = manifest.to_bytes()
    assert manifest.to_bytes() is data
    assert data == encode_canonical(manifest.to_dict())
    changed = dataclasses.replace(manifest, content_digest="f" * 64)
    assert changed.to_bytes() != data
    assert changed.to_bytes() == encode_canonical(changed.to_dict())
    assert json.loads(changed.to_bytes())["content_digest"] == "f" * 64


def test_ready_marker_round_trips_exactly() -> None:
    """C06: the READY marker survives to_bytes/from_bytes unchanged."""
    marker = dataclasses.replace(small_marker(), published_at_ns=0)
    again = PublicationMarker.from_bytes(marker.to_bytes())
    assert again == marker
    assert again.to_bytes() == marker.to_bytes()


def test_marker_names_the_manifest_bytes() -> None:
    """C06: a READY marker built from a manifest names that manifest's SHA-256 and identity key."""
    manifest = small_manifest()
    data = manifest.to_bytes()
    marker = PublicationMarker(
        identity_key=manifest.identity_key,
        publication_id="p",
        manifest_sha256=manifest_sha256(data),
        content_digest=manifest.content_digest,
        published_at_ns=1,
    )
    again = PublicationMarker.from_bytes(marker.to_bytes())
    assert again.manifest_sha256 == manifest_sha256(WeightManifest.from_bytes(data).to_bytes())


# --- C06: strict parsing --------------------------------------------------------------------

MANIFEST_OBJECT_PATHS: list[tuple[Any, ...]] = [
    (),
    ("identity",),
    ("identity", "layout"),
    ("format_metadata",),
    ("files", 0),
    ("files", 1),
    ("tensors", 0),
    ("tensors", 2),
]


def _at(value: Any, path: tuple[Any, ...]) -> Any:
    for part in path:
        value = value[part]
    return value


@pytest.mark.parametrize("path", [p for p in MANIFEST_OBJECT_PATHS if p != ("format_metadata",)], ids=str)
def test_manifest_rejects_unknown_keys(path: tuple[Any, ...]) -> None:
    """C06: an unknown key anywhere in the manifest structure is rejected."""
    data = _manifest_dict()
    _at(data, path)["unexpected"] = 1
    with pytest.raises(ValueError):
        WeightManifest.from_bytes(_reencode(data))


def test_manifest_format_metadata_may_hold_any_keys() -> None:
    """C06: format_metadata is the producer's free-form object and round-trips as given."""
    data = _manifest_dict()
    data["format_metadata"]["anything"] = {"nested": [1, 2.5]}
    manifest = WeightManifest.from_bytes(_reencode(data))
    assert manifest.format_metadata.to_value() == data["format_metadata"]


def _manifest_key_paths() -> list[tuple[Any, ...]]:
    data = _manifest_dict()
    paths: list[tuple[Any, ...]] = []
    for path in [p for p in MANIFEST_OBJECT_PATHS if p not in ((), ("format_metadata",))] + [()]:
        paths.extend((*path, key) for key in _at(data, path))
    return paths


@pytest.mark.parametrize("path", _manifest_key_paths(), ids=str)
def test_manifest_rejects_missing_keys(path: tuple[Any, ...]) -> None:
    """C06: removing any one key of the manifest, a file, a tensor or the identity is rejected."""
    data = _manifest_dict()
    del _at(data, path[:-1])[path[-1]]
    with pytest.raises(ValueError):
        WeightManifest.from_bytes(_reencode(data))


STRING_NUMBERS = [
    (("schema_version",), "1"),
    (("digest_chunk_bytes",), "1024"),
    (("total_bytes",), "222"),
    (("files", 0, "size"), "158"),
    (("files", 0, "header_size"), "128"),
    (("tensors", 0, "shape"), ["2", "3"]),
    (("tensors", 0, "shape"), [2, "3"]),
    (("tensors", 0, "strides"), ["3", "1"]),
    (("tensors", 0, "data_offsets"), ["0", "24"]),
    (("tensors", 0, "data_offsets"), [0, "24"]),
    (("identity", "schema_version"), "1"),
    (("identity", "layout", "tensor_parallel_size"), "1"),
]
OTHER_COERCIONS = [
    (("files", 0, "size"), 158.0),
    (("files", 0, "size"), True),
    (("schema_version",), True),
    (("schema_version",), 1.0),
    (("tensors", 0, "shape"), [2.0, 3]),
    (("tensors", 0, "shape"), [True, 3]),
    (("tensors", 0, "shape"), "2,3"),
    (("tensors", 0, "data_offsets"), [0]),
    (("tensors", 0, "data_offsets"), [0, 24, 48]),
    (("files", 0, "tensors"), "w"),
    (("files", 0, "tensors"), ["w", 1]),
    (("tensors", 0, "name"), 1),
    (("tensors", 0, "kind"), "weight"),
    (("tensors", 0, "dtype"), "float32"),
    (("tensors", 0, "digest"), "1" * 63),
    (("tensors", 0, "digest"), "A" * 64),
    (("content_digest",), "x" * 64),
    (("files",), {"0": 1}),
    (("format_metadata",), []),
    (("identity_key",), "0" * 64),
    (("total_bytes",), 221),
]


@pytest.mark.parametrize(("path", "bad"), STRING_NUMBERS + OTHER_COERCIONS, ids=str)
def test_manifest_rejects_string_numbers_and_coerced_types(path: tuple[Any, ...], bad: Any) -> None:
    """C06: "12" for 12 (and other coercions or inconsistencies) anywhere in the manifest is rejected."""
    data = _manifest_dict()
    _at(data, path[:-1])[path[-1]] = bad
    with pytest.raises(ValueError):
        WeightManifest.from_bytes(_reencode(data))


def _reverse_keys(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _reverse_keys(item) for key, item in reversed(list(value.items()))}
    if isinstance(value, list):
        return [_reverse_keys(item) for item in value]
    return value


@pytest.mark.parametrize(
    "mutate",
    [
        lambda b: b + b"\n",
        lambda b: b" " + b,
        lambda b: b.replace(b'":', b'": ', 1),
        lambda b: json.dumps(json.loads(b)).encode(),
        lambda b: json.dumps(_reverse_keys(json.loads(b)), separators=(",", ":"), ensure_ascii=False).encode(),
        lambda b: json.dumps(json.loads(b), separators=(",", ":"), sort_keys=True, ensure_ascii=True).encode()
        .replace(b'"role":"weight"', b'"role":"\\u0077eight"'),
    ],
    ids=["trailing-newline", "leading-space", "space", "json-dumps-default", "unsorted", "escaped-ascii"],
)
def test_manifest_and_marker_reject_non_canonical_bytes(mutate: Any) -> None:
    """C06: bytes that parse to a valid manifest/marker but are not canonical are rejected."""
    manifest_bytes = mutate(small_manifest().to_bytes())
    assert manifest_bytes != small_manifest().to_bytes()
    with pytest.raises(ValueError):
        WeightManifest.from_bytes(manifest_bytes)
    marker_bytes = mutate(small_marker().to_bytes())
    if marker_bytes != small_marker().to_bytes():
        with pytest.raises(ValueError):
            PublicationMarker.from_bytes(marker_bytes)


@pytest.mark.parametrize("key", sorted(json.loads(GOLDEN_MARKER)))
def test_marker_rejects_missing_keys(key: str) -> None:
    """C06: every READY key is required."""
    data = _marker_dict()
    del data[key]
    with pytest.raises(ValueError):
        PublicationMarker.from_bytes(_reencode(data))


def test_marker_rejects_unknown_keys() -> None:
    """C06: an unknown READY key is rejected."""
    data = _marker_dict()
    data["host"] = "node-1"
    with pytest.raises(ValueError):
        PublicationMarker.from_bytes(_reencode(data))


@pytest.mark.parametrize(
    ("key", "bad"),
    [
        ("published_at_ns", "1700000000123456789"),
        ("published_at_ns", 1.5),
        ("published_at_ns", True),
        ("published_at_ns", -1),
        ("schema_version", "1"),
        ("schema_version", True),
        ("schema_version", 1.0),
        ("schema_version", 2),
        ("publication_id", 1),
        ("publication_id", ""),
        ("identity_key", "a" * 63),
        ("manifest_sha256", None),
        ("content_digest", "C" * 64),
    ],
    ids=str,
)
def test_marker_rejects_string_numbers_and_coerced_types(key: str, bad: Any) -> None:
    """C06: "12" for 12, bools, floats and malformed digests in READY.json are rejected."""
    data = _marker_dict()
    data[key] = bad
    with pytest.raises(ValueError):
        PublicationMarker.from_bytes(_reencode(data))


@pytest.mark.parametrize("data", [b"[]", b"null", b'"READY"', b"{}"])
def test_marker_rejects_non_objects(data: bytes) -> None:
    """C06: READY.json must be the marker object."""
    with pytest.raises(ValueError):
        PublicationMarker.from_bytes(data)


@pytest.mark.parametrize("bad", [True, 1.0])
def test_constructors_reject_a_schema_version_that_only_compares_equal(bad: Any) -> None:
    """C06: True == 1 and 1.0 == 1 in Python, but would not round-trip; the dataclasses refuse them."""
    with pytest.raises(ValueError):
        dataclasses.replace(small_manifest(), schema_version=bad)
    with pytest.raises(ValueError):
        dataclasses.replace(small_marker(), schema_version=bad)


def test_manifest_rejects_tensor_listed_under_the_wrong_file() -> None:
    """C06: each file's tensor list must name exactly the tensors whose entry points at that file."""
    data = _manifest_dict()
    data["files"][0]["tensors"] = ["w", "buf"]
    data["files"][1]["tensors"] = ["b"]
    with pytest.raises(ValueError):
        WeightManifest.from_bytes(_reencode(data))


@pytest.mark.parametrize(
    "mutate",
    [
        lambda d: d["files"].append(copy.deepcopy(d["files"][0])),
        lambda d: d["tensors"].append(copy.deepcopy(d["tensors"][0])),
        lambda d: d["files"][0]["tensors"].append("ghost"),
        lambda d: d["files"][0]["tensors"].remove("b"),
        lambda d: d["tensors"][0].update(file="model-00003-of-00003.safetensors"),
        lambda d: d["tensors"][0].update(data_offsets=[0, 20]),
        lambda d: d["tensors"][0].update(strides=[1, 2]),
        lambda d: d["tensors"][0].update(shape=[-2, -3], strides=[-3, 1]),
        lambda d: d["files"][0].update(header_size=7),
        lambda d: d["files"][0].update(size=100, header_size=128),
        lambda d: d.update(digest_chunk_bytes=0),
        lambda d: d.update(schema_version=2),
    ],
    ids=[
        "duplicate-file",
        "duplicate-tensor",
        "ghost-tensor",
        "unlisted-tensor",
        "unlisted-file",
        "offsets-vs-shape",
        "non-contiguous",
        "negative-shape",
        "header-too-small",
        "size-below-header",
        "zero-chunk",
        "schema-2",
    ],
)
def test_manifest_rejects_inconsistent_content(mutate: Any) -> None:
    """C06: internally inconsistent manifests are rejected, not accepted and misread later."""
    data = _manifest_dict()
    mutate(data)
    data["total_bytes"] = sum(f["size"] for f in data["files"])
    with pytest.raises(ValueError):
        WeightManifest.from_bytes(_reencode(data))


# --- C07: payload file names ----------------------------------------------------------------

BAD_NAMES = [
    "",
    ".",
    "..",
    "../x",
    "../x.safetensors",
    "a/b",
    "a/b.safetensors",
    "/abs.safetensors",
    "dir/",
    "a\\b.safetensors",
    "a\x00.safetensors",
    "a\nb.safetensors",
    "tab\there.safetensors",
    "model.bin",
    "model",
    "model.safetensors.tmp",
    "model.SAFETENSORS",
    ".safetensors",
    ".hidden.safetensors",
    MANIFEST_FILE_NAME,
    READY_FILE_NAME,
    "x" * 200 + ".safetensors",
]


@pytest.mark.parametrize("name", BAD_NAMES, ids=repr)
def test_validate_file_name_rejects_unsafe_names(name: str) -> None:
    """C07: anything but one plain basename ending in .safetensors is rejected."""
    with pytest.raises(ValueError):
        validate_file_name(name)


@pytest.mark.parametrize("name", [None, b"model.safetensors", 1, ["model.safetensors"]], ids=repr)
def test_validate_file_name_rejects_non_strings(name: Any) -> None:
    """C07: only str names are considered."""
    with pytest.raises(ValueError):
        validate_file_name(name)


@pytest.mark.parametrize(
    "name", [FILE_A, "model.safetensors", "diffusion_pytorch_model.safetensors", "a.b.safetensors"]
)
def test_validate_file_name_accepts_plain_payload_names(name: str) -> None:
    """C07: ordinary sharded payload names are accepted unchanged."""
    assert validate_file_name(name) == name


@pytest.mark.parametrize("name", BAD_NAMES, ids=repr)
def test_manifest_entries_reject_unsafe_names(name: str) -> None:
    """C07: file entries, tensor entries and parsed manifests all refuse unsafe names."""
    file_entry = small_manifest().files[0]
    with pytest.raises(ValueError):
        dataclasses.replace(file_entry, name=name)
    tensor_entry = small_manifest().tensors[0]
    with pytest.raises(ValueError):
        dataclasses.replace(tensor_entry, file=name)
    data = _manifest_dict()
    data["files"][0]["name"] = name
    for tensor in data["tensors"]:
        if tensor["file"] == FILE_A:
            tensor["file"] = name
    with pytest.raises(ValueError):
        WeightManifest.from_bytes(_reencode(data))


# --- C06: the reader's identity hint ----------------------------------------------------------


def test_manifest_takes_the_readers_identity_when_its_document_is_that_identity() -> None:
    """C06: a reader that passes the identity it expects gets that very object back, equal to a plain parse."""
    expected = small_identity()
    data = small_manifest().to_bytes()
    hinted = WeightManifest.from_bytes(data, identity=expected)
    assert hinted.identity is expected
    assert hinted == WeightManifest.from_bytes(data)
    assert hinted.to_bytes() == data


def test_manifest_decodes_its_own_identity_when_it_differs_from_the_hint() -> None:
    """C06: another identity than the hint is decoded from the bytes as ever (the reader then sees the mismatch)."""
    other = dataclasses.replace(small_identity(), layout=RuntimeWeightLayout(name="other"))
    manifest = WeightManifest.from_bytes(small_manifest().to_bytes(), identity=other)
    assert manifest.identity is not other
    assert manifest.identity == small_identity()


def test_manifest_hint_never_admits_an_identity_that_only_compares_equal() -> None:
    """C06: `true` where the identity holds 1 equals the hint in Python but not in bytes: still refused."""
    data = _manifest_dict()
    data["identity"]["layout"]["tensor_parallel_size"] = True
    with pytest.raises(ValueError):
        WeightManifest.from_bytes(_reencode(data), identity=small_identity())

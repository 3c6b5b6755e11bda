"""Fuzzing the bounded parsers: CanonicalJson input and node source-digest cache entries (C02).

CanonicalJson must accept exactly canonical JSON and reject everything else with ValueError (never
RecursionError or anything untyped), and whatever it accepts must round-trip. A source-digest cache
entry is disposable: a damaged or foreign one is recomputed, so the cache's public API never raises
for bad entry bytes and never returns a digest that the entry did not validly record. Few examples by
default; `make fuzz` (HWR_FUZZ_EXAMPLES) runs many.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import pytest
from hypothesis import event, given
from hypothesis import strategies as st

from host_weight_runtime.canonical_json import CanonicalJson, decode_json, encode_canonical
from host_weight_runtime.diffusion._digest_cache import DIGEST_ENTRY_SCHEMA
from host_weight_runtime.diffusion.source_identity import FileState, NodeSourceDigestCache

from ._hostile import fuzz_settings

pytestmark = pytest.mark.fuzz

json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=10)
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=16,
)


def nested_bytes(depth: int, inner: bytes = b"") -> bytes:
    return b"[" * depth + inner + b"]" * depth


@st.composite
def hostile_json_bytes(draw: st.DrawFn) -> bytes:
    """Bytes near canonical JSON: canonical encodings, their mutations, deep nesting and plain garbage."""
    kind = draw(st.sampled_from(["canonical", "pretty", "flip", "truncate", "nesting", "objects", "random", "numbers"]))
    if kind == "random":
        return draw(st.binary(max_size=200))
    if kind == "nesting":
        return nested_bytes(draw(st.integers(1, 200_000)), draw(st.sampled_from([b"", b"1", b"{}", b'"x"'])))
    if kind == "objects":
        depth = draw(st.integers(1, 20_000))
        return b'{"a":' * depth + b"0" + b"}" * depth
    if kind == "numbers":
        return draw(st.sampled_from([b"1e400", b"-1e400", b"NaN", b"Infinity", b"1" * 5000, b"[1.0]", b"-0", b"01"]))
    value = draw(json_values)
    try:
        data = encode_canonical(value)
    except ValueError:
        data = json.dumps(value).encode()
    if kind == "pretty":
        return json.dumps(value, indent=draw(st.integers(0, 2))).encode()
    if kind == "flip" and data:
        flipped = bytearray(data)
        at = draw(st.integers(0, len(data) - 1))
        flipped[at] ^= draw(st.integers(1, 255))
        return bytes(flipped)
    if kind == "truncate" and data:
        return data[: draw(st.integers(0, len(data) - 1))]
    return data


@fuzz_settings(150)
@given(data=hostile_json_bytes())
def test_fuzzed_canonical_json_bytes_are_accepted_only_when_canonical(data: bytes) -> None:
    """C02: CanonicalJson(bytes) raises only ValueError, and accepted bytes round-trip exactly."""
    try:
        canonical = CanonicalJson(data)
    except ValueError:
        event("rejected with ValueError")
        return
    event("accepted")
    value = canonical.to_value()
    assert CanonicalJson.from_value(value).data == data
    assert encode_canonical(decode_json(data)) == data


def _deep_value(depth: int, leaf: Any) -> Any:
    value = leaf
    for index in range(depth):
        value = [value] if index % 2 else {"k": value}
    return value


python_values = (
    json_values
    | st.builds(_deep_value, st.integers(1, 5_000), json_scalars)
    | st.tuples(json_scalars, json_scalars)
    | st.dictionaries(st.integers() | st.booleans(), json_scalars, min_size=1, max_size=2)
    | st.sets(st.integers(), max_size=3)
    | st.binary(max_size=4)
    | st.sampled_from([float("nan"), float("inf"), -float("inf"), object(), 1j])
)


@fuzz_settings(150)
@given(value=python_values)
def test_fuzzed_canonical_json_values_are_typed(value: object) -> None:
    """C02: CanonicalJson.from_value raises only ValueError (deep nesting included), and what it
    accepts decodes back to bytes that CanonicalJson accepts unchanged."""
    try:
        canonical = CanonicalJson.from_value(value)
    except ValueError:
        event("rejected with ValueError")
        return
    event("accepted")
    assert CanonicalJson(canonical.data).data == canonical.data
    assert CanonicalJson.from_value(canonical.to_value()) == canonical


# --------------------------------------------------------------------------- source-digest cache entries


class DigestCacheFixture:
    """A real file, its state and true content id, a real cache, and the valid entry the cache wrote."""

    def __init__(self, base: Path) -> None:
        self.path = base / "weights.safetensors"
        self.path.write_bytes(os.urandom(4096))
        self.state = FileState.of(self.path)
        self.true_id = "sha256:" + hashlib.sha256(self.path.read_bytes()).hexdigest()
        self.cache = NodeSourceDigestCache(base / "domain")
        assert self.cache.content_id(self.path, self.state) == self.true_id
        self.entry = self.cache.entry_path(self.path, self.state)
        self.valid_entry = self.entry.read_bytes()

    def well_formed_entry(self, digest: str) -> bytes:
        """The exact bytes of a self-consistent entry that records `digest` for this file and state."""
        body = {"schema": DIGEST_ENTRY_SCHEMA, "path": os.path.realpath(self.path), **self.state.to_dict()}
        body["digest"] = digest
        return encode_canonical({**body, "entry_sha256": hashlib.sha256(encode_canonical(body)).hexdigest()})


@pytest.fixture(scope="module")
def digest_cache(tmp_path_factory: pytest.TempPathFactory) -> DigestCacheFixture:
    return DigestCacheFixture(tmp_path_factory.mktemp("fuzz-digest-cache"))


@st.composite
def entry_plants(draw: st.DrawFn, valid: bytes) -> bytes:
    """Hostile cache entries: mutated valid entries, fields of the wrong type, forged digests, nesting, garbage."""
    kind = draw(
        st.sampled_from(
            ["flip", "truncate", "field", "forged_digest", "forged_consistent", "nesting", "random", "huge", "json"]
        )
    )
    value = json.loads(valid)
    if kind == "flip":
        data = bytearray(valid)
        for _ in range(draw(st.integers(1, 4))):
            data[draw(st.integers(0, len(data) - 1))] ^= draw(st.integers(1, 255))
        return bytes(data)
    if kind == "truncate":
        return valid[: draw(st.integers(0, len(valid) - 1))]
    if kind == "field":
        value[draw(st.sampled_from(sorted(value)))] = draw(json_values)
        return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()
    if kind == "forged_digest":
        value["digest"] = "sha256:" + draw(st.text("0123456789abcdef", min_size=64, max_size=64))
        return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()
    if kind == "forged_consistent":
        body = {key: item for key, item in value.items() if key != "entry_sha256"}
        body["digest"] = "sha256:" + draw(st.text("0123456789abcdef", min_size=64, max_size=64))
        return encode_canonical({**body, "entry_sha256": hashlib.sha256(encode_canonical(body)).hexdigest()})
    if kind == "nesting":
        depth = draw(st.integers(1, 60_000))
        field = draw(st.sampled_from(sorted(value)))
        value[field] = "@@"
        text = json.dumps(value, sort_keys=True, separators=(",", ":")).encode()
        return text.replace(b'"@@"', nested_bytes(depth))
    if kind == "huge":
        return valid[:-1] + b',"pad":"' + b"x" * draw(st.integers(60_000, 70_000)) + b'"}'
    if kind == "json":
        try:
            return encode_canonical(draw(json_values))
        except ValueError:
            return b"[]"
    return draw(st.binary(max_size=300))


@fuzz_settings(60)
@given(data=st.data())
def test_fuzzed_source_digest_cache_entries_are_recomputed_not_trusted(
    digest_cache: DigestCacheFixture, data: st.DataObject
) -> None:
    """C02: a damaged or foreign source-digest cache entry never raises through the public API and never
    yields a digest other than the true one, unless it is a complete, self-consistent entry (a deliberate
    forgery by the store's own user, which the cache cannot tell from a real entry)."""
    fixture = digest_cache
    planted = data.draw(entry_plants(fixture.valid_entry))
    fixture.entry.write_bytes(planted)
    os.chmod(fixture.entry, 0o600)
    cached = fixture.cache.cached_content_id(fixture.path, fixture.state)
    computed = fixture.cache.content_id(fixture.path, fixture.state)
    for found in (cached, computed):
        if found is None or found == fixture.true_id:
            continue
        assert planted == fixture.well_formed_entry(found), (found, planted[:200])
        event("a self-consistent forged entry is believed (same-uid trust)")
    if cached is None:
        event("entry rejected, digest recomputed")
        assert computed == fixture.true_id
        assert fixture.entry.read_bytes() == fixture.valid_entry  # the recomputed entry replaced the bad one
    elif cached == fixture.true_id:
        event("entry accepted, digest correct")

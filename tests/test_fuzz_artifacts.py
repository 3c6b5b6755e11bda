"""Fuzzing published artifacts: hostile payload headers, manifests and READY markers (S10, C06).

Each example restores a real published artifact, plants one fuzzed defect (re-sealing every digest that
would otherwise give it away, so the fuzzed bytes are the only defect), and looks it up at both
validation levels. What must hold: no exception escapes the store (every outcome is a StoreResult with a
FailureCode), nothing crashes, and a HIT is only ever the published tensors, bit for bit, as stock
safetensors also reads them (a mutation that changes nothing observable, such as another __metadata__
string, may hit). Few examples by default; `make fuzz` (HWR_FUZZ_EXAMPLES) runs many.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import event, given
from hypothesis import strategies as st

from host_weight_runtime import BuildRequest, FilesystemHostWeightStore, StoreStatus, ValidationLevel
from host_weight_runtime.canonical_json import encode_canonical
from host_weight_runtime.failures import FailureCode
from host_weight_runtime.manifest import MANIFEST_FILE_NAME, READY_FILE_NAME

from ._hostile import (
    PristineArtifact,
    assert_served_exactly,
    assert_stock_safetensors_agrees,
    fuzz_settings,
    manifest_value,
    padded,
    plant_header,
    plant_manifest_text,
    split_payload,
    writable,
)
from .support import SyntheticProducer, make_identity, make_tensors

pytestmark = pytest.mark.fuzz

META = ValidationLevel.MANIFEST_AND_METADATA
FULL = ValidationLevel.FULL_CHECKSUM
INVALID_CODES = frozenset(
    {
        FailureCode.PAYLOAD_INVALID,
        FailureCode.MANIFEST_INVALID,
        FailureCode.MANIFEST_INCOMPATIBLE,
        FailureCode.CHECKSUM_MISMATCH,
        FailureCode.IDENTITY_COLLISION,
    }
)
TENSORS = make_tensors(5)

json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**65), max_value=2**65)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12)
    | st.sampled_from(["", "\x00", "..", "../x", "BF16", "F32", "U8", "I64", "parameter"])
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)
hostile_names = st.sampled_from(["", "\x00", "a\x00b", "..", "../../etc/passwd", "__metadata__", "é", " "]) | st.text(
    max_size=20
)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> PristineArtifact:
    """One real published artifact (two payload files) and a saved copy to restore before every example."""
    base = tmp_path_factory.mktemp("fuzz-artifacts")
    store = FilesystemHostWeightStore(base / "hwr")
    identity = make_identity()
    result = store.get_or_build(
        BuildRequest(identity),
        SyntheticProducer(identity, TENSORS, files=2),
        validation=META,
        deadline=time.monotonic() + 60.0,
    )
    assert result.status is StoreStatus.BUILT and result.lease is not None, result.failure
    result.lease.close()
    return PristineArtifact(store, identity.key, base / "saved")


def assert_never_served_wrong(pristine: PristineArtifact) -> None:
    """Look the planted artifact up at both levels: typed INVALID, or exactly the published tensors."""
    identity = make_identity()
    for level in (META, FULL):
        result = pristine.store.lookup(identity, validation=level)
        if result.status is StoreStatus.HIT:
            assert result.lease is not None
            try:
                assert_served_exactly(result.lease.tensors, TENSORS)
            finally:
                result.lease.close()
            assert_stock_safetensors_agrees(pristine.directory, TENSORS)
            event(f"{level.value}: hit, bit-exact (the mutation changed nothing observable)")
            continue
        assert result.status is StoreStatus.INVALID, (level, result.status, result.failure)
        assert result.lease is None and result.failure is not None
        assert result.failure.code in INVALID_CODES, result.failure
        event(f"{level.value}: invalid, {result.failure.code.value}")
        pristine.store.layout.deny_marker(pristine.key).unlink()


# --------------------------------------------------------------------------- payload headers


@st.composite
def header_plants(draw: st.DrawFn, header: dict[str, Any], file_size: int) -> tuple[bytes, int | None]:
    """One hostile header for a payload whose real header is `header`: (header bytes, length prefix or None)."""
    names = sorted(name for name in header if name != "__metadata__")
    value = json.loads(json.dumps(header))
    kind = draw(
        st.sampled_from(
            [
                "field",
                "near_miss",
                "rename",
                "drop",
                "extra",
                "duplicate",
                "metadata",
                "nesting",
                "non_utf8",
                "flip",
                "random",
                "length_prefix",
                "truncate",
            ]
        )
    )
    raw: bytes | None = None
    prefix: int | None = None
    if kind == "field":
        name = draw(st.sampled_from(names))
        field = draw(st.sampled_from(["dtype", "shape", "data_offsets", "extra"]))
        value[name][field] = draw(json_values)
    elif kind == "near_miss":
        name = draw(st.sampled_from(names))
        entry = value[name]
        choice = draw(st.sampled_from(["shape", "begin", "end", "dtype", "float", "bool", "overlap", "past_eof"]))
        if choice == "shape":
            entry["shape"] = [*entry["shape"], draw(st.integers(0, 3))] if draw(st.booleans()) else entry["shape"][1:]
        elif choice in ("begin", "end"):
            index = 0 if choice == "begin" else 1
            entry["data_offsets"][index] += draw(st.integers(-16, 16))
        elif choice == "dtype":
            entry["dtype"] = draw(st.sampled_from(["BF16", "F16", "F32", "F64", "I64", "U8", "BOOL", "bf16", "F8"]))
        elif choice == "float":
            entry["shape"] = [float(d) for d in entry["shape"]]
        elif choice == "bool":
            entry["data_offsets"] = [bool(o) if o in (0, 1) else o for o in entry["data_offsets"]]
        elif choice == "overlap":
            other = value[draw(st.sampled_from(names))]
            entry["data_offsets"] = list(other["data_offsets"])
        else:
            size = entry["data_offsets"][1] - entry["data_offsets"][0]
            entry["data_offsets"] = [file_size, file_size + size]
    elif kind == "rename":
        old = draw(st.sampled_from(names))
        value[draw(hostile_names)] = value.pop(old)
    elif kind == "drop":
        del value[draw(st.sampled_from(names))]
    elif kind == "extra":
        value[draw(hostile_names)] = draw(json_values)
    elif kind == "duplicate":
        name = draw(st.sampled_from(names))
        text = json.dumps(value, separators=(",", ":"))
        raw = (text[:-1] + "," + json.dumps(name) + ":" + json.dumps(value[name]) + "}").encode()
    elif kind == "metadata":
        value["__metadata__"] = draw(json_values)
    elif kind == "nesting":
        depth = draw(st.integers(1, 200_000))
        nest = "[" * depth + "]" * depth
        key = draw(st.sampled_from([*names, "__metadata__", "x"]))
        text = json.dumps({k: v for k, v in value.items() if k != key}, separators=(",", ":"))
        raw = (text[:-1] + ("," if len(text) > 2 else "") + json.dumps(key) + ":" + nest + "}").encode()
    elif kind == "non_utf8":
        text = json.dumps(value, separators=(",", ":")).encode()
        at = draw(st.integers(0, len(text) - 1))
        raw = text[:at] + draw(st.sampled_from([b"\xff", b"\xc0\x80", b"\xed\xa0\x80", b"\xfe\xff"])) + text[at:]
    elif kind == "flip":
        data = bytearray(json.dumps(value, separators=(",", ":")).encode())
        for _ in range(draw(st.integers(1, 4))):
            at = draw(st.integers(0, len(data) - 1))
            data[at] ^= draw(st.integers(1, 255))
        raw = bytes(data)
    elif kind == "random":
        raw = draw(st.binary(max_size=300))
    elif kind == "length_prefix":
        real = len(padded(json.dumps(value, separators=(",", ":")).encode()))
        prefix = draw(
            st.sampled_from([0, 1, 7, real - 1, real + 1, real + 8, file_size, file_size * 2, 2**63, 2**64 - 1])
            | st.integers(0, 2**64 - 1)
        )
    elif kind == "truncate":
        text = json.dumps(value, separators=(",", ":")).encode()
        raw = text[: draw(st.integers(0, len(text) - 1))]
    if raw is None:
        raw = json.dumps(value, separators=(",", ":")).encode()
    return padded(raw), prefix


@fuzz_settings(60)
@given(data=st.data())
def test_fuzzed_payload_headers_are_typed_and_never_served_wrong(
    pristine: PristineArtifact, data: st.DataObject
) -> None:
    """S10: fuzzed safetensors headers of a published artifact (lengths, offsets past EOF or overlapping,
    dtype/shape disagreeing with the bytes, duplicate, NUL, '..' and non-UTF-8 names, huge nesting, random
    bytes), with manifest sizes and digests re-sealed around them: typed INVALID, or exactly the published tensors."""
    directory = pristine.restore()
    files = manifest_value(directory)["files"]
    assert isinstance(files, list)
    name = data.draw(st.sampled_from([entry["name"] for entry in files]))
    header, _data = split_payload(directory / name)
    planted, prefix = data.draw(header_plants(json.loads(header), (directory / name).stat().st_size))
    plant_header(directory, name, planted, length_prefix=prefix)
    assert_never_served_wrong(pristine)


# --------------------------------------------------------------------------- manifests and READY markers


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every path to a value inside a JSON document."""
    found = [prefix]
    if isinstance(value, dict):
        for key, item in value.items():
            found.extend(_paths(item, (*prefix, key)))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            found.extend(_paths(item, (*prefix, index)))
    return found


def _encode(value: Any) -> bytes:
    """Canonical bytes when the value allows it (so the mutation is the only defect), else plain JSON."""
    try:
        return encode_canonical(value)
    except ValueError:
        return json.dumps(value, separators=(",", ":")).encode()  # ASCII: lone surrogates are escaped


@st.composite
def document_mutations(draw: st.DrawFn, document: dict[str, Any], deep_field: str) -> bytes:
    """A hostile version of a JSON document: a changed, removed or added field, deep nesting, or garbage."""
    value = json.loads(json.dumps(document))
    kind = draw(st.sampled_from(["replace", "remove", "add", "tweak_int", "nesting", "whole", "random", "flip"]))
    if kind in ("replace", "remove", "tweak_int"):
        path = draw(st.sampled_from([p for p in _paths(value) if p]))
        parent = value
        for step in path[:-1]:
            parent = parent[step]
        if kind == "replace":
            parent[path[-1]] = draw(json_values)
        elif kind == "remove":
            del parent[path[-1]]
        elif isinstance(parent[path[-1]], int) and not isinstance(parent[path[-1]], bool):
            parent[path[-1]] += draw(st.sampled_from([-1, 1, 8, -(2**63), 2**63, 10**30]))
        else:
            parent[path[-1]] = str(parent[path[-1]])  # a string-typed number or a stringified object
    elif kind == "add":
        path = draw(st.sampled_from([p for p in _paths(value) if not p or isinstance(_at(value, p), dict)]))
        _at(value, path)[draw(st.text(max_size=8))] = draw(json_values)
    elif kind == "nesting":
        depth = draw(st.integers(1, 200_000))
        text = _encode(value)
        marker = json.dumps(deep_field).encode() + b":"
        at = text.index(marker) + len(marker)
        end = _value_end(text, at)
        return text[:at] + b"[" * depth + b"]" * depth + text[end:]
    elif kind == "whole":
        return _encode(draw(json_values))
    elif kind == "random":
        return draw(st.binary(max_size=400))
    else:
        data = bytearray(_encode(value))
        for _ in range(draw(st.integers(1, 4))):
            at = draw(st.integers(0, len(data) - 1))
            data[at] ^= draw(st.integers(1, 255))
        return bytes(data)
    return _encode(value)


def _at(value: Any, path: tuple[Any, ...]) -> Any:
    for step in path:
        value = value[step]
    return value


def _value_end(text: bytes, start: int) -> int:
    """Where the JSON value starting at `start` in canonical `text` ends (a scalar or a bracketed value)."""
    decoder = json.JSONDecoder()
    decoded = text.decode("utf-8")
    prefix = text[:start].decode("utf-8")
    _value, end = decoder.raw_decode(decoded, len(prefix))
    return len(decoded[:end].encode("utf-8"))


def _plant_ready(directory: Path, ready: bytes) -> None:
    with writable(directory):
        (directory / READY_FILE_NAME).write_bytes(ready)


@fuzz_settings(60)
@given(data=st.data())
def test_fuzzed_manifests_are_typed_and_never_served_wrong(pristine: PristineArtifact, data: st.DataObject) -> None:
    """C06 S10: fuzzed manifests (wrong types, string numbers, missing and unknown keys, deep nesting, random
    JSON and bytes) with READY.json re-hashed to name them: typed INVALID, or exactly the published tensors."""
    directory = pristine.restore()
    document = manifest_value(directory)
    field = data.draw(st.sampled_from(["format_metadata", "identity", "files", "tensors", "total_bytes"]))
    plant_manifest_text(directory, data.draw(document_mutations(document, field)))
    assert_never_served_wrong(pristine)


@fuzz_settings(60)
@given(data=st.data())
def test_fuzzed_ready_markers_are_typed_and_never_served_wrong(pristine: PristineArtifact, data: st.DataObject) -> None:
    """C06 S10: fuzzed READY.json markers (wrong types, bad digests, missing and unknown keys, deep nesting,
    random JSON and bytes): typed INVALID, or exactly the published tensors."""
    directory = pristine.restore()
    document = json.loads((directory / READY_FILE_NAME).read_bytes())
    field = data.draw(st.sampled_from(sorted(document)))
    _plant_ready(directory, data.draw(document_mutations(document, field)))
    assert_never_served_wrong(pristine)


def test_manifest_bytes_are_what_the_fuzzer_mutates(pristine: PristineArtifact) -> None:
    """The fuzzers' helpers reproduce the published bytes exactly when they change nothing (a sanity anchor)."""
    directory = pristine.restore()
    original = (directory / MANIFEST_FILE_NAME).read_bytes()
    assert _encode(manifest_value(directory)) == original
    start = original.index(b'"format_metadata":') + len(b'"format_metadata":')
    assert original[start : _value_end(original, start)] == b"{}"
    for level in (META, FULL):
        result = pristine.store.lookup(make_identity(), validation=level)
        assert result.status is StoreStatus.HIT and result.lease is not None
        result.lease.close()

"""CanonicalJson: the one byte encoding behind identities, manifests and markers (C01, C02)."""

from __future__ import annotations

import copy
import dataclasses
import decimal
import enum
import hashlib
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from host_weight_runtime.canonical_json import CanonicalJson, decode_canonical_json, decode_json, encode_canonical

# A fixed value that exercises sorting (including the empty key and upper case before
# lower case), nesting, empty containers, non-ASCII text of 2, 3 and 4 UTF-8 bytes,
# escapes, a control character, U+2028, and the float spellings Python's repr picks.
GOLDEN_VALUE = {
    "zeta": [1, -2, 2.5, 1e16, -0.0, None, True, False],
    "Alpha": {"\u00e9t\u00e9": "\u00fc\u20ac\U0001f600", "b": [], "a": {}},
    "text": 'tab\tquote"back\\slash/\x01\u2028',
    "": 0,
}
GOLDEN_BYTES = (
    b'{"":0,'
    b'"Alpha":{"a":{},"b":[],"\xc3\xa9t\xc3\xa9":"\xc3\xbc\xe2\x82\xac\xf0\x9f\x98\x80"},'
    b'"text":"tab\\tquote\\"back\\\\slash/\\u0001\xe2\x80\xa8",'
    b'"zeta":[1,-2,2.5,1e+16,-0.0,null,true,false]}'
)
GOLDEN_SHA256 = "00fd77162d43851a53cad9a41bbb8dd91e57d505021a3752191eba94b4143cf4"

# Hypothesis must not write a database into the working tree.
HYPOTHESIS = settings(database=None, deadline=None, max_examples=200)

json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text()
)
json_values = st.recursive(
    json_scalars,
    lambda children: st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=8), children, max_size=5),
    max_leaves=30,
)


class Color(enum.IntEnum):
    RED = 1


class Flavor(str, enum.Enum):
    SWEET = "sweet"


class MyInt(int):
    pass


class MyFloat(float):
    pass


class MyStr(str):
    pass


# --- C01: frozen snapshot, byte-stable encoding -------------------------------------------


def test_golden_bytes_for_a_fixed_nested_value() -> None:
    """C01: the encoding of a fixed nested value is pinned byte for byte (sorted keys, compact, raw UTF-8)."""
    canonical = CanonicalJson.from_value(GOLDEN_VALUE)
    assert canonical.data == GOLDEN_BYTES
    assert canonical.sha256 == GOLDEN_SHA256
    assert canonical.sha256 == hashlib.sha256(GOLDEN_BYTES).hexdigest()
    assert CanonicalJson(GOLDEN_BYTES) == canonical
    assert canonical.to_value() == GOLDEN_VALUE


def test_mutating_the_input_after_from_value_changes_nothing() -> None:
    """C01: from_value takes a snapshot; later mutation of nested input containers is invisible."""
    value: dict[str, object] = {"layers": [1, {"w": [2, 3]}], "name": "m"}
    original = copy.deepcopy(value)
    canonical = CanonicalJson.from_value(value)
    before = canonical.data

    layers = value["layers"]
    assert isinstance(layers, list)
    layers.append(4)
    inner = layers[1]
    assert isinstance(inner, dict)
    inner["w"].append(5)
    inner["extra"] = True
    value["name"] = "changed"
    value["new"] = None

    assert canonical.data == before
    assert canonical.to_value() == original
    assert canonical == CanonicalJson.from_value(original)


def test_to_value_returns_an_independent_copy() -> None:
    """C01: mutating what to_value returned does not change the snapshot."""
    canonical = CanonicalJson.from_value({"a": [1, 2], "b": {"c": 3}})
    first = canonical.to_value()
    assert isinstance(first, dict)
    a = first["a"]
    b = first["b"]
    assert isinstance(a, list) and isinstance(b, dict)
    a.append(99)
    b["c"] = 4
    assert canonical.to_value() == {"a": [1, 2], "b": {"c": 3}}


def test_canonical_json_instances_are_frozen_and_hashable() -> None:
    """C01: the snapshot itself cannot be reassigned, and equal snapshots hash equal."""
    canonical = CanonicalJson.from_value({"a": 1})
    with pytest.raises(dataclasses.FrozenInstanceError):
        canonical.data = b'{"a":2}'  # type: ignore[misc]
    assert type(canonical.data) is bytes
    assert hash(canonical) == hash(CanonicalJson(b'{"a":1}'))
    assert CanonicalJson.empty().data == b"{}"


def test_encoding_does_not_depend_on_dict_insertion_order() -> None:
    """C01: equal values built in different key orders give identical bytes."""
    forward = {"a": 1, "b": {"x": [1, 2], "y": "z"}, "c": None}
    backward = {"c": None, "b": {"y": "z", "x": [1, 2]}, "a": 1}
    assert CanonicalJson.from_value(forward).data == CanonicalJson.from_value(backward).data
    assert CanonicalJson.from_value(forward).data == b'{"a":1,"b":{"x":[1,2],"y":"z"},"c":null}'


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (0.1, b"0.1"),
        (1.0, b"1.0"),
        (-0.0, b"-0.0"),
        (1e-7, b"1e-07"),
        (5e-324, b"5e-324"),
        (1.7976931348623157e308, b"1.7976931348623157e+308"),
        (123456789012345678901234567890, b"123456789012345678901234567890"),
        (1, b"1"),
        (True, b"true"),
        (None, b"null"),
        ("\u00e9", b'"\xc3\xa9"'),
        ("\x7f", b'"\x7f"'),
        ("\x1f", b'"\\u001f"'),
    ],
)
def test_scalar_spellings_are_pinned(value: object, expected: bytes) -> None:
    """C01: each scalar has exactly one spelling, and the bytes parse back to an equal value."""
    canonical = CanonicalJson.from_value(value)
    assert canonical.data == expected
    assert CanonicalJson(expected) == canonical
    decoded = canonical.to_value()
    assert decoded == value
    assert type(decoded) is type(value)


def test_tuples_encode_as_lists() -> None:
    """C01: a tuple is accepted as a JSON array and reads back as a list."""
    assert CanonicalJson.from_value({"shape": (2, 3)}).data == b'{"shape":[2,3]}'
    assert CanonicalJson.from_value({"shape": (2, 3)}) == CanonicalJson.from_value({"shape": [2, 3]})


def test_shared_but_acyclic_references_are_fine() -> None:
    """C01: the same list referenced twice is not a cycle and encodes twice."""
    shared = [1, 2]
    assert CanonicalJson.from_value({"a": shared, "b": shared}).data == b'{"a":[1,2],"b":[1,2]}'


@HYPOTHESIS
@given(json_values)
def test_round_trip_property(value: object) -> None:
    """C01: for any JSON-native value, from_value(v).to_value() == v and the bytes re-validate."""
    canonical = CanonicalJson.from_value(value)
    assert canonical.to_value() == value
    again = CanonicalJson(canonical.data)
    assert again == canonical
    assert CanonicalJson.from_value(again.to_value()).data == canonical.data
    assert canonical.data == encode_canonical(value)


@HYPOTHESIS
@given(st.dictionaries(st.text(max_size=6), json_scalars, max_size=8))
def test_key_order_property(value: dict[str, object]) -> None:
    """C01: reversing a dict's insertion order never changes its canonical bytes."""
    reversed_value = dict(reversed(list(value.items())))
    assert CanonicalJson.from_value(reversed_value).data == CanonicalJson.from_value(value).data


# --- C02: rejections ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value",
    [
        float("nan"),
        float("inf"),
        float("-inf"),
        [1.0, float("nan")],
        {"a": {"b": [float("inf")]}},
        {"x": -float("inf")},
    ],
    ids=["nan", "inf", "-inf", "nan-in-list", "inf-nested", "-inf-in-dict"],
)
def test_rejects_non_finite_numbers(value: object) -> None:
    """C02: NaN and infinities are rejected wherever they appear."""
    with pytest.raises(ValueError):
        CanonicalJson.from_value(value)
    with pytest.raises(ValueError):
        encode_canonical(value)


@pytest.mark.parametrize(
    "value",
    [
        {1: "a"},
        {"a": {2: "b"}},
        {1: "a", "1": "b"},
        {True: 1},
        {None: 1},
        {1.5: 1},
        {("a",): 1},
        {MyStr("k"): 1},
        {Flavor.SWEET: 1},
    ],
    ids=["int", "nested-int", "int-and-str-collide", "bool", "none", "float", "tuple", "str-subclass", "str-enum"],
)
def test_rejects_non_string_keys(value: dict[object, object]) -> None:
    """C02: only exact str keys; json.dumps would silently stringify ints, bools, None and floats."""
    with pytest.raises(ValueError):
        CanonicalJson.from_value(value)


def test_int_keys_that_json_dumps_would_stringify_are_rejected() -> None:
    """C02: json.dumps turns {1: .., "1": ..} into duplicate "1" keys; canonical JSON refuses the input."""
    assert json.dumps({1: "a", "1": "b"}, sort_keys=False) == '{"1": "a", "1": "b"}'
    with pytest.raises(ValueError):
        CanonicalJson.from_value({1: "a", "1": "b"})
    with pytest.raises(ValueError):
        CanonicalJson.from_value({1: "a"})


def _cycle() -> list[object]:
    items: list[object] = [1]
    items.append({"back": items})
    return items


@pytest.mark.parametrize(
    "value",
    [
        Color.RED,
        Flavor.SWEET,
        MyInt(3),
        MyFloat(1.5),
        MyStr("s"),
        {1, 2},
        frozenset({1}),
        b"bytes",
        bytearray(b"x"),
        memoryview(b"x"),
        object(),
        decimal.Decimal("1.5"),
        1 + 2j,
        CanonicalJson.empty(),
        [1, {"a": object()}],
        {"deep": [[{1, 2}]]},
        _cycle(),
        "\ud800",
        {"\udfff": 1},
    ],
    ids=[
        "IntEnum",
        "str-enum",
        "int-subclass",
        "float-subclass",
        "str-subclass",
        "set",
        "frozenset",
        "bytes",
        "bytearray",
        "memoryview",
        "object",
        "Decimal",
        "complex",
        "CanonicalJson",
        "nested-object",
        "nested-set",
        "cycle",
        "lone-surrogate",
        "lone-surrogate-key",
    ],
)
def test_rejects_values_that_are_not_json_native(value: object) -> None:
    """C02: subclasses, sets, bytes, arbitrary objects, cycles and lone surrogates raise ValueError."""
    with pytest.raises(ValueError):
        CanonicalJson.from_value(value)


@pytest.mark.parametrize(
    "data",
    [
        b'{"a": 1}',
        b'{"a":1, "b":2}',
        b' {"a":1}',
        b'{"a":1}\n',
        b'{"b":1,"a":2}',
        b'"\\u00e9"',
        b'"\\ud83d\\ude00"',
        b'"\\/"',
        b'{"a":1,"a":1}',
        b'{"a":1,"a":2}',
        b"NaN",
        b"Infinity",
        b"-Infinity",
        b"[1.0E5]",
        b"1e5",
        b"1.50",
        b"-0",
        b"\xef\xbb\xbf{}",
        b"\xff",
        b'"\xed\xa0\x80"',
        b"",
        b"{",
        b'"\\ud800"',
    ],
    ids=[
        "space-after-colon",
        "space-after-comma",
        "leading-space",
        "trailing-newline",
        "unsorted-keys",
        "ensure-ascii-escape",
        "escaped-astral",
        "escaped-slash",
        "duplicate-equal-keys",
        "duplicate-keys",
        "NaN",
        "Infinity",
        "-Infinity",
        "exponent-spelling",
        "exponent-int",
        "trailing-zero",
        "negative-zero-int",
        "utf8-bom",
        "invalid-utf8",
        "encoded-surrogate",
        "empty",
        "truncated",
        "escaped-lone-surrogate",
    ],
)
def test_rejects_bytes_that_are_not_already_canonical(data: bytes) -> None:
    """C02: CanonicalJson(bytes) accepts only the exact canonical spelling."""
    with pytest.raises(ValueError):
        CanonicalJson(data)


@pytest.mark.parametrize("data", ["{}", bytearray(b"{}"), memoryview(b"{}"), None, {}])
def test_rejects_data_that_is_not_bytes(data: object) -> None:
    """C02: the constructor takes exact bytes only; values go through from_value."""
    with pytest.raises(ValueError):
        CanonicalJson(data)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "data",
    [b"{}", b"[]", b"null", b"0", b'"\xc3\xa9"', b'{"a":[1,2.5,null],"b":{"c":true}}', GOLDEN_BYTES],
)
def test_accepts_canonical_bytes_unchanged(data: bytes) -> None:
    """C02: bytes already canonical are accepted and kept byte for byte."""
    assert CanonicalJson(data).data == data
    assert encode_canonical(decode_json(data)) == data


def test_decode_json_rejects_constants_and_duplicates() -> None:
    """C02: the strict parser refuses NaN/Infinity and duplicate keys even when whitespace is allowed."""
    assert decode_json(b' {"a" : 1} ') == {"a": 1}
    for data in (b"[NaN]", b'{"x": Infinity}', b'{"a": 1, "a": 1}'):
        with pytest.raises(ValueError):
            decode_json(data)


@pytest.mark.parametrize(
    "data", [b'{"a":1,"a":1}', b'{"a":1,"a":2}', b'{"a":{"b":1,"b":1}}'], ids=["equal", "different", "nested"]
)
def test_decode_canonical_json_names_a_duplicate_key(data: bytes) -> None:
    """C02: the fast canonical parser has no duplicate hook; the canonical check refuses them, named as such."""
    with pytest.raises(ValueError, match="duplicate JSON key"):
        decode_canonical_json(data)


@pytest.mark.parametrize(
    "data", [b'{"b":1,"a":2}', b'{"a": 1}', b"[NaN]", b'{"a":1}\n', b"\xff", b"", b"[1.50]"], ids=str
)
def test_decode_canonical_json_refuses_what_is_not_canonical(data: bytes) -> None:
    """C02: anything but the exact canonical spelling is a ValueError; canonical bytes decode as `decode_json`."""
    with pytest.raises(ValueError):
        decode_canonical_json(data)
    for canonical in (b"{}", b'{"a":[1,2.5,null],"b":{"c":true}}', GOLDEN_BYTES):
        assert decode_canonical_json(canonical) == decode_json(canonical)

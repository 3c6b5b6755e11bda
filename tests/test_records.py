"""The record field tables (`_records.RecordSpec`) and the canonical digest helper behind identities, manifests and
READY.json: exact keys, no coercion, the bytes of the records unchanged (C01, C03, C05, C06).
"""

from __future__ import annotations

import ast
import enum
import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import pytest

import host_weight_runtime
from host_weight_runtime._records import (
    EnumValue,
    Field,
    Integer,
    IntPair,
    Ints,
    Json,
    Nested,
    Records,
    RecordSpec,
    Text,
    Texts,
)
from host_weight_runtime.canonical_json import (
    CanonicalJson,
    canonical_sha256,
    canonical_sha256_trusted,
    encode_canonical,
)
from host_weight_runtime.failures import FailureCode, HostWeightFailure, ResolutionStage, failure

PACKAGE_DIR = Path(host_weight_runtime.__file__).resolve().parent


class Color(enum.Enum):
    RED = "red"


@dataclass(frozen=True, slots=True)
class Leaf:
    SPEC: ClassVar[RecordSpec] = RecordSpec("Leaf", "leaf", (Field("n", Integer(minimum=0)),))

    n: int

    def __post_init__(self) -> None:
        self.SPEC.check(self)

    def to_dict(self) -> dict[str, Any]:
        return self.SPEC.encode(self)

    @classmethod
    def from_dict(cls, value: object) -> Leaf:
        return cls(**cls.SPEC.decode(value))


@dataclass(frozen=True, slots=True)
class Sample:
    SPEC: ClassVar[RecordSpec] = RecordSpec(
        "Sample",
        "sample",
        (
            Field("name", Text()),
            Field("note", Text(allow_empty=True, optional=True)),
            Field("shape", Ints()),
            Field("span", IntPair()),
            Field("tags", Texts()),
            Field("color", EnumValue(Color)),
            Field("meta", Json()),
            Field("leaf", Nested(Leaf)),
            Field("leaves", Records(Leaf)),
            Field("count", Integer(), derived=True),
        ),
    )

    name: str
    note: str | None
    shape: tuple[int, ...]
    span: tuple[int, int]
    tags: tuple[str, ...]
    color: Color
    leaf: Leaf
    leaves: tuple[Leaf, ...]
    meta: CanonicalJson = field(default_factory=CanonicalJson.empty)

    @property
    def count(self) -> int:
        return len(self.leaves)

    def __post_init__(self) -> None:
        self.SPEC.check(self)


SAMPLE = Sample(
    name="s",
    note=None,
    shape=(2, 3),
    span=(0, 24),
    tags=("a", "b"),
    color=Color.RED,
    leaf=Leaf(1),
    leaves=(Leaf(2), Leaf(3)),
    meta=CanonicalJson.from_value({"k": [1]}),
)
SAMPLE_DICT = {
    "name": "s",
    "note": None,
    "shape": [2, 3],
    "span": [0, 24],
    "tags": ["a", "b"],
    "color": "red",
    "meta": {"k": [1]},
    "leaf": {"n": 1},
    "leaves": [{"n": 2}, {"n": 3}],
    "count": 2,
}


def test_a_spec_encodes_in_table_order_and_decodes_back() -> None:
    """C03: encode gives every field (the derived one from its property) in table order; decode reads them back."""
    encoded = Sample.SPEC.encode(SAMPLE)
    assert encoded == SAMPLE_DICT
    assert list(encoded) == [f.name for f in Sample.SPEC.fields]
    values = Sample.SPEC.decode(SAMPLE_DICT)
    assert values["count"] == 2
    assert Sample(**Sample.SPEC.arguments(values)) == SAMPLE


@pytest.mark.parametrize(
    ("key", "bad"),
    [
        ("name", 1),
        ("note", 3),
        ("shape", [1.0]),
        ("shape", [True]),
        ("span", [1, 2, 3]),
        ("tags", ["a", 1]),
        ("color", "blue"),
        ("meta", []),
        ("leaf", {"n": "1"}),
        ("leaf", {"n": 1, "extra": 0}),
        ("leaves", {"n": 1}),
        ("count", "2"),
    ],
)
def test_decode_refuses_coerced_or_malformed_fields(key: str, bad: object) -> None:
    """C05: a wrong type in any field, at any depth, is a ValueError; nothing is coerced."""
    with pytest.raises(ValueError):
        Sample.SPEC.decode({**SAMPLE_DICT, key: bad})


def test_decode_requires_exactly_the_table_keys() -> None:
    """C05: an unknown key and a missing key are each refused, naming the record."""
    with pytest.raises(ValueError, match=r"sample has unexpected field\(s\) \['extra'\]"):
        Sample.SPEC.decode({**SAMPLE_DICT, "extra": 1})
    missing = dict(SAMPLE_DICT)
    del missing["tags"]
    with pytest.raises(ValueError, match=r"sample is missing field\(s\) \['tags'\]"):
        Sample.SPEC.decode(missing)


@pytest.mark.parametrize(
    ("name", "bad"),
    [("name", ""), ("shape", [2]), ("span", (1,)), ("tags", ("a", 2)), ("color", "red"), ("leaf", {"n": 1})],
)
def test_check_names_the_class_and_field(name: str, bad: object) -> None:
    """C05: an instance built with a wrong field type is refused as `Class.field`."""
    arguments = {f: getattr(SAMPLE, f) for f in Sample.SPEC.arguments(SAMPLE_DICT)}
    with pytest.raises(ValueError, match=rf"Sample\.{name} "):
        Sample(**{**arguments, name: bad})
    with pytest.raises(ValueError, match=r"Leaf\.n must be >= 0"):
        Leaf(-1)


def test_a_spec_refuses_a_field_named_twice() -> None:
    """C05: a table that names one key twice is a programming error, refused when the class is defined."""
    with pytest.raises(ValueError, match="names a field twice"):
        RecordSpec("Twice", "twice", (Field("a", Text()), Field("a", Integer())))


def test_canonical_sha256_is_the_sha256_of_the_canonical_bytes() -> None:
    """C01: the digest helper hashes exactly `encode_canonical`'s bytes; the trusted one agrees on the same value."""
    value = {"b": [1, "\u00e9"], "a": None}
    expected = hashlib.sha256(encode_canonical(value)).hexdigest()
    assert canonical_sha256(value) == expected == CanonicalJson.from_value(value).sha256
    assert canonical_sha256_trusted(value) == expected
    with pytest.raises(ValueError):
        canonical_sha256({"x": float("nan")})


def _hand_written_digests(source: str) -> list[int]:
    """Lines of `hashlib.sha256(encode_canonical...(x))`: a digest of canonical bytes not made by the helper."""
    lines: list[int] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "sha256":
            for argument in node.args:
                if isinstance(argument, ast.Call):
                    called = argument.func
                    name = called.id if isinstance(called, ast.Name) else getattr(called, "attr", "")
                    if name.startswith("encode_canonical"):
                        lines.append(node.lineno)
    return lines


def test_no_module_hashes_canonical_bytes_by_hand() -> None:
    """C01: outside canonical_json.py, a canonical document's digest is `canonical_sha256` (one way, one place)."""
    assert _hand_written_digests("import hashlib\nhashlib.sha256(encode_canonical(x)).hexdigest()\n") == [2]
    found = [
        f"{path.relative_to(PACKAGE_DIR)}:{line}"
        for path in sorted(PACKAGE_DIR.rglob("*.py"))
        if path.name != "canonical_json.py"
        for line in _hand_written_digests(path.read_text(encoding="utf-8"))
    ]
    assert found == []


def test_a_failure_keeps_its_bytes() -> None:
    """C06: a failure value written by its field table keeps the bytes it had when written by hand, and reads back."""
    value = failure(
        ResolutionStage.REMOTE, FailureCode.REMOTE_FAILED, "the remote \u00e9 said no", retryable=True, url="file:///x", tries=2
    )
    data = encode_canonical(value.to_dict())
    assert data == (
        b'{"code":"remote_failed","details":{"tries":2,"url":"file:///x"},'
        b'"message":"the remote \xc3\xa9 said no","retryable":true,"stage":"remote"}'
    )
    assert HostWeightFailure.from_dict(CanonicalJson(data).to_value()) == value
    with pytest.raises(ValueError, match=r"failure\.retryable must be a boolean"):
        HostWeightFailure.from_dict({**value.to_dict(), "retryable": 1})

"""One declarative way to define a JSON record: a table of fields per class, each field with one codec.

A record class (an identity part, a manifest entry, READY.json) lists its fields once in a
`RecordSpec`; the spec checks an instance's field types, encodes it to the dict its canonical
bytes are made of, and decodes a parsed JSON object back with exact keys and no coercion. The
field order of the table is the order of `to_dict`; canonical bytes sort keys anyway.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from ._strict import (
    get_bool,
    get_int,
    get_int_tuple,
    get_json,
    get_list,
    get_optional_str,
    get_str,
    require_int_field,
    require_json_field,
    require_record,
    require_str_field,
)
from .canonical_json import JsonValue

__all__ = [
    "Boolean",
    "EnumValue",
    "Field",
    "FieldCodec",
    "Integer",
    "IntPair",
    "Ints",
    "Json",
    "Nested",
    "RecordSpec",
    "Records",
    "Text",
    "Texts",
]


class FieldCodec(Protocol):
    """How one field is checked on an instance, written to JSON and read back from a parsed object."""

    def check(self, value: object, name: str) -> None:
        """Raise ValueError naming `name` (`Class.field`) when `value` is not this field's type."""

    def encode(self, value: Any) -> JsonValue:
        """The JSON value the field is written as."""

    def decode(self, obj: Mapping[str, object], key: str, where: str) -> object:
        """The field's value read from `obj[key]`, strictly typed; a ValueError names `where.key`."""


class _Record(Protocol):
    def to_dict(self) -> dict[str, JsonValue]: ...


@dataclass(frozen=True, slots=True)
class Text:
    """A string; empty only with `allow_empty`, null only with `optional`."""

    allow_empty: bool = False
    optional: bool = False

    def check(self, value: object, name: str) -> None:
        if value is None and self.optional:
            return
        require_str_field(value, name, allow_empty=self.allow_empty)

    def encode(self, value: Any) -> JsonValue:
        return value  # type: ignore[no-any-return]  # checked to be str or None

    def decode(self, obj: Mapping[str, object], key: str, where: str) -> object:
        return get_optional_str(obj, key, where) if self.optional else get_str(obj, key, where)


@dataclass(frozen=True, slots=True)
class Integer:
    """An int (never a bool), at least `minimum` when one is given."""

    minimum: int | None = None

    def check(self, value: object, name: str) -> None:
        require_int_field(value, name, minimum=self.minimum)

    def encode(self, value: Any) -> JsonValue:
        return value  # type: ignore[no-any-return]  # checked to be int

    def decode(self, obj: Mapping[str, object], key: str, where: str) -> object:
        return get_int(obj, key, where)


@dataclass(frozen=True, slots=True)
class Boolean:
    """A bool (never an int)."""

    def check(self, value: object, name: str) -> None:
        if type(value) is not bool:
            raise ValueError(f"{name} must be a bool")

    def encode(self, value: Any) -> JsonValue:
        return value  # type: ignore[no-any-return]  # checked to be bool

    def decode(self, obj: Mapping[str, object], key: str, where: str) -> object:
        return get_bool(obj, key, where)


@dataclass(frozen=True, slots=True)
class Json:
    """Free-form metadata: `CanonicalJson` holding a JSON object."""

    def check(self, value: object, name: str) -> None:
        require_json_field(value, name)

    def encode(self, value: Any) -> JsonValue:
        return value.to_value()  # type: ignore[no-any-return]  # a CanonicalJson

    def decode(self, obj: Mapping[str, object], key: str, where: str) -> object:
        return get_json(obj, key, where)


@dataclass(frozen=True, slots=True)
class Ints:
    """A tuple of ints, written as a list."""

    def check(self, value: object, name: str) -> None:
        if type(value) is not tuple or any(type(item) is not int for item in value):
            raise ValueError(f"{name} must be a tuple of integers")

    def encode(self, value: Any) -> JsonValue:
        return list(value)

    def decode(self, obj: Mapping[str, object], key: str, where: str) -> object:
        return get_int_tuple(obj, key, where)


@dataclass(frozen=True, slots=True)
class IntPair:
    """Two ints, (begin, end), written as a list."""

    def check(self, value: object, name: str) -> None:
        if type(value) is not tuple or len(value) != 2 or any(type(item) is not int for item in value):
            raise ValueError(f"{name} must be a pair of integers")

    def encode(self, value: Any) -> JsonValue:
        return list(value)

    def decode(self, obj: Mapping[str, object], key: str, where: str) -> object:
        pair = get_int_tuple(obj, key, where)
        if len(pair) != 2:
            raise ValueError(f"{where}.{key} must have two integers")
        return (pair[0], pair[1])


@dataclass(frozen=True, slots=True)
class Texts:
    """A tuple of strings, written as a list."""

    def check(self, value: object, name: str) -> None:
        if type(value) is not tuple or any(type(item) is not str for item in value):
            raise ValueError(f"{name} must be a tuple of strings")

    def encode(self, value: Any) -> JsonValue:
        return list(value)

    def decode(self, obj: Mapping[str, object], key: str, where: str) -> object:
        items = get_list(obj, key, where)
        if any(type(item) is not str for item in items):
            raise ValueError(f"{where}.{key} must hold strings")
        return tuple(str(item) for item in items)


@dataclass(frozen=True, slots=True)
class EnumValue:
    """A member of `enum_type`, written as its string value."""

    enum_type: type[enum.Enum]

    def check(self, value: object, name: str) -> None:
        if not isinstance(value, self.enum_type):
            raise ValueError(f"{name} must be a {self.enum_type.__name__}")

    def encode(self, value: Any) -> JsonValue:
        return value.value  # type: ignore[no-any-return]  # a member whose value is a str

    def decode(self, obj: Mapping[str, object], key: str, where: str) -> object:
        return self.enum_type(get_str(obj, key, where))


@dataclass(frozen=True, slots=True)
class Nested:
    """Another record, written as its own object and read back by its own `from_dict`."""

    record_type: type[Any]

    def check(self, value: object, name: str) -> None:
        if not isinstance(value, self.record_type):
            raise ValueError(f"{name} must be a {self.record_type.__name__}")

    def encode(self, value: Any) -> JsonValue:
        record: _Record = value
        return record.to_dict()

    def decode(self, obj: Mapping[str, object], key: str, where: str) -> object:
        return self.record_type.from_dict(obj[key])


@dataclass(frozen=True, slots=True)
class Records:
    """A tuple of records of one type, written as a list of objects."""

    record_type: type[Any]

    def check(self, value: object, name: str) -> None:
        if type(value) is not tuple or any(not isinstance(item, self.record_type) for item in value):
            raise ValueError(f"{name} must be a tuple of {self.record_type.__name__}")

    def encode(self, value: Any) -> JsonValue:
        return [item.to_dict() for item in value]

    def decode(self, obj: Mapping[str, object], key: str, where: str) -> object:
        return tuple(self.record_type.from_dict(item) for item in get_list(obj, key, where))


@dataclass(frozen=True, slots=True)
class Field:
    """One field of a record: its JSON key (the attribute of the same name) and codec.

    A `derived` field is written from the instance (a property) and read back, but is no
    constructor argument: the record checks the value read equals the one it derives.
    """

    name: str
    codec: FieldCodec
    derived: bool = False


def _reader(codec: FieldCodec) -> Callable[[Mapping[str, object], str, str], object]:
    """The codec's decode, or the strict getter it would call (one call less per field of a hot record)."""
    if isinstance(codec, Text):
        return get_optional_str if codec.optional else get_str
    if isinstance(codec, Integer):
        return get_int
    if isinstance(codec, Boolean):
        return get_bool
    if isinstance(codec, Ints):
        return get_int_tuple
    if isinstance(codec, Json):
        return get_json
    return codec.decode


@dataclass(frozen=True, slots=True)
class RecordSpec:
    """The field table of one record class: `where` names it in decode errors, `owner` in check errors."""

    owner: str
    where: str
    fields: tuple[Field, ...]
    keys: frozenset[str] = field(init=False)
    # Bound codec methods, looked up once: manifests encode and decode thousands of entries per artifact.
    _writers: tuple[tuple[str, Callable[[Any], JsonValue] | None], ...] = field(init=False, repr=False, compare=False)
    _readers: tuple[tuple[str, Callable[[Mapping[str, object], str, str], object]], ...] = field(
        init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        names = [f.name for f in self.fields]
        if len(set(names)) != len(names):
            raise ValueError(f"{self.owner} names a field twice")
        object.__setattr__(self, "keys", frozenset(names))
        writers = tuple(
            (f.name, None if isinstance(f.codec, Text | Integer | Boolean) else f.codec.encode) for f in self.fields
        )
        object.__setattr__(self, "_writers", writers)
        object.__setattr__(self, "_readers", tuple((f.name, _reader(f.codec)) for f in self.fields))

    def check(self, record: object) -> None:
        """Check every constructor field's type (`Owner.field must be ...`)."""
        for f in self.fields:
            if not f.derived:
                f.codec.check(getattr(record, f.name), f"{self.owner}.{f.name}")

    def encode(self, record: object) -> dict[str, JsonValue]:
        """The record as the dict its canonical bytes are made of."""
        # Strings and ints are written as they are (None: no codec call).
        out: dict[str, JsonValue] = {}
        for name, write in self._writers:
            value = getattr(record, name)
            out[name] = value if write is None else write(value)
        return out

    def decode(self, value: object) -> dict[str, Any]:
        """Every field read from a parsed JSON object with exactly these keys (derived ones included)."""
        return self.read(require_record(value, self.keys, self.where))

    def read(self, obj: Mapping[str, object]) -> dict[str, Any]:
        """`decode` for an object whose keys were already checked."""
        where = self.where
        return {name: read(obj, name, where) for name, read in self._readers}

    def arguments(self, values: Mapping[str, Any]) -> dict[str, Any]:
        """The constructor arguments among decoded `values` (the derived fields left out)."""
        return {f.name: values[f.name] for f in self.fields if not f.derived}

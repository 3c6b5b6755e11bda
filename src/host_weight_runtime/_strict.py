"""Strict readers for parsed JSON objects: exact keys and no type coercion."""

from __future__ import annotations

from collections.abc import Mapping

from .canonical_json import CanonicalJson


def require_object(value: object, where: str) -> Mapping[str, object]:
    if not isinstance(value, dict):
        raise ValueError(f"{where} must be a JSON object, got {type(value).__name__}")
    return value


def require_exact_keys(obj: Mapping[str, object], keys: frozenset[str], where: str) -> None:
    if obj.keys() == keys:
        return
    present = set(obj)
    unknown = sorted(present - keys)
    missing = sorted(keys - present)
    if unknown:
        raise ValueError(f"{where} has unexpected field(s) {unknown}")
    if missing:
        raise ValueError(f"{where} is missing field(s) {missing}")


def require_record(value: object, keys: frozenset[str], where: str) -> Mapping[str, object]:
    """A JSON object with exactly `keys`: anything else is a ValueError naming what is wrong."""
    obj = require_object(value, where)
    require_exact_keys(obj, keys, where)
    return obj


def get_str(obj: Mapping[str, object], key: str, where: str) -> str:
    value = obj[key]
    if type(value) is not str:
        raise ValueError(f"{where}.{key} must be a string, got {type(value).__name__}")
    return value


def get_optional_str(obj: Mapping[str, object], key: str, where: str) -> str | None:
    value = obj[key]
    if value is None:
        return None
    return get_str(obj, key, where)


def get_int(obj: Mapping[str, object], key: str, where: str) -> int:
    value = obj[key]
    if type(value) is not int:
        raise ValueError(f"{where}.{key} must be an integer, got {type(value).__name__}")
    return value


def get_bool(obj: Mapping[str, object], key: str, where: str) -> bool:
    value = obj[key]
    if type(value) is not bool:
        raise ValueError(f"{where}.{key} must be a boolean, got {type(value).__name__}")
    return value


def get_list(obj: Mapping[str, object], key: str, where: str) -> list[object]:
    value = obj[key]
    if type(value) is not list:
        raise ValueError(f"{where}.{key} must be a list, got {type(value).__name__}")
    return value


def get_int_tuple(obj: Mapping[str, object], key: str, where: str) -> tuple[int, ...]:
    items = get_list(obj, key, where)
    for item in items:
        if type(item) is not int:
            raise ValueError(f"{where}.{key} must hold integers, got {type(item).__name__}")
    return tuple(items)  # type: ignore[arg-type]  # every item was checked to be exactly int


def get_json(obj: Mapping[str, object], key: str, where: str) -> CanonicalJson:
    value = obj[key]
    if not isinstance(value, dict):
        raise ValueError(f"{where}.{key} must be a JSON object")
    return CanonicalJson.from_value(value)


def require_str_field(value: object, name: str, *, allow_empty: bool = False) -> None:
    if type(value) is not str:
        raise ValueError(f"{name} must be a str, got {type(value).__name__}")
    if not allow_empty and not value:
        raise ValueError(f"{name} must not be empty")


def require_int_field(value: object, name: str, *, minimum: int | None = None) -> None:
    if type(value) is not int:
        raise ValueError(f"{name} must be an int, got {type(value).__name__}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def require_json_field(value: object, name: str) -> None:
    """A metadata field: CanonicalJson holding a JSON object (what `get_json` reads back)."""
    if not isinstance(value, CanonicalJson):
        raise ValueError(f"{name} must be CanonicalJson, got {type(value).__name__}")
    if not value.data.startswith(b"{"):
        raise ValueError(f"{name} must hold a JSON object, got {value!r}")

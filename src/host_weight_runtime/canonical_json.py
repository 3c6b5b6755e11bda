"""The one byte encoding used for identities, manifests and markers.

Keys are sorted, separators compact, text UTF-8, and only JSON-native values are
accepted, so that equal values always produce equal bytes and equal digests.

Everything here is bounded, because the bytes it parses may come from a hostile
co-tenant: at most MAX_JSON_BYTES of input and MAX_JSON_DEPTH nested containers, and
every way parsing can fail (including the parser's own recursion guard) is a ValueError.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from typing import TypeAlias

JsonValue: TypeAlias = bool | int | float | str | list["JsonValue"] | dict[str, "JsonValue"] | None

MAX_JSON_DEPTH = 128
"""The deepest nesting of lists and objects accepted anywhere (real metadata nests a few levels)."""
MAX_JSON_BYTES = 64 * 1024 * 1024
"""The largest JSON document `decode_json` parses by default."""


def _check_value(value: object, path: str, ancestors: frozenset[int] = frozenset()) -> None:
    """Reject anything that JSON cannot represent exactly and stably.

    Scalars must be exactly None, bool, int, float or str: subclasses (IntEnum, str
    enums, numpy scalars) are rejected rather than silently converted.
    """
    if len(ancestors) >= MAX_JSON_DEPTH and isinstance(value, (list, tuple, dict)):
        raise ValueError(f"canonical JSON rejects nesting deeper than {MAX_JSON_DEPTH} levels at {path[:200]}")
    if value is None or type(value) in (bool, str, int):
        return
    if type(value) is float:
        if not math.isfinite(value):
            raise ValueError(f"canonical JSON rejects non-finite number {value!r} at {path}")
        return
    if isinstance(value, (list, tuple, dict)):
        if id(value) in ancestors:
            raise ValueError(f"canonical JSON rejects a circular reference at {path}")
        inner = ancestors | {id(value)}
        if isinstance(value, dict):
            for key, item in value.items():
                if type(key) is not str:
                    raise ValueError(
                        f"canonical JSON needs string keys; got {type(key).__name__} key {key!r} at {path}"
                    )
                _check_value(item, f"{path}.{key}", inner)
        else:
            for index, item in enumerate(value):
                _check_value(item, f"{path}[{index}]", inner)
        return
    raise ValueError(
        f"canonical JSON accepts only None, bool, int, float, str, list and dict; "
        f"got {type(value).__name__} at {path}"
    )


def _is_plain(value: object, ancestors: set[int]) -> bool:
    """The fast form of `_check_value`: True when the value is acceptable, without building paths."""
    kind = type(value)
    if value is None or kind is bool or kind is str or kind is int:
        return True
    if kind is float:
        return math.isfinite(value)  # type: ignore[arg-type]
    if not isinstance(value, (list, tuple, dict)) or id(value) in ancestors or len(ancestors) >= MAX_JSON_DEPTH:
        return False
    ancestors.add(id(value))
    try:
        if isinstance(value, dict):
            return all(type(key) is str and _is_plain(item, ancestors) for key, item in value.items())
        return all(_is_plain(item, ancestors) for item in value)
    finally:
        ancestors.discard(id(value))


def _reject_constant(name: str) -> object:
    raise ValueError(f"canonical JSON rejects the constant {name}")


def encode_canonical(value: object) -> bytes:
    """Encode a JSON-native value as canonical bytes, or raise ValueError."""
    if not _is_plain(value, set()):
        _check_value(value, "$")  # raises, naming where the value goes wrong
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"canonical JSON text must be valid Unicode (no lone surrogates): {exc}") from exc


def canonical_sha256(value: object) -> str:
    """Hex SHA-256 of `value`'s canonical bytes: the one way a document's digest (a key, a fingerprint) is made."""
    return hashlib.sha256(encode_canonical(value)).hexdigest()


def canonical_sha256_trusted(value: JsonValue) -> str:
    """`canonical_sha256` of a value this package built from validated, typed fields (`encode_canonical_trusted`)."""
    return hashlib.sha256(_encode_decoded(value)).hexdigest()


def _encode_decoded(value: JsonValue) -> bytes:
    """Canonical bytes of a value that `decode_json` produced (already JSON-native, so unchecked)."""
    try:
        text = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
        return text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"canonical JSON text must be valid Unicode (no lone surrogates): {exc}") from exc
    except RecursionError:
        raise ValueError("canonical JSON value is nested too deeply to encode") from None


def encode_canonical_trusted(value: JsonValue) -> bytes:
    """Canonical bytes of a value this package built itself from validated, typed fields (no type walk).

    The same bytes as `encode_canonical` for any value that one accepts; only for hot paths
    whose input cannot hold anything else.
    """
    return _encode_decoded(value)


def is_canonical(data: bytes, value: JsonValue) -> bool:
    """Whether `data`, which decoded to `value`, is already in canonical form."""
    return _encode_decoded(value) == data


def _check_input(data: object, max_bytes: int) -> None:
    if not isinstance(data, (bytes, bytearray)):
        raise ValueError(f"JSON input must be bytes, got {type(data).__name__}")
    if len(data) > max_bytes:
        raise ValueError(f"JSON input is {len(data)} bytes; the limit is {max_bytes}")


def decode_canonical_json(data: bytes, *, max_bytes: int = MAX_JSON_BYTES) -> JsonValue:
    """Parse bytes that must be canonical JSON, or raise ValueError (what `decode_json` then `is_canonical` decide).

    The bytes must equal their value's canonical encoding, which a document with a duplicate key can
    never do (the parsed value keeps one of them, and re-encodes shorter), so the parser runs without
    its per-object duplicate hook; on refusal the strict parser says what exactly is wrong. Depth is
    bounded by the parser's recursion guard only, as `decode_json(max_depth=None)`.
    """
    _check_input(data, max_bytes)
    try:
        value: JsonValue = json.loads(
            bytes(data).decode("utf-8"), parse_constant=_reject_constant, parse_float=_finite_float
        )
        canonical = _encode_decoded(value) == data
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError, ValueError):
        canonical = False
    if not canonical:
        decode_json(data, max_bytes=max_bytes, max_depth=None)  # raises, naming the fault, when there is one
        raise ValueError("the bytes are not canonical JSON")
    return value


def _nesting_exceeds(value: JsonValue, limit: int) -> bool:
    """Whether a decoded value nests more than `limit` containers deep (iterative, one level at a time)."""
    level: list[JsonValue] = [value] if isinstance(value, (list, dict)) else []
    depth = 0
    while level:
        depth += 1
        if depth > limit:
            return True
        inner: list[JsonValue] = []
        for container in level:
            items = container.values() if isinstance(container, dict) else container
            inner.extend(item for item in items if isinstance(item, (list, dict)))  # type: ignore[union-attr]
        level = inner
    return False


def _finite_float(text: str) -> float:
    number = float(text)
    if not math.isfinite(number):
        raise ValueError(f"JSON number {text[:40]!r} is out of range for a finite float")
    return number


def _no_float(text: str) -> float:
    raise ValueError(f"JSON number {text[:40]!r} is not an integer, and this document holds only integers")


def _no_duplicates(pairs: list[tuple[str, object]]) -> dict[str, object]:
    result: dict[str, object] = {}
    for key, item in pairs:
        if key in result:
            raise ValueError(f"duplicate JSON key {key[:200]!r}")
        result[key] = item
    return result


def decode_json(
    data: bytes, *, max_bytes: int = MAX_JSON_BYTES, max_depth: int | None = MAX_JSON_DEPTH, floats: bool = True
) -> JsonValue:
    """Parse JSON bytes strictly (no NaN, Infinity or out-of-range floats, no duplicate keys), or raise ValueError.

    Input is bounded by `max_bytes` and nesting by `max_depth`. A caller that checks the
    shape of every field itself (the manifest) may pass `max_depth=None` to skip the
    depth walk; extreme nesting still fails, as the parser's recursion guard, with ValueError.
    `floats=False` rejects every non-integer number (for documents that hold none).
    """
    _check_input(data, max_bytes)
    try:
        text = bytes(data).decode("utf-8")
        value: JsonValue = json.loads(
            text,
            parse_constant=_reject_constant,
            parse_float=_finite_float if floats else _no_float,
            object_pairs_hook=_no_duplicates,
        )
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"not valid UTF-8 JSON: {exc}") from exc
    except RecursionError:
        raise ValueError("JSON input is nested too deeply") from None
    # Counting brackets is cheap, and fewer of them than the limit cannot nest deeper than it.
    if (
        max_depth is not None
        and data.count(b"[") + data.count(b"{") > max_depth
        and _nesting_exceeds(value, max_depth)
    ):
        raise ValueError(f"JSON input nests deeper than {max_depth} levels")
    return value


@dataclass(frozen=True, slots=True)
class CanonicalJson:
    """Immutable canonical JSON bytes; construction from non-canonical bytes fails."""

    data: bytes

    def __post_init__(self) -> None:
        if type(self.data) is not bytes:
            raise ValueError("CanonicalJson.data must be bytes; use CanonicalJson.from_value for values")
        value = decode_json(self.data)
        if _encode_decoded(value) != self.data:
            raise ValueError(
                "bytes are not canonical JSON (sorted keys, compact separators, UTF-8); "
                "build it with CanonicalJson.from_value"
            )

    @classmethod
    def from_value(cls, value: object) -> CanonicalJson:
        """Snapshot a JSON-native value; later changes to `value` do not affect the result."""
        snapshot = object.__new__(cls)
        # encode_canonical's output is canonical by construction: skip re-checking it.
        object.__setattr__(snapshot, "data", encode_canonical(value))
        return snapshot

    @classmethod
    def empty(cls) -> CanonicalJson:
        """The empty object `{}`, the default for metadata fields."""
        return _EMPTY

    def to_value(self) -> JsonValue:
        """A fresh, independent copy of the value."""
        # The bytes were checked when this instance was made; a value built in memory may exceed the input limit.
        return decode_json(self.data, max_bytes=max(len(self.data), MAX_JSON_BYTES))

    @property
    def encoded(self) -> bytes:
        """The canonical bytes (the name vLLM-Omni's reference uses for `data`)."""
        return self.data

    @property
    def sha256(self) -> str:
        """Hex SHA-256 of the canonical bytes."""
        return hashlib.sha256(self.data).hexdigest()

    def __repr__(self) -> str:
        return f"CanonicalJson({self.data.decode('utf-8')!r})"


_EMPTY = CanonicalJson(b"{}")

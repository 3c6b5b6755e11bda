"""Small helpers the tools share.

`remove_tree` is the store's own (it makes read-only published directories writable first), not a copy.
"""

from __future__ import annotations

from typing import TypeAlias

# The store's file helper; the one name the tools take from a private module until the store exports it.
from host_weight_runtime.filesystem import remove_tree

__all__ = ["JsonValue", "remove_tree"]

# The shape of a value `json.dumps` writes and `json.loads` reads back.
JsonValue: TypeAlias = bool | int | float | str | list["JsonValue"] | dict[str, "JsonValue"] | None

"""Small helpers the tools share.

`remove_tree` is the store's own (it makes read-only published directories writable first), not a copy.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TypeAlias

# The store's file helper; the one name the tools take from a private module until the store exports it.
from host_weight_runtime.filesystem import remove_tree

__all__ = ["REPO_ROOT", "TOOLS_SOURCE", "JsonValue", "pythonpath_with_tools", "remove_tree"]

# This package's source folder (tools/src) and the checkout around it (whose src/ holds the runtime).
TOOLS_SOURCE = Path(__file__).resolve().parents[1]
REPO_ROOT = TOOLS_SOURCE.parents[1]


def pythonpath_with_tools(src: str) -> str:
    """PYTHONPATH for a child that takes the runtime from the tree `src` and these tools (a compared tree has none)."""
    return os.pathsep.join([src, str(TOOLS_SOURCE)])

# The shape of a value `json.dumps` writes and `json.loads` reads back.
JsonValue: TypeAlias = bool | int | float | str | list["JsonValue"] | dict[str, "JsonValue"] | None

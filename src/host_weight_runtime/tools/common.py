"""Small helpers the tools share, so none of them reaches for the product's private ones."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import TypeAlias

__all__ = ["JsonValue", "remove_tree"]

# The shape of a value `json.dumps` writes and `json.loads` reads back.
JsonValue: TypeAlias = bool | int | float | str | list["JsonValue"] | dict[str, "JsonValue"] | None


def remove_tree(path: Path) -> None:
    """Remove a file or directory tree if present; published directories are read-only, so each is made writable."""
    if not os.path.lexists(path):
        return
    if path.is_symlink() or not path.is_dir():
        path.unlink()
        return
    for directory, _subdirs, _files in os.walk(path):
        os.chmod(directory, 0o700)
    shutil.rmtree(path)

"""The reference's local filesystem store: this runtime's store under the reference's constructor."""

from __future__ import annotations

from .store import FilesystemHostWeightStore, detect_filesystem_type, detect_storage_class

__all__ = ["FilesystemHostWeightStore", "detect_filesystem_type", "detect_storage_class"]

"""Manifests: this runtime's own records (its on-disk format, not the reference's)."""

from __future__ import annotations

from ...manifest import FileManifestEntry, PublicationMarker, TensorManifestEntry, WeightManifest
from ...tensors import TensorKind

__all__ = [
    "FileManifestEntry",
    "ManifestValidationError",
    "PublicationMarker",
    "TensorKind",
    "TensorManifestEntry",
    "WeightManifest",
]

ManifestValidationError = ValueError
"""This runtime rejects a bad manifest with ValueError (the reference's error is a ValueError subclass)."""

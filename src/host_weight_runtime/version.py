"""The package version, in a contract of its own so that any room can name it without the front door."""

__all__ = ["__version__"]

__version__ = "0.1.0"
"""Kept equal to `version` in pyproject.toml."""

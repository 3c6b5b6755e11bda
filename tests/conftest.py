"""Test-wide settings: Hypothesis keeps no example database, so tests never write into the checkout."""

from __future__ import annotations

from hypothesis import settings

settings.register_profile("hwr", database=None)
settings.load_profile("hwr")

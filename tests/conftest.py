"""Test-wide settings: Hypothesis keeps no example database, so tests never write into the checkout.

The background full verification (HWR_BACKGROUND_VERIFY, default `once`) is an asynchronous actor
that may deny a corrupted artifact at any moment after its first lease; the tests that pin down what
each validation level does on its own (S07-S10) would race with it. So the suite runs with it off
(spawned children inherit this), and `tests/test_background_verify.py` and the soak test switch it on.
"""

from __future__ import annotations

import os

from hypothesis import settings

os.environ["HWR_BACKGROUND_VERIFY"] = "off"

settings.register_profile("hwr", database=None)
settings.load_profile("hwr")

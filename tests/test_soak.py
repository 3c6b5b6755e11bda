"""The soak (`make soak`) runs in `make test` too, for a handful of steps: every kind of action, no violation.

Real worker processes, real SIGKILLs (some paused at a named build seam), real corruption of published
files, cleanup, gc and LRU eviction; the invariant checker runs after every step (S16, S08, S02).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hwr_tools.soak import ACTIONS, SoakOptions, main, run_soak


def test_a_short_soak_does_every_action_and_finds_no_violation(tmp_path: Path) -> None:
    """S16, S08, S02: kills mid-build leave nothing visible; every corruption the soak injects is detected
    before a FULL_CHECKSUM lease could serve it; cleanup and gc leave no dead builder's leftovers; every
    FULL_CHECKSUM lease is bit-exact; no worker dies of anything but the soak's SIGKILLs."""
    options = SoakOptions(
        seconds=600.0, workers=2, seed=20260, synthetic_models=3, diffusers_models=0, steps=len(ACTIONS) + 4
    )
    summary = run_soak(options)
    assert summary.violations == []
    assert set(summary.actions) == set(ACTIONS)
    assert summary.kills >= 2 and summary.kills_mid_build >= 1
    assert summary.corruptions_injected >= 1
    assert summary.corruptions_detected == summary.corruptions_injected
    assert summary.resolves >= 2 and summary.cleanups >= 1 and summary.gcs >= 1 and summary.evictions >= 1
    assert summary.junk_planted >= 1
    assert summary.to_dict()["invariant_violations"] == 0


def test_soak_options_are_checked_and_the_cli_prints_json(capsys: pytest.CaptureFixture[str]) -> None:
    """R10: a bad duration or worker count is a ValueError that names the setting; --json prints the summary."""
    with pytest.raises(ValueError, match="SOAK_SECONDS"):
        SoakOptions(seconds=0)
    with pytest.raises(ValueError, match="SOAK_WORKERS"):
        SoakOptions(workers=0)
    status = main(
        [
            "--steps",
            "1",
            "--workers",
            "1",
            "--synthetic-models",
            "1",
            "--diffusers-models",
            "0",
            "--seed",
            "7",
            "--json",
        ]
    )
    assert status == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["seed"] == 7 and summary["steps"] == 1 and summary["invariant_violations"] == 0

"""The warm goals' bound is the fastest bare mapping of the same bytes on the same tmpfs, each bound reported."""

from __future__ import annotations

from typing import Any

import pytest

from hwr_tools.bench.goals import WARM_VS_VIEWS_TARGET
from hwr_tools.bench.goals import goals as goal_table
from hwr_tools.bench.row_names import (
    VIEWS_HUGE,
    VIEWS_POPULATE_SHM,
    VIEWS_SHM,
    VIEWS_THREAD_SHM,
    WARM_HUGE,
    WARM_SHM,
)


def _hot(ready_ms: float) -> dict[str, Any]:
    return {"hot": {"time_to_ready_ms": {"median": ready_ms, "min": ready_ms, "max": ready_ms}}}


def _data(rows: dict[str, float]) -> dict[str, Any]:
    return {
        "rows": {name: _hot(value) for name, value in rows.items()},
        "model": {"artifact_bytes": 1},
        "throughput": {"publication_vs_raw": None, "full_checksum_vs_sha256": None},
    }


def test_warm_is_judged_against_the_fastest_bare_population() -> None:
    """Page by page, MAP_POPULATE and a prefault thread are each reported; the goal takes the fastest."""
    goals = {
        goal["goal"]: goal
        for goal in goal_table(
            _data({WARM_SHM: 40.0, VIEWS_SHM: 45.0, VIEWS_POPULATE_SHM: 30.0, VIEWS_THREAD_SHM: 34.0, WARM_HUGE: 20.0})
        )
    }
    judged = goals["warm / bare safetensors mmap views (same tmpfs)"]
    assert judged["value"] == pytest.approx(40.0 / 30.0) and judged["target"] == WARM_VS_VIEWS_TARGET
    assert judged["met"] is False  # 1.33 > 1.25, although warm beats the page-by-page views
    assert goals["warm / bare views, page by page (same tmpfs)"]["value"] == pytest.approx(40.0 / 45.0)
    assert goals["warm / bare views, MAP_POPULATE (same tmpfs)"]["value"] == pytest.approx(40.0 / 30.0)
    assert goals["warm / bare views, prefault thread (same tmpfs)"]["value"] == pytest.approx(40.0 / 34.0)
    assert goals["warm / bare views, prefault thread (same tmpfs)"]["met"] is None  # a bound, not a goal
    huge = goals["warm / bare safetensors mmap views (huge-page tmpfs)"]
    assert huge["value"] is None and huge["met"] is None  # no huge-page views measured: no verdict


def test_a_single_measured_bound_is_the_bound() -> None:
    """Where only the page-by-page views ran (an older result file), they are the bound."""
    goals = {goal["goal"]: goal for goal in goal_table(_data({WARM_HUGE: 24.0, VIEWS_HUGE: 20.0}))}
    judged = goals["warm / bare safetensors mmap views (huge-page tmpfs)"]
    assert judged["value"] == pytest.approx(1.2) and judged["met"] is True
    assert "warm / bare views, MAP_POPULATE (huge-page tmpfs)" not in goals

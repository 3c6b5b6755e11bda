"""`hwr bench` pipeline rows (P02, X01): a whole Flux pipeline measured several ways in fresh worker processes.

A benchmark, not a timed test: this runs the rows once on a small pipeline and checks what they
measured is what they claim (every served component a local hit in the warm rows, from the folder and
from the hub cache, every one canonical in the first workers' rows, the same bytes touched, PSS read
while held); the ratios are reported, never asserted. The report's shape is also checked on made-up
figures, without a process.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from hwr_tools.bench.pipeline_rows import (
    CANONICAL,
    FIRST_WORKER,
    HUB_CANONICAL,
    HUB_FIRST_WORKER,
    HUB_LIMIT,
    HUB_ROWS,
    HUB_WARM,
    LIMIT,
    MEMORY_ROWS,
    PIPELINE_ROWS,
    TRANSFORMER_ONLY,
    VIEWS,
    WARM,
    _report,
    measure_pipeline_rows,
    render,
)

WEIGHTED = {"text_encoder", "text_encoder_2", "transformer", "vae"}
RATIOS = {"warm / limit", "first worker / canonical", "hub warm / limit", "hub first worker / canonical"}


@pytest.mark.slow
def test_pipeline_rows_measure_every_component_and_report_every_goal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """P02/X01/S08: the node's first hit, untimed, verifies every publication in the background before any timed
    row (as on a real node, no later warm worker verifies again); the warm rows (folder and hub cache) get a
    LOCAL_HIT for every weighted component, the first workers a canonical load of each on their empty domains,
    transformer-only the transformer alone; canonical, warm and first workers hold one copy of every weighted
    component and the limit rows touch the artifacts' bytes; every goal carries a ratio; nothing is left behind
    (with the checkpoint evicted from the page cache before every row that reads it, `--cold-cache`)."""
    monkeypatch.setenv("HWR_BACKGROUND_VERIFY", "once")  # the workers inherit it, as on a node with the default
    report = measure_pipeline_rows(transformer_mib=16, runs=1, workers=1, workdir=tmp_path, cold_cache=True)
    assert report["first_hit_verifications"] == ["verified"] * len(WEIGHTED)
    rows, memory = report["rows"], report["memory"]
    assert isinstance(rows, dict) and isinstance(memory, dict)
    assert set(rows) == set(PIPELINE_ROWS + HUB_ROWS) and set(memory) == set(MEMORY_ROWS)
    for row in (WARM, HUB_WARM):
        assert rows[row]["outcomes"] == dict.fromkeys(WEIGHTED, "local_hit")
    for row in (FIRST_WORKER, HUB_FIRST_WORKER):
        assert rows[row]["outcomes"] == dict.fromkeys(WEIGHTED, "canonical_fallback")
    assert rows[TRANSFORMER_ONLY]["outcomes"] == {"transformer": "local_hit"}
    assert all(rows[row]["outcomes"] == {} for row in (CANONICAL, HUB_CANONICAL, VIEWS, LIMIT, HUB_LIMIT))
    one_copy = report["one_copy_bytes"]
    assert isinstance(one_copy, int) and one_copy > 16 * 2**20 // 2  # the BF16 transformer alone is 8 MiB
    for row in (CANONICAL, HUB_CANONICAL, WARM, HUB_WARM, FIRST_WORKER, HUB_FIRST_WORKER):
        assert rows[row]["weight_bytes"] == one_copy
    artifact_bytes = report["artifact_bytes"]
    assert isinstance(artifact_bytes, int) and 0.9 * one_copy <= artifact_bytes <= 1.1 * one_copy
    assert rows[LIMIT]["weight_bytes"] == rows[HUB_LIMIT]["weight_bytes"] == rows[VIEWS]["weight_bytes"]
    for row in MEMORY_ROWS:
        assert memory[row]["pss_sum_bytes"] > memory[row]["weights_pss_sum_bytes"] > 0
    assert set(report["ratios"]) == RATIOS
    goals = report["goals"]
    assert isinstance(goals, list) and len(goals) == len(RATIOS) + 2
    assert all(isinstance(goal, dict) and isinstance(goal["ratio"], float) for goal in goals)
    text = render(report)
    assert all(row in text for row in PIPELINE_ROWS + HUB_ROWS) and "one copy of every weighted component" in text
    assert list(tmp_path.iterdir()) == []


def _row(median: float, outcomes: dict[str, str] | None = None) -> dict[str, Any]:
    times = {"median": median, "min": median, "max": median, "mean": median, "n": 1}
    return {"time_to_ready_ms": times, "outcomes": outcomes or {}, "weight_bytes": 2**20}


def test_the_report_gives_warm_over_limit_and_first_worker_over_canonical_for_each_source() -> None:
    """X01: warm / limit and first worker / canonical, each against its own source's row (a hub row against the
    hub rows), each with its goal; without the hub rows only the folder's; PSS only for the rows measured so."""
    medians = {CANONICAL: 400.0, TRANSFORMER_ONLY: 300.0, WARM: 120.0, LIMIT: 100.0, VIEWS: 50.0}
    medians |= {FIRST_WORKER: 440.0, HUB_CANONICAL: 500.0, HUB_WARM: 150.0, HUB_LIMIT: 100.0, HUB_FIRST_WORKER: 500.0}
    memory = {row: {"pss_sum_bytes": 3.0 * 2**20, "weights_pss_sum_bytes": 2.0 * 2**20} for row in MEMORY_ROWS}
    facts: dict[str, Any] = {"one_copy": 2**20, "workers": 1, "checkpoint_bytes": {}, "artifact_bytes": 2**20}
    report = _report(solo={row: _row(m) for row, m in medians.items()}, memory=memory, transformer_mib=16, **facts)
    assert report["ratios"] == {
        "warm / limit": 1.2,
        "first worker / canonical": 1.1,
        "hub warm / limit": 1.5,
        "hub first worker / canonical": 1.0,
    }
    goals = report["goals"]
    assert isinstance(goals, list)
    met = {goal["goal"]: goal["met"] for goal in goals if isinstance(goal, dict)}
    assert sum(met.values()) == 3 and len(met) == 6  # hub warm (1.5x), views (2.4x), PSS (2.0x) are not met
    vs_canonical = report["vs_canonical"]
    assert isinstance(vs_canonical, dict) and vs_canonical[HUB_WARM] == 0.3 and vs_canonical[WARM] == 0.3
    text = render(report)
    assert f"| {LIMIT} | 100 | 0.25 | - | - | - |" in text and "NOT met" in text
    folder_only = _report(
        solo={row: _row(medians[row]) for row in PIPELINE_ROWS}, memory=memory, transformer_mib=16, **facts
    )
    assert set(folder_only["ratios"]) == {"warm / limit", "first worker / canonical"}

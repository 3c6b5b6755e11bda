"""`hwr bench` pipeline rows (P02): a whole Flux pipeline measured four ways in fresh worker processes.

A benchmark, not a timed test: this runs the rows once on a small pipeline and checks what they
measured is what they claim (every served component a local hit in the warm row, the same bytes
touched, PSS read while held); the ratios are reported, never asserted.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from hwr_tools.bench.pipeline_rows import (
    CANONICAL,
    PIPELINE_ROWS,
    TRANSFORMER_ONLY,
    VIEWS,
    WARM,
    measure_pipeline_rows,
    render,
)

WEIGHTED = {"text_encoder", "text_encoder_2", "transformer", "vae"}


@pytest.mark.slow
def test_pipeline_rows_measure_every_component_and_report_both_goals(tmp_path: Path) -> None:
    """P02: the warm row gets a LOCAL_HIT for every weighted component, transformer-only for the transformer alone;
    canonical holds one copy of every weighted component; both goals carry a ratio; nothing is left behind."""
    report = measure_pipeline_rows(transformer_mib=16, runs=1, workers=1, workdir=tmp_path)
    rows, memory = report["rows"], report["memory"]
    assert isinstance(rows, dict) and isinstance(memory, dict)
    assert set(rows) == set(memory) == set(PIPELINE_ROWS)
    assert rows[WARM]["outcomes"] == dict.fromkeys(WEIGHTED, "local_hit")
    assert rows[TRANSFORMER_ONLY]["outcomes"] == {"transformer": "local_hit"}
    assert rows[CANONICAL]["outcomes"] == {} and rows[VIEWS]["outcomes"] == {}
    one_copy = report["one_copy_bytes"]
    assert isinstance(one_copy, int) and one_copy > 16 * 2**20 // 2  # the BF16 transformer alone is 8 MiB
    assert rows[WARM]["weight_bytes"] == rows[CANONICAL]["weight_bytes"] == one_copy
    artifact_bytes = report["artifact_bytes"]
    assert isinstance(artifact_bytes, int) and 0.9 * one_copy <= artifact_bytes <= 1.1 * one_copy
    for row in PIPELINE_ROWS:
        assert memory[row]["pss_sum_bytes"] > memory[row]["weights_pss_sum_bytes"] > 0
    goals = report["goals"]
    assert isinstance(goals, list) and len(goals) == 2
    assert all(isinstance(goal, dict) and isinstance(goal["ratio"], float) for goal in goals)
    text = render(report)
    assert all(row in text for row in PIPELINE_ROWS) and "one copy of every weighted component" in text
    assert list(tmp_path.iterdir()) == []

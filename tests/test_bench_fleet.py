"""The fleet rows of `hwr bench` (E12): push vs a plain upload and node B's time to ready vs a plain copy, measured
side by side on real file:// objects, and their goals reported in the right direction. Nothing here is timed.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from host_weight_runtime.remote import push_artifact
from hwr_tools.bench.fleet import measure_fleet
from hwr_tools.bench.goals import goals as goal_table
from hwr_tools.bench.row_names import REMOTE_FILE, REMOTE_S3

from .remote_support import Node


def test_measure_fleet_times_both_sides_and_leaves_nothing(tmp_path: Path) -> None:
    """E12: each pair has as many samples as runs, ratios are positive, and the remote and work folder are left
    as they were (only the artifact pushed before the measurement)."""
    node_a = Node(tmp_path / "node-a")
    identity = node_a.build()
    remote = tmp_path / "remote"
    url = f"file://{remote}"
    push_artifact(node_a.store, identity, url)
    before = sorted(path.name for path in remote.iterdir())
    workdir = tmp_path / "work"
    workdir.mkdir()
    measured = measure_fleet(node_a.store, identity, url, {}, workdir=workdir, runs=2)
    for pair in (("push_s", "plain_upload_s"), ("node_b_ready_s", "plain_copy_s")):
        for side in pair:
            assert len(measured[side]["samples"]) == 2 and measured[side]["median"] > 0
    assert measured["push_vs_plain_upload"] > 0 and measured["node_b_vs_plain_copy"] > 0
    assert sorted(path.name for path in remote.iterdir()) == before
    assert list(workdir.iterdir()) == []


def test_fleet_goals_point_the_right_way() -> None:
    """E12: push must reach 0.8x a plain upload (higher is better); node B must stay within 1.3x the plain copy
    (lower is better); a remote without fleet figures reports the goals as not measured."""
    base: dict[str, Any] = {
        "rows": {},
        "model": {"artifact_bytes": 1},
        "throughput": {"publication_vs_raw": 0.9, "full_checksum_vs_sha256": 2.5},
        "remote": {
            "throughput": {
                REMOTE_FILE: {
                    "import_vs_plain_copy": 0.5,
                    "fleet": {"push_vs_plain_upload": 0.9, "node_b_vs_plain_copy": 1.2},
                },
                REMOTE_S3: {
                    "import_vs_plain_copy": 0.9,
                    "fleet": {"push_vs_plain_upload": 0.7, "node_b_vs_plain_copy": 1.4},
                },
            }
        },
    }
    goals = {goal["goal"]: goal for goal in goal_table(copy.deepcopy(base))}
    assert goals["hwr push throughput / plain fsspec upload (file://)"]["met"] is True
    assert goals["hwr push throughput / plain fsspec upload (moto S3)"]["met"] is False
    assert goals["node B time to ready / plain fsspec copy (file://)"]["met"] is True
    assert goals["node B time to ready / plain fsspec copy (moto S3)"]["met"] is False
    del base["remote"]["throughput"][REMOTE_S3]["fleet"]
    goals = {goal["goal"]: goal for goal in goal_table(base)}
    assert goals["node B time to ready / plain fsspec copy (moto S3)"]["met"] is None

"""`hwr demo` end to end, and the README's usage example run as written."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

RUN_TIMEOUT_S = 300.0
README = Path(__file__).resolve().parents[1] / "README.md"
EXAMPLE_ROOT = 'Path("/dev/shm/hwr-example")'


def _environment() -> dict[str, str]:
    return {name: value for name, value in os.environ.items() if not name.startswith("HWR_")}


@pytest.mark.slow
def test_demo_publishes_once_and_workers_share_the_pages() -> None:
    """A small demo: the publisher row is local_production, every worker row local_hit, each with positive
    RSS and PSS read while the leases were held; the temporary domain is gone afterwards."""
    result = subprocess.run(
        [sys.executable, "-m", "host_weight_runtime.cli", "demo", "--synthetic", "--size-mib", "16", "--json"],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
        env=_environment(),
        check=False,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    rows = report["rows"]
    assert [row["process"] for row in rows] == ["publisher", "worker 1", "worker 2", "worker 3"]
    assert rows[0]["outcome"] == "local_production" and rows[0]["lease_source"] == "built"
    assert all(row["outcome"] == "local_hit" and row["lease_source"] == "local_hit" for row in rows[1:])
    for row in rows:
        assert row["failure"] is None
        assert row["rss_bytes"] > 0 and row["pss_bytes"] > 0
        assert row["artifact_rss_bytes"] > 0 and row["artifact_pss_bytes"] > 0
        assert row["touched_pages"] > 0 and row["time_to_ready_ms"] >= 0
    assert report["artifact_bytes"] >= 16 * 2**20 - 2**20
    assert report["ok"] is True
    assert not Path(report["root"]).exists()


def test_demo_rejects_a_bad_size() -> None:
    """--size-mib 0 is a usage error (exit 2) before any process is started."""
    result = subprocess.run(
        [sys.executable, "-m", "host_weight_runtime.cli", "demo", "--size-mib", "0"],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
        env=_environment(),
        check=False,
    )
    assert result.returncode == 2
    assert "--size-mib" in result.stderr


def _readme_example() -> str:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), flags=re.DOTALL)
    chosen = [block for block in blocks if EXAMPLE_ROOT in block]
    assert chosen, "README.md has no ```python block with the lower-level example"
    return str(chosen[0])


def test_readme_example_runs_as_written(tmp_path: Path) -> None:
    """The README's usage example, pointed at a domain under tmp_path: the first process falls back and
    publishes after load; a second, fresh process gets a local hit on the published tensors."""
    source = _readme_example()
    assert EXAMPLE_ROOT in source
    script = tmp_path / "example.py"
    script.write_text(source.replace(EXAMPLE_ROOT, f"Path({str(tmp_path / 'domain')!r})"), encoding="utf-8")
    outputs = []
    for _ in range(2):
        run = subprocess.run(
            [sys.executable, str(script)],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=RUN_TIMEOUT_S,
            env=_environment(),
            cwd=tmp_path,
            check=False,
        )
        assert run.returncode == 0, run.stderr
        outputs.append(run.stdout.strip())
    assert outputs[0] == "canonical_fallback -> published"
    assert outputs[1].startswith("local_hit")

"""`hwr bench --plots DIR --from-json FILE`: the charts drawn from a results JSON hold one bar or line per row."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any
from xml.etree import ElementTree

import pytest

from hwr_tools.bench.plots import MEMORY, TIME_TO_READY_COLD, TIME_TO_READY_HOT, series_id

MIB = 1 << 20
SVG = "{http://www.w3.org/2000/svg}"


def _stats(median: float) -> dict[str, Any]:
    return {"median": median, "min": median * 0.9, "max": median * 1.2, "samples": [median]}


def _row(
    ready_ms: float, *, baseline: str = "canonical", cold_ms: float | None = None, weights_mib: float | None = None
) -> dict[str, Any]:
    row: dict[str, Any] = {
        "description": "",
        "cold_start": False,
        "baseline": baseline,
        "hot": {"time_to_ready_ms": _stats(ready_ms)},
    }
    if cold_ms is not None:
        row["cold"] = {"time_to_ready_ms": _stats(cold_ms)}
    if weights_mib is not None:
        row["memory_group"] = {
            "pss_sum_bytes": _stats(2 * weights_mib * MIB),
            "weights_pss_sum_bytes": _stats(weights_mib * MIB),
        }
    return row


def _results() -> dict[str, Any]:
    """A small result in the shape `hwr bench` writes: 5 rows hot, 2 of them cold too, 3 memory groups of 4."""
    return {
        "options": {"workers": 4},
        "model": {"artifact_bytes": 100 * MIB},
        "rows": {
            "canonical": _row(400.0, cold_ms=2000.0, weights_mib=400.0),
            "hwr cold: canonical + publish": _row(1900.0),
            "canonical (hub cache)": _row(380.0, baseline="canonical (hub cache)"),
            "hwr warm: /dev/shm": _row(70.0, cold_ms=75.0, weights_mib=101.0),
            "tensorizer": _row(470.0, weights_mib=401.0),
        },
    }


def _ids(path: Path) -> list[str]:
    tree = ElementTree.parse(path)
    return [element.get("id", "") for element in tree.iter(f"{SVG}g")]


def _draw(tmp_path: Path, data: dict[str, Any]) -> subprocess.CompletedProcess[str]:
    source = tmp_path / "results.json"
    source.write_text(json.dumps(data), encoding="utf-8")
    out = tmp_path / "plots"
    out.mkdir(exist_ok=True)
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "host_weight_runtime.cli",
            "bench",
            "--plots",
            str(out),
            "--from-json",
            str(source),
            "--json",
        ],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_plots_from_json_draw_a_bar_per_row_and_a_line_per_memory_group(tmp_path: Path) -> None:
    """Time to ready: one bar per row measured hot (5), one per row measured cold (2); memory: one line per
    concurrent group (3); every file is SVG and the command lists what it wrote."""
    completed = _draw(tmp_path, _results())
    assert completed.returncode == 0, completed.stderr
    out = tmp_path / "plots"
    written = json.loads(completed.stdout)["plots"]
    assert [Path(path).name for path in written] == [TIME_TO_READY_HOT, TIME_TO_READY_COLD, MEMORY]
    hot = [i for i in _ids(out / TIME_TO_READY_HOT) if i.startswith("ttr-hot-")]
    assert sorted(hot) == sorted(series_id("ttr-hot", name) for name in _results()["rows"])
    cold = [i for i in _ids(out / TIME_TO_READY_COLD) if i.startswith("ttr-cold-")]
    assert sorted(cold) == [series_id("ttr-cold", "canonical"), series_id("ttr-cold", "hwr warm: /dev/shm")]
    memory = [i for i in _ids(out / MEMORY) if i.startswith("memory-")]
    assert sorted(memory) == sorted(series_id("memory", n) for n in ("canonical", "hwr warm: /dev/shm", "tensorizer"))


def test_memory_lines_grow_per_worker_only_for_private_copies(tmp_path: Path) -> None:
    """Canonical's 4 workers held 4 copies: its line rises from one copy at 1 worker; the warm row held one
    copy: its line stays flat (read from the path the SVG draws)."""
    from hwr_tools.bench.plots import draw_charts

    (tmp_path / "out").mkdir()
    draw_charts(_results(), tmp_path / "out")
    tree = ElementTree.parse(tmp_path / "out" / MEMORY)
    heights = {}
    for group in tree.iter(f"{SVG}g"):
        if group.get("id") in (series_id("memory", "canonical"), series_id("memory", "hwr warm: /dev/shm")):
            path = next(group.iter(f"{SVG}path")).get("d", "")
            ys = [float(token.split()[-1]) for token in path.replace("M", "L").split("L") if token.strip()]
            heights[group.get("id")] = ys
    canonical, warm = heights[series_id("memory", "canonical")], heights[series_id("memory", "hwr warm: /dev/shm")]
    assert len(canonical) == len(warm) == 4
    assert canonical[0] > canonical[-1]  # SVG y grows downwards: the line rises
    assert max(warm) - min(warm) < 1e-6


def test_plots_of_a_serve_result_draw_one_line_per_loader(tmp_path: Path) -> None:
    """A `hwr bench --serve` result: node PSS per worker count, canonical next to load_pipeline."""
    rows = [
        {"loader": loader, "workers": workers, "node_pss_bytes": workers * 400 * MIB}
        for workers in (1, 2, 4)
        for loader in ("canonical", "load_pipeline")
    ]
    completed = _draw(tmp_path, {"rows": rows})
    assert completed.returncode == 0, completed.stderr
    ids = [i for i in _ids(tmp_path / "plots" / MEMORY) if i.startswith("memory-")]
    assert sorted(ids) == ["memory-canonical", "memory-load-pipeline"]


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--from-json", "results.json"], "--plots"),
        (["--plots", "missing", "--from-json", "results.json"], "--plots"),
        (["--plots", ".", "--from-json", "missing.json"], "--from-json"),
        (["--plots", ".", "--from-json", "garbage.json"], "JSON"),
        (["--plots", ".", "--from-json", "empty.json"], "rows"),
    ],
)
def test_plot_options_are_checked_before_anything_runs(tmp_path: Path, arguments: list[str], message: str) -> None:
    """A missing folder or file, no --plots, or a file that is no results JSON: exit 2, saying what to fix."""
    (tmp_path / "results.json").write_text(json.dumps(_results()), encoding="utf-8")
    (tmp_path / "garbage.json").write_text("{not json", encoding="utf-8")
    (tmp_path / "empty.json").write_text("{}", encoding="utf-8")
    completed = subprocess.run(
        [sys.executable, "-m", "host_weight_runtime.cli", "bench", *arguments],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=tmp_path,
    )
    assert completed.returncode == 2, completed.stderr
    assert message in completed.stderr


RESULTS = sorted(
    path
    for path in (Path(__file__).resolve().parents[1] / "benchmarks" / "results").glob("*.json")
    if isinstance(json.loads(path.read_text(encoding="utf-8")).get("rows"), dict)
)


@pytest.mark.parametrize("results", RESULTS, ids=[path.name for path in RESULTS])
def test_plots_of_every_committed_result(tmp_path: Path, results: Path) -> None:
    """Every full results JSON in benchmarks/results draws: one bar per row measured hot, and one memory line
    per row measured as a concurrent group, so the charts follow the shape `hwr bench` really writes."""
    from hwr_tools.bench.plots import draw_charts

    data = json.loads(results.read_text(encoding="utf-8"))
    written = draw_charts(data, tmp_path)
    assert written[0].name == TIME_TO_READY_HOT and written[-1].name == MEMORY
    rows = data["rows"]
    hot = [i for i in _ids(written[0]) if i.startswith("ttr-hot-")]
    assert sorted(hot) == sorted(series_id("ttr-hot", name) for name, entry in rows.items() if entry.get("hot"))
    memory = [i for i in _ids(written[-1]) if i.startswith("memory-")]
    assert sorted(memory) == sorted(
        series_id("memory", name) for name, entry in rows.items() if "memory_group" in entry
    )

"""`hwr demo` (P01, P02): a whole Flux pipeline loaded canonical, cold and warm in fresh processes, with parity checks."""

from __future__ import annotations

import functools
import json
import tempfile
from pathlib import Path
from typing import Any

import accelerate  # noqa: F401  (`make test` installs it: a missing one fails the module, never skips it)
import diffusers  # noqa: F401
import pytest
from rich.console import Console

from host_weight_runtime import cli
from hwr_tools import demo_diffusers as flux_demo
from hwr_tools.demo_diffusers import FluxDemoReport, FluxDemoRow, report_table, summary_line
from hwr_tools.demo_store import DemoError

SIZE_MIB = "8"
WEIGHTED = ("text_encoder", "text_encoder_2", "transformer", "vae")


def _run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, dict[str, Any], str]:
    status = cli.main(argv)
    captured = capsys.readouterr()
    report: dict[str, Any] = json.loads(captured.out)
    return status, report, captured.err


@pytest.mark.slow
def test_demo_loads_canonical_cold_and_warm_with_bit_identical_outputs(capsys: pytest.CaptureFixture[str]) -> None:
    """P01/P02: canonical is plain DiffusionPipeline.from_pretrained, cold falls back and publishes every weighted
    component, both warm workers hit every one; every image equals the canonical reference, memory was read while
    loaded, and the pipeline folder and the tmpfs domain are gone afterwards."""
    status, report, _ = _run_cli(["demo", "--size-mib", SIZE_MIB, "--workers", "2", "--json"], capsys)

    assert status == 0
    assert report["ok"] is True and report["problems"] == []
    rows = {row["path"]: row for row in report["rows"]}
    assert list(rows) == ["canonical", "cold", "warm-1", "warm-2"]
    assert rows["canonical"]["outcome"] == "from_pretrained" and rows["canonical"]["publication"] is None
    assert rows["cold"]["outcome"] == "canonical_fallback" and rows["cold"]["load_path"] == "canonical"
    assert rows["cold"]["publication"] == "published" and rows["cold"]["publication_ms"] > 0
    for name in ("warm-1", "warm-2"):
        assert rows[name]["outcome"] == "local_hit" and rows[name]["load_path"] == "artifact"
        assert rows[name]["artifact_bytes"] == report["artifact_bytes"] > 0
        assert rows[name]["artifact_pss_bytes"] > 0
        assert rows[name]["components"] == dict.fromkeys(WEIGHTED, "local_hit")
    assert rows["cold"]["components"] == dict.fromkeys(WEIGHTED, "canonical_fallback")
    assert len({row["pid"] for row in rows.values()}) == 4
    touched = {row["touched_pages"] for row in rows.values()}
    assert len(touched) == 1 and touched.pop() > 0  # the same touch pass over the same tensors in every row
    for row in rows.values():
        assert row["parity"] is True and row["max_abs_diff"] == 0.0
        assert row["failure"] is None
        assert row["time_to_ready_ms"] > 0 and row["rss_bytes"] >= row["pss_bytes"] > 0
    assert report["checkpoint_bytes"] >= int(SIZE_MIB) * 2**20
    assert not Path(report["workdir"]).exists()
    assert not Path(report["domain"]).exists()


@pytest.mark.slow
def test_demo_fails_when_an_output_differs_from_the_reference(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A reference computed on other inputs: every parity check fails, the report says so and `hwr demo` exits 1
    with one line naming the rows, although every load went as expected."""
    other_seed = flux_demo.INPUT_SEED + 1
    monkeypatch.setattr(flux_demo, "run_demo", functools.partial(flux_demo.run_demo, reference_seed=other_seed))
    status, report, err = _run_cli(["demo", "--size-mib", SIZE_MIB, "--workers", "1", "--json"], capsys)

    assert status == 1
    assert report["ok"] is False
    rows = report["rows"]
    assert [row["outcome"] for row in rows] == ["from_pretrained", "canonical_fallback", "local_hit"]
    assert all(row["parity"] is False and row["max_abs_diff"] > 0 for row in rows)
    reason = "parity FAILED for canonical, cold, warm-1 (output differs from the canonical reference)"
    assert report["problems"] == [reason]
    assert err.strip().splitlines() == [f"the demo did not go as expected: {reason}"]
    assert not Path(report["workdir"]).exists() and not Path(report["domain"]).exists()


def test_demo_removes_its_folders_when_a_child_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    """A child that dies before reporting raises DemoError; the checkpoint folder and the domain are removed."""
    created: list[Path] = []
    real_mkdtemp = tempfile.mkdtemp

    def recording_mkdtemp(*args: Any, **kwargs: Any) -> str:
        path = str(real_mkdtemp(*args, **kwargs))
        created.append(Path(path))
        return path

    def dying_child(*_args: object) -> list[str]:
        return ["/bin/sh", "-c", "exit 3"]

    monkeypatch.setattr(tempfile, "mkdtemp", recording_mkdtemp)
    monkeypatch.setattr(flux_demo, "_child_command", dying_child)
    monkeypatch.setattr(flux_demo, "save_proportional_flux_pipeline", lambda root, **_kwargs: root.mkdir())
    with pytest.raises(DemoError, match="canonical exited with status 3"):
        flux_demo.run_demo(size_mib=1, workers=1)
    assert len(created) == 2
    assert not any(path.exists() for path in created)


def _row(path: str, outcome: str, *, parity: bool = True, publication: str | None = None) -> FluxDemoRow:
    return FluxDemoRow(
        path=path,
        pid=1,
        outcome=outcome,
        load_path="artifact" if outcome == "local_hit" else "canonical",
        publication=publication,
        publication_ms=12.0 if publication else None,
        time_to_ready_ms=1000.0 if outcome != "local_hit" else 50.0,
        rss_bytes=500 * 2**20,
        pss_bytes=400 * 2**20,
        artifact_pss_bytes=50 * 2**20 if outcome == "local_hit" else 0,
        artifact_bytes=150 * 2**20 if outcome == "local_hit" else 0,
        touched_pages=10,
        parity=parity,
        max_abs_diff=0.0 if parity else 0.5,
    )


def _report(*rows: FluxDemoRow) -> FluxDemoReport:
    return FluxDemoReport(
        size_mib=320, checkpoint_bytes=320 * 2**20, build_ms=1.0, workdir="/w", domain="/d", rows=rows
    )


def test_rows_round_trip_and_malformed_rows_are_refused() -> None:
    """A row survives the JSON protocol unchanged; a non-boolean parity or a missing field is a DemoError."""
    row = _row("cold", "canonical_fallback", publication="published")
    assert FluxDemoRow.from_dict(json.loads(json.dumps(row.to_dict()))) == row
    with pytest.raises(DemoError):
        FluxDemoRow.from_dict({**row.to_dict(), "parity": "yes"})
    with pytest.raises(DemoError):
        FluxDemoRow.from_dict({key: value for key, value in row.to_dict().items() if key != "pss_bytes"})


def test_report_judges_outcomes_and_the_table_fits_80_columns() -> None:
    """An unpublished cold load or a warm miss is a problem; the table shows FAILED parity and fits a pipe."""
    good = _report(
        _row("canonical", "from_pretrained"),
        _row("cold", "canonical_fallback", publication="published"),
        _row("warm-1", "local_hit"),
        _row("warm-2", "local_hit", parity=False),
    )
    assert good.problems() == ["parity FAILED for warm-2 (output differs from the canonical reference)"]
    assert "parity: FAILED for warm-2" in summary_line(good)
    assert "warm time to ready 50 ms (mean of 2) vs canonical 1000 ms (20.0x faster)" in summary_line(good)
    console = Console(width=80, record=True, highlight=False)
    console.print(report_table(good))
    text = console.export_text()
    assert "FAILED" in text and "…" not in text
    assert max(len(line) for line in text.splitlines()) <= 80

    bad = _report(
        _row("canonical", "from_pretrained"),
        _row("cold", "canonical_fallback", publication="skipped"),
        _row("warm-1", "canonical_fallback"),
    )
    assert bad.problems() == [
        "cold got canonical_fallback / publication skipped, not canonical_fallback / published",
        "warm-1 got canonical_fallback, not local_hit",
    ]
    assert not bad.ok

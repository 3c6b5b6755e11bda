"""`hwr inspect` keeps a pipeline's component names apart at any width and says what its size column counts."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from host_weight_runtime import cli
from host_weight_runtime.cli.inspect import middle_cut
from hwr_tools.synthetic_hub import save_hub_snapshot
from hwr_tools.synthetic_pipelines import save_tiny_pipeline

from .test_cli_listing import _hwr

REPO_ID = "black-forest-labs/FLUX.1-dev-tiny-listing"
COMMIT = "89abcdef0123456789abcdef0123456789abcdef"
COMPONENTS = {"transformer", "text_encoder", "text_encoder_2", "vae"}


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A domain holding every served component of a tiny Flux pipeline from a long-named hub repo."""
    base = tmp_path_factory.mktemp("inspect-names")
    save_hub_snapshot(base / "hub", REPO_ID, save_tiny_pipeline(base / "flux", "flux", seed=2), revision=COMMIT)
    domain = base / "domain"
    with pytest.MonkeyPatch.context() as patch:
        for name in list(os.environ):
            if name.startswith("HWR_"):
                patch.delenv(name)
        patch.setenv("HF_HUB_OFFLINE", "1")
        status = cli.main(
            [
                "prewarm",
                REPO_ID,
                "--revision",
                COMMIT,
                "--cache-dir",
                str(base / "hub"),
                "--root",
                str(domain),
                "--json",
            ]
        )
    assert status == 0
    return domain


def _cells(stdout: str, column: str, following: str) -> list[str]:
    """The text of one column on every inventory row, sliced where the header places it."""
    lines = stdout.splitlines()
    header = next(line for line in lines if line.startswith("MODEL"))
    start, end = header.index(column), header.index(following)
    rows = [line for line in lines[lines.index(header) + 1 :] if line.strip() and "ready" in line]
    return [line[start:end].strip() for line in rows]


@pytest.mark.parametrize("columns", [60, 80, 100, 200])
def test_component_names_stay_distinct_at_any_width(root: Path, columns: int) -> None:
    """At 60, 80, 100 and 200 columns every component of one model shows a different name (never two
    `text_enc…`), cut, if at all, in the middle so both ends stay; the size column says it counts tensor bytes
    while verify and gc count bytes on disk."""
    result = _hwr("inspect", "--root", str(root), columns=columns)
    assert result.returncode == 0, result.stderr
    components = _cells(result.stdout, "COMPONENT", "REVISION")
    assert len(components) == len(COMPONENTS) == len(set(components)), result.stdout
    for shown in components:
        [name] = [name for name in COMPONENTS if middle_cut(name, len(shown)) == shown]
        assert shown == name or (shown[0] == name[0] and shown[-1] == name[-1])
    if columns >= 80:
        assert all(len(line) <= columns for line in result.stdout.splitlines()), result.stdout
    assert "SIZE*" in result.stdout and "* SIZE: tensor bytes" in result.stdout and "bytes on disk" in result.stdout


def test_middle_cut_keeps_both_ends() -> None:
    """A name too long for its column loses its middle: `text_encoder_2` at 9 cells is `text…er_2`."""
    assert middle_cut("text_encoder_2", 9) == "text…er_2"
    assert middle_cut("text_encoder", 9) == "text…oder"
    assert middle_cut("vae", 9) == "vae"


def test_an_unknown_option_shows_the_commands_own_usage(capsys: pytest.CaptureFixture[str]) -> None:
    """`hwr inspect --bogus` exits 2 with inspect's usage (its --wide, --root, --json), not the top-level one."""
    with pytest.raises(SystemExit) as stopped:
        cli.main(["inspect", "--bogus"])
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert "usage: hwr inspect" in err and "--wide" in err and "unrecognized arguments: --bogus" in err

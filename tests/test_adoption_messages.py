"""Messages a new user meets first, from the library and from `hwr`, on real models.

A wrong `subfolder` in a cached repo is the caller's mistake, not the cache's: the message
names the snapshot and the subfolders that hold a config.json. Every fix is said in the
caller's own syntax: `subfolder="transformer"` to a Python caller, `--subfolder transformer`
to a shell user (the failure carries the fix as data, `ArgumentHint`, which `hwr` renders).
Fetching is `hf download`, the current name of the Hugging Face CLI.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest

from host_weight_runtime import cli
from host_weight_runtime.diffusion import HostWeightUsageError, load_component, prewarm_component
from host_weight_runtime.failures import ArgumentHint, FailureCode, HostWeightError, HostWeightFailure
from host_weight_runtime.outcomes import ResolutionOutcome
from hwr_tools.synthetic_models import save_hub_snapshot, save_pipeline_folder

from ._adoption import KIND, SUBFOLDER, artifact_keys, isolate_environment, save_variant_folder
from ._diffusion import runtime_at

REPO_ID = "hwr-test/tiny-flux-messages"
COMMIT = "fedcba9876543210fedcba9876543210fedcba98"
MISSPELT = "transfomer"
STALE_NAMES = ("huggingface-cli", "not in the local Hugging Face cache", "partial download")


@pytest.fixture(autouse=True)
def _isolated(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    isolate_environment(monkeypatch, tmp_path)
    monkeypatch.setenv("COLUMNS", "200")


@pytest.fixture
def pipeline(tmp_path: Path) -> Path:
    return save_pipeline_folder(tmp_path / "models" / "tiny-flux", KIND, seed=21)


@pytest.fixture
def cache(tmp_path: Path, pipeline: Path) -> Path:
    cache = tmp_path / "hub"
    save_hub_snapshot(cache, REPO_ID, pipeline, revision=COMMIT)
    return cache


def _hwr_error(capsys: pytest.CaptureFixture[str], *args: str, status: int) -> str:
    """Run `hwr ARGS`; it must exit `status` with one line on stderr and nothing on stdout; returns that line."""
    assert cli.main(list(args)) == status
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert captured.out == "" and len(lines) == 1, captured.err
    return lines[0]


def test_a_wrong_subfolder_in_a_cached_repo_names_the_snapshot_and_its_components(
    tmp_path: Path, cache: Path
) -> None:
    """load_component(REPO, subfolder="transfomer", cache_dir=...): a HostWeightUsageError saying the subfolder
    does not exist in that snapshot, listing the subfolders with a config.json and suggesting
    subfolder="transformer"; it does not blame the cache or suggest downloading; nothing is created."""
    root = tmp_path / "domain"
    with pytest.raises(HostWeightUsageError) as raised:
        load_component(REPO_ID, subfolder=MISSPELT, cache_dir=cache, runtime=runtime_at(root))
    message = raised.value.failure.message
    assert f"subfolder '{MISSPELT}' does not exist in snapshot {COMMIT[:12]} of '{REPO_ID}'" in message
    assert "the subfolders that hold a config.json: transformer" in message
    assert message.endswith('pass subfolder="transformer"')
    assert not any(stale in message for stale in STALE_NAMES) and "download" not in message
    assert raised.value.code is FailureCode.INVALID_CONFIGURATION
    assert not root.exists()


def test_hwr_prewarm_says_the_subfolder_fix_as_an_option(
    tmp_path: Path, cache: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`hwr prewarm REPO --subfolder transfomer --cache-dir C` exits 2 with one line ending in
    `pass --subfolder transformer` (no Python keyword syntax); no artifact is built."""
    root = tmp_path / "domain"
    line = _hwr_error(
        capsys, "prewarm", REPO_ID, "--subfolder", MISSPELT, "--cache-dir", str(cache), "--root", str(root), status=2
    )
    assert line.startswith("hwr prewarm: subfolder 'transfomer' does not exist in snapshot")
    assert line.endswith("pass --subfolder transformer")
    assert "subfolder=" not in line and not any(stale in line for stale in STALE_NAMES)
    assert artifact_keys(root) == []


def test_hwr_prewarm_of_a_folder_without_subfolder_or_model_index(
    tmp_path: Path, pipeline: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`hwr prewarm FOLDER` (no --subfolder) on a folder with neither config.json nor model_index.json says the
    folder has no config.json, lists the components and says `--subfolder transformer`; the library says
    subfolder="transformer" for the same folder. (A pipeline folder with model_index.json prewarms every
    component instead: tests/test_cli_prewarm.py.)"""
    (pipeline / "model_index.json").unlink()
    root = tmp_path / "domain"
    line = _hwr_error(capsys, "prewarm", str(pipeline), "--root", str(root), status=2)
    assert "has no config.json" in line and "the subfolders that hold a config.json: transformer" in line
    assert line.endswith("pass --subfolder transformer") and "subfolder=" not in line
    with pytest.raises(HostWeightUsageError, match=r'pass subfolder="transformer"$'):
        prewarm_component(pipeline, runtime=runtime_at(root))
    assert artifact_keys(root) == []


def test_a_variant_only_folder_says_variant_as_an_option_and_prewarm_variant_works(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`hwr prewarm FOLDER --subfolder transformer` on *.fp16.safetensors only exits 2 saying
    `pass --variant fp16`; `hwr prewarm ... --variant fp16` then builds the artifact that
    load_component(..., variant="fp16") hits."""
    folder = save_variant_folder(tmp_path / "fp16-only", seed=22, default=False)
    root = tmp_path / "domain"
    line = _hwr_error(capsys, "prewarm", str(folder), "--subfolder", SUBFOLDER, "--root", str(root), status=2)
    assert "diffusion_pytorch_model.fp16.safetensors" in line and line.endswith("pass --variant fp16")
    assert "variant=" not in line and artifact_keys(root) == []

    assert cli.main(["prewarm", str(folder), "--subfolder", SUBFOLDER, "--variant", "fp16", "--root", str(root)]) == 0
    printed = capsys.readouterr().out
    [key] = artifact_keys(root)
    assert key in printed
    with load_component(folder, subfolder=SUBFOLDER, variant="fp16", runtime=runtime_at(root)) as loaded:
        assert loaded.outcome is ResolutionOutcome.LOCAL_HIT and loaded.identity_key == key


def test_a_variant_that_is_not_there_says_drop_it(tmp_path: Path, pipeline: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`hwr prewarm PIPELINE --subfolder transformer --variant fp16` where only default weights exist says
    `drop --variant fp16`; the library says drop variant="fp16"."""
    root = tmp_path / "domain"
    args = ["prewarm", str(pipeline), "--subfolder", SUBFOLDER, "--variant", "fp16", "--root", str(root)]
    line = _hwr_error(capsys, *args, status=2)
    assert line.endswith("drop --variant fp16") and "variant=" not in line
    with pytest.raises(HostWeightUsageError, match=r'drop variant="fp16"$'):
        prewarm_component(pipeline, subfolder=SUBFOLDER, variant="fp16", runtime=runtime_at(root))


def test_a_variant_problem_in_a_cached_repo_does_not_blame_the_cache(tmp_path: Path) -> None:
    """A cached repo whose component holds only fp16 files, loaded without a variant: the usage error says
    variant="fp16", not that the repo is missing from the cache."""
    cache = tmp_path / "hub"
    save_hub_snapshot(cache, REPO_ID, save_variant_folder(tmp_path / "fp16-only", seed=23, default=False))
    with pytest.raises(HostWeightUsageError) as raised:
        load_component(REPO_ID, subfolder=SUBFOLDER, cache_dir=cache, runtime=runtime_at(tmp_path / "domain"))
    message = raised.value.failure.message
    assert message.endswith('pass variant="fp16"') and not any(stale in message for stale in STALE_NAMES)


def test_an_uncached_repo_says_hf_download_and_the_cache_option(
    tmp_path: Path, cache: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A repo id the cache lacks: NOT_FOUND, `hf download ORG/NAME` (never `huggingface-cli`); to the library
    `cache_dir=...`, to `hwr prewarm` `--cache-dir ...`; exit 1."""
    absent = "hwr-test/not-cached"
    with pytest.raises(HostWeightError) as raised:
        prewarm_component(absent, subfolder=SUBFOLDER, cache_dir=cache, runtime=runtime_at(tmp_path / "domain"))
    failure = raised.value.failure
    assert failure.code is FailureCode.NOT_FOUND
    assert f"`hf download {absent}`" in failure.message and "huggingface-cli" not in failure.message
    assert failure.message.endswith("or pass cache_dir=...")
    line = _hwr_error(capsys, "prewarm", absent, "--subfolder", SUBFOLDER, "--cache-dir", str(cache), status=1)
    assert line.startswith("hwr prewarm: [not_found] ") and f"`hf download {absent}`" in line
    assert line.endswith("or pass --cache-dir ...") and "cache_dir=" not in line


def test_the_hint_survives_json_and_pickling(tmp_path: Path, cache: Path) -> None:
    """The fix travels with the failure: after HostWeightFailure.to_dict/from_dict and after pickling the error,
    ArgumentHint.of still gives the problem and the hint, and a failure without one gives None."""
    with pytest.raises(HostWeightUsageError) as raised:
        load_component(REPO_ID, subfolder=MISSPELT, cache_dir=cache, runtime=runtime_at(tmp_path / "domain"))
    failure = raised.value.failure
    again = pickle.loads(pickle.dumps(raised.value)).failure
    for copy in (HostWeightFailure.from_dict(failure.to_dict()), again):
        hinted = ArgumentHint.of(copy)
        assert hinted is not None
        problem, hint = hinted
        assert failure.message == f"{problem}; {hint.as_python()}"
        assert hint == ArgumentHint(use=(("subfolder", "transformer"),))
    plain = HostWeightFailure.from_dict({**failure.to_dict(), "details": {}})
    assert ArgumentHint.of(plain) is None
    with pytest.raises(ValueError, match="use or to drop"):
        ArgumentHint()

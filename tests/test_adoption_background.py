"""A script that just ends still publishes in the background, `outcome` is always a
ResolutionOutcome, and the first import of diffusers is reported apart from the load."""

from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest
import torch

from host_weight_runtime._faults import Fault, FaultAction, armed
from host_weight_runtime.config import RuntimeMode
from host_weight_runtime.diffusion import load_component
from host_weight_runtime.failures import FailureCode, ResolutionStage
from host_weight_runtime.filesystem.inspection import ArtifactState
from host_weight_runtime.filesystem.store import FilesystemHostWeightStore
from host_weight_runtime.outcomes import AttemptAction, AttemptResult, ResolutionOutcome
from host_weight_runtime.tensors import ValidationLevel
from hwr_tools.synthetic_models import save_pipeline_folder

from ._adoption import (
    KIND,
    README_MODEL,
    SUBFOLDER,
    artifact_keys,
    canonical,
    forward,
    isolate_environment,
    readme_script,
    run_fresh,
)
from ._diffusion import runtime_at

WAIT_S = 240.0


@pytest.fixture(autouse=True)
def _isolated(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    isolate_environment(monkeypatch, tmp_path)


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_pipeline_folder(tmp_path_factory.mktemp("models") / "tiny-flux", KIND, seed=21)


# ----------------------------------------------------------------------------- item 1: publication at exit


def test_readme_background_example_publishes_at_exit_in_a_script_that_just_ends(tmp_path: Path, pipeline: Path) -> None:
    """D14 (background): the README's publish_in_background block, run as written in two fresh processes that
    never wait: the first prints canonical_fallback and leaves a published, fully checksummed artifact behind at
    exit (no 'cannot schedule new futures'); the second prints local_hit and loads from it."""
    script = readme_script(tmp_path, "publish_in_background=True", README_MODEL, pipeline)
    assert "wait()" not in script.read_text(encoding="utf-8")
    root = tmp_path / "domain"

    first = run_fresh(script, root)

    assert first.stdout.split() == ["canonical_fallback", "canonical"]
    assert "background publication failed" not in first.stderr, first.stderr
    [key] = artifact_keys(root)
    published = FilesystemHostWeightStore(root).inspect_artifact(key, validation=ValidationLevel.FULL_CHECKSUM)
    assert published.state is ArtifactState.READY, published.problem
    assert published.publication_id is not None

    second = run_fresh(script, root)

    assert second.stdout.split() == ["local_hit", "artifact"]
    assert artifact_keys(root) == [key]


# ----------------------------------------------------------------------------- item 1: outcome is always set


def test_a_skipped_lookup_is_canonical_fallback_with_one_skipped_attempt(tmp_path: Path, pipeline: Path) -> None:
    """D14 (background): on a node where no worker identified the checkpoint the lookup is skipped; the outcome is still a
    ResolutionOutcome (CANONICAL_FALLBACK) whose one attempt says why, so the README's print works."""
    runtime = runtime_at(tmp_path / "domain")
    with load_component(pipeline, subfolder=SUBFOLDER, runtime=runtime, publish_in_background=True) as loaded:
        background = loaded.background_publication
        assert background is not None
        assert background.wait(WAIT_S) and background.failure is None, background.failure
    assert loaded.outcome is ResolutionOutcome.CANONICAL_FALLBACK
    [attempt] = loaded.resolution.attempts
    assert (attempt.stage, attempt.result, attempt.action) == (
        ResolutionStage.LOOKUP,
        AttemptResult.SKIPPED,
        AttemptAction.FALL_BACK,
    )
    assert "no worker of this node has identified" in attempt.detail
    assert loaded.resolution.identity_key == "" and loaded.identity_key is None
    assert loaded.summary()["outcome"] == "canonical_fallback"


def test_disabled_is_canonical_direct(tmp_path: Path, pipeline: Path) -> None:
    """D14/R01: DISABLED asks no runtime; the outcome says so (CANONICAL_DIRECT, no attempts)."""
    root = tmp_path / "domain"
    with load_component(pipeline, subfolder=SUBFOLDER, runtime=runtime_at(root, RuntimeMode.DISABLED)) as loaded:
        assert loaded.outcome is ResolutionOutcome.CANONICAL_DIRECT
        assert loaded.resolution.attempts == () and loaded.resolution.mode == "disabled"
        assert torch.equal(forward(loaded.model), forward(canonical(pipeline / SUBFOLDER)))
    assert not root.exists()


def test_an_identity_failure_is_canonical_fallback_with_the_failed_attempt(tmp_path: Path, pipeline: Path) -> None:
    """D14: an I/O error while hashing the checkpoint before returning (the named seam; publish_in_background=False,
    since by default the hashing runs behind the load) falls back in PREFERRED; the outcome is CANONICAL_FALLBACK
    and its one FAILED attempt carries the same failure as `identity_failure`."""
    runtime = runtime_at(tmp_path / "domain")
    with (
        armed("source_digest.after_hash", Fault(FaultAction.RAISE_OSERROR, errno=errno.EIO)),
        load_component(pipeline, subfolder=SUBFOLDER, runtime=runtime, publish_in_background=False) as loaded,
    ):
        assert loaded.outcome is ResolutionOutcome.CANONICAL_FALLBACK
        assert loaded.identity_failure is not None
        assert loaded.identity_failure.code is FailureCode.IO_ERROR
        [attempt] = loaded.resolution.attempts
        assert (attempt.result, attempt.action) == (AttemptResult.FAILED, AttemptAction.FALL_BACK)
        assert attempt.failure == loaded.identity_failure == loaded.resolution.failure
        assert torch.equal(forward(loaded.model), forward(canonical(pipeline / SUBFOLDER)))


# ----------------------------------------------------------------------------- item 5: import time apart

_TIMING_SCRIPT = """
import json, sys, time

import torch

from host_weight_runtime.diffusion import load_component

before = "diffusers" in sys.modules
started = time.monotonic()
first = load_component({folder!r}, subfolder="transformer", torch_dtype=torch.bfloat16)
wall = time.monotonic() - started
second = load_component({folder!r}, subfolder="transformer", torch_dtype=torch.bfloat16)
print(json.dumps({{
    "diffusers_before": before,
    "first": [first.outcome.value, first.import_s, first.elapsed_s, wall],
    "second": [second.outcome.value, second.import_s, second.elapsed_s],
}}))
"""


def test_first_import_of_diffusers_is_reported_as_import_s_not_elapsed_s(tmp_path: Path, pipeline: Path) -> None:
    """D14: in a fresh process the first load pays diffusers' import, reported as import_s and kept out of
    elapsed_s (the two add up to no more than the call); the second load, with everything imported, reports
    import_s == 0 and is a local hit."""
    script = tmp_path / "timing.py"
    script.write_text(_TIMING_SCRIPT.format(folder=str(pipeline)), encoding="utf-8")

    result = json.loads(run_fresh(script, tmp_path / "domain").stdout)

    assert result["diffusers_before"] is False, "importing host_weight_runtime.diffusion must not import diffusers"
    outcome, import_s, elapsed_s, wall = result["first"]
    assert outcome == "canonical_fallback"
    assert import_s > 0.0 and elapsed_s > 0.0
    assert import_s + elapsed_s <= wall
    outcome, import_s, elapsed_s = result["second"]
    assert outcome == "local_hit"
    assert import_s == 0.0 and elapsed_s > 0.0

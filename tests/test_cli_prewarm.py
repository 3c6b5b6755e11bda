"""`hwr prewarm` (D14, R03): stream a real tiny diffusers checkpoint into its artifact from the command line.

The command runs in-process through `host_weight_runtime.cli.main` (capsys captures what it
prints) against a real domain under tmp_path; workers that load afterwards with
`load_component` must hit that artifact and compute what canonical diffusers computes.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from host_weight_runtime import cli
from host_weight_runtime.config import HostWeightRuntimeConfig, RuntimeMode
from host_weight_runtime.diffusion import ComponentLoadPath, load_component
from host_weight_runtime.outcomes import ResolutionOutcome
from host_weight_runtime.runtime import HostWeightRuntime
from hwr_tools.synthetic_models import (
    forward_inputs,
    run_forward,
    save_hub_snapshot,
    save_pipeline_folder,
    tiny_spec,
)

KIND = "flux"
SUBFOLDER = "transformer"
REPO_ID = "hwr-test/tiny-flux-cli"


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No HWR_* setting leaks in, the hub is offline with an empty default cache, and tables are wide enough."""
    for name in list(os.environ):
        if name.startswith("HWR_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-hub-cache"))
    monkeypatch.setenv("COLUMNS", "120")


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A FluxPipeline-shaped folder whose transformer/ is a real, seeded tiny Flux model."""
    return save_pipeline_folder(tmp_path_factory.mktemp("models") / "tiny-flux", KIND, seed=11)


@pytest.fixture(scope="module")
def canonical_output(pipeline: Path) -> torch.Tensor:
    model = tiny_spec(KIND).model_class().from_pretrained(str(pipeline / SUBFOLDER), torch_dtype=torch.bfloat16)
    return _forward(model)


def _forward(model: torch.nn.Module) -> torch.Tensor:
    return run_forward(KIND, model, forward_inputs(KIND, model))


def _prewarm_json(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, Any]:
    assert cli.main(["prewarm", *args, "--json"]) == 0
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert isinstance(report, dict), captured.out
    return report


def _artifact_keys(root: Path) -> list[str]:
    artifacts = root / "artifacts"
    return sorted(path.name for path in artifacts.iterdir()) if artifacts.is_dir() else []


def test_prewarm_builds_then_hits(tmp_path: Path, pipeline: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """D14/R03: `hwr prewarm PIPELINE --subfolder transformer --root DIR` exits 0 and prints the key and
    local_production; running it again prints local_hit for the same key; one artifact is stored."""
    root = tmp_path / "domain"
    args = ["prewarm", str(pipeline), "--subfolder", SUBFOLDER, "--root", str(root)]
    assert cli.main(args) == 0
    first = capsys.readouterr()
    [key] = _artifact_keys(root)
    assert key in first.out
    assert ResolutionOutcome.LOCAL_PRODUCTION.value in first.out
    assert ResolutionOutcome.LOCAL_HIT.value not in first.out

    assert cli.main(args) == 0
    second = capsys.readouterr()
    assert key in second.out
    assert ResolutionOutcome.LOCAL_HIT.value in second.out
    assert ResolutionOutcome.LOCAL_PRODUCTION.value not in second.out
    assert _artifact_keys(root) == [key]


def test_prewarm_json_report(tmp_path: Path, pipeline: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """D14: --json prints one JSON object with the key, the artifact's size and tensor count and the
    resolution report; the second run reports local_hit with the same facts."""
    root = tmp_path / "domain"
    first = _prewarm_json(capsys, str(pipeline), "--subfolder", SUBFOLDER, "--root", str(root))
    assert first["model"] == str(pipeline) and first["subfolder"] == SUBFOLDER
    assert _artifact_keys(root) == [first["identity_key"]]
    assert isinstance(first["total_bytes"], int) and first["total_bytes"] > 0
    expected_tensors = len(tiny_spec(KIND).model_class().from_pretrained(str(pipeline / SUBFOLDER)).state_dict())
    assert first["tensor_count"] == expected_tensors
    resolution = first["resolution"]
    assert resolution["outcome"] == ResolutionOutcome.LOCAL_PRODUCTION.value
    assert resolution["identity_key"] == first["identity_key"]
    assert resolution["mode"] == RuntimeMode.REQUIRED.value and resolution["failure"] is None

    second = _prewarm_json(capsys, str(pipeline), "--subfolder", SUBFOLDER, "--root", str(root))
    assert second["resolution"]["outcome"] == ResolutionOutcome.LOCAL_HIT.value
    assert {name: second[name] for name in ("identity_key", "total_bytes", "tensor_count")} == {
        name: first[name] for name in ("identity_key", "total_bytes", "tensor_count")
    }


def test_workers_hit_what_prewarm_built(
    tmp_path: Path, pipeline: Path, capsys: pytest.CaptureFixture[str], canonical_output: torch.Tensor
) -> None:
    """D14: after `hwr prewarm`, load_component in PREFERRED against the same root is a LOCAL_HIT on the
    prewarmed key, with forward outputs bit-identical to canonical from_pretrained(torch_dtype=bfloat16)."""
    root = tmp_path / "domain"
    report = _prewarm_json(capsys, str(pipeline), "--subfolder", SUBFOLDER, "--root", str(root))
    runtime = HostWeightRuntime(HostWeightRuntimeConfig(mode=RuntimeMode.PREFERRED, root=root))
    with load_component(str(pipeline), subfolder=SUBFOLDER, runtime=runtime) as loaded:
        assert loaded.outcome is ResolutionOutcome.LOCAL_HIT
        assert loaded.load_path is ComponentLoadPath.ARTIFACT
        assert loaded.identity_key == report["identity_key"]
        assert loaded.publication is None
        assert torch.equal(_forward(loaded.model), canonical_output)
    assert _artifact_keys(root) == [report["identity_key"]]


def test_prewarm_of_a_missing_path_fails_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """D14: a model path that does not exist exits 1 with one line naming it (no traceback) and builds nothing."""
    root = tmp_path / "domain"
    missing = tmp_path / "no" / "such-model"
    assert cli.main(["prewarm", str(missing), "--subfolder", SUBFOLDER, "--root", str(root)]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("hwr prewarm: ") and str(missing) in lines[0]
    assert "not_found" in lines[0] and "Traceback" not in captured.err
    assert _artifact_keys(root) == []


def test_prewarm_of_a_pipeline_without_subfolder_prewarms_every_component(
    tmp_path: Path, pipeline: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """P02: `hwr prewarm PIPELINE` without --subfolder streams every weighted component of model_index.json
    (here the transformer) and prints one JSON record per component; a second run finds every artifact."""
    root = tmp_path / "domain"
    first = _prewarm_json(capsys, str(pipeline), "--root", str(root))
    served = [component for component in first["components"] if component["identity_key"] is not None]
    assert [component["name"] for component in served] == [SUBFOLDER]
    assert served[0]["outcome"] == ResolutionOutcome.LOCAL_PRODUCTION.value and served[0]["handling"] == "served"
    assert _artifact_keys(root) == [served[0]["identity_key"]]
    second = _prewarm_json(capsys, str(pipeline), "--root", str(root))
    assert [c["outcome"] for c in second["components"] if c["identity_key"]] == [ResolutionOutcome.LOCAL_HIT.value]
    runtime = HostWeightRuntime(HostWeightRuntimeConfig(mode=RuntimeMode.PREFERRED, root=root))
    with load_component(pipeline, subfolder=SUBFOLDER, runtime=runtime) as loaded:
        assert loaded.outcome is ResolutionOutcome.LOCAL_HIT and loaded.identity_key == served[0]["identity_key"]


def test_prewarm_of_a_folder_that_is_neither_model_nor_pipeline_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """D14: a folder with neither config.json nor model_index.json exits 2 with one line naming config.json."""
    folder = tmp_path / "empty-folder"
    folder.mkdir()
    root = tmp_path / "domain"
    assert cli.main(["prewarm", str(folder), "--root", str(root)]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert "config.json" in lines[0]
    assert _artifact_keys(root) == []


def test_prewarm_a_repo_id_from_the_local_hub_cache(
    tmp_path: Path, pipeline: Path, capsys: pytest.CaptureFixture[str], canonical_output: torch.Tensor
) -> None:
    """D14: `hwr prewarm ORG/NAME --cache-dir DIR` streams a repo from the local Hugging Face cache (offline);
    load_component of the same repo id then hits it bit-identically; an uncached repo id exits 1."""
    cache = tmp_path / "hub"
    save_hub_snapshot(cache, REPO_ID, pipeline)
    root = tmp_path / "domain"
    report = _prewarm_json(capsys, REPO_ID, "--subfolder", SUBFOLDER, "--cache-dir", str(cache), "--root", str(root))
    assert report["resolution"]["outcome"] == ResolutionOutcome.LOCAL_PRODUCTION.value
    assert _artifact_keys(root) == [report["identity_key"]]

    runtime = HostWeightRuntime(HostWeightRuntimeConfig(mode=RuntimeMode.PREFERRED, root=root))
    with load_component(REPO_ID, subfolder=SUBFOLDER, runtime=runtime, cache_dir=cache) as loaded:
        assert loaded.outcome is ResolutionOutcome.LOCAL_HIT
        assert loaded.identity_key == report["identity_key"]
        assert torch.equal(_forward(loaded.model), canonical_output)

    uncached = ["prewarm", "hwr-test/not-cached", "--subfolder", SUBFOLDER, "--cache-dir", str(cache)]
    assert cli.main([*uncached, "--root", str(root)]) == 1
    err = capsys.readouterr().err
    assert "not_found" in err and "hwr-test/not-cached" in err and "Traceback" not in err
    assert _artifact_keys(root) == [report["identity_key"]]


def test_workers_hit_a_prewarm_given_a_relative_path(
    tmp_path: Path, pipeline: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """D14: an operator who runs `hwr prewarm tiny-flux --subfolder transformer` in the models directory
    prewarms the artifact that a worker loading the same folder by its absolute path hits."""
    root = tmp_path / "domain"
    monkeypatch.chdir(pipeline.parent)
    report = _prewarm_json(capsys, pipeline.name, "--subfolder", SUBFOLDER, "--root", str(root))
    runtime = HostWeightRuntime(HostWeightRuntimeConfig(mode=RuntimeMode.PREFERRED, root=root))
    with load_component(str(pipeline), subfolder=SUBFOLDER, runtime=runtime) as loaded:
        assert loaded.identity_key == report["identity_key"]
        assert loaded.outcome is ResolutionOutcome.LOCAL_HIT

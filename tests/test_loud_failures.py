"""Loud failures (X04): every canonical load is a WARNING saying why, refused values are refused, a prewarm that
builds nothing (or misses its variant) exits non-zero, and errors name what is actually wrong.

A tiny real Flux pipeline (CLIP + T5 text encoders, a Flux transformer, a VAE) saved with `save_pretrained`.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch

from host_weight_runtime import cli
from host_weight_runtime.config import HostWeightRuntimeConfig, RuntimeMode
from host_weight_runtime.diffusion import ComponentHandling, HostWeightUsageError, load_component, load_pipeline
from host_weight_runtime.outcomes import ResolutionOutcome
from host_weight_runtime.runtime import HostWeightRuntime
from hwr_tools.synthetic_pipelines import save_tiny_pipeline

from ._pipelines import artifact_keys, copy_pipeline, edit_model_index, runtime_at
from .test_pipeline_loader import _pickle_only_vae

CANONICAL_LOGGER = "host_weight_runtime.canonical"  # the logger operators route
SERVED = ("text_encoder", "text_encoder_2", "transformer")


@pytest.fixture(scope="module")
def flux(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_pipeline(tmp_path_factory.mktemp("loud") / "flux", "flux", seed=3)


@pytest.fixture(autouse=True)
def _no_hwr_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in list(os.environ):
        if name.startswith("HWR_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-hub-cache"))


def _canonical_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        record.getMessage()
        for record in caplog.records
        if record.name == CANONICAL_LOGGER and record.levelno == logging.WARNING
    ]


def test_every_canonical_component_is_a_warning_and_hits_are_quiet(
    tmp_path: Path, flux: Path, caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str]
) -> None:
    """X04: a first load_pipeline logs one WARNING per component loaded canonically, naming it and why (no artifact
    yet, built behind it for the next worker; pickle-only weights); the next load logs only the one it still cannot serve,
    and its transformers hits print no "Loading weights" progress bar. `safety_checker=None`, which FluxPipeline
    does not have, is ignored with a WARNING naming it (as diffusers does), not refused as a load argument."""
    folder = copy_pipeline(flux, tmp_path / "flux")
    _pickle_only_vae(folder)
    caplog.set_level(logging.WARNING)
    with load_pipeline(folder, runtime=runtime_at(tmp_path / "store")) as cold:
        assert set(cold.components) == set(SERVED)
    first = _canonical_warnings(caplog)
    assert len(first) == 4, first
    for name in SERVED:
        [line] = [line for line in first if f"subfolder {name} " in line]
        assert "canonical_fallback" in line and "no artifact" in line and "for the next worker" in line
    [vae] = [line for line in first if "component vae " in line]
    assert "pickle" in vae and str(folder) in vae
    caplog.clear()
    capfd.readouterr()
    with load_pipeline(folder, runtime=runtime_at(tmp_path / "store"), safety_checker=None) as warm:
        assert set(warm.outcomes.values()) == {ResolutionOutcome.LOCAL_HIT}
        assert warm.record("vae").handling is ComponentHandling.CANONICAL
    second = _canonical_warnings(caplog)
    assert len(second) == 1 and "component vae " in second[0]
    [ignored] = [record.getMessage() for record in caplog.records if "safety_checker" in record.getMessage()]
    assert "FluxPipeline" in ignored and "ignored" in ignored
    assert "Loading weights" not in capfd.readouterr().err


@pytest.mark.parametrize(
    ("arguments", "named"),
    [
        ({"torch_dtype": "auto"}, "torch_dtype"),
        ({"dtype": "auto"}, "dtype"),
        ({"torch_dtype": torch.float64}, "torch_dtype"),
        ({"torch_dtype": "float8_e4m3fn"}, "torch_dtype"),
        ({"device_map": "cuda"}, "device_map"),
        ({"quantization_config": {"load_in_4bit": True}}, "quantization_config"),
        ({"safety_checker": object()}, "safety_checker"),
        ({"subfolder": "transformer"}, "subfolder"),
    ],
)
def test_refused_values_are_refused_before_anything_loads(
    tmp_path: Path, flux: Path, arguments: dict[str, object], named: str
) -> None:
    """X04: "auto" and every other value the README says is refused is a HostWeightUsageError (a ValueError)
    naming the argument and what to pass instead, raised before any component loads (the store stays empty);
    a value for a component the pipeline does not have is named as a pipeline argument."""
    with pytest.raises(HostWeightUsageError) as raised:
        load_pipeline(flux, runtime=runtime_at(tmp_path / "store"), **arguments)
    assert isinstance(raised.value, ValueError) and named in str(raised.value)
    message = str(raised.value)
    if named.endswith("dtype"):
        assert "torch.bfloat16" in message
    if named == "safety_checker":
        assert "pipeline argument" in message and "FluxPipeline" in message and "load_component takes" not in message
    assert artifact_keys(tmp_path / "store") == []


def test_a_missing_local_path_is_a_missing_folder(tmp_path: Path) -> None:
    """X04: a path that names no folder is reported as a missing folder, never as a repo missing from the Hugging
    Face cache with an `hf download /srv/...` suggestion; `hwr prewarm` of it exits 2 saying the same."""
    missing = tmp_path / "srv" / "models" / "missing"
    with pytest.raises(HostWeightUsageError) as raised:
        load_pipeline(str(missing), runtime=runtime_at(tmp_path / "store"))
    message = str(raised.value)
    assert f"{missing} does not exist" in message and "hf download" not in message
    assert "not in the local Hugging Face cache" not in message
    assert raised.value.failure.code.value == "not_found"


def test_a_pipeline_prewarm_that_builds_nothing_or_misses_its_variant_exits_non_zero(
    tmp_path: Path, flux: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """X04: `hwr prewarm PIPELINE --variant fp16` on a pipeline without fp16 files, and a prewarm of a pipeline
    with no weighted component to build, exit 2 naming the components, and build nothing."""
    root = tmp_path / "domain"
    assert cli.main(["prewarm", str(flux), "--variant", "fp16", "--root", str(root)]) == 2
    err = capsys.readouterr().err
    assert "variant 'fp16' is missing" in err and "transformer" in err
    empty = copy_pipeline(flux, tmp_path / "nothing")
    edit_model_index(empty, **{name: [None, None] for name in (*SERVED, "vae")})
    assert cli.main(["prewarm", str(empty), "--root", str(root)]) == 2
    assert "would build nothing" in capsys.readouterr().err
    assert artifact_keys(root) == []


def test_load_component_warns_when_the_runtime_is_disabled(
    tmp_path: Path, flux: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """X04: load_component with the runtime DISABLED loads canonically and says so, naming the component and why."""
    caplog.set_level(logging.WARNING)
    with load_component(flux, subfolder="vae", runtime=runtime_at(tmp_path / "never", RuntimeMode.DISABLED)) as vae:
        assert vae.outcome is ResolutionOutcome.CANONICAL_DIRECT
    [line] = _canonical_warnings(caplog)
    assert f"{flux} subfolder vae" in line and "DISABLED" in line and "HWR_MODE" in line
    assert not (tmp_path / "never").exists()


def test_a_read_only_worker_says_a_prewarm_must_build_the_artifact(
    tmp_path: Path, flux: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """X04: a worker configured as the Kubernetes workers are (no local build, no post-load publication) that misses
    loads canonically and its WARNING says that it will not publish, so a prewarm must build the artifact."""
    config = HostWeightRuntimeConfig(root=tmp_path / "domain", allow_local_build=False, allow_post_load_publish=False)
    caplog.set_level(logging.WARNING)
    with load_component(flux, subfolder="vae", runtime=HostWeightRuntime(config)) as vae:
        assert vae.outcome is ResolutionOutcome.CANONICAL_FALLBACK
    [line] = _canonical_warnings(caplog)
    assert "subfolder vae" in line and "HWR_ALLOW_POST_LOAD_PUBLISH=false" in line and "prewarm" in line
    assert artifact_keys(tmp_path / "domain") == []

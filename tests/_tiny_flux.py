"""The tiny Flux transformer that the `load_component` tests share, and the clean environment they load it in.

A real FluxTransformer2DModel built small with a fixed seed and saved as a pipeline folder; what
a diffusers user gets from it (`from_pretrained(torch_dtype=torch.bfloat16)`); and an environment
where no HWR_* setting leaks in and the hub is offline with an empty default cache. A test module
takes the `pipeline` and `canonical_output` fixtures by importing their functions.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hwr_tools.synthetic_models import forward_inputs, run_forward, save_pipeline_folder, tiny_spec

KIND = "flux"
SUBFOLDER = "transformer"
MODEL_CLASS = "FluxTransformer2DModel"
REPO_ID = "hwr-test/tiny-flux"
HWR_VARIABLES = (
    "HWR_MODE",
    "HWR_ROOT",
    "HWR_VALIDATION",
    "HWR_STORAGE_CLASS",
    "HWR_ALLOW_LOCAL_BUILD",
    "HWR_ALLOW_POST_LOAD_PUBLISH",
    "HWR_LOCK_TIMEOUT_S",
    "HWR_MAX_ARTIFACT_BYTES",
    "HWR_MAX_STORE_BYTES",
    "HWR_MIN_FREE_BYTES",
    "HWR_REMOTE",
)


def isolate_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No HWR_* setting leaks in, the hub is offline, and the default hub cache is an empty folder."""
    for name in HWR_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-hub-cache"))


@pytest.fixture(scope="module", name="pipeline")
def tiny_flux_pipeline(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A FluxPipeline-shaped folder whose transformer/ is a real, seeded tiny Flux model (one per test module)."""
    return save_pipeline_folder(tmp_path_factory.mktemp("models") / "tiny-flux", KIND, seed=7)


@pytest.fixture(scope="module", name="canonical_output")
def tiny_flux_canonical_output(pipeline: Path) -> torch.Tensor:
    """The forward output of exactly what diffusers gives for `pipeline`."""
    return flux_forward(canonical_flux(pipeline))


def canonical_flux(folder: Path) -> torch.nn.Module:
    """Exactly what a diffusers user gets from this folder: from_pretrained(torch_dtype=torch.bfloat16)."""
    model: torch.nn.Module = (
        tiny_spec(KIND).model_class().from_pretrained(str(folder / SUBFOLDER), torch_dtype=torch.bfloat16)
    )
    return model


def flux_forward(model: torch.nn.Module) -> torch.Tensor:
    """The model's output on the fixed tiny inputs."""
    return run_forward(KIND, model, forward_inputs(KIND, model))

"""Helpers for the adoption tests: real diffusers folders with variants, README blocks, fresh processes.

A diffusers user's call is run as written: folders are saved by diffusers' own
`save_pretrained` (with `variant=` where the test needs variant files), and the README's
examples run in fresh `python` processes with only the model id swapped for a local folder.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hwr_tools.synthetic_models import build_model, forward_inputs, run_forward, tiny_spec

KIND = "flux"
SUBFOLDER = "transformer"
README = Path(__file__).resolve().parents[1] / "README.md"
README_MODEL = '"black-forest-labs/FLUX.1-dev"'
SCRIPT_TIMEOUT_S = 300


def isolate_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No HWR_* from the caller's shell, and an empty, offline Hugging Face cache."""
    for name in list(os.environ):
        if name.startswith("HWR_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-hub-cache"))


def save_variant_folder(
    root: Path,
    *,
    seed: int,
    subfolder: str = SUBFOLDER,
    default: bool = True,
    variants: tuple[str, ...] = ("fp16",),
    safetensors: bool = True,
) -> Path:
    """A pipeline-shaped folder whose component holds the default FP32 weights and/or FP16 variant files.

    The variant files hold the same seeded model cast to FP16, so they are different bytes
    (and, after the BF16 cast, possibly different values) from the default files.
    """
    folder = root / subfolder
    if default:
        build_model(KIND, seed=seed).save_pretrained(folder, safe_serialization=safetensors)
    for variant in variants:
        half = build_model(KIND, seed=seed).to(torch.float16)
        half.save_pretrained(folder, safe_serialization=safetensors, variant=variant)
    return root


def canonical(folder: Path, kind: str = KIND, **kwargs: object) -> torch.nn.Module:
    """What a diffusers user gets from `from_pretrained(..., torch_dtype=torch.bfloat16)`."""
    model: torch.nn.Module = (
        tiny_spec(kind).model_class().from_pretrained(str(folder), torch_dtype=torch.bfloat16, **kwargs)
    )
    return model


def forward(model: torch.nn.Module, kind: str = KIND) -> torch.Tensor:
    with torch.no_grad():
        return run_forward(kind, model, forward_inputs(kind, model))


def artifact_keys(root: Path) -> list[str]:
    artifacts = root / "artifacts"
    return sorted(path.name for path in artifacts.iterdir()) if artifacts.is_dir() else []


def readme_block(marker: str) -> str:
    """The README's one ```python block containing `marker`."""
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), flags=re.DOTALL)
    chosen = [str(block) for block in blocks if marker in block]
    assert len(chosen) == 1, f"README.md has {len(chosen)} ```python blocks containing {marker!r}, expected one"
    return chosen[0]


def readme_script(tmp_path: Path, marker: str, model: str, folder: Path) -> Path:
    """The README block as a script file, with its model id `model` swapped for the local `folder`."""
    source = readme_block(marker)
    assert model in source, f"the README block no longer loads {model}"
    name = re.sub(r"\W+", "_", marker).strip("_")
    script = tmp_path / f"readme_{name}.py"
    script.write_text(source.replace(model, repr(str(folder))), encoding="utf-8")
    return script


def run_fresh(script: Path, root: Path) -> subprocess.CompletedProcess[str]:
    """Run `script` in a fresh interpreter with HWR_ROOT=root and no other HWR_* setting; it must exit 0."""
    environment = {name: value for name, value in os.environ.items() if not name.startswith("HWR_")}
    environment["HWR_ROOT"] = str(root)
    completed = subprocess.run(
        [sys.executable, str(script)],
        env=environment,
        capture_output=True,
        text=True,
        timeout=SCRIPT_TIMEOUT_S,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr
    return completed

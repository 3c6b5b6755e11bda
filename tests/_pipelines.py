"""Whole-pipeline helpers: tiny real pipeline folders and the bodies of spawned worker processes.

The children are module level so spawn can import them. Each one generates one image per
pipeline with a fixed seed and saves the output tensor to a file (exact bytes, any dtype),
reporting how every component was loaded.
"""

from __future__ import annotations

import json
import shutil
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

from host_weight_runtime.config import HostWeightRuntimeConfig, RuntimeMode
from host_weight_runtime.diffusion import LoadedComponent, LoadedPipeline, load_pipeline
from host_weight_runtime.runtime import HostWeightRuntime
from hwr_tools.synthetic_pipelines import generation_kwargs, pipeline_kind, save_tiny_pipeline

PIPELINES = ("flux", "sd3", "pixart_sigma", "sdxl", "sana")


def runtime_at(root: Path, mode: RuntimeMode = RuntimeMode.PREFERRED) -> HostWeightRuntime:
    return HostWeightRuntime(HostWeightRuntimeConfig(mode=mode, root=root, lock_timeout_s=60.0))


def save_pipelines(base: Path, names: tuple[str, ...] = PIPELINES) -> dict[str, Path]:
    return {name: save_tiny_pipeline(base / name, name, seed=7) for name in names}


def image(pipeline: Any, name: str) -> torch.Tensor:
    """One image from `pipeline` with the fixed generator seed, as the output tensor."""
    with torch.no_grad():
        output = pipeline(**generation_kwargs(name)).images
    assert isinstance(output, torch.Tensor)
    return output


def canonical_image(folder: Path, name: str) -> torch.Tensor:
    from diffusers import DiffusionPipeline

    pipeline = DiffusionPipeline.from_pretrained(str(folder), dtype=pipeline_kind(name).torch_dtype)
    return image(pipeline, name)


def describe(loaded: LoadedPipeline) -> dict[str, Any]:
    """What a test checks about a load: the pipeline class, each record, each served component's outcome."""
    return {
        "class": type(loaded.pipeline).__name__,
        "handling": {record.name: record.handling.value for record in loaded.records},
        "outcomes": {name: component.outcome.value for name, component in loaded.components.items()},
        "publications": {name: _publication(component) for name, component in loaded.components.items()},
        "keys": {name: component.identity_key for name, component in loaded.components.items()},
    }


def _publication(component: LoadedComponent) -> str | None:
    """The post-load publication's status, "behind" for one on a background thread, None for none."""
    if component.background_publication is not None:
        return "behind"
    return None if component.publication is None else component.publication.status.value


def images_in_child(folders: dict[str, str], store: str | None, out: str, mode: str, conn: Connection) -> None:
    """A fresh worker: every pipeline canonically (store None) or through load_pipeline; images to `out`."""
    reports: dict[str, Any] = {}
    for name, folder in folders.items():
        dtype = pipeline_kind(name).torch_dtype
        if store is None:
            torch.save(canonical_image(Path(folder), name), Path(out) / f"{name}.pt")
            continue
        with load_pipeline(folder, torch_dtype=dtype, runtime=runtime_at(Path(store), RuntimeMode(mode))) as loaded:
            reports[name] = describe(loaded)
            torch.save(image(loaded.pipeline, name), Path(out) / f"{name}.pt")
    conn.send(reports)


def load_image(out: Path, name: str) -> torch.Tensor:
    loaded = torch.load(out / f"{name}.pt", weights_only=True)
    assert isinstance(loaded, torch.Tensor)
    return loaded


def copy_pipeline(source: Path, destination: Path) -> Path:
    shutil.copytree(source, destination)
    return destination


def edit_model_index(folder: Path, **changes: Any) -> None:
    path = folder / "model_index.json"
    index = json.loads(path.read_text())
    index.update(changes)
    path.write_text(json.dumps(index))


def artifact_keys(store: Path) -> list[str]:
    artifacts = store / "artifacts"
    return sorted(path.name for path in artifacts.iterdir()) if artifacts.is_dir() else []

"""Load the served pipeline through the node's host weight artifacts: the one call each worker makes.

Kept apart so that the service never cares how a pipeline is assembled: this function returns
the pipeline, one report per component (where its weights came from) and the leases to close.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

SERVED_DTYPE = torch.bfloat16


@dataclass
class ServedPipeline:
    """A pipeline ready to generate, how each of its components was loaded, and what to close at shutdown."""

    pipeline: Any
    components: dict[str, dict[str, Any]]
    load_s: float
    closers: list[Callable[[], None]] = field(default_factory=list)

    def close(self) -> None:
        """Release every lease (idempotent); the pipeline must not generate afterwards."""
        while self.closers:
            self.closers.pop()()


def _weighted_components(pipeline: Any) -> dict[str, Any]:
    return {name: value for name, value in pipeline.components.items() if isinstance(value, torch.nn.Module)}


def import_loading_modules(model: str) -> None:
    """Import what loading `model` needs (diffusers, its pipeline class), so a worker can do it before its turn."""
    import diffusers

    import host_weight_runtime.diffusion  # noqa: F401

    index = Path(model) / "model_index.json"
    if index.is_file():
        class_name = json.loads(index.read_text(encoding="utf-8")).get("_class_name")
        if isinstance(class_name, str):
            getattr(diffusers, class_name, None)  # diffusers imports a pipeline class (and its models) on first use


def load_served_pipeline(model: str) -> ServedPipeline:
    """The pipeline at `model` (a folder or cached repo id), its transformer from the node's artifact.

    The runtime is configured from `HWR_*` (HWR_MODE, HWR_ROOT, ...). In PREFERRED mode a worker
    whose domain cannot be used loads canonically and says why in its transformer report.
    """
    from diffusers import DiffusionPipeline

    from host_weight_runtime.diffusion import load_component

    started = time.perf_counter()
    loaded = load_component(model, subfolder="transformer", torch_dtype=SERVED_DTYPE)
    pipeline = DiffusionPipeline.from_pretrained(model, transformer=loaded.model, dtype=SERVED_DTYPE)
    pipeline.set_progress_bar_config(disable=True)
    components: dict[str, dict[str, Any]] = {}
    for name in _weighted_components(pipeline):
        if name == "transformer":
            components[name] = {**loaded.summary(), "attempts": loaded.resolution.to_dict()["attempts"]}
        else:
            components[name] = {"load_path": "canonical", "outcome": "not_served", "identity_key": None}
    return ServedPipeline(pipeline, components, time.perf_counter() - started, [loaded.close])

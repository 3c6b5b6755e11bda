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
    domain_error: dict[str, Any] | None = None  # the runtime's failure when the domain could not be used at all

    def close(self) -> None:
        """Release every lease (idempotent); the pipeline must not generate afterwards."""
        while self.closers:
            self.closers.pop()()


def import_loading_modules(model: str) -> None:
    """Import what loading `model` needs (diffusers, its pipeline class), so a worker can do it before its turn."""
    import diffusers

    import host_weight_runtime.diffusion  # noqa: F401

    index = Path(model) / "model_index.json"
    if index.is_file():
        class_name = json.loads(index.read_text(encoding="utf-8")).get("_class_name")
        if isinstance(class_name, str):
            getattr(diffusers, class_name, None)  # diffusers imports a pipeline class (and its models) on first use


def load_served_pipeline(model: str, revision: str | None = None) -> ServedPipeline:
    """The pipeline at `model` (a folder or cached repo id), every weighted component it can serve from the node's
    artifacts (`load_pipeline`).

    The runtime is configured from `HWR_*` (HWR_MODE, HWR_ROOT, ...). In PREFERRED mode a miss, a full
    domain or a damaged artifact already falls back to the canonical load, reported per component. A
    domain the runtime refuses outright (a root on NFS, or writable by others: a configuration error,
    which the runtime raises even in PREFERRED) makes this service load canonically all the same, with
    the runtime disabled, and report the error as `domain_error`: a worker that serves slowly is better
    than one that does not serve, and /status says why. In REQUIRED mode the error stands.
    """
    from host_weight_runtime import HostWeightError, HostWeightRuntime, HostWeightRuntimeConfig, RuntimeMode
    from host_weight_runtime.diffusion import load_pipeline

    started = time.perf_counter()
    runtime = HostWeightRuntime.from_env()
    domain_error = None
    try:
        # Publishing before returning, so /health reports each publication's outcome (why it failed, on a full
        # domain) and the workers started next hit. Drop the argument for the fastest first worker: the
        # artifacts are then built behind it (`LoadedComponent.background_publication`).
        loaded = load_pipeline(model, torch_dtype=SERVED_DTYPE, revision=revision, runtime=runtime, publish_in_background=False)
    except HostWeightError as exc:
        if runtime.config.mode is not RuntimeMode.PREFERRED:
            raise
        domain_error = exc.failure.to_dict()
        disabled = HostWeightRuntime(HostWeightRuntimeConfig(mode=RuntimeMode.DISABLED))
        loaded = load_pipeline(model, torch_dtype=SERVED_DTYPE, revision=revision, runtime=disabled)
    loaded.pipeline.set_progress_bar_config(disable=True)
    components: dict[str, dict[str, Any]] = {}
    for record in loaded.records:
        if record.name in loaded.components:
            served = loaded.components[record.name]
            attempts = served.resolution.to_dict()["attempts"]
            publication = None if served.publication is None else served.publication.to_dict()
            components[record.name] = {
                **record.to_dict(),
                **served.summary(),
                "attempts": attempts,
                "publication_report": publication,  # why publishing failed, if it did (a full domain, ...)
            }
        elif isinstance(getattr(loaded.pipeline, record.name, None), torch.nn.Module):
            components[record.name] = {**record.to_dict(), "load_path": "canonical", "outcome": "not_served"}
    elapsed = time.perf_counter() - started
    return ServedPipeline(loaded.pipeline, components, elapsed, [loaded.close], domain_error=domain_error)

"""The bodies of the X01/X02 workers: `load_pipeline` calls in one fresh process, models and repeats counted.

Module level so spawn can import it. Model constructions are counted with torch's own global
submodule-registration hook (every model registers its first submodule in its `__init__`), the
per-process work with the runtime's own counters.
"""

from __future__ import annotations

from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

from host_weight_runtime.diffusion import load_pipeline
from host_weight_runtime.diffusion._binding_plans import BINDING_PLANS
from host_weight_runtime.diffusion._ownership_plans import OWNERSHIP_PLANS
from host_weight_runtime.diffusion.restorer import CHECKED_LAYOUTS
from host_weight_runtime.diffusion.skeleton import SKELETON_BUILDS
from host_weight_runtime.manifest import PARSED_MANIFESTS
from hwr_tools.synthetic_pipelines import pipeline_kind

from ._pipelines import canonical_image, image, runtime_at


def _counters() -> dict[str, int]:
    return {
        "binding_computations": BINDING_PLANS.computations,
        "binding_renamings": BINDING_PLANS.renamings,
        "ownership_discoveries": OWNERSHIP_PLANS.discoveries,
        "manifest_parses": PARSED_MANIFESTS.parses,
        "layout_checks": CHECKED_LAYOUTS.checks,
    }


def two_warm_loads(folder: str, store: str, served_classes: list[str], conn: Connection) -> None:
    """Two warm loads; per load: models constructed per class, skeleton builds, outcomes, image vs canonical."""
    constructed: dict[int, torch.nn.Module] = {}

    def registered(module: torch.nn.Module, _name: str, _submodule: torch.nn.Module | None) -> None:
        if type(module).__name__ in served_classes:
            constructed[id(module)] = module  # kept alive, so an id is never reused within a load

    handle = torch.nn.modules.module.register_module_module_registration_hook(registered)
    dtype = pipeline_kind("flux").torch_dtype
    expected = canonical_image(Path(folder), "flux")
    constructed.clear()
    loads: list[dict[str, Any]] = []
    try:
        for _ in range(2):
            before, built = _counters(), SKELETON_BUILDS.snapshot()
            constructed.clear()
            with load_pipeline(folder, torch_dtype=dtype, runtime=runtime_at(Path(store))) as loaded:
                models: dict[str, int] = {}
                for model in constructed.values():
                    models[type(model).__name__] = models.get(type(model).__name__, 0) + 1
                after = SKELETON_BUILDS.snapshot()
                loads.append(
                    {
                        "outcomes": {name: outcome.value for name, outcome in loaded.outcomes.items()},
                        "models_constructed": models,
                        "skeletons_built": {name: after.get(name, 0) - built.get(name, 0) for name in after},
                        "repeated": {name: value - before[name] for name, value in _counters().items()},
                        "image_equal": bool(torch.equal(image(loaded.pipeline, "flux"), expected)),
                    }
                )
    finally:
        handle.remove()
    conn.send(loads)


def first_then_warm(folder: str, store: str, served_classes: list[str], conn: Connection) -> None:
    """The first worker on an empty domain, then (its publications done) a warm load; models constructed per load."""
    constructed: dict[int, torch.nn.Module] = {}

    def registered(module: torch.nn.Module, _name: str, _submodule: torch.nn.Module | None) -> None:
        if type(module).__name__ in served_classes:
            constructed[id(module)] = module

    handle = torch.nn.modules.module.register_module_module_registration_hook(registered)
    dtype = pipeline_kind("flux").torch_dtype
    expected = canonical_image(Path(folder), "flux")
    loads: list[dict[str, Any]] = []
    try:
        for _ in range(2):
            constructed.clear()
            built = SKELETON_BUILDS.snapshot()
            with load_pipeline(folder, torch_dtype=dtype, runtime=runtime_at(Path(store))) as loaded:
                models: dict[str, int] = {}
                for model in constructed.values():
                    models[type(model).__name__] = models.get(type(model).__name__, 0) + 1
                after = SKELETON_BUILDS.snapshot()
                publications = [
                    component.background_publication
                    for component in loaded.components.values()
                    if component.background_publication is not None
                ]
                loads.append(
                    {
                        "outcomes": {name: outcome.value for name, outcome in loaded.outcomes.items()},
                        "models_constructed": models,
                        "skeletons_built": {name: after.get(name, 0) - built.get(name, 0) for name in after},
                        "image_equal": bool(torch.equal(image(loaded.pipeline, "flux"), expected)),
                        "published": [
                            publication.wait(600.0) and publication.failure is None for publication in publications
                        ],
                    }
                )
    finally:
        handle.remove()
    conn.send(loads)

"""`prewarm_component`: build (or find) a component's artifact from its checkpoint without loading the model.

source (`component_source.py`) -> skeleton and identity (`skeleton.py`) -> `build_artifact`
(`publish_step.py`), in REQUIRED mode: what `load_component` would serve, made ready beforehand.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from ..runtime import HostWeightRuntime
from ._load_options import LoadOptions, check_dtype, check_parallel, check_variant
from .component_source import ComponentLocation, checkpoint_source, node_digest_cache
from .contracts import FinalLayoutParallelIdentity
from .load_reports import PrewarmResult
from .load_runtime import required_runtime, runtime_for_load
from .producers._shards import ProgressCallback
from .publish_step import build_artifact
from .representation import check_fp8_dtype, check_representation, fp8_skeleton
from .skeleton import identify_component, prepare_skeleton

__all__ = ["prewarm_component"]


def prewarm_component(
    model_or_path: str | os.PathLike[str],
    *,
    subfolder: str | None = None,
    revision: str | None = None,
    variant: str | None = None,
    runtime: HostWeightRuntime | None = None,
    parallel: FinalLayoutParallelIdentity | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    progress: ProgressCallback | None = None,
    torch_dtype: torch.dtype | str = torch.bfloat16,
    representation: str = "bf16",
) -> PrewarmResult:
    """Build (or find) the artifact straight from the checkpoint, without loading the model.

    `variant` picks the checkpoint files and `torch_dtype` the representation as in `load_component`
    (and so the artifact a later `load_component(..., variant=..., torch_dtype=...)` hits); diffusers
    and transformers components alike. Runs in REQUIRED mode with local builds allowed
    whatever the environment says, so a failure raises `HostWeightError` instead of being
    hidden by a fallback; a bad argument or model folder raises `HostWeightUsageError`.
    `representation="fp8"` streams the FP8 artifact `load_component(..., representation="fp8")`
    hits (diffusers components only, BF16 `torch_dtype`); see `diffusion/producers/fp8_checkpoint.py`.
    """
    fp8 = check_representation(representation)
    options = LoadOptions(variant=check_variant(variant), dtype=check_dtype(torch_dtype))
    if fp8:
        check_fp8_dtype(options.dtype)
    check_parallel(parallel)
    required = runtime_for_load(required_runtime(runtime if runtime is not None else HostWeightRuntime.from_env()))
    location = ComponentLocation(model_or_path, subfolder, revision, Path(cache_dir) if cache_dir is not None else None)
    parallel = parallel if parallel is not None else FinalLayoutParallelIdentity()
    source = checkpoint_source(location, options)  # a bad folder is refused before the domain is opened
    skeleton = prepare_skeleton(location, options, parallel, source=source, records=node_digest_cache(required))
    if fp8:
        skeleton = fp8_skeleton(skeleton)
    return build_artifact(identify_component(skeleton, required), required, progress)

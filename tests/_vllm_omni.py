"""vLLM-Omni's own diffusion adapters on this store, through `compat.vllm_omni.install()` (X03).

Nothing here reimplements the reference: the identity, producer and restorer are vLLM-Omni's, imported
from the installed vllm-omni wheel after `install()`. This module only builds the model they work on (a
real tiny diffusers Flux transformer in BF16, the component a vLLM-Omni pipeline owns as its DiT) and
runs each side; the child side runs in a spawned process.
"""

from __future__ import annotations

import hashlib
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

from host_weight_runtime.compat import vllm_omni as compat
from hwr_tools.synthetic_models import build_model

DIT = "transformer"
MODEL_ID = "test-org/tiny-flux"


class Pipeline(torch.nn.Module):
    """The pipeline object vLLM-Omni's adapters restore into: it owns the DiT as a named submodule."""

    def __init__(self, transformer: torch.nn.Module) -> None:
        super().__init__()
        self.transformer = transformer


def build_pipeline(seed: int) -> Pipeline:
    """A seeded tiny Flux DiT cast to BF16, declaring vLLM-Omni's final-layout restore contract."""
    from vllm_omni.diffusion.models.host_weight_contract import FinalLayoutModelContract

    transformer = build_model("flux", seed=seed).to(torch.bfloat16)
    transformer.host_weight_restore_contract = FinalLayoutModelContract(
        implementation_id="diffusers.FluxTransformer2DModel", version="1"
    )
    transformer.validate_restored_host_weights = lambda: None
    return Pipeline(transformer)


def identity_context(pipeline: Pipeline, checkpoint: Path, cache_root: Path) -> Any:
    """vLLM-Omni's exact identity for the pipeline's DiT, from the canonical checkpoint it was loaded from."""
    from vllm_omni.diffusion.model_loader.host_weights import (
        FINAL_LAYOUT_BF16_POLICY,
        FinalLayoutLoaderIdentity,
        FinalLayoutRequest,
        ImplementationIdentity,
        NodeSourceDigestCache,
        PreparedWeightSource,
        build_final_layout_identity,
    )

    source = PreparedWeightSource(
        model_or_path=MODEL_ID,
        subfolder=DIT,
        requested_revision=None,
        prefix=f"{DIT}.",
        resolved_root=checkpoint,
        weight_files=tuple(sorted(checkpoint.glob("*.safetensors"))),
        use_safetensors=True,
    )
    loader = FinalLayoutLoaderIdentity(
        implementation=ImplementationIdentity("tests.tiny-flux-loader", "1", "loader-abi-1"),
        model_config_fingerprint=hashlib.sha256((checkpoint / "config.json").read_bytes()).hexdigest(),
        weight_transform_fingerprint="cast-to-bf16",
    )
    return build_final_layout_identity(
        pipeline,
        dit_modules=[(DIT, pipeline.transformer)],
        prepared_sources=[source],
        request=FinalLayoutRequest(model_id=MODEL_ID, loader=loader),
        policy=FINAL_LAYOUT_BF16_POLICY,
        source_digest_cache=NodeSourceDigestCache(cache_root, timeout_seconds=30.0),
    )


def runtime(root: Path) -> Any:
    """vLLM-Omni's runtime type, configured the reference's way, on this store."""
    from vllm_omni.host_weight_runtime import (
        HostWeightRuntime,
        HostWeightRuntimeConfig,
        ProductionPolicy,
        RuntimeMode,
        StorageClass,
        StorageDomainPolicy,
    )

    domain = StorageDomainPolicy(root=root, storage_class=StorageClass.AUTO)
    config = HostWeightRuntimeConfig(
        mode=RuntimeMode.REQUIRED, domain=domain, production=ProductionPolicy(allow_post_load_publish=True)
    )
    return HostWeightRuntime.from_config(config)


def tensor_digests(pipeline: Pipeline) -> dict[str, str]:
    """SHA-256 of every DiT tensor's bytes, with its dtype and shape: equal digests, bit-exact tensors."""
    state = pipeline.transformer.state_dict()
    return {
        name: f"{tensor.dtype}:{tuple(tensor.shape)}:"
        + hashlib.sha256(tensor.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
        for name, tensor in state.items()
    }


def publish(root: Path, checkpoint: Path, cache_root: Path) -> tuple[Any, dict[str, str]]:
    """Publish the loaded pipeline's final layout with vLLM-Omni's producer; its report and tensor digests."""
    compat.install()
    from vllm_omni.diffusion.model_loader.host_weights import FinalLayoutBF16Producer

    pipeline = build_pipeline(seed=0)
    context = identity_context(pipeline, checkpoint, cache_root)
    producer = FinalLayoutBF16Producer(context, pipeline, [(DIT, pipeline.transformer)])
    report = runtime(root).publish_after_load(context.identity, producer=producer)
    return report, tensor_digests(pipeline)


def publish_in_child(root: str, checkpoint: str, cache_root: str, conn: Connection) -> None:
    """In a fresh process: load the pipeline and publish it after load with vLLM-Omni's producer."""
    report, digests = publish(Path(root), Path(checkpoint), Path(cache_root))
    failure = None if report.failure is None else report.failure.code.value
    conn.send({"outcome": report.outcome.value, "key": report.identity_digest, "failure": failure, "digests": digests})
    conn.close()


def restore_in_child(root: str, checkpoint: str, cache_root: str, conn: Connection) -> None:
    """In a fresh process: resolve the artifact and restore it with vLLM-Omni's restorer into a new skeleton."""
    compat.install()
    from vllm_omni.diffusion.model_loader.host_weights import FinalLayoutTensorRestorer

    skeleton = build_pipeline(seed=1)  # other values: only the restore can make them equal
    before = tensor_digests(skeleton)
    context = identity_context(skeleton, Path(checkpoint), Path(cache_root))
    resolution = runtime(Path(root)).resolve(context.identity)
    lease = resolution.lease
    answer: dict[str, Any] = {"outcome": resolution.report.outcome.value, "before": before}
    if lease is not None:
        FinalLayoutTensorRestorer(context).plan_restore(skeleton, lease).commit()
        weight = skeleton.transformer.state_dict()["proj_out.weight"]
        answer["restored"] = tensor_digests(skeleton)
        answer["shares_lease_memory"] = weight.data_ptr() == lease.tensors[f"{DIT}.proj_out.weight"].data_ptr()
        answer["key"] = lease.identity.key
    conn.send(answer)
    conn.close()


def install_facts_in_child(conn: Connection) -> None:
    """What `install()` makes of the `vllm_omni` names in a fresh process (twice: it is idempotent)."""
    import importlib
    import sys

    compat.install()
    compat.install()
    import vllm_omni.host_weight_runtime as reference
    import vllm_omni.host_weight_runtime.filesystem.locks
    from vllm_omni.diffusion.model_loader import host_weights

    facts: dict[str, Any] = {
        "same_module": reference is compat,
        "locks": vllm_omni.host_weight_runtime.filesystem.locks.__name__,
        "finders": sum(type(finder).__name__ == "_RuntimeFinder" for finder in sys.meta_path),
        "package_init_ran": hasattr(sys.modules["vllm_omni"], "OmniModelConfig"),
        "adapters_see": host_weights.contracts.HostWeightFailure.__module__,
        "vllm_loaded": "vllm" in sys.modules,
    }
    try:
        importlib.import_module("vllm_omni.host_weight_runtime.filesystem.writer")
    except ModuleNotFoundError as exc:
        facts["private"] = str(exc)
    conn.send(facts)
    conn.close()


def install_after_reference_in_child(conn: Connection) -> None:
    """`install()` in a process that already imported the reference's runtime module: refused."""
    import sys
    import types

    sys.modules["vllm_omni.host_weight_runtime"] = types.ModuleType("vllm_omni.host_weight_runtime")
    try:
        compat.install()
    except RuntimeError as exc:
        conn.send(str(exc))
    else:
        conn.send(None)
    conn.close()

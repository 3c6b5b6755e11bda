"""Online FP8 per-tensor final layouts: reference quantization, own key, fresh-process hit, TP=2 shards.

The reference quantization is written here from the definition, independently of the product:
scale = amax(|W|) / 448 in FP32 over the canonical BF16 weight, q = (W.float() / scale) cast to
float8_e4m3fn; a TP rank's shard uses the full tensor's scale.
"""

from __future__ import annotations

from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import pytest
import torch

from host_weight_runtime.config import RuntimeMode
from host_weight_runtime.diffusion import (
    ComponentLoadPath,
    FinalLayoutFP8Producer,
    FinalLayoutFP8Restorer,
    FP8Linear,
    HostWeightUsageError,
    load_component,
    prewarm_tensor_parallel,
)
from host_weight_runtime.diffusion.contracts import FinalLayoutParallelIdentity
from host_weight_runtime.diffusion.parallel.plan import localize_module
from host_weight_runtime.diffusion.representation import quantize_model_fp8
from host_weight_runtime.outcomes import PostLoadPublicationStatus, ResolutionOutcome
from hwr_tools.synthetic_models import forward_inputs, run_forward

from ._diffusion import DIT, Folder, runtime_at, save_folder
from ._tp_children import rank_contexts
from .support import recv_within, spawned_child

FLUX_TP4 = {"num_attention_heads": 4, "attention_head_dim": 8, "axes_dims_rope": (2, 2, 4)}


@pytest.fixture(scope="module")
def flux(tmp_path_factory: pytest.TempPathFactory) -> Folder:
    return save_folder(tmp_path_factory.mktemp("fp8-flux"), "flux", seed=5, config_overrides=FLUX_TP4)


def reference_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scale) of one BF16 weight by the per-tensor e4m3 definition."""
    amax = weight.detach().to(torch.float32).abs().max()
    scale = amax / torch.tensor(448.0, dtype=torch.float32)
    return (weight.detach().to(torch.float32) / scale).to(torch.float8_e4m3fn), scale


def bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def _forward(folder_root: str, model: torch.nn.Module) -> torch.Tensor:
    return run_forward("flux", model, forward_inputs("flux", model))


def _fp8_in_child(root: str, folder_root: str, conn: Connection) -> None:
    """A fresh worker: load the FP8 representation and report how, with its forward output."""
    with load_component(folder_root, subfolder=DIT, runtime=runtime_at(Path(root)), representation="fp8") as loaded:
        quantized = [m for m in loaded.model.modules() if isinstance(m, FP8Linear)]
        conn.send(
            {
                "outcome": loaded.outcome.value,
                "load_path": loaded.load_path.value,
                "identity_key": loaded.identity_key,
                "fp8_modules": len(quantized),
                "weights_are_fp8": all(m.weight.dtype == torch.float8_e4m3fn for m in quantized),
                "output": _forward(folder_root, loaded.model).to(torch.float32).numpy(),
            }
        )


def test_fp8_matches_the_reference_quantization_has_its_own_key_and_a_fresh_process_hits(
    tmp_path: Path, flux: Folder
) -> None:
    """D05/D14: representation="fp8" quantizes exactly the Linear weights (bit-equal to the reference per-tensor
    quantization of the canonical BF16 weights), keeps norms/embeddings/biases as the BF16 contract says,
    publishes under a key different from BF16's, and a fresh process hits it with a bit-identical forward."""
    root = tmp_path / "domain"
    canonical = flux.canonical()
    expected = dict(canonical.named_parameters())
    with load_component(flux.root, subfolder=DIT, runtime=runtime_at(root), representation="fp8", publish_in_background=False) as cold:
        assert cold.outcome is ResolutionOutcome.CANONICAL_FALLBACK
        assert cold.publication is not None and cold.publication.status is PostLoadPublicationStatus.PUBLISHED
        fp8_key = cold.identity_key
        quantized = {name: m for name, m in cold.model.named_modules() if isinstance(m, FP8Linear)}
        assert "transformer_blocks.0.attn.to_q" in quantized and "proj_out" in quantized
        assert not [name for name in quantized if "norm" in name or "pos_embed" in name]
        for name, module in quantized.items():
            q, scale = reference_fp8(expected[f"{name}.weight"])
            assert module.weight.dtype == torch.float8_e4m3fn and torch.equal(bits(module.weight), bits(q)), name
            assert module.weight_scale.dtype == torch.float32 and torch.equal(bits(module.weight_scale), bits(scale))
            assert torch.equal(module.dequantized_weight(), q.to(torch.float32) * scale), name
        quantized_weights = {f"{name}.weight" for name in quantized}
        kept = {name: t for name, t in cold.model.named_parameters() if name not in quantized_weights}
        assert kept.keys() == expected.keys() - quantized_weights
        for name, tensor in kept.items():
            assert tensor.dtype == expected[name].dtype and torch.equal(bits(tensor), bits(expected[name])), name
        cold_output = _forward(str(flux.root), cold.model)

    with spawned_child(_fp8_in_child, str(root), str(flux.root)) as conn:
        warm = recv_within(conn)
    assert isinstance(warm, dict)
    assert warm["outcome"] == ResolutionOutcome.LOCAL_HIT.value
    assert warm["load_path"] == ComponentLoadPath.ARTIFACT.value
    assert warm["identity_key"] == fp8_key
    assert warm["fp8_modules"] == len(quantized) and warm["weights_are_fp8"]
    assert torch.equal(torch.from_numpy(warm["output"]), cold_output.to(torch.float32))

    with load_component(flux.root, subfolder=DIT, runtime=runtime_at(root), publish_in_background=False) as bf16:
        assert bf16.identity_key not in (None, fp8_key)
        assert not [m for m in bf16.model.modules() if isinstance(m, FP8Linear)]


def test_unsupported_representation_combinations_are_usage_errors(tmp_path: Path, flux: Folder) -> None:
    """D06: an unknown representation (one component, a tensor-parallel rank or a TP prewarm) or FP8 with
    another torch_dtype is refused up front; FP8 streams at TP > 1 too, so stream_on_miss with it is not
    refused there (tests/test_diffusion_tp_group.py serves it)."""
    runtime = runtime_at(tmp_path / "domain")
    tensor_parallel = FinalLayoutParallelIdentity(tensor_parallel_size=2)
    refused: list[dict[str, Any]] = [
        {"representation": "int4"},
        {"representation": "fp8", "torch_dtype": torch.float16},
        {"representation": "int4", "stream_on_miss": True, "parallel": tensor_parallel},
    ]
    for arguments in refused:
        with pytest.raises(HostWeightUsageError):
            load_component(flux.root, subfolder=DIT, runtime=runtime, **arguments)
    with pytest.raises(HostWeightUsageError):
        prewarm_tensor_parallel(flux.root, tensor_parallel_size=2, subfolder=DIT, runtime=runtime, representation="e5m2")
    assert not (tmp_path / "domain").exists() or not list((tmp_path / "domain").rglob("*.safetensors"))


def test_tp2_fp8_shards_are_slices_of_the_full_tensor_quantization(tmp_path: Path, flux: Folder) -> None:
    """D05/D13: at TP=2 each rank's FP8 artifact holds its slice of the full-tensor quantization and the full
    tensor's scale (so ranks dequantize exactly as TP=1 does); rank keys differ; the FP8 restorer binds them."""
    expected = dict(flux.canonical().named_parameters())
    holder, contexts = rank_contexts(flux, 2, fp8=True)
    assert len({context.identity.key for context in contexts}) == 2
    quantized = {name for name, m in holder.get_submodule(DIT).named_modules() if isinstance(m, FP8Linear)}
    split = 0
    for context in contexts:
        model = flux.canonical()
        quantize_model_fp8(model)
        localize_module(model, {n.removeprefix(f"{DIT}."): s for n, s in context.tensor_shards.items()})
        runtime = runtime_at(tmp_path / f"rank{context.request.parallel.tensor_parallel_rank}", RuntimeMode.PREFERRED)
        report = runtime.publish_after_load(context.identity, FinalLayoutFP8Producer(context, [(DIT, model)]))
        assert report.status is PostLoadPublicationStatus.PUBLISHED
        resolution = runtime.resolve(context.identity, None)
        lease = resolution.lease
        assert lease is not None
        for name in quantized:
            q, scale = reference_fp8(expected[f"{name}.weight"])
            shard = context.tensor_shards.get(f"{DIT}.{name}.weight")
            split += shard is not None
            local = q if shard is None else shard.take(q)
            assert torch.equal(bits(lease.tensors[f"{DIT}.{name}.weight"]), bits(local)), name
            assert torch.equal(bits(lease.tensors[f"{DIT}.{name}.weight_scale"]), bits(scale)), name
        FinalLayoutFP8Restorer(context)._plan_on_identity_skeleton(holder, lease).commit()
        for name in quantized:
            module = holder.get_submodule(f"{DIT}.{name}")
            assert isinstance(module, FP8Linear)
            assert module.weight.data_ptr() == lease.tensors[f"{DIT}.{name}.weight"].data_ptr()
        lease.close()
    assert split > 0

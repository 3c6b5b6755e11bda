"""Small real diffusers transformers with seeded random weights, saved as real folders.

Tests, `hwr demo` and the benchmarks need genuine diffusers models (the real classes,
the real `save_pretrained` / `from_pretrained` code paths, real Hugging Face cache
layouts) but can download nothing. This module builds them from reduced configs and
fills every saved tensor with seeded random values, so a weight that a restorer drops,
casts wrongly or misplaces always changes the output:

    <pipeline root>/                    save_pipeline_folder / save_flux_pipeline_folder
    ├── model_index.json                {"_class_name": "<Pipeline>", "transformer": ["diffusers", "<Model>"]}
    └── transformer/                    save_model_folder (diffusers' save_pretrained)
        ├── config.json
        └── diffusion_pytorch_model.safetensors
            (or diffusion_pytorch_model-0000i-of-0000n.safetensors + ….safetensors.index.json)

The same folders saved as a Hugging Face cache snapshot (synthetic_hub.py) and the forward
passes the parity tests compare (synthetic_forward.py) are re-exported here.
"""

from __future__ import annotations

import copy
import hashlib
import inspect
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import diffusers
import torch
from diffusers.models.modeling_utils import ModelMixin, no_init_weights

# Re-exported: the forward passes and the hub-cache layout live in their own modules.
from .synthetic_forward import MODEL_KINDS, forward_inputs, run_forward
from .synthetic_hub import save_hub_snapshot

__all__ = [
    "MODEL_KINDS",
    "SyntheticModelSpec",
    "build_model",
    "fill_seeded",
    "flux_config_for_bytes",
    "forward_inputs",
    "run_forward",
    "save_flux_pipeline_folder",
    "save_hub_snapshot",
    "save_model_folder",
    "save_pipeline_folder",
    "tiny_spec",
]


TRANSFORMER_SUBFOLDER = "transformer"
_MODEL_INDEX = "model_index.json"

# Every generated tensor draws from its own generator seeded by (seed, tensor name), so a
# tensor's values depend only on the seed, its name and its shape: adding a layer through
# config_overrides leaves every other tensor as it was.
_BIAS_STD = 0.05
_NORM_WEIGHT_STD = 0.05


@dataclass(frozen=True)
class SyntheticModelSpec:
    """A reduced diffusers config that still has every kind of block of the real model."""

    kind: str
    class_name: str
    config: dict[str, Any]
    pipeline_class_name: str

    def model_class(self) -> Any:
        """The diffusers model class, looked up by name so callers never import it themselves.

        Typed Any: the classes mix ModelMixin with ConfigMixin, and from_config/from_pretrained are untyped.
        """
        cls = getattr(diffusers, self.class_name)
        if not (isinstance(cls, type) and issubclass(cls, ModelMixin)):
            raise TypeError(f"diffusers.{self.class_name} is not a diffusers model class")
        return cls


# Sizes are chosen so that each model stays well under 1 MB in FP32 while keeping every
# block type: Flux/Flux2 double- and single-stream blocks plus the guidance embedder,
# SD3.5-style dual-attention and context_pre_only blocks with RMS qk-norm, Wan 2.1 I2V
# (image embedder and added K/V, so every _keep_in_fp32_modules entry owns parameters),
# MiniMax-H3 token refiner, block stack and both audio/video heads. Partial rotary
# (MiniMax rotates 12 of 16 head channels) is kept on purpose.
_SPECS: dict[str, SyntheticModelSpec] = {
    "flux": SyntheticModelSpec(
        kind="flux",
        class_name="FluxTransformer2DModel",
        config={
            "patch_size": 1,
            "in_channels": 16,
            "out_channels": None,
            "num_layers": 2,
            "num_single_layers": 2,
            "attention_head_dim": 16,
            "num_attention_heads": 2,
            "joint_attention_dim": 32,
            "pooled_projection_dim": 24,
            "guidance_embeds": True,
            "axes_dims_rope": (4, 6, 6),
        },
        pipeline_class_name="FluxPipeline",
    ),
    "flux2": SyntheticModelSpec(
        kind="flux2",
        class_name="Flux2Transformer2DModel",
        config={
            "patch_size": 1,
            "in_channels": 16,
            "out_channels": None,
            "num_layers": 2,
            "num_single_layers": 2,
            "attention_head_dim": 16,
            "num_attention_heads": 2,
            "joint_attention_dim": 32,
            "timestep_guidance_channels": 32,
            "mlp_ratio": 3.0,
            "axes_dims_rope": (4, 4, 4, 4),
            "rope_theta": 2000,
            "eps": 1e-6,
            "guidance_embeds": True,
        },
        pipeline_class_name="Flux2Pipeline",
    ),
    "minimax_h3": SyntheticModelSpec(
        kind="minimax_h3",
        class_name="MiniMaxH3Transformer3DModel",
        config={
            "num_attention_heads": 4,
            "attention_head_dim": 16,
            "hidden_size": 48,
            "num_layers": 2,
            "num_refiner_layers": 1,
            "ffn_dim": 96,
            "in_channels": 8,
            "audio_in_channels": 8,
            "patch_size": (1, 2, 2),
            "text_dim": 32,
            "freq_dim": 32,
            "time_embed_hidden_dim": 48,
            "time_embed_dim": 24,
            "rope_freq_dim": 2,
            "rope_theta": 10000.0,
        },
        # diffusers 0.42 ships MiniMax-H3 only as a modular pipeline.
        pipeline_class_name="MiniMaxH3ModularPipeline",
    ),
    "sd3": SyntheticModelSpec(
        kind="sd3",
        class_name="SD3Transformer2DModel",
        config={
            "sample_size": 16,
            "patch_size": 2,
            "in_channels": 8,
            "num_layers": 2,
            "attention_head_dim": 16,
            "num_attention_heads": 2,
            "joint_attention_dim": 32,
            "caption_projection_dim": 32,
            "pooled_projection_dim": 24,
            "out_channels": 8,
            "pos_embed_max_size": 16,
            "dual_attention_layers": (0,),
            "qk_norm": "rms_norm",
        },
        pipeline_class_name="StableDiffusion3Pipeline",
    ),
    "wan": SyntheticModelSpec(
        kind="wan",
        class_name="WanTransformer3DModel",
        config={
            "patch_size": (1, 2, 2),
            "num_attention_heads": 2,
            "attention_head_dim": 16,
            "in_channels": 8,
            "out_channels": 8,
            "text_dim": 32,
            "freq_dim": 32,
            "ffn_dim": 64,
            "num_layers": 2,
            "cross_attn_norm": True,
            "qk_norm": "rms_norm_across_heads",
            "eps": 1e-6,
            "image_dim": 24,
            "added_kv_proj_dim": 32,  # must equal heads * head_dim: the image tokens are projected first
            "rope_max_seq_len": 32,
        },
        pipeline_class_name="WanImageToVideoPipeline",
    ),
}


def tiny_spec(kind: str) -> SyntheticModelSpec:
    """The reduced spec of `kind`; a deep copy, so a caller editing its config changes nothing shared."""
    return copy.deepcopy(_spec(kind))


def _spec(kind: str) -> SyntheticModelSpec:
    try:
        return _SPECS[kind]
    except KeyError:
        raise ValueError(f"unknown synthetic model kind {kind!r}: use one of {', '.join(MODEL_KINDS)}") from None


def _merged_config(spec: SyntheticModelSpec, overrides: Mapping[str, Any] | None) -> dict[str, Any]:
    """Spec config with overrides applied; unknown keys are refused because diffusers would only log them."""
    config = copy.deepcopy(spec.config)
    if overrides:
        accepted = set(inspect.signature(spec.model_class().__init__).parameters) - {"self"}
        unknown = sorted(set(overrides) - accepted)
        if unknown:
            raise ValueError(
                f"{spec.class_name} has no config field {', '.join(unknown)}: use one of {sorted(accepted)}"
            )
        config.update(copy.deepcopy(dict(overrides)))
    return config


def build_model(kind: str, *, seed: int = 0, config_overrides: Mapping[str, Any] | None = None) -> ModelMixin:
    """An FP32 `kind` model whose every saved floating tensor is seeded random, identical in every process.

    Seeded values replace diffusers' own initialisation because it zero-inits some output
    layers, which would let a restorer that drops them pass a parity test.
    """
    spec = _spec(kind)
    config = _merged_config(spec, config_overrides)
    # no_init_weights skips torch.nn.init: every saved tensor is overwritten below anyway,
    # and diffusers' default init dominates the build time of large models. The class is looked
    # up first: its lazy import can be transformers' first, which would keep the window's no-ops.
    model_class = spec.model_class()
    with no_init_weights():
        model = model_class.from_config(config)
    if not isinstance(model, ModelMixin):
        raise TypeError(f"{spec.class_name}.from_config returned {type(model).__name__}")
    # No model.to(float32): it would also cast non-persistent buffers, which from_pretrained leaves as built.
    not_fp32 = sorted(name for name, p in model.named_parameters() if p.dtype != torch.float32)
    if not_fp32:
        raise RuntimeError(f"{kind} built with non-FP32 parameters {not_fp32[:3]}: reset torch.set_default_dtype")
    fill_seeded(model, seed)
    model.eval()
    return model


def fill_seeded(model: torch.nn.Module, seed: int) -> None:
    """Overwrite every floating parameter and persistent buffer in place with values derived from (seed, name).

    Linear and convolution weights get N(0, 1/fan_in), the weights of norm modules
    1 + N(0, 0.05²) (near one, so q/k-norms keep attention far from uniform), everything
    else (biases, modulation tables, SD3's position table) N(0, 0.05²).
    """
    saved = set(model.state_dict())
    filled: set[str] = set()
    with torch.no_grad():
        for module_name, module in model.named_modules():
            is_matmul = isinstance(module, (torch.nn.Linear, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d))
            is_norm = "Norm" in type(module).__name__
            locals_ = [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
            for local_name, tensor in locals_:
                name = f"{module_name}.{local_name}" if module_name else local_name
                if name not in saved or not tensor.is_floating_point():
                    continue
                generator = torch.Generator(device="cpu").manual_seed(_tensor_seed(seed, name))
                if is_matmul and local_name == "weight":
                    mean, std = 0.0, 1.0 / math.sqrt(max(1, tensor.numel() // max(1, tensor.shape[0])))
                elif is_norm and local_name == "weight":
                    mean, std = 1.0, _NORM_WEIGHT_STD
                else:
                    mean, std = 0.0, _BIAS_STD
                if tensor.dtype == torch.float32 and tensor.device.type == "cpu" and tensor.is_contiguous():
                    tensor.normal_(mean, std, generator=generator)
                else:
                    values = torch.empty(tensor.shape, dtype=torch.float32).normal_(mean, std, generator=generator)
                    tensor.copy_(values)
                filled.add(name)
    # A tied tensor (T5's shared embedding is also encoder.embed_tokens) is filled once, under its first name.
    state = model.state_dict(keep_vars=True)
    filled_storage = {state[name].data_ptr() for name in filled}
    missed = sorted(n for n, t in state.items() if t.is_floating_point() and t.data_ptr() not in filled_storage)
    if missed:
        raise RuntimeError(f"seeded fill missed {missed}: a tensor no module owns is not supported")


def _tensor_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}\0{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def save_model_folder(model: ModelMixin, folder: Path, *, max_shard_size: int | str | None = None) -> Path:
    """A real diffusers model folder: config.json plus safetensors weights (sharded with an index if asked)."""
    if max_shard_size is None:
        model.save_pretrained(folder, safe_serialization=True)
    else:
        model.save_pretrained(folder, safe_serialization=True, max_shard_size=max_shard_size)
    return folder


def _write_pipeline_folder(
    root: Path, model: ModelMixin, pipeline_class_name: str, max_shard_size: int | str | None
) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    index = {
        "_class_name": pipeline_class_name,
        "_diffusers_version": diffusers.__version__,
        TRANSFORMER_SUBFOLDER: ["diffusers", type(model).__name__],
    }
    (root / _MODEL_INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    save_model_folder(model, root / TRANSFORMER_SUBFOLDER, max_shard_size=max_shard_size)
    return root


def save_pipeline_folder(
    root: Path,
    kind: str,
    *,
    seed: int = 0,
    max_shard_size: int | str | None = None,
    config_overrides: Mapping[str, Any] | None = None,
) -> Path:
    """A pipeline-shaped folder holding only the transformer: what `from_pretrained(root, subfolder=...)` reads."""
    model = build_model(kind, seed=seed, config_overrides=config_overrides)
    return _write_pipeline_folder(root, model, _spec(kind).pipeline_class_name, max_shard_size)


# ---------------------------------------------------------------------------------------
# The large Flux demo model


_FLUX_HEAD_DIM = 64
_FLUX_DEMO_BASE: dict[str, Any] = {
    "patch_size": 1,
    "in_channels": 64,
    "out_channels": None,
    "attention_head_dim": _FLUX_HEAD_DIM,
    "joint_attention_dim": 4096,
    "pooled_projection_dim": 768,
    "guidance_embeds": True,
    "axes_dims_rope": (8, 28, 28),
}
# One double-stream block holds about 36 d² parameters and one single-stream block about
# 15 d²; the width is chosen so that a target takes a handful of such (1 double + 2 single)
# units, keeping the layer count (and so the build time per byte) reasonable.
_FLUX_UNIT_PARAMS_PER_D2 = 36 + 2 * 15
_FLUX_UNITS_PER_TARGET = 4


def _flux_parameter_bytes(config: Mapping[str, Any]) -> int:
    """FP32 bytes of a Flux config, measured on the meta device so nothing is allocated."""
    with torch.device("meta"):
        model: torch.nn.Module = _spec("flux").model_class()(**config)
    return sum(tensor.numel() * 4 for tensor in model.state_dict().values())


def _flux_heads(wanted: float) -> int:
    """`wanted` heads rounded to a multiple of 4 once it is 2 or more, else to at least 1.

    A multiple of 4 lets the benchmark split the model at TP=2 and TP=4: every split block
    (heads, MLP width 4 * heads * 64) then divides by the TP size.
    """
    if wanted < 2:
        return max(1, int(wanted))
    return 4 * max(1, round(wanted / 4))


def flux_config_for_bytes(target_bytes: int) -> dict[str, Any]:
    """A FluxTransformer2DModel config whose FP32 weights total at least `target_bytes` (and not much more).

    From about 20 MiB up its head count is a multiple of 4, so TP=2 and TP=4 plans split it.
    """
    if target_bytes <= 0:
        raise ValueError(f"target_bytes must be positive, got {target_bytes}")
    width = math.sqrt(target_bytes / 4 / _FLUX_UNITS_PER_TARGET / _FLUX_UNIT_PARAMS_PER_D2)
    heads = _flux_heads(width / _FLUX_HEAD_DIM)
    shape = {**_FLUX_DEMO_BASE, "num_attention_heads": heads}
    base = _flux_parameter_bytes({**shape, "num_layers": 0, "num_single_layers": 0})
    double = _flux_parameter_bytes({**shape, "num_layers": 1, "num_single_layers": 0}) - base
    single = _flux_parameter_bytes({**shape, "num_layers": 0, "num_single_layers": 1}) - base
    num_layers = max(1, (target_bytes - base) // (double + 2 * single))
    num_single_layers = max(1, math.ceil((target_bytes - base - num_layers * double) / single))
    config = {**shape, "num_layers": int(num_layers), "num_single_layers": int(num_single_layers)}
    total = _flux_parameter_bytes(config)
    if total < target_bytes:
        raise RuntimeError(f"flux config for {target_bytes} bytes holds only {total}: the size model is out of date")
    return config


def save_flux_pipeline_folder(
    root: Path,
    *,
    target_bytes: int = 320 * 2**20,
    seed: int = 0,
    max_shard_size: int | str | None = None,
) -> Path:
    """A FluxPipeline-shaped folder whose FP32 transformer weights total at least `target_bytes`.

    Shards default to a third of the target, so the folder always has several shards
    and an index, as real checkpoints do.
    """
    config = flux_config_for_bytes(target_bytes)
    model = build_model("flux", seed=seed, config_overrides=config)
    shard = max_shard_size if max_shard_size is not None else max(1, math.ceil(target_bytes / 3))
    return _write_pipeline_folder(root, model, _spec("flux").pipeline_class_name, shard)

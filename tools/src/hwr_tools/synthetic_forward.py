"""Small deterministic forward passes of the synthetic models (synthetic_models.py), for parity tests:
the same inputs through a canonical and a served model must give bit-identical outputs."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

__all__ = ["MODEL_KINDS", "forward_inputs", "run_forward"]

MODEL_KINDS = ("flux", "flux2", "minimax_h3", "sd3", "wan")


def _check_kind(kind: str) -> None:
    if kind not in MODEL_KINDS:
        raise ValueError(f"unknown synthetic model kind {kind!r}: use one of {', '.join(MODEL_KINDS)}")



def _config_of(model: torch.nn.Module) -> Mapping[str, Any]:
    config = getattr(model, "config", None)
    if not isinstance(config, Mapping):
        raise TypeError(f"{type(model).__name__} has no diffusers config: pass a model built by build_model")
    return config


def forward_inputs(
    kind: str, model: torch.nn.Module, *, seed: int = 0, dtype: torch.dtype = torch.bfloat16
) -> dict[str, Any]:
    """Small deterministic keyword arguments for `model.forward`, shaped by the model's own config.

    Random values are drawn in FP32 and then cast, so inputs for different dtypes hold
    the same numbers up to rounding; position ids and index tensors are exact.
    """
    config = _config_of(model)
    generator = torch.Generator(device="cpu").manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=generator, dtype=torch.float32).to(dtype)

    _check_kind(kind)
    if kind == "flux":
        return _flux_inputs(config, randn, dtype)
    if kind == "flux2":
        return _flux2_inputs(config, randn, dtype)
    if kind == "sd3":
        return _sd3_inputs(config, randn)
    if kind == "wan":
        return _wan_inputs(config, randn)
    return _minimax_h3_inputs(config, randn)


_IMAGE_SIDE = 4  # latent tokens per side (after patching)
_TEXT_TOKENS = 8
_WAN_I2V_TEXT_TOKENS = 512  # WanAttnProcessor hard-codes 512 text tokens when added K/V projections exist
_WAN_IMAGE_TOKENS = 4


def _grid_ids(columns: int, dtype: torch.dtype) -> torch.Tensor:
    """(side², columns) position ids whose columns 1 and 2 are the row and column of each latent token."""
    rows = torch.arange(_IMAGE_SIDE).repeat_interleave(_IMAGE_SIDE)
    cols = torch.arange(_IMAGE_SIDE).repeat(_IMAGE_SIDE)
    ids = torch.zeros(_IMAGE_SIDE * _IMAGE_SIDE, columns)
    ids[:, 1] = rows
    ids[:, 2] = cols
    return ids.to(dtype)


def _flux_inputs(config: Mapping[str, Any], randn: Callable[..., torch.Tensor], dtype: torch.dtype) -> dict[str, Any]:
    inputs: dict[str, Any] = {
        "hidden_states": randn(1, _IMAGE_SIDE * _IMAGE_SIDE, config["in_channels"]),
        "encoder_hidden_states": randn(1, _TEXT_TOKENS, config["joint_attention_dim"]),
        "pooled_projections": randn(1, config["pooled_projection_dim"]),
        "timestep": torch.tensor([0.5], dtype=dtype),
        "img_ids": _grid_ids(3, dtype),
        "txt_ids": torch.zeros(_TEXT_TOKENS, 3, dtype=dtype),
    }
    if config["guidance_embeds"]:
        inputs["guidance"] = torch.tensor([4.0], dtype=dtype)  # 4000 is exact in BF16
    return inputs


def _flux2_inputs(config: Mapping[str, Any], randn: Callable[..., torch.Tensor], dtype: torch.dtype) -> dict[str, Any]:
    axes = len(config["axes_dims_rope"])
    txt_ids = torch.zeros(_TEXT_TOKENS, axes)
    txt_ids[:, axes - 1] = torch.arange(_TEXT_TOKENS)
    inputs: dict[str, Any] = {
        "hidden_states": randn(1, _IMAGE_SIDE * _IMAGE_SIDE, config["in_channels"]),
        "encoder_hidden_states": randn(1, _TEXT_TOKENS, config["joint_attention_dim"]),
        "timestep": torch.tensor([0.5], dtype=dtype),
        "img_ids": _grid_ids(axes, dtype),
        "txt_ids": txt_ids.to(dtype),
    }
    if config["guidance_embeds"]:
        inputs["guidance"] = torch.tensor([4.0], dtype=dtype)
    return inputs


def _sd3_inputs(config: Mapping[str, Any], randn: Callable[..., torch.Tensor]) -> dict[str, Any]:
    side = _IMAGE_SIDE * config["patch_size"]
    return {
        "hidden_states": randn(1, config["in_channels"], side, side),
        "encoder_hidden_states": randn(1, _TEXT_TOKENS, config["joint_attention_dim"]),
        "pooled_projections": randn(1, config["pooled_projection_dim"]),
        "timestep": torch.tensor([500.0]),
    }


def _wan_inputs(config: Mapping[str, Any], randn: Callable[..., torch.Tensor]) -> dict[str, Any]:
    p_t, p_h, p_w = config["patch_size"]
    i2v = config["added_kv_proj_dim"] is not None
    inputs: dict[str, Any] = {
        "hidden_states": randn(1, config["in_channels"], 2 * p_t, 2 * p_h, 2 * p_w),
        "timestep": torch.tensor([500.0]),
        "encoder_hidden_states": randn(1, _WAN_I2V_TEXT_TOKENS if i2v else _TEXT_TOKENS, config["text_dim"]),
    }
    if config["image_dim"] is not None:
        inputs["encoder_hidden_states_image"] = randn(1, _WAN_IMAGE_TOKENS, config["image_dim"])
    return inputs


def _minimax_h3_inputs(config: Mapping[str, Any], randn: Callable[..., torch.Tensor]) -> dict[str, Any]:
    """One packed sequence: 5 text rows, a 1x2x2 video grid, 3 audio rows; text at timestep 0, the rest at 1."""
    p_t, p_h, p_w = config["patch_size"]
    text, audio = 5, 3
    grid = [(t, h, w) for t in range(1) for h in range(2) for w in range(2)]
    video = len(grid)
    positions = [(k, 0, 0) for k in range(text)] + grid + [(k, 0, 0) for k in range(audio)]
    length = text + video + audio
    return {
        "hidden_states": randn(1, video, config["in_channels"] * p_t * p_h * p_w),
        "audio_hidden_states": randn(1, audio, config["audio_in_channels"]),
        "encoder_hidden_states": randn(1, text, config["text_dim"]),
        "timestep": torch.tensor([0.0, 0.75]),
        "timestep_indices": torch.tensor([0] * text + [1] * (video + audio)),
        "token_tags": torch.tensor([1] * text + [0] * video + [2] * audio),
        "position_ids": torch.tensor(positions),
        "video_indices": torch.arange(text, text + video),
        "audio_indices": torch.arange(text + video, length),
        "text_indices": torch.arange(text),
    }


def run_forward(kind: str, model: torch.nn.Module, inputs: Mapping[str, Any]) -> torch.Tensor:
    """The model's (video) sample for `inputs`, without autograd: `model(**inputs, return_dict=False)[0]`."""
    _check_kind(kind)
    with torch.inference_mode():
        outputs = model(**inputs, return_dict=False)
    sample = outputs[0]
    if not isinstance(sample, torch.Tensor):
        raise TypeError(f"{type(model).__name__} returned {type(sample).__name__} as its sample")
    return sample

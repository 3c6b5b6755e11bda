"""Whole tiny diffusers pipelines with seeded random weights, saved as real pipeline folders.

`load_pipeline` must give exactly the images of `DiffusionPipeline.from_pretrained`, so its
tests, the demo and the benchmark need real pipelines: the real model classes, real
tokenizers, schedulers and `model_index.json`, all written by `save_pretrained`. Nothing can be
downloaded, so the tokenizers are made here with the `tokenizers`-backed transformers classes
(a character-level BPE for CLIP and Gemma, a Unigram for T5) and every weight is seeded:

    <root>/model_index.json             written by the pipeline's save_pretrained
    <root>/scheduler/scheduler_config.json
    <root>/tokenizer*/tokenizer.json     (+ tokenizer_config.json)
    <root>/text_encoder*/config.json     + model.safetensors (transformers)
    <root>/transformer|unet|vae/config.json + diffusion_pytorch_model.safetensors
"""

from __future__ import annotations

import string
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import diffusers as _diffusers
import torch
import transformers as _transformers
from diffusers.models.modeling_utils import no_init_weights

from .synthetic_models import build_model, fill_seeded

# Both libraries are typed loosely (untyped constructors, lazy module attributes).
diffusers: Any = _diffusers
transformers: Any = _transformers

__all__ = [
    "PIPELINE_KINDS",
    "PipelineKind",
    "build_pipeline",
    "generation_kwargs",
    "pipeline_kind",
    "save_proportional_flux_pipeline",
    "save_tiny_pipeline",
]

CLIP_MAX_LENGTH = 16
"""Tokens per CLIP prompt (the tiny CLIP encoders have that many positions)."""
T5_MAX_LENGTH = 16
"""Tokens per T5/Gemma prompt, passed to pipelines as `max_sequence_length`."""
PROMPT = "red cube"

_CHARACTERS = [c for c in string.printable if not c.isspace()]


@dataclass(frozen=True, slots=True)
class PipelineKind:
    """One tiny pipeline: the diffusers class, its working dtype and how to call it for one image."""

    name: str
    pipeline_class_name: str
    torch_dtype: torch.dtype
    height: int
    build: Callable[[int], dict[str, Any]]
    call: Mapping[str, Any]

    def pipeline_class(self) -> Any:
        return getattr(diffusers, self.pipeline_class_name)


# ---------------------------------------------------------------------------------------
# Tokenizers, made locally


def clip_tokenizer() -> Any:
    """A CLIP BPE over single printable characters (word-final forms end in `</w>`), no merges."""
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for suffix in ("", "</w>"):
        for character in _CHARACTERS:
            vocab[character + suffix] = len(vocab)
    return transformers.CLIPTokenizer(vocab=vocab, merges=[], model_max_length=CLIP_MAX_LENGTH)


def t5_tokenizer() -> Any:
    """A T5 Unigram over printable characters and word-initial lowercase letters, no extra ids."""
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    pieces += [(character, -3.0) for character in _CHARACTERS]
    pieces += [("\u2581" + letter, -2.5) for letter in string.ascii_lowercase]
    return transformers.T5Tokenizer(vocab=pieces, extra_ids=0, model_max_length=T5_MAX_LENGTH)


def gemma_tokenizer() -> Any:
    """A Gemma BPE over printable characters with one merge per word-initial lowercase letter."""
    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3, "<mask>": 4, "\u2581": 5}
    for character in _CHARACTERS:
        vocab[character] = len(vocab)
    merges = [("\u2581", letter) for letter in string.ascii_lowercase]
    for left, right in merges:
        vocab[left + right] = len(vocab)
    return transformers.GemmaTokenizerFast(vocab=vocab, merges=merges, model_max_length=T5_MAX_LENGTH)


# ---------------------------------------------------------------------------------------
# Seeded components


def _seeded(model: torch.nn.Module, seed: int, dtype: torch.dtype = torch.float32) -> Any:
    """Every saved floating tensor drawn from (seed, name), tied tensors once; then cast for saving."""
    fill_seeded(model, seed)
    model.eval()
    return model.to(dtype) if dtype != torch.float32 else model


def _diffusers_model(class_name: str, seed: int, **config: Any) -> Any:
    model_class = getattr(diffusers, class_name)  # outside the window: its lazy import may be transformers' first
    with no_init_weights():
        model = model_class.from_config(config)
    return _seeded(model, seed)


def _clip(seed: int, hidden: int, projection: int | None = None) -> Any:
    config = transformers.CLIPTextConfig(
        vocab_size=2 + 2 * len(_CHARACTERS),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=CLIP_MAX_LENGTH,
        projection_dim=projection if projection is not None else hidden,
        hidden_act="gelu",
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
    )
    model_class = transformers.CLIPTextModel if projection is None else transformers.CLIPTextModelWithProjection
    return _seeded(model_class(config), seed)


def _t5(seed: int, d_model: int) -> Any:
    config = transformers.T5Config(
        vocab_size=4 + len(_CHARACTERS) + len(string.ascii_lowercase),
        d_model=d_model,
        d_kv=8,
        d_ff=2 * d_model,
        num_layers=2,
        num_heads=2,
        relative_attention_num_buckets=8,
        feed_forward_proj="gated-gelu",
        pad_token_id=0,
        eos_token_id=1,
        decoder_start_token_id=0,
    )
    return _seeded(transformers.T5EncoderModel(config), seed)


def _gemma2(seed: int, hidden: int) -> Any:
    config = transformers.Gemma2Config(
        vocab_size=6 + len(_CHARACTERS) + len(string.ascii_lowercase),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        max_position_embeddings=64,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
    )
    return _seeded(transformers.Gemma2Model(config), seed)


def _vae(seed: int, latent_channels: int, *, shift: float | None = None) -> Any:
    extra = {} if shift is None else {"shift_factor": shift, "use_quant_conv": False, "use_post_quant_conv": False}
    return _diffusers_model(
        "AutoencoderKL",
        seed,
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
        block_out_channels=(8, 8),
        layers_per_block=1,
        latent_channels=latent_channels,
        norm_num_groups=2,
        sample_size=32,
        scaling_factor=0.5,
        **extra,
    )


def _flow_scheduler(**config: Any) -> Any:
    return diffusers.FlowMatchEulerDiscreteScheduler(**config)


def _flux(seed: int) -> dict[str, Any]:
    return {
        "transformer": build_model("flux", seed=seed),
        "vae": _vae(seed + 1, 4, shift=0.1),
        "text_encoder": _clip(seed + 2, 24),
        "tokenizer": clip_tokenizer(),
        "text_encoder_2": _t5(seed + 3, 32),
        "tokenizer_2": t5_tokenizer(),
        "scheduler": _flow_scheduler(),
    }


def _sd3(seed: int) -> dict[str, Any]:
    return {
        "transformer": build_model("sd3", seed=seed),
        "vae": _vae(seed + 1, 8, shift=0.1),
        "text_encoder": _clip(seed + 2, 16, projection=12),
        "tokenizer": clip_tokenizer(),
        "text_encoder_2": _clip(seed + 4, 16, projection=12),
        "tokenizer_2": clip_tokenizer(),
        "text_encoder_3": _t5(seed + 3, 32),
        "tokenizer_3": t5_tokenizer(),
        "scheduler": _flow_scheduler(shift=3.0),
    }


def _pixart_sigma(seed: int) -> dict[str, Any]:
    transformer = _diffusers_model(
        "PixArtTransformer2DModel",
        seed,
        sample_size=8,
        num_layers=2,
        patch_size=2,
        attention_head_dim=8,
        num_attention_heads=2,
        caption_channels=32,
        in_channels=4,
        cross_attention_dim=16,
        out_channels=8,
        attention_bias=True,
        activation_fn="gelu-approximate",
        num_embeds_ada_norm=1000,
        norm_type="ada_norm_single",
        norm_elementwise_affine=False,
        norm_eps=1e-6,
        use_additional_conditions=False,
    )
    return {
        "transformer": transformer,
        "vae": _vae(seed + 1, 4),
        "text_encoder": _t5(seed + 3, 32),
        "tokenizer": t5_tokenizer(),
        "scheduler": diffusers.DDIMScheduler(),
    }


def _sdxl(seed: int) -> dict[str, Any]:
    unet = _diffusers_model(
        "UNet2DConditionModel",
        seed,
        block_out_channels=(16, 32),
        layers_per_block=1,
        sample_size=8,
        in_channels=4,
        out_channels=4,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        attention_head_dim=(2, 4),
        use_linear_projection=True,
        addition_embed_type="text_time",
        addition_time_embed_dim=8,
        transformer_layers_per_block=(1, 1),
        projection_class_embeddings_input_dim=6 * 8 + 16,
        cross_attention_dim=32,
        norm_num_groups=4,
    )
    return {
        "unet": unet,
        "vae": _vae(seed + 1, 4),
        "text_encoder": _clip(seed + 2, 16),
        "tokenizer": clip_tokenizer(),
        "text_encoder_2": _clip(seed + 4, 16, projection=16),
        "tokenizer_2": clip_tokenizer(),
        "scheduler": diffusers.EulerDiscreteScheduler(),
    }


def _sana(seed: int) -> dict[str, Any]:
    transformer = _diffusers_model(
        "SanaTransformer2DModel",
        seed,
        patch_size=1,
        in_channels=4,
        out_channels=4,
        num_layers=2,
        num_attention_heads=2,
        attention_head_dim=8,
        num_cross_attention_heads=2,
        cross_attention_head_dim=8,
        cross_attention_dim=16,
        caption_channels=16,
        sample_size=8,
    )
    vae = _diffusers_model(
        "AutoencoderDC",
        seed + 1,
        in_channels=3,
        latent_channels=4,
        attention_head_dim=2,
        encoder_block_types=("ResBlock", "EfficientViTBlock"),
        decoder_block_types=("ResBlock", "EfficientViTBlock"),
        encoder_block_out_channels=(8, 8),
        decoder_block_out_channels=(8, 8),
        encoder_qkv_multiscales=((), (5,)),
        decoder_qkv_multiscales=((), (5,)),
        encoder_layers_per_block=(1, 1),
        decoder_layers_per_block=(1, 1),
        upsample_block_type="interpolate",
        downsample_block_type="stride_conv",
        decoder_norm_types="rms_norm",
        decoder_act_fns="silu",
        scaling_factor=0.5,
    )
    return {
        "transformer": transformer,
        "vae": vae,
        "text_encoder": _gemma2(seed + 3, 16),
        "tokenizer": gemma_tokenizer(),
        "scheduler": diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0),
    }


_COMMON_CALL = {"prompt": PROMPT, "num_inference_steps": 2, "output_type": "pt"}
_T5_CALL = {**_COMMON_CALL, "max_sequence_length": T5_MAX_LENGTH}

PIPELINE_KINDS: dict[str, PipelineKind] = {
    kind.name: kind
    for kind in (
        PipelineKind("flux", "FluxPipeline", torch.bfloat16, 16, _flux, {**_T5_CALL, "guidance_scale": 3.5}),
        PipelineKind("sd3", "StableDiffusion3Pipeline", torch.bfloat16, 16, _sd3, {**_T5_CALL, "guidance_scale": 2.0}),
        PipelineKind(
            "pixart_sigma",
            "PixArtSigmaPipeline",
            torch.bfloat16,
            16,
            _pixart_sigma,
            {**_T5_CALL, "guidance_scale": 2.0, "use_resolution_binning": False, "clean_caption": False},
        ),
        PipelineKind(
            "sdxl", "StableDiffusionXLPipeline", torch.float16, 16, _sdxl, {**_COMMON_CALL, "guidance_scale": 2.0}
        ),
        PipelineKind(
            "sana",
            "SanaPipeline",
            torch.bfloat16,
            32,
            _sana,
            {
                **_COMMON_CALL,
                "max_sequence_length": T5_MAX_LENGTH,
                "guidance_scale": 2.0,
                "complex_human_instruction": None,
                "use_resolution_binning": False,
                "clean_caption": False,
            },
        ),
    )
}


def pipeline_kind(name: str) -> PipelineKind:
    try:
        return PIPELINE_KINDS[name]
    except KeyError:
        raise ValueError(f"unknown tiny pipeline {name!r}: use one of {', '.join(PIPELINE_KINDS)}") from None


def build_pipeline(name: str, *, seed: int = 0) -> Any:
    """The tiny `name` pipeline in memory, FP32, every weight seeded (identical in every process)."""
    kind = pipeline_kind(name)
    components = kind.build(seed)
    return kind.pipeline_class()(**components)


def save_tiny_pipeline(root: Path, name: str, *, seed: int = 0) -> Path:
    """A real pipeline folder (`save_pretrained`, safetensors) of the tiny `name` pipeline."""
    build_pipeline(name, seed=seed).save_pretrained(str(root), safe_serialization=True)
    return root


def generation_kwargs(name: str, seed: int = 0) -> dict[str, Any]:
    """The arguments that make one small image deterministically (a fresh seeded CPU generator)."""
    kind = pipeline_kind(name)
    generator = torch.Generator(device="cpu").manual_seed(seed)
    return {**kind.call, "height": kind.height, "width": kind.height, "generator": generator}


def _t5_config(d_model: int, num_layers: int) -> Any:
    return transformers.T5Config(
        vocab_size=4 + len(_CHARACTERS) + len(string.ascii_lowercase),
        d_model=d_model,
        d_kv=64,
        d_ff=1024,
        num_layers=num_layers,
        num_heads=8,
        relative_attention_num_buckets=8,
        feed_forward_proj="gated-gelu",
        pad_token_id=0,
        eos_token_id=1,
        decoder_start_token_id=0,
    )


def _t5_bytes(config: Any) -> int:
    """FP32 bytes of a T5 encoder, measured on the meta device so nothing is allocated."""
    with torch.device("meta"):
        model = transformers.T5EncoderModel(config)
    return sum(tensor.numel() * 4 for tensor in model.state_dict().values())


def save_proportional_flux_pipeline(root: Path, *, transformer_bytes: int, seed: int = 0) -> Path:
    """A Flux pipeline folder with real proportions: the transformer about 2.5x the bytes of its T5 encoder.

    For the demo and the benchmark: a transformer of about `transformer_bytes` (FP32), a T5
    encoder of d_model `joint_attention_dim` with as many layers as make about 40% of that, a
    CLIP text encoder of width `pooled_projection_dim`, and the tiny VAE, tokenizers and scheduler.
    """
    from .synthetic_models import flux_config_for_bytes

    config = flux_config_for_bytes(transformer_bytes)
    d_model = int(config["joint_attention_dim"])
    base = _t5_bytes(_t5_config(d_model, 0))
    per_layer = _t5_bytes(_t5_config(d_model, 1)) - base
    layers = max(1, round((transformer_bytes / 2.5 - base) / per_layer))
    components = _flux(seed)
    components["transformer"] = build_model("flux", seed=seed, config_overrides=config)
    components["vae"] = _vae(seed + 1, int(config["in_channels"]) // 4, shift=0.1)  # Flux packs 2x2 latents
    components["text_encoder"] = _clip(seed + 2, int(config["pooled_projection_dim"]))
    components["text_encoder_2"] = _seeded(transformers.T5EncoderModel(_t5_config(d_model, layers)), seed + 3)
    diffusers.FluxPipeline(**components).save_pretrained(str(root), safe_serialization=True)
    return root

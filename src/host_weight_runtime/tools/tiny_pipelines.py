"""Whole tiny diffusers pipelines (text encoders, tokenizers, VAE, scheduler, transformer) saved as real folders.

A serving test needs what a user serves: a folder `DiffusionPipeline.from_pretrained` opens and
that turns a prompt into an image. Nothing can come from the Hugging Face hub here, so the
tokenizers are built locally (a character-level CLIP BPE vocabulary and a T5 unigram model);
every model is a real diffusers/transformers class built small from a config with a fixed seed.
The transformer is the synthetic one of `synthetic_models`, so its contract tests apply too.
"""

from __future__ import annotations

import importlib
import json
import string
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .synthetic_models import build_model

__all__ = ["PIPELINE_KINDS", "TOKEN_LIMIT", "save_tiny_pipeline"]

# Prompts are cut to this many tokens by every tokenizer, and the text encoders are sized for it.
TOKEN_LIMIT = 16
_LETTERS = string.ascii_lowercase


def _module(name: str) -> Any:
    """diffusers, transformers or tokenizers, typed Any: they are untyped, or typed too loosely for --strict."""
    return importlib.import_module(name)


def _clip_tokenizer(folder: Path) -> Any:
    """A CLIP BPE tokenizer over single letters (no merges): every word is spelled out."""
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for letter in _LETTERS:
        vocab[letter] = len(vocab)
    for letter in _LETTERS:
        vocab[letter + "</w>"] = len(vocab)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
    (folder / "merges.txt").write_text("#version: 0.2\n", encoding="utf-8")
    return _module("transformers").CLIPTokenizer(
        str(folder / "vocab.json"), str(folder / "merges.txt"), model_max_length=TOKEN_LIMIT
    )


def _t5_tokenizer() -> Any:
    """A T5 tokenizer over a unigram model of single letters."""
    tokenizers = _module("tokenizers")
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)] + [(letter, -1.0) for letter in _LETTERS]
    backend = tokenizers.Tokenizer(tokenizers.models.Unigram(pieces, unk_id=2))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Metaspace()
    return _module("transformers").T5TokenizerFast(
        tokenizer_object=backend,
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        extra_ids=0,
        model_max_length=TOKEN_LIMIT,
    )


def _clip_encoder(hidden: int, *, projection: int | None, seed: int) -> Any:
    transformers = _module("transformers")
    config = transformers.CLIPTextConfig(
        vocab_size=2 + 2 * len(_LETTERS),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=TOKEN_LIMIT,
        projection_dim=projection or hidden,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
    )
    torch.manual_seed(seed)
    kind = transformers.CLIPTextModel if projection is None else transformers.CLIPTextModelWithProjection
    model = kind(config)
    return model.eval()


def _t5_encoder(d_model: int, *, seed: int) -> Any:
    transformers = _module("transformers")
    config = transformers.T5Config(
        vocab_size=3 + len(_LETTERS),
        d_model=d_model,
        d_kv=8,
        d_ff=2 * d_model,
        num_layers=2,
        num_heads=2,
        relative_attention_num_buckets=8,
        decoder_start_token_id=0,
        pad_token_id=0,
        eos_token_id=1,
    )
    torch.manual_seed(seed)
    return transformers.T5EncoderModel(config).eval()


def _vae(latent_channels: int, *, seed: int, shift: float, scale: float) -> Any:
    torch.manual_seed(seed)
    return (
        _module("diffusers")
        .AutoencoderKL(
            in_channels=3,
            out_channels=3,
            down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
            up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
            block_out_channels=(8, 16),
            layers_per_block=1,
            latent_channels=latent_channels,
            norm_num_groups=4,
            sample_size=16,
            shift_factor=shift,
            scaling_factor=scale,
            use_quant_conv=False,
            use_post_quant_conv=False,
        )
        .eval()
    )


def _flux(folder: Path, seed: int) -> Any:
    diffusers = _module("diffusers")
    transformer = build_model("flux", seed=seed)  # in_channels 16 = 4 latent channels packed 2x2
    return diffusers.FluxPipeline(
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=False),
        vae=_vae(4, seed=seed + 1, shift=0.0609, scale=1.5035),
        text_encoder=_clip_encoder(24, projection=None, seed=seed + 2),  # pooled size = pooled_projection_dim
        tokenizer=_clip_tokenizer(folder / "_clip_vocab"),
        text_encoder_2=_t5_encoder(32, seed=seed + 3),  # d_model = joint_attention_dim
        tokenizer_2=_t5_tokenizer(),
        transformer=transformer,
    )


def _sd3(folder: Path, seed: int) -> Any:
    diffusers = _module("diffusers")
    transformer = build_model("sd3", seed=seed)  # in_channels 8; pooled 24 = 12 + 12; joint 32 = T5 d_model
    return diffusers.StableDiffusion3Pipeline(
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0),
        vae=_vae(8, seed=seed + 1, shift=0.0609, scale=1.5305),
        text_encoder=_clip_encoder(12, projection=12, seed=seed + 2),
        tokenizer=_clip_tokenizer(folder / "_clip_vocab"),
        text_encoder_2=_clip_encoder(12, projection=12, seed=seed + 4),
        tokenizer_2=_clip_tokenizer(folder / "_clip_vocab_2"),
        text_encoder_3=_t5_encoder(32, seed=seed + 3),
        tokenizer_3=_t5_tokenizer(),
        transformer=transformer,
    )


_BUILDERS: dict[str, Callable[[Path, int], Any]] = {"flux": _flux, "sd3": _sd3}
PIPELINE_KINDS = tuple(_BUILDERS)


def save_tiny_pipeline(root: Path, kind: str = "flux", *, seed: int = 0) -> Path:
    """Save a whole tiny `kind` pipeline ("flux" or "sd3") at `root` in diffusers' safetensors layout."""
    try:
        builder = _BUILDERS[kind]
    except KeyError:
        raise ValueError(f"unknown pipeline kind {kind!r}: use one of {', '.join(PIPELINE_KINDS)}") from None
    scratch = root.parent / f".{root.name}.vocab"
    pipeline = builder(scratch, seed)
    pipeline.save_pretrained(root, safe_serialization=True)
    for leftover in sorted(scratch.rglob("*"), reverse=True):
        leftover.unlink() if leftover.is_file() else leftover.rmdir()
    scratch.rmdir()
    return root

"""Tiny real transformers encoders, saved with `save_pretrained` into a pipeline-shaped folder.

Each kind is a real transformers class built from a small config with a fixed seed, saved as
transformers saves it (T5's tied `encoder.embed_tokens.weight` is left out of the checkpoint,
Qwen2.5-VL's keys keep their pre-v5 names), next to a `model_index.json` that names the class
as a diffusers pipeline does. Functions here also run in spawned children (module level).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

from host_weight_runtime.config import HostWeightRuntimeConfig, RuntimeMode
from host_weight_runtime.runtime import HostWeightRuntime

Payload = tuple[str, tuple[int, ...], bytes]
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True, slots=True)
class EncoderSpec:
    """One tiny encoder: its class, its config, and what its forward takes."""

    class_name: str
    config: Callable[[], Any]
    vision: bool = False


def _clip() -> Any:
    from transformers import CLIPTextConfig

    return CLIPTextConfig(
        vocab_size=99,
        hidden_size=32,
        intermediate_size=37,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=32,
        projection_dim=16,
    )


_T5_SIZES: dict[str, Any] = {
    "vocab_size": 64,
    "d_model": 32,
    "d_kv": 8,
    "d_ff": 64,
    "num_layers": 2,
    "num_heads": 4,
    "relative_attention_num_buckets": 8,
}
"""The size of both tiny T5-style encoders (T5 and UMT5)."""

_DECODER_SIZES: dict[str, Any] = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
"""The size of every tiny decoder-style text model (Gemma2, Llama, Qwen2.5-VL's text model)."""


def _t5() -> Any:
    from transformers import T5Config

    return T5Config(**_T5_SIZES, feed_forward_proj="gated-gelu")


def _umt5() -> Any:
    from transformers import UMT5Config

    return UMT5Config(**_T5_SIZES)


def _gemma2() -> Any:
    from transformers import Gemma2Config

    return Gemma2Config(vocab_size=64, head_dim=8, **_DECODER_SIZES)


def _llama() -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=64, **_DECODER_SIZES)


def _qwen2_5_vl() -> Any:
    from transformers import Qwen2_5_VLConfig

    return Qwen2_5_VLConfig(
        text_config={
            "vocab_size": 128,
            **_DECODER_SIZES,
            "rope_scaling": {"type": "mrope", "mrope_section": [1, 1, 2]},
        },
        vision_config={
            "depth": 2,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 4,
            "out_hidden_size": 32,
            "patch_size": 2,
            "spatial_merge_size": 1,
            "temporal_patch_size": 1,
            "window_size": 4,
            "fullatt_block_indexes": [1],
        },
    )


def _siglip() -> Any:
    from transformers import SiglipVisionConfig

    return SiglipVisionConfig(
        hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4, image_size=30, patch_size=6
    )


ENCODERS: dict[str, EncoderSpec] = {
    "text_encoder": EncoderSpec("CLIPTextModel", _clip),
    "text_encoder_2": EncoderSpec("T5EncoderModel", _t5),
    "text_encoder_3": EncoderSpec("CLIPTextModelWithProjection", _clip),
    "umt5": EncoderSpec("UMT5EncoderModel", _umt5),
    "gemma2": EncoderSpec("Gemma2Model", _gemma2),
    "llama": EncoderSpec("LlamaModel", _llama),
    "qwen2_5_vl": EncoderSpec("Qwen2_5_VLForConditionalGeneration", _qwen2_5_vl),
    "image_encoder": EncoderSpec("SiglipVisionModel", _siglip, vision=True),
}
"""Subfolder -> encoder; the first two are where a Flux pipeline keeps its CLIP and T5 encoders."""


def model_class(subfolder: str) -> type[Any]:
    import transformers

    found: type[Any] = getattr(transformers, ENCODERS[subfolder].class_name)
    return found


def save_encoder(folder: Path, subfolder: str, *, seed: int) -> Path:
    """Build the encoder with a fixed seed and save it with `save_pretrained` under `folder/subfolder`."""
    torch.manual_seed(seed)
    model = model_class(subfolder)(ENCODERS[subfolder].config())
    model.save_pretrained(folder / subfolder)
    return folder / subfolder


def save_encoder_pipeline(folder: Path, subfolders: tuple[str, ...] = tuple(ENCODERS), *, seed: int = 0) -> Path:
    """A pipeline-shaped folder: every encoder in its subfolder and a model_index.json naming each class."""
    index: dict[str, Any] = {"_class_name": "FluxPipeline", "_diffusers_version": "0.42.1"}
    for position, subfolder in enumerate(subfolders):
        save_encoder(folder, subfolder, seed=seed + position)
        index[subfolder] = ["transformers", ENCODERS[subfolder].class_name]
    (folder / "model_index.json").write_text(json.dumps(index, indent=2))
    return folder


def forward_inputs(subfolder: str) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(11)
    if ENCODERS[subfolder].vision:
        return {"pixel_values": torch.randn(1, 3, 30, 30, generator=generator)}
    return {"input_ids": torch.randint(0, 60, (1, 7), generator=generator)}


def forward(subfolder: str, model: torch.nn.Module) -> torch.Tensor:
    """The model's first output on fixed inputs (vision inputs in the model's own dtype)."""
    inputs = forward_inputs(subfolder)
    if "pixel_values" in inputs:
        inputs["pixel_values"] = inputs["pixel_values"].to(next(model.parameters()).dtype)
    with torch.no_grad():
        output = model(**inputs)
    first: torch.Tensor = output[0]
    return first


def canonical(folder: Path, subfolder: str, dtype: torch.dtype) -> torch.nn.Module:
    """Exactly what a transformers user gets: from_pretrained(folder, dtype=...)."""
    loaded: torch.nn.Module = model_class(subfolder).from_pretrained(str(folder / subfolder), dtype=dtype)
    return loaded


def payload(tensor: torch.Tensor) -> Payload:
    """A tensor as plain bytes, so it crosses a pipe without torch's shared-memory reductions."""
    flat = tensor.detach().contiguous()
    return str(flat.dtype), tuple(flat.shape), flat.reshape(-1).view(torch.uint8).numpy().tobytes()


def every_tensor(model: torch.nn.Module) -> dict[str, Payload]:
    """Every parameter and buffer (tied names too), persistent or not, as raw bytes."""
    named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    return {name: payload(tensor) for name, tensor in named}


def runtime_at(root: Path, mode: RuntimeMode = RuntimeMode.PREFERRED) -> HostWeightRuntime:
    return HostWeightRuntime(HostWeightRuntimeConfig(mode=mode, root=root))


def warm_load_every_encoder_in_child(root: str, folder: str, subfolders: list[str], conn: Connection) -> None:
    """One fresh worker for every encoder (each starts with nothing of its own loaded): load each at every
    served dtype and report, per subfolder, the outcome, every tensor and the output."""
    import transformers

    transformers.logging.set_verbosity_error()
    conn.send({subfolder: _warm_reports(Path(root), folder, subfolder) for subfolder in subfolders})


def _warm_reports(root: Path, folder: str, subfolder: str) -> list[dict[str, Any]]:
    from host_weight_runtime.diffusion import load_component

    reports: list[dict[str, Any]] = []
    for dtype in DTYPES:
        with load_component(folder, subfolder=subfolder, runtime=runtime_at(root), torch_dtype=dtype) as loaded:
            model = loaded.model
            live = dict(model.named_parameters(remove_duplicate=False))
            reports.append(
                {
                    "dtype": str(dtype),
                    "outcome": loaded.outcome.value,
                    "load_path": loaded.load_path.value,
                    "identity_key": loaded.identity_key,
                    "tensors": every_tensor(model),
                    "output": payload(forward(subfolder, model)),
                    "compact_output": payload(forward(subfolder, copy.deepcopy(model))),
                    "training": model.training,
                    "tied": sorted(
                        name
                        for name, tensor in live.items()
                        if any(other is tensor for o, other in live.items() if o != name)
                    ),
                }
            )
    return reports


def stand_in_initializers() -> list[str]:
    """The entries of transformers' initializer table that are not torch's own functions (none in a sound process)."""
    import importlib

    table = importlib.import_module("transformers.initialization").TORCH_INIT_FUNCTIONS
    return sorted(name for name, function in table.items() if function.__module__ != "torch.nn.init")


def load_after_transformers_imported_in_no_init_weights(root: str, folder: str, subfolder: str, conn: Connection) -> None:
    """A fresh worker whose first transformers import happens inside diffusers' `no_init_weights()` (as a
    diffusers class looked up lazily there imports it, through peft), so transformers records the window's
    no-op initializers; a load inside that window (refused), then a cold and a warm BF16 load of `subfolder`,
    each reported with every tensor."""
    import sys

    from diffusers.models.modeling_utils import no_init_weights

    from host_weight_runtime.diffusion import load_component
    from host_weight_runtime.failures import HostWeightUsageError

    imported_before = "transformers.initialization" in sys.modules
    with no_init_weights():
        import transformers.modeling_utils  # noqa: F401  (the import is the point: it copies the no-ops)
    recorded = stand_in_initializers()
    refused = ""
    with no_init_weights():  # torch's own functions swapped out too: nothing can repair the table, so refused
        try:
            load_component(folder, subfolder=subfolder, runtime=runtime_at(Path(root))).close()
        except HostWeightUsageError as exc:
            refused = str(exc)
    reports: list[dict[str, Any]] = []
    for _attempt in ("cold", "warm"):
        with load_component(
            folder, subfolder=subfolder, runtime=runtime_at(Path(root)), publish_in_background=False
        ) as loaded:
            reports.append({"outcome": loaded.outcome.value, "tensors": every_tensor(loaded.model)})
    conn.send(
        {
            "imported_before": imported_before,
            "refused": refused,
            "recorded": recorded,
            "reports": reports,
            "after": stand_in_initializers(),
            "from_pretrained": every_tensor(canonical(Path(folder), subfolder, torch.bfloat16)),
        }
    )

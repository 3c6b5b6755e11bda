"""Helpers for the serving tests: small LoRA adapters made locally, and canonical images made in a fresh process.

`python -m tests._serve_support REQUEST_JSON` prints, as JSON, the images a canonical
`DiffusionPipeline.from_pretrained(folder, dtype=torch.bfloat16)` generates for each request,
so a test can compare a served answer with what plain diffusers gives, computed in a process of its own.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch

from hwr_tools.synthetic_models import build_model
from hwr_tools.synthetic_pipelines import T5_MAX_LENGTH

SERVE_EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "serve"
LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]
CALL_KWARGS: dict[str, Any] = {"max_sequence_length": T5_MAX_LENGTH}


def pipeline_class(kind: str) -> Any:
    import diffusers

    return {"flux": diffusers.FluxPipeline, "sd3": diffusers.StableDiffusion3Pipeline}[kind]


def make_lora(kind: str, out_dir: Path, *, seed: int, config_overrides: dict[str, Any] | None = None) -> Path:
    """A rank-2 LoRA on the attention projections of the tiny `kind` transformer, with random (non-zero) weights,
    saved by the pipeline class's own `save_lora_weights`."""
    from peft import LoraConfig, get_peft_model_state_dict

    transformer = build_model(kind, seed=seed, config_overrides=config_overrides)
    torch.manual_seed(seed)
    transformer.add_adapter(
        LoraConfig(r=2, lora_alpha=2, target_modules=LORA_TARGETS, init_lora_weights=False), adapter_name="made"
    )
    layers = get_peft_model_state_dict(transformer, adapter_name="made")
    pipeline_class(kind).save_lora_weights(out_dir, transformer_lora_layers=layers, safe_serialization=True)
    return out_dir


def generate(pipeline: Any, request: dict[str, Any]) -> torch.Tensor:
    """What the example service runs for one request (serve_api.DiffusionAPI.predict)."""
    with torch.inference_mode():
        images = pipeline(
            request["prompt"],
            num_inference_steps=request["steps"],
            height=request["height"],
            width=request["width"],
            guidance_scale=request.get("guidance_scale", 3.5),
            generator=torch.Generator("cpu").manual_seed(request["seed"]),
            output_type="pt",
            **CALL_KWARGS,
        ).images
    return images.detach().clone()


def canonical_images(folder: str, requests: list[dict[str, Any]], loras: dict[str, str]) -> list[dict[str, Any]]:
    sys.path.insert(0, str(SERVE_EXAMPLE))
    from diffusers import DiffusionPipeline

    from serve_api import encode_image

    torch.set_num_threads(1)  # as the service's workers (--threads 1)
    pipeline = DiffusionPipeline.from_pretrained(folder, dtype=torch.bfloat16)
    pipeline.set_progress_bar_config(disable=True)
    for name, path in sorted(loras.items()):
        pipeline.load_lora_weights(path, adapter_name=name)
    answers = []
    for request in requests:
        if loras:
            if request.get("adapter") is None:
                pipeline.disable_lora()
            else:
                pipeline.enable_lora()
                pipeline.set_adapters(request["adapter"])
        answers.append(encode_image(generate(pipeline, request)))
    return answers


if __name__ == "__main__":
    spec = json.loads(sys.argv[1])
    print(json.dumps(canonical_images(spec["folder"], spec["requests"], spec.get("loras", {}))))

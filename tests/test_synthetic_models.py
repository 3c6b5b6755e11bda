"""The synthetic diffusers models: real classes, seeded weights, real folders, and what canonical loading does to them.

The per-kind facts pinned here (which tensors diffusers keeps in FP32, which buffers are
rebuilt rather than loaded) are what a final-layout restorer must reproduce; a diffusers
upgrade that changes them fails here first.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import accelerate  # noqa: F401  (`make test` installs it: a missing one fails the module, never skips it)
import diffusers  # noqa: F401
import pytest
import torch
from safetensors.torch import load_file

from hwr_tools.synthetic_models import (
    MODEL_KINDS,
    build_model,
    flux_config_for_bytes,
    forward_inputs,
    run_forward,
    save_flux_pipeline_folder,
    save_hub_snapshot,
    save_model_folder,
    save_pipeline_folder,
    tiny_spec,
)

CHILD_TIMEOUT_S = 120.0

# What diffusers 0.42.1 leaves in FP32 after from_pretrained(torch_dtype=bfloat16): every
# parameter whose dotted name has a `_keep_in_fp32_modules` entry as one of its components.
# Wan's norm1/norm3 inside blocks have no parameters (elementwise_affine=False), so
# only the image embedder's norm1/norm2 and the blocks' norm2 show up.
EXPECTED_FP32: dict[str, set[str]] = {
    "flux": set(),
    "flux2": set(),
    "sd3": set(),
    "minimax_h3": {
        f"{module}.{kind}"
        for module in (
            "proj_in",
            "audio_proj_in",
            "time_embedder.linear_1",
            "time_embedder.linear_2",
            "proj_out",
            "audio_proj_out",
        )
        for kind in ("weight", "bias")
    },
    "wan": {
        "scale_shift_table",
        *(f"condition_embedder.time_embedder.linear_{i}.{kind}" for i in (1, 2) for kind in ("weight", "bias")),
        *(f"condition_embedder.image_embedder.norm{i}.{kind}" for i in (1, 2) for kind in ("weight", "bias")),
        *(f"blocks.{b}.scale_shift_table" for b in range(2)),
        *(f"blocks.{b}.norm2.{kind}" for b in range(2) for kind in ("weight", "bias")),
    },
}

# Buffers that are not in the checkpoint: from_pretrained computes them while building the
# model. They come out FP32 although the model is built under default dtype bfloat16,
# because diffusers computes them with explicit dtypes.
EXPECTED_NON_PERSISTENT: dict[str, dict[str, torch.dtype]] = {
    "flux": {},
    "flux2": {},
    "sd3": {},
    "minimax_h3": {"rope.inv_freq": torch.float32},
    "wan": {"rope.freqs_cos": torch.float32, "rope.freqs_sin": torch.float32},
}

# Modules that prove every kind of block exists in the reduced config.
EXPECTED_MODULES: dict[str, tuple[str, ...]] = {
    "flux": (
        "transformer_blocks.1.ff_context",
        "single_transformer_blocks.1.proj_mlp",
        "time_text_embed.guidance_embedder",
    ),
    "flux2": (
        "transformer_blocks.1.ff_context",
        "single_transformer_blocks.1.attn.to_qkv_mlp_proj",
        "time_guidance_embed.guidance_embedder",
        "double_stream_modulation_txt",
        "single_stream_modulation",
    ),
    "sd3": ("transformer_blocks.0.attn2", "transformer_blocks.0.ff_context", "transformer_blocks.1.attn.norm_q"),
    "minimax_h3": ("token_refiner.refiner_blocks.0.ff", "transformer_blocks.1.adaln_proj", "audio_proj_out", "rope"),
    "wan": ("condition_embedder.image_embedder.norm1", "blocks.1.attn2.add_k_proj", "blocks.1.norm2", "rope"),
}

# The hub cache helper lets huggingface_hub 2.x warn about an argument diffusers 0.42.1 still
# passes whenever a repo id (not a local folder) is resolved; nothing on our side causes it.
HUB_ARGUMENT_WARNING = "ignore:The `local_dir_use_symlinks` argument is deprecated:UserWarning"


def _saved_tensors(model_folder: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(model_folder.glob("*.safetensors")):
        tensors.update(load_file(path))
    return tensors


def _load_bf16(kind: str, root: Path | str, **kwargs: Any) -> Any:
    return (
        tiny_spec(kind)
        .model_class()
        .from_pretrained(root, subfolder="transformer", torch_dtype=torch.bfloat16, **kwargs)
    )


def _state_digest(model: torch.nn.Module) -> str:
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}\n".encode())
        digest.update(tensor.contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _files(root: Path) -> dict[str, bytes]:
    return {str(path.relative_to(root)): path.read_bytes() for path in sorted(root.rglob("*")) if path.is_file()}


@pytest.mark.parametrize("kind", MODEL_KINDS)
def test_tiny_models_are_small_fp32_and_have_every_block(kind: str) -> None:
    model = build_model(kind)
    state = model.state_dict()
    assert sum(t.numel() * t.element_size() for t in state.values()) < 1 * 2**20
    assert {t.dtype for t in state.values()} == {torch.float32}
    names = {name for name, _ in model.named_modules()}
    missing = [name for name in EXPECTED_MODULES[kind] if name not in names]
    assert not missing, missing
    if kind == "sd3":
        assert model.transformer_blocks[1].context_pre_only and model.transformer_blocks[1].ff_context is None
    # Entries name modules (Wan's block norm1/norm3 have no parameters) or parameters (scale_shift_table).
    tensors = {name for name, _ in (*model.named_parameters(), *model.named_buffers())}
    keep_in_fp32: list[str] = type(model)._keep_in_fp32_modules or []
    for entry in keep_in_fp32:
        assert any(entry in name.split(".") for name in names | tensors), f"{entry} is missing from the reduced {kind}"


@pytest.mark.parametrize("kind", MODEL_KINDS)
def test_every_saved_tensor_is_seeded_and_no_output_layer_stays_zero(kind: str) -> None:
    first, again, other = build_model(kind, seed=0), build_model(kind, seed=0), build_model(kind, seed=1)
    assert _state_digest(first) == _state_digest(again)
    other_state = other.state_dict()
    for name, tensor in first.state_dict().items():
        assert torch.count_nonzero(tensor) == tensor.numel(), f"{name} has zeros"
        assert not torch.equal(tensor, other_state[name]), f"{name} ignores the seed"


def test_builds_are_identical_in_another_process_with_one_thread() -> None:
    code = (
        "import hashlib, json, torch\n"
        "from hwr_tools.synthetic_models import MODEL_KINDS, build_model\n"
        "torch.set_num_threads(1)\n"
        "def digest(model):\n"
        "    h = hashlib.sha256()\n"
        "    for name, t in sorted(model.state_dict().items()):\n"
        "        h.update(f'{name}:{t.dtype}:{tuple(t.shape)}\\n'.encode())\n"
        "        h.update(t.contiguous().view(torch.uint8).numpy().tobytes())\n"
        "    return h.hexdigest()\n"
        "print(json.dumps({kind: digest(build_model(kind, seed=7)) for kind in MODEL_KINDS}))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=CHILD_TIMEOUT_S, check=False
    )
    assert result.returncode == 0, result.stderr
    child = json.loads(result.stdout.strip().splitlines()[-1])
    assert child == {kind: _state_digest(build_model(kind, seed=7)) for kind in MODEL_KINDS}


@pytest.mark.parametrize("kind", MODEL_KINDS)
def test_same_seed_same_bytes_on_disk(kind: str, tmp_path: Path) -> None:
    first = _files(save_pipeline_folder(tmp_path / "a", kind, seed=3))
    again = _files(save_pipeline_folder(tmp_path / "b", kind, seed=3))
    other = _files(save_pipeline_folder(tmp_path / "c", kind, seed=4))
    assert first == again
    weights = "transformer/diffusion_pytorch_model.safetensors"
    assert set(first) == {"model_index.json", "transformer/config.json", weights}
    assert other[weights] != first[weights] and other["transformer/config.json"] == first["transformer/config.json"]


@pytest.mark.parametrize("kind", MODEL_KINDS)
def test_canonical_bf16_load_matches_saved_weights(kind: str, tmp_path: Path) -> None:
    spec = tiny_spec(kind)
    root = save_pipeline_folder(tmp_path, kind)
    index = json.loads((root / "model_index.json").read_text())
    assert index["_class_name"] == spec.pipeline_class_name
    assert index["transformer"] == ["diffusers", spec.class_name]
    saved = _saved_tensors(root / "transformer")
    assert {t.dtype for t in saved.values()} == {torch.float32}

    loaded = _load_bf16(kind, root)
    state = loaded.state_dict()
    assert set(state) == set(saved), "diffusers renamed or dropped keys on load"
    fp32 = {name for name, tensor in state.items() if tensor.dtype == torch.float32}
    assert fp32 == EXPECTED_FP32[kind]
    for name, tensor in state.items():
        expected_dtype = torch.float32 if name in EXPECTED_FP32[kind] else torch.bfloat16
        assert tensor.dtype == expected_dtype, name
        assert torch.equal(tensor, saved[name].to(expected_dtype)), name

    built = build_model(kind)
    built_buffers = dict(built.named_buffers())
    non_persistent = {name: buffer for name, buffer in loaded.named_buffers() if name not in state}
    assert {name: b.dtype for name, b in non_persistent.items()} == EXPECTED_NON_PERSISTENT[kind]
    for name, buffer in non_persistent.items():
        assert torch.equal(buffer, built_buffers[name]), f"{name} differs from a freshly built model"


@pytest.mark.parametrize("kind", MODEL_KINDS)
def test_two_canonical_loads_give_identical_finite_outputs(kind: str, tmp_path: Path) -> None:
    root = save_pipeline_folder(tmp_path, kind)
    first, second = _load_bf16(kind, root), _load_bf16(kind, root)
    out_first = run_forward(kind, first, forward_inputs(kind, first))
    out_second = run_forward(kind, second, forward_inputs(kind, second))
    assert torch.equal(out_first, out_second)
    assert torch.isfinite(out_first).all() and torch.count_nonzero(out_first) > 0
    # MiniMax-H3's output heads are FP32 modules, so its sample stays FP32.
    assert out_first.dtype == (torch.float32 if kind == "minimax_h3" else torch.bfloat16)

    other = _load_bf16(kind, save_pipeline_folder(tmp_path / "other", kind, seed=1))
    assert not torch.equal(run_forward(kind, other, forward_inputs(kind, other)), out_first)
    assert not torch.equal(run_forward(kind, first, forward_inputs(kind, first, seed=1)), out_first)


@pytest.mark.parametrize("kind", MODEL_KINDS)
def test_fp32_build_and_bf16_load_agree_roughly(kind: str, tmp_path: Path) -> None:
    """The inputs mean the same thing in both dtypes: a BF16 load stays close to the FP32 model it came from."""
    model = build_model(kind)
    reference = run_forward(kind, model, forward_inputs(kind, model, dtype=torch.float32))
    loaded = _load_bf16(kind, save_model_folder(model, tmp_path / "transformer").parent)
    sample = run_forward(kind, loaded, forward_inputs(kind, loaded)).float()
    assert sample.shape == reference.shape
    relative = (sample - reference).norm() / reference.norm()
    assert relative < 0.05, float(relative)


def test_unknown_kind_and_unknown_override_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown synthetic model kind"):
        build_model("unet")
    with pytest.raises(ValueError, match="no config field"):
        build_model("flux", config_overrides={"num_layer": 3})
    spec = tiny_spec("flux")
    spec.config["num_layers"] = 99
    assert tiny_spec("flux").config["num_layers"] == 2


def test_config_overrides_change_only_the_named_structure() -> None:
    """Wan T2V (no image path) and an extra layer; shared tensors keep their values because seeds follow names."""
    t2v = build_model("wan", config_overrides={"image_dim": None, "added_kv_proj_dim": None, "num_layers": 3})
    base = build_model("wan").state_dict()
    state = t2v.state_dict()
    assert "blocks.2.ffn.net.2.weight" in state and not any("image_embedder" in name for name in state)
    assert torch.equal(state["blocks.0.attn1.to_q.weight"], base["blocks.0.attn1.to_q.weight"])
    sample = run_forward("wan", t2v, forward_inputs("wan", t2v, dtype=torch.float32))
    assert sample.shape == (1, 8, 2, 4, 4) and torch.isfinite(sample).all()


@pytest.mark.filterwarnings(HUB_ARGUMENT_WARNING)
def test_hub_snapshot_is_a_real_cache_layout(tmp_path: Path) -> None:
    repo_id = "tiny-org/tiny-wan"
    root = save_pipeline_folder(tmp_path / "pipeline", "wan", max_shard_size="60KB")
    shards = sorted((root / "transformer").glob("*.safetensors"))
    assert len(shards) >= 2 and (root / "transformer" / "diffusion_pytorch_model.safetensors.index.json").is_file()

    snapshot = save_hub_snapshot(tmp_path / "cache", repo_id, root)
    revision = hashlib.sha1(repo_id.encode()).hexdigest()
    repo_dir = tmp_path / "cache" / "models--tiny-org--tiny-wan"
    assert snapshot == repo_dir / "snapshots" / revision
    assert (repo_dir / "refs" / "main").read_text() == revision

    blobs = repo_dir / "blobs"
    for blob in blobs.iterdir():
        assert blob.is_file() and not blob.is_symlink()
        assert hashlib.sha256(blob.read_bytes()).hexdigest() == blob.name
    originals = _files(root)
    links = sorted(path for path in snapshot.rglob("*") if path.is_symlink())
    assert {str(link.relative_to(snapshot)) for link in links} == set(originals)
    for link in links:
        relative = link.relative_to(snapshot)
        digest = hashlib.sha256(originals[str(relative)]).hexdigest()
        assert os.readlink(link) == "/".join([".."] * (len(relative.parts) + 1) + ["blobs", digest])
        assert link.resolve() == (blobs / digest).resolve()
    assert {blob.name for blob in blobs.iterdir()} == {hashlib.sha256(data).hexdigest() for data in originals.values()}

    assert save_hub_snapshot(tmp_path / "cache", repo_id, root) == snapshot  # idempotent

    direct = _load_bf16("wan", root).state_dict()
    for loaded in (
        _load_bf16("wan", snapshot),
        _load_bf16("wan", repo_id, cache_dir=tmp_path / "cache", local_files_only=True),
    ):
        state = loaded.state_dict()
        assert set(state) == set(direct) and all(torch.equal(state[name], direct[name]) for name in direct)


def test_hub_snapshot_revision_and_refusals(tmp_path: Path) -> None:
    root = save_pipeline_folder(tmp_path / "pipeline", "sd3")
    revision = "0123456789abcdef0123456789abcdef01234567"
    snapshot = save_hub_snapshot(tmp_path / "cache", "org/model", root / "transformer", revision=revision)
    assert snapshot.name == revision
    assert os.readlink(snapshot / "config.json").startswith("../../blobs/")
    assert tiny_spec("sd3").model_class().from_pretrained(snapshot) is not None
    with pytest.raises(ValueError, match="org/name"):
        save_hub_snapshot(tmp_path / "cache", "no-slash", root)
    with pytest.raises(ValueError, match="40 lowercase hex"):
        save_hub_snapshot(tmp_path / "cache", "org/model", root, revision="main")
    other = save_pipeline_folder(tmp_path / "other", "sd3", seed=1)
    with pytest.raises(FileExistsError):
        save_hub_snapshot(tmp_path / "cache", "org/model", other / "transformer", revision=revision)


def test_flux_demo_folder_reaches_its_target_in_several_shards(tmp_path: Path) -> None:
    target = 8 * 2**20
    root = save_flux_pipeline_folder(tmp_path, target_bytes=target)
    transformer = root / "transformer"
    index = json.loads((transformer / "diffusion_pytorch_model.safetensors.index.json").read_text())
    shards = sorted(transformer.glob("*.safetensors"))
    assert len(shards) >= 3 and set(index["weight_map"].values()) == {path.name for path in shards}
    saved = _saved_tensors(transformer)
    total = sum(t.numel() * t.element_size() for t in saved.values())
    assert total >= target and index["metadata"]["total_size"] == total
    assert {t.dtype for t in saved.values()} == {torch.float32}
    config = json.loads((transformer / "config.json").read_text())
    expected = flux_config_for_bytes(target)
    assert {key: config[key] for key in expected} == {
        k: list(v) if isinstance(v, tuple) else v for k, v in expected.items()
    }
    assert config["num_layers"] >= 1 and config["num_single_layers"] >= 1


@pytest.mark.parametrize("target", [1, 8 * 2**20, 320 * 2**20])
def test_flux_config_for_bytes_is_at_least_and_near_the_target(target: int) -> None:
    config = flux_config_for_bytes(target)
    with torch.device("meta"):
        model = tiny_spec("flux").model_class()(**config)
    total = sum(t.numel() * 4 for t in model.state_dict().values())
    assert total >= target
    if target >= 8 * 2**20:
        assert total <= 1.1 * target
    with pytest.raises(ValueError):
        flux_config_for_bytes(0)

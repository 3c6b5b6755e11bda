"""transformers components in the folder shapes workers meet (P03, P04, D06, D14): shards, variants, lone folders.

Each encoder is real, saved by `save_pretrained` (sharded, as a variant, or alone without a
pipeline around it); every load is compared with `from_pretrained(folder, dtype=...)` byte for byte.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from host_weight_runtime.config import RuntimeMode
from host_weight_runtime.diffusion import load_component, prewarm_tensor_parallel
from host_weight_runtime.failures import HostWeightUsageError
from host_weight_runtime.outcomes import ResolutionOutcome
from hwr_tools.synthetic_models import save_hub_snapshot

from ._encoders import ENCODERS, canonical, every_tensor, model_class, runtime_at


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in ("HWR_MODE", "HWR_ROOT", "HWR_REMOTE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-hub-cache"))


def _t5(seed: int = 21) -> torch.nn.Module:
    torch.manual_seed(seed)
    built: torch.nn.Module = model_class("text_encoder_2")(ENCODERS["text_encoder_2"].config())
    return built


def test_a_sharded_t5_streams_and_hits_tied(tmp_path: Path) -> None:
    """P03: a T5 saved in several shards (an index.json) streams into an artifact whose hit equals from_pretrained
    and keeps the tie; the post-load artifact of a second node has the same key."""
    folder = tmp_path / "sharded"
    _t5().save_pretrained(folder / "text_encoder_2", max_shard_size="20KB")  # type: ignore[operator]
    assert (folder / "text_encoder_2" / "model.safetensors.index.json").is_file()
    streamed = runtime_at(tmp_path / "a")
    with load_component(folder, subfolder="text_encoder_2", runtime=streamed, stream_on_miss=True, publish_in_background=False) as first:
        assert first.outcome is ResolutionOutcome.LOCAL_PRODUCTION
    with load_component(folder, subfolder="text_encoder_2", runtime=streamed, publish_in_background=False) as warm:
        assert warm.outcome is ResolutionOutcome.LOCAL_HIT
        model = warm.model
        assert model.get_parameter("shared.weight") is model.get_parameter("encoder.embed_tokens.weight")
        assert every_tensor(model) == every_tensor(canonical(folder, "text_encoder_2", torch.bfloat16))
    with load_component(folder, subfolder="text_encoder_2", runtime=runtime_at(tmp_path / "b"), publish_in_background=False) as other_node:
        assert other_node.identity_key == first.identity_key


def test_a_variant_is_its_own_artifact(tmp_path: Path) -> None:
    """P04/D14: `variant="fp16"` reads model.fp16.safetensors as transformers does, under a key of its own."""
    folder = tmp_path / "variants" / "text_encoder_2"
    model = _t5()
    model.save_pretrained(folder)  # type: ignore[operator]
    model.half().save_pretrained(folder, variant="fp16")  # type: ignore[operator]
    runtime = runtime_at(tmp_path / "domain")
    keys = []
    for variant in (None, "fp16"):
        load_component(folder.parent, subfolder="text_encoder_2", runtime=runtime, variant=variant).close()
        with load_component(folder.parent, subfolder="text_encoder_2", runtime=runtime, variant=variant) as warm:
            assert warm.outcome is ResolutionOutcome.LOCAL_HIT
            reference = model_class("text_encoder_2").from_pretrained(str(folder), dtype=torch.bfloat16, variant=variant)
            assert every_tensor(warm.model) == every_tensor(reference)
            keys.append(warm.identity_key)
    assert keys[0] != keys[1]


def test_a_lone_folder_and_a_pipeline_entry_name_the_class(tmp_path: Path) -> None:
    """D14: without a pipeline the config's `architectures` names the class; in a pipeline, model_index.json does
    (a T5 encoder whose config says T5ForConditionalGeneration loads as the T5EncoderModel the pipeline names)."""
    lone = tmp_path / "lone"
    _t5().save_pretrained(lone / "encoder")  # type: ignore[operator]
    with load_component(lone / "encoder", runtime=runtime_at(tmp_path / "d1")) as loaded:
        assert type(loaded.model).__name__ == "T5EncoderModel"
        assert loaded.identity_failure is None

    pipeline = tmp_path / "pipeline"
    _t5().save_pretrained(pipeline / "text_encoder_2")  # type: ignore[operator]
    config_path = pipeline / "text_encoder_2" / "config.json"
    config = json.loads(config_path.read_text())
    config["architectures"] = ["T5ForConditionalGeneration"]
    config_path.write_text(json.dumps(config))
    index = {"_class_name": "FluxPipeline", "text_encoder_2": ["transformers", "T5EncoderModel"]}
    (pipeline / "model_index.json").write_text(json.dumps(index))
    runtime = runtime_at(tmp_path / "d2")
    load_component(pipeline, subfolder="text_encoder_2", runtime=runtime).close()
    with load_component(pipeline, subfolder="text_encoder_2", runtime=runtime) as warm:
        assert type(warm.model).__name__ == "T5EncoderModel"
        assert warm.outcome is ResolutionOutcome.LOCAL_HIT


def test_what_a_transformers_component_cannot_be_served_as_is_refused_up_front(tmp_path: Path) -> None:
    """D06/D14: FP8 and tensor parallelism serve diffusers models; asking either of a text encoder is a usage error
    naming the argument, and nothing is built."""
    folder = tmp_path / "pipeline"
    _t5().save_pretrained(folder / "text_encoder_2")  # type: ignore[operator]
    root = tmp_path / "domain"
    with pytest.raises(HostWeightUsageError, match="representation='fp8' serves diffusers models"):
        load_component(folder, subfolder="text_encoder_2", runtime=runtime_at(root), representation="fp8")
    with pytest.raises(HostWeightUsageError, match="tensor parallelism serves diffusers models"):
        prewarm_tensor_parallel(folder, subfolder="text_encoder_2", tensor_parallel_size=2, runtime=runtime_at(root))
    with pytest.raises(HostWeightUsageError, match="keeps the unquantized tensors in BF16"):
        load_component(
            folder, subfolder="text_encoder_2", runtime=runtime_at(root), representation="fp8", torch_dtype="float16"
        )
    assert not (root / "artifacts").exists() or not any((root / "artifacts").iterdir())


def test_disabled_mode_loads_a_text_encoder_canonically(tmp_path: Path) -> None:
    """D14: with the runtime DISABLED a text encoder is exactly from_pretrained at the dtype asked, nothing kept."""
    folder = tmp_path / "pipeline"
    _t5().save_pretrained(folder / "text_encoder_2")  # type: ignore[operator]
    runtime = runtime_at(tmp_path / "domain", RuntimeMode.DISABLED)
    with load_component(folder, subfolder="text_encoder_2", runtime=runtime, torch_dtype=torch.float16) as loaded:
        assert loaded.outcome is ResolutionOutcome.CANONICAL_DIRECT
        assert every_tensor(loaded.model) == every_tensor(canonical(folder, "text_encoder_2", torch.float16))


def test_a_repo_id_in_the_hub_cache_serves_its_text_encoders(tmp_path: Path) -> None:
    """D14/P04: a pipeline repo in the local Hugging Face cache (symlinked blobs) serves its T5 encoder; the class
    comes from the snapshot's model_index.json, and the snapshot and a plain copy of it share one key."""
    pipeline = tmp_path / "pipeline"
    _t5().save_pretrained(pipeline / "text_encoder_2")  # type: ignore[operator]
    config_path = pipeline / "text_encoder_2" / "config.json"
    config = json.loads(config_path.read_text())
    config["architectures"] = ["T5ForConditionalGeneration"]  # only model_index.json says T5EncoderModel
    config_path.write_text(json.dumps(config))
    index = {"_class_name": "FluxPipeline", "text_encoder_2": ["transformers", "T5EncoderModel"]}
    (pipeline / "model_index.json").write_text(json.dumps(index))
    cache = tmp_path / "hub"
    save_hub_snapshot(cache, "hwr-test/tiny-encoders", pipeline)
    runtime = runtime_at(tmp_path / "domain")
    repo = "hwr-test/tiny-encoders"
    load_component(repo, subfolder="text_encoder_2", runtime=runtime, cache_dir=cache, publish_in_background=False).close()
    with load_component(repo, subfolder="text_encoder_2", runtime=runtime, cache_dir=cache, publish_in_background=False) as warm:
        assert warm.outcome is ResolutionOutcome.LOCAL_HIT
        assert type(warm.model).__name__ == "T5EncoderModel"
        with load_component(pipeline, subfolder="text_encoder_2", runtime=runtime, publish_in_background=False) as copy:
            assert copy.outcome is ResolutionOutcome.LOCAL_HIT
            assert copy.identity_key == warm.identity_key

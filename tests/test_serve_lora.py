"""P05: LoRA adapters on a pipeline whose transformer is served from the node's artifact (shared, mapped pages).

For a tiny Flux and a tiny SD3 pipeline, each with two small LoRAs made locally (peft, saved with the
pipeline class's `save_lora_weights`): unfused adapters give exactly the images of the same adapters on a
canonical pipeline, switching adapters between generations works, and the artifact's pages stay what they
were (no private copies, the base tensors still views of the mapping); `fuse_lora()` works, the tensors it
touches become private copy-on-write pages, and the artifact file never changes (a FULL_CHECKSUM
inspection passes, a fresh lease reads the canonical weights). A LoRA of another shape fails with the
framework's error and leaves the shared pages untouched.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from host_weight_runtime import FilesystemHostWeightStore, ResolutionOutcome, ValidationLevel
from host_weight_runtime.diffusion import load_component, load_pipeline
from hwr_tools.memory import MappedMemory, mapped_file_memory
from hwr_tools.synthetic_pipelines import save_tiny_pipeline
from tests._diffusion import runtime_at
from tests._serve_support import generate, make_lora

pytestmark = [
    pytest.mark.slow,
    # peft warns whenever a second adapter is added to one model, which is what switching adapters needs.
    pytest.mark.filterwarnings("ignore:Already found a `peft_config` attribute:UserWarning"),
    # load_pipeline hands diffusers `torch_dtype`, which diffusers 0.42 deprecates in favour of `dtype`.
    pytest.mark.filterwarnings("ignore:`torch_dtype` is deprecated:FutureWarning"),
]

REQUEST = {"prompt": "a small red cat", "seed": 11, "steps": 2, "height": 16, "width": 16}


def _base_tensors(transformer: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The transformer's own weights (not the adapters'), by their name without peft's `base_layer.`."""
    return {
        name.replace("base_layer.", ""): tensor
        for name, tensor in transformer.state_dict(keep_vars=True).items()
        if "lora_" not in name
    }


def _pipelines(folder: Path, root: Path) -> tuple[Any, Any, Any]:
    """The served pipeline (`load_pipeline`, a local hit for each served component) and a canonical one."""
    from diffusers import DiffusionPipeline

    runtime = runtime_at(root)
    load_pipeline(folder, runtime=runtime).close()  # the first worker: canonical load, then publication
    served = load_pipeline(folder, runtime=runtime)
    assert served.outcomes["transformer"] is ResolutionOutcome.LOCAL_HIT
    assert set(served.outcomes.values()) == {ResolutionOutcome.LOCAL_HIT}
    canonical = DiffusionPipeline.from_pretrained(folder, dtype=torch.bfloat16)
    for pipeline in (served.pipeline, canonical):
        pipeline.set_progress_bar_config(disable=True)
    return served, served.pipeline, canonical


def _memory(root: Path) -> MappedMemory:
    return mapped_file_memory("self", root / "artifacts")


@pytest.mark.parametrize("kind", ["flux", "sd3"])
def test_unfused_lora_matches_canonical_and_keeps_pages_shared(tmp_path: Path, kind: str) -> None:
    """P05: unfused LoRAs on a served pipeline give the canonical pipeline's images, adapter by adapter and
    switched between generations, and leave the artifact's mapped pages untouched (same RSS/PSS, no
    private dirty page, every base tensor the same object at the same address with the same bytes)."""
    torch.set_num_threads(1)
    folder = save_tiny_pipeline(tmp_path / "pipe", kind, seed=5)
    loras = {name: make_lora(kind, tmp_path / f"lora-{name}", seed=seed) for name, seed in (("ink", 21), ("oil", 22))}
    root = tmp_path / "hwr"
    served, pipe, canonical = _pipelines(folder, root)
    base_image = generate(pipe, REQUEST)
    assert torch.equal(base_image, generate(canonical, REQUEST))
    before = _memory(root)
    base = _base_tensors(pipe.transformer)
    addresses = {name: tensor.data_ptr() for name, tensor in base.items()}
    assert before.mappings > 0 and before.private_dirty == 0

    for pipeline in (pipe, canonical):
        for name, path in loras.items():
            pipeline.load_lora_weights(path, adapter_name=name)
    images = {}
    for adapter in ("ink", "oil", None, "ink"):
        for pipeline in (pipe, canonical):
            if adapter is None:
                pipeline.disable_lora()
            else:
                pipeline.enable_lora()
                pipeline.set_adapters(adapter)
        got, want = generate(pipe, REQUEST), generate(canonical, REQUEST)
        assert torch.equal(got, want), f"adapter {adapter}: the served pipeline differs from the canonical one"
        images[adapter] = got
    assert not torch.equal(images["ink"], base_image) and not torch.equal(images["ink"], images["oil"])
    assert torch.equal(images[None], base_image)

    after = _memory(root)
    assert after.private_dirty == 0 and after.rss == before.rss and after.pss == before.pss
    now = _base_tensors(pipe.transformer)
    assert now.keys() == base.keys()
    for name, tensor in now.items():
        assert tensor is base[name] and tensor.data_ptr() == addresses[name], name
    served.close()


@pytest.mark.parametrize("kind", ["flux", "sd3"])
def test_fused_lora_makes_private_copies_and_never_changes_the_artifact(tmp_path: Path, kind: str) -> None:
    """P05: `fuse_lora()` on a served pipeline gives the canonical fused images; the tensors it wrote became
    private copy-on-write pages of this process; the artifact still passes a FULL_CHECKSUM inspection and a
    new lease (another worker) reads exactly the canonical weights."""
    torch.set_num_threads(1)
    folder = save_tiny_pipeline(tmp_path / "pipe", kind, seed=6)
    lora = make_lora(kind, tmp_path / "lora", seed=31)
    root = tmp_path / "hwr"
    served, pipe, canonical = _pipelines(folder, root)
    generate(pipe, REQUEST)
    before = _memory(root)
    for pipeline in (pipe, canonical):
        pipeline.load_lora_weights(lora, adapter_name="ink")
        pipeline.fuse_lora(adapter_names=["ink"])
        pipeline.unload_lora_weights()  # the fused weights stay; the adapter layers go
    assert torch.equal(generate(pipe, REQUEST), generate(canonical, REQUEST))
    after = _memory(root)
    assert after.private_dirty > before.private_dirty, "fusing wrote no private page: did it write to the file?"

    key = served.components["transformer"].identity_key
    assert key is not None
    inspection = FilesystemHostWeightStore(root).inspect_artifact(key, validation=ValidationLevel.FULL_CHECKSUM)
    assert inspection.problem is None, inspection.problem
    other = load_component(folder, subfolder="transformer", runtime=runtime_at(root))
    assert other.outcome is ResolutionOutcome.LOCAL_HIT
    reference = canonical_transformer(folder)
    for name, tensor in other.model.state_dict().items():
        assert torch.equal(tensor, reference[name]), name
    other.close()
    served.close()


def canonical_transformer(folder: Path) -> dict[str, torch.Tensor]:
    from diffusers import DiffusionPipeline

    return dict(DiffusionPipeline.from_pretrained(folder, dtype=torch.bfloat16).transformer.state_dict())


def test_lora_of_another_shape_fails_and_leaves_the_shared_pages(tmp_path: Path) -> None:
    """P05: a LoRA made for a wider transformer fails to load with diffusers/peft's own error; the served
    transformer's base tensors and the artifact's pages are as they were."""
    torch.set_num_threads(1)
    folder = save_tiny_pipeline(tmp_path / "pipe", "flux", seed=7)
    wrong = make_lora("flux", tmp_path / "wide", seed=41, config_overrides={"num_attention_heads": 3})
    root = tmp_path / "hwr"
    served, pipe, _canonical = _pipelines(folder, root)
    image = generate(pipe, REQUEST)
    before = _memory(root)
    base = {
        name: (tensor.data_ptr(), tensor.detach().clone()) for name, tensor in _base_tensors(pipe.transformer).items()
    }
    with pytest.raises((ValueError, RuntimeError)) as raised:
        pipe.load_lora_weights(wrong, adapter_name="wide")
    assert "size" in str(raised.value) or "shape" in str(raised.value)
    after = _memory(root)
    assert after.private_dirty == before.private_dirty == 0
    for name, tensor in _base_tensors(pipe.transformer).items():
        address, value = base[name]
        assert tensor.data_ptr() == address and torch.equal(tensor, value), name
    pipe.unload_lora_weights()
    assert torch.equal(generate(pipe, REQUEST), image)
    served.close()

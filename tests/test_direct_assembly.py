"""A warm pipeline assembled without diffusers' from_pretrained is the pipeline from_pretrained assembles.

`load_pipeline` builds a pipeline whose remaining components are tokenizers and schedulers itself
(the constructor call and the `_name_or_path` record diffusers makes); everything else still goes
through diffusers. These tests hold the direct assembly to diffusers' own on the tiny real pipelines.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from host_weight_runtime.diffusion._direct_assembly import assemble_directly
from host_weight_runtime.diffusion._model_index import ClassKind, read_model_index
from hwr_tools.synthetic_pipelines import pipeline_kind

from ._pipelines import PIPELINES, copy_pipeline, edit_model_index, save_pipelines

PROMPT = "a red cube on a wooden table"


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return save_pipelines(tmp_path_factory.mktemp("pipelines"))


def _canonical(folder: Path, name: str) -> Any:
    from diffusers import DiffusionPipeline

    return DiffusionPipeline.from_pretrained(str(folder), dtype=pipeline_kind(name).torch_dtype)


def _weighted(folder: Path, pipeline: Any) -> dict[str, Any]:
    """The components load_pipeline would serve, taken from a canonical pipeline (as a warm load hands them)."""
    index = read_model_index(folder)
    served = (ClassKind.DIFFUSERS_MODEL, ClassKind.TRANSFORMERS_MODEL)
    return {
        component.name: getattr(pipeline, component.name) for component in index.components if component.kind in served
    }


def _plain_attributes(pipeline: Any) -> dict[str, Any]:
    """The pipeline's own settings its constructor derives (scale factors, lengths): not modules, not processors."""
    return {
        key: value
        for key, value in vars(pipeline).items()
        if isinstance(value, (int, float, str, bool, tuple, type(None))) and not key.startswith("_")
    }


@pytest.mark.parametrize("name", [name for name in PIPELINES if name != "sdxl"])
def test_a_plain_pipeline_is_the_one_diffusers_assembles(name: str, folders: dict[str, Path]) -> None:
    """P02: with every weighted component served, the tokenizers and scheduler load as diffusers loads them and
    the pipeline equals from_pretrained's: class, config (with `_name_or_path`), settings, each component."""
    folder = folders[name]
    canonical = _canonical(folder, name)
    served = _weighted(folder, canonical)
    direct = assemble_directly(read_model_index(folder), folder, served, {}, variant=None)
    assert direct is not None, f"{name} should be assembled directly"
    assert type(direct) is type(canonical)
    assert dict(direct.config) == dict(canonical.config)
    assert _plain_attributes(direct) == _plain_attributes(canonical)
    assert direct.components.keys() == canonical.components.keys()
    for component, expected in canonical.components.items():
        got = direct.components[component]
        if component in served:
            assert got is expected
            continue
        assert type(got) is type(expected), component
        if hasattr(expected, "init_kwargs"):  # a tokenizer: same files, same settings, same ids
            assert got.name_or_path == expected.name_or_path
            assert got.init_kwargs == expected.init_kwargs
            assert got(PROMPT).input_ids == expected(PROMPT).input_ids
        elif expected is not None:  # a scheduler
            assert dict(got.config) == dict(expected.config)


def test_a_pipeline_setting_from_model_index_goes_to_diffusers(folders: dict[str, Path]) -> None:
    """P02: SDXL's model_index.json sets `force_zeros_for_empty_prompt`, which diffusers passes to the
    constructor: such a pipeline is left to diffusers' own assembly."""
    folder = folders["sdxl"]
    assert "force_zeros_for_empty_prompt" in json.loads((folder / "model_index.json").read_text())
    index = read_model_index(folder)
    assert index.settings == ("force_zeros_for_empty_prompt",)
    served = _weighted(folder, _canonical(folder, "sdxl"))
    assert assemble_directly(index, folder, served, {}, variant=None) is None


def test_anything_but_the_plain_shape_goes_to_diffusers(tmp_path: Path, folders: dict[str, Path]) -> None:
    """P02/P06: a model the caller passes (diffusers checks its class), a variant, a processor component, and
    a required component model_index.json leaves out are all left to diffusers, which loads or refuses them
    as it always does; a component the caller leaves out (None) is None in a direct assembly."""
    folder = folders["flux"]
    canonical = _canonical(folder, "flux")
    served = _weighted(folder, canonical)
    index = read_model_index(folder)
    vae = served.pop("vae")
    assert assemble_directly(index, folder, served, {"vae": vae}, variant=None) is None
    served["vae"] = vae
    assert assemble_directly(index, folder, served, {}, variant="fp16") is None

    with_processor = copy_pipeline(folder, tmp_path / "with-processor")
    edit_model_index(with_processor, feature_extractor=["transformers", "CLIPImageProcessor"])
    assert assemble_directly(read_model_index(with_processor), with_processor, served, {}, variant=None) is None

    without_tokenizer = copy_pipeline(folder, tmp_path / "without-tokenizer")
    listed = json.loads((without_tokenizer / "model_index.json").read_text())
    del listed["tokenizer"]
    (without_tokenizer / "model_index.json").write_text(json.dumps(listed))
    index_without = read_model_index(without_tokenizer)
    assert assemble_directly(index_without, without_tokenizer, served, {}, variant=None) is None

    left_out = {name: model for name, model in served.items() if name != "text_encoder"}
    direct = assemble_directly(index, folder, left_out, {"text_encoder": None}, variant=None)
    assert direct is not None and direct.text_encoder is None
    assert isinstance(direct.transformer, torch.nn.Module) and direct.transformer is served["transformer"]

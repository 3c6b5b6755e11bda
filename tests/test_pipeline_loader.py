"""`load_pipeline` (P01, P02, P06): whole tiny real pipelines, images bit for bit, every weight served.

Five tiny pipelines built locally with seeded weights and locally made tokenizers (Flux: CLIP + T5;
SD3: two CLIPs with projection + T5; PixArt-Sigma: T5; SDXL in FP16: two CLIPs and a UNet; Sana:
Gemma2) are saved with `save_pretrained`. Canonical `DiffusionPipeline.from_pretrained`, a cold
`load_pipeline` (the node's first worker) and a warm one (the next worker) each run in a fresh
spawned process and must produce the same output tensor with the same generator seed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from host_weight_runtime import cli
from host_weight_runtime.config import RuntimeMode
from host_weight_runtime.diffusion import (
    ComponentHandling,
    HostWeightUsageError,
    load_pipeline,
    prewarm_pipeline,
)
from host_weight_runtime.outcomes import ResolutionOutcome
from hwr_tools.synthetic_models import build_model, save_hub_snapshot, save_model_folder

from ._pipelines import (
    PIPELINES,
    artifact_keys,
    canonical_image,
    copy_pipeline,
    describe,
    edit_model_index,
    image,
    images_in_child,
    load_image,
    runtime_at,
    save_pipelines,
)
from .support import recv_within, spawned_child

NOT_WEIGHTED = {ComponentHandling.UNWEIGHTED.value, ComponentHandling.ABSENT.value}


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return save_pipelines(tmp_path_factory.mktemp("pipelines"))


@pytest.fixture(scope="module")
def three_workers(folders: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Canonical, cold and warm: each a fresh spawned process over every pipeline, one store for the last two."""
    store = tmp_path_factory.mktemp("store")
    paths = {name: str(folder) for name, folder in folders.items()}
    runs: dict[str, Any] = {}
    for run, store_arg in (("canonical", None), ("cold", str(store)), ("warm", str(store))):
        out = tmp_path_factory.mktemp(run)
        with spawned_child(images_in_child, paths, store_arg, str(out), RuntimeMode.PREFERRED.value) as conn:
            reports = recv_within(conn, 600.0)
        runs[run] = {"out": out, "reports": reports}
    runs["store"] = store
    return runs


@pytest.mark.parametrize("name", PIPELINES)
def test_cold_and_warm_images_equal_canonical(
    name: str, folders: dict[str, Path], three_workers: dict[str, Any]
) -> None:
    """P01/P02/X02: the class model_index.json names; the first worker (default settings) loads every weighted
    component canonically and returns, its artifacts built behind it and left at its plain exit; the next gets a
    LOCAL_HIT for each; both images equal canonical `from_pretrained` bit for bit."""
    index = json.loads((folders[name] / "model_index.json").read_text())
    cold = three_workers["cold"]["reports"][name]
    warm = three_workers["warm"]["reports"][name]
    assert cold["class"] == warm["class"] == index["_class_name"]
    expected = load_image(three_workers["canonical"]["out"], name)
    assert expected.dtype in (torch.float32, torch.bfloat16, torch.float16) and expected.std() > 0
    for run in ("cold", "warm"):
        assert torch.equal(load_image(three_workers[run]["out"], name), expected), f"{name} {run}"
    weighted = {component for component, handling in cold["handling"].items() if handling not in NOT_WEIGHTED}
    assert weighted and set(cold["outcomes"]) == weighted, cold["handling"]
    assert set(cold["outcomes"].values()) == {ResolutionOutcome.CANONICAL_FALLBACK.value}
    assert set(cold["publications"].values()) == {"behind"}
    assert set(cold["keys"].values()) == {None}  # returned before hashing: the keys were found behind it
    assert set(warm["outcomes"].values()) == {ResolutionOutcome.LOCAL_HIT.value}
    assert set(warm["keys"].values()) <= set(artifact_keys(three_workers["store"]))


def test_tokenizers_and_schedulers_load_as_diffusers_loads_them(
    folders: dict[str, Path], three_workers: dict[str, Any]
) -> None:
    """P02: tokenizers and schedulers are left to diffusers (records say so) and no artifact holds them."""
    for name in PIPELINES:
        handling = three_workers["warm"]["reports"][name]["handling"]
        for component in ("scheduler", "tokenizer"):
            assert handling[component] == ComponentHandling.UNWEIGHTED.value, (name, component)
    served = sum(len(three_workers["cold"]["reports"][name]["keys"]) for name in PIPELINES)
    assert len(artifact_keys(three_workers["store"])) <= served


def test_prewarm_then_a_first_required_worker_is_all_hits(
    tmp_path: Path, folders: dict[str, Path], three_workers: dict[str, Any]
) -> None:
    """P02: prewarm_pipeline streams every weighted component; then the node's first worker, in REQUIRED mode,
    gets a LOCAL_HIT for every one and the image of canonical from_pretrained."""
    store = tmp_path / "store"
    prewarmed = prewarm_pipeline(folders["flux"], runtime=runtime_at(store))
    assert {result.resolution.outcome for result in prewarmed.built.values()} == {ResolutionOutcome.LOCAL_PRODUCTION}
    assert sorted(artifact_keys(store)) == sorted(result.identity_key for result in prewarmed.built.values())
    out = tmp_path / "out"
    out.mkdir()
    with spawned_child(images_in_child, {"flux": str(folders["flux"])}, str(store), str(out), "required") as conn:
        report = recv_within(conn, 600.0)["flux"]
    assert set(report["outcomes"]) == set(prewarmed.built)
    assert set(report["outcomes"].values()) == {ResolutionOutcome.LOCAL_HIT.value}
    assert torch.equal(load_image(out, "flux"), load_image(three_workers["canonical"]["out"], "flux"))


def test_a_component_the_caller_passes_is_used_as_given(tmp_path: Path, folders: dict[str, Path]) -> None:
    """P02: `transformer=model` and `text_encoder=None` are used as given, as in diffusers, and recorded as CALLER."""
    model = build_model("flux", seed=99).to(torch.bfloat16)
    runtime = runtime_at(tmp_path / "store")
    with load_pipeline(folders["flux"], runtime=runtime, transformer=model, text_encoder=None) as loaded:
        assert loaded.pipeline.transformer is model
        assert loaded.pipeline.text_encoder is None
        for name in ("transformer", "text_encoder"):
            assert loaded.record(name).handling is ComponentHandling.CALLER
            assert name not in loaded.components
        assert "vae" in loaded.components


def test_a_repo_id_in_the_local_cache_hits_what_the_folder_published(
    tmp_path: Path, folders: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """P01: a repo id in the local Hugging Face cache loads offline; its components hit the artifacts a load of
    the same bytes from a plain folder published before returning (content keys), and the image equals canonical."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cache = tmp_path / "hub"
    save_hub_snapshot(cache, "hwr-test/tiny-flux-pipeline", folders["flux"])
    runtime = runtime_at(tmp_path / "store")
    with load_pipeline(folders["flux"], runtime=runtime, publish_in_background=False) as first:
        keys = describe(first)["keys"]
    with load_pipeline("hwr-test/tiny-flux-pipeline", cache_dir=cache, runtime=runtime) as second:
        assert describe(second)["keys"] == keys
        assert set(second.outcomes.values()) == {ResolutionOutcome.LOCAL_HIT}
        assert torch.equal(image(second.pipeline, "flux"), canonical_image(folders["flux"], "flux"))


def test_a_text_encoder_shared_by_two_pipelines_is_one_artifact(tmp_path: Path, folders: dict[str, Path]) -> None:
    """P02: two pipeline folders holding the same text encoder bytes (and VAE) but different transformers share
    one artifact per shared component (each published before returning); only the transformers differ."""
    other = copy_pipeline(folders["flux"], tmp_path / "other-flux")
    save_model_folder(build_model("flux", seed=1234), other / "transformer")
    runtime = runtime_at(tmp_path / "store")
    with (
        load_pipeline(folders["flux"], runtime=runtime, publish_in_background=False) as first,
        load_pipeline(other, runtime=runtime, publish_in_background=False) as second,
    ):
        first_keys, second_keys = describe(first)["keys"], describe(second)["keys"]
    assert set(first_keys) == set(second_keys) and "text_encoder_2" in first_keys
    shared = set(first_keys) - {"transformer"}
    assert all(first_keys[name] == second_keys[name] for name in shared)
    assert first_keys["transformer"] != second_keys["transformer"]
    assert len(artifact_keys(tmp_path / "store")) == len(first_keys) + 1


# ----------------------------------------------------------------------------- P06: bad input


def _malformed(folder: Path, how: str) -> None:
    path = folder / "model_index.json"
    index = json.loads(path.read_text())
    if how == "not json":
        path.write_text("{ this is not json")
    elif how == "a list":
        path.write_text("[1, 2]")
    elif how == "no class":
        del index["_class_name"]
        path.write_text(json.dumps(index))
    elif how == "unknown pipeline":
        edit_model_index(folder, _class_name="NoSuchPipeline")
    elif how == "entry not a pair":
        edit_model_index(folder, vae="diffusers.AutoencoderKL")
    elif how == "unknown class":
        edit_model_index(folder, text_encoder=["transformers", "NoSuchTextModel"])
    elif how == "deep nesting":
        path.write_text('{"_class_name": "FluxPipeline", "x": ' + "[" * 5000 + "]" * 5000 + "}")
    elif how == "missing":
        path.unlink()


@pytest.mark.parametrize(
    "how",
    [
        "not json",
        "a list",
        "no class",
        "unknown pipeline",
        "entry not a pair",
        "unknown class",
        "deep nesting",
        "missing",
    ],
)
def test_a_malformed_model_index_is_a_usage_error(tmp_path: Path, folders: dict[str, Path], how: str) -> None:
    """P06: a malformed or missing model_index.json is a HostWeightUsageError (a ValueError) that names the file,
    before anything is loaded or published."""
    folder = copy_pipeline(folders["flux"], tmp_path / "broken")
    _malformed(folder, how)
    store = tmp_path / "store"
    with pytest.raises(HostWeightUsageError) as raised:
        load_pipeline(folder, runtime=runtime_at(store))
    assert isinstance(raised.value, ValueError) and str(folder) in str(raised.value)
    with pytest.raises(HostWeightUsageError):
        prewarm_pipeline(folder, runtime=runtime_at(store))
    assert artifact_keys(store) == []


def _pickle_only_vae(folder: Path) -> None:
    vae_folder = folder / "vae"
    from diffusers import AutoencoderKL

    vae = AutoencoderKL.from_pretrained(str(vae_folder))
    for path in vae_folder.glob("*.safetensors"):
        path.unlink()
    vae.save_pretrained(str(vae_folder), safe_serialization=False)


def test_a_pickle_only_component_is_a_reported_canonical_load(tmp_path: Path, folders: dict[str, Path]) -> None:
    """P06: a component with only .bin weights is loaded by diffusers as always and its record says why;
    the image still equals canonical. REQUIRED mode refuses it with a HostWeightUsageError naming it."""
    folder = copy_pipeline(folders["flux"], tmp_path / "pickle-vae")
    _pickle_only_vae(folder)
    with load_pipeline(folder, runtime=runtime_at(tmp_path / "store")) as loaded:
        record = loaded.record("vae")
        assert record.handling is ComponentHandling.CANONICAL and record.reason is not None
        assert "pickle" in record.reason and "vae" not in loaded.components
        assert type(loaded.pipeline.vae).__name__ == "AutoencoderKL"
        assert "transformer" in loaded.components
        assert torch.equal(image(loaded.pipeline, "flux"), canonical_image(folder, "flux"))
    with pytest.raises(HostWeightUsageError) as raised:
        load_pipeline(folder, runtime=runtime_at(tmp_path / "required", RuntimeMode.REQUIRED))
    assert "vae" in str(raised.value) and "pickle" in str(raised.value)
    assert artifact_keys(tmp_path / "required") == []


def test_a_custom_class_from_remote_code_is_refused_before_any_load(tmp_path: Path, folders: dict[str, Path]) -> None:
    """P06: a component whose class comes from the repository's own code is a HostWeightUsageError that says
    load_pipeline runs no remote code, raised before any component is loaded or published."""
    folder = copy_pipeline(folders["flux"], tmp_path / "custom")
    edit_model_index(folder, text_encoder=["tiny_remote_code", "MyTextEncoder"])
    store = tmp_path / "store"
    for call in (load_pipeline, prewarm_pipeline):
        with pytest.raises(HostWeightUsageError) as raised:
            call(folder, runtime=runtime_at(store))
        assert "text_encoder" in str(raised.value) and "remote code" in str(raised.value)
    assert artifact_keys(store) == []


def test_a_non_torch_component_is_reported_and_never_a_deep_traceback(tmp_path: Path, folders: dict[str, Path]) -> None:
    """P06: a component whose class is not a torch module (an ONNX runtime model) is left to diffusers and
    recorded; when diffusers cannot load it, the call fails with one HostWeightUsageError, not a partial pipeline."""
    folder = copy_pipeline(folders["flux"], tmp_path / "onnx")
    edit_model_index(folder, vae=["diffusers", "OnnxRuntimeModel"])
    store = tmp_path / "store"
    with pytest.raises(HostWeightUsageError) as raised:
        load_pipeline(folder, runtime=runtime_at(store))
    assert "FluxPipeline" in str(raised.value)
    prewarmed = prewarm_pipeline(folder, runtime=runtime_at(store))
    record = next(record for record in prewarmed.records if record.name == "vae")
    assert record.handling is ComponentHandling.CANONICAL and "not a torch module" in (record.reason or "")
    assert "vae" not in prewarmed.built


def test_a_pipeline_diffusers_cannot_assemble_is_one_usage_error(tmp_path: Path, folders: dict[str, Path]) -> None:
    """P06: a pipeline folder whose scheduler config is gone fails with one HostWeightUsageError naming the
    pipeline, after the served components were loaded: never a silent partial pipeline."""
    folder = copy_pipeline(folders["flux"], tmp_path / "no-scheduler")
    (folder / "scheduler" / "scheduler_config.json").unlink()
    with pytest.raises(HostWeightUsageError) as raised:
        load_pipeline(folder, runtime=runtime_at(tmp_path / "store"))
    assert "FluxPipeline" in str(raised.value) and str(folder) in str(raised.value)


def test_hwr_prewarm_of_an_fp16_pipeline_serves_a_required_fp16_load(
    tmp_path: Path, folders: dict[str, Path], three_workers: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    """P02: `hwr prewarm SDXL_FOLDER --dtype float16` builds every weighted component's FP16 artifact; then a
    fresh REQUIRED `load_pipeline(..., torch_dtype=torch.float16)` is all hits and gives the canonical FP16 image."""
    store = tmp_path / "store"
    argv = ["prewarm", str(folders["sdxl"]), "--dtype", "float16", "--root", str(store), "--json"]
    assert cli.main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    built = {c["name"]: c["outcome"] for c in report["components"] if c["identity_key"] is not None}
    assert built == dict.fromkeys(("text_encoder", "text_encoder_2", "unet", "vae"), "local_production")
    out = tmp_path / "out"
    out.mkdir()
    with spawned_child(images_in_child, {"sdxl": str(folders["sdxl"])}, str(store), str(out), "required") as conn:
        loaded = recv_within(conn, 600.0)["sdxl"]
    assert loaded["outcomes"] == dict.fromkeys(built, ResolutionOutcome.LOCAL_HIT.value)
    assert torch.equal(load_image(out, "sdxl"), load_image(three_workers["canonical"]["out"], "sdxl"))

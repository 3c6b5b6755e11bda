"""`load_component` on malformed model folders: each is a clear typed error, never an untyped
traceback from inside diffusers, and nothing is ever published for it, in PREFERRED or REQUIRED.

Real diffusers models, saved for real and then broken the way a bad download or a hostile co-tenant breaks
them: no config, a config naming a non-model class or not being a JSON object, an index naming a missing
shard or holding a malformed weight map, a truncated or foreign shard.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from host_weight_runtime.config import HostWeightRuntimeConfig, RuntimeMode
from host_weight_runtime.diffusion import load_component
from host_weight_runtime.failures import FailureCode, HostWeightError, HostWeightUsageError
from host_weight_runtime.runtime import HostWeightRuntime
from hwr_tools.synthetic_models import build_model, save_model_folder

WEIGHTS = "diffusion_pytorch_model.safetensors"
INDEX = "diffusion_pytorch_model.safetensors.index.json"

Plant = Callable[[Path], None]


def _config(folder: Path) -> dict[str, object]:
    value = json.loads((folder / "config.json").read_text())
    assert isinstance(value, dict)
    return value


def _write_config(folder: Path, value: object) -> None:
    (folder / "config.json").write_text(json.dumps(value))


def _with_class(name: object) -> Plant:
    return lambda folder: _write_config(folder, {**_config(folder), "_class_name": name})


def _index(folder: Path) -> dict[str, object]:
    value = json.loads((folder / INDEX).read_text())
    assert isinstance(value, dict)
    return value


def _first_shard(folder: Path) -> Path:
    weight_map = _index(folder)["weight_map"]
    assert isinstance(weight_map, dict)
    return folder / sorted(set(weight_map.values()))[0]


def _with_weight_map(weight_map: object) -> Plant:
    def plant(folder: Path) -> None:
        (folder / INDEX).write_text(json.dumps({**_index(folder), "weight_map": weight_map}))

    return plant


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _drop_some_tensors(folder: Path) -> None:
    tensors = load_file(str(folder / WEIGHTS))
    kept = dict(sorted(tensors.items())[: len(tensors) // 2])
    save_file(kept, str(folder / WEIGHTS))


def _wrong_shape(folder: Path) -> None:
    tensors = load_file(str(folder / WEIGHTS))
    name = sorted(tensors)[0]
    tensors[name] = torch.zeros(3, 3, dtype=tensors[name].dtype)
    save_file(tensors, str(folder / WEIGHTS))


# (case, sharded source?, how to break it, what the message must name)
CASES: list[tuple[str, bool, Plant, str]] = [
    ("no_config", False, lambda folder: (folder / "config.json").unlink(), "config.json"),
    ("class_os_system", False, _with_class("os.system"), "not a diffusers model class"),
    ("class_not_a_model", False, _with_class("NotAModel"), "not a diffusers model class"),
    ("class_a_pipeline", False, _with_class("DiffusionPipeline"), "not a diffusers model class"),
    ("class_a_scheduler", False, _with_class("DDPMScheduler"), "not a diffusers model class"),
    ("class_not_a_string", False, _with_class(7), "_class_name"),
    ("config_not_json", False, lambda folder: (folder / "config.json").write_text("{not json"), "config.json"),
    ("config_a_list", False, lambda folder: _write_config(folder, [1, 2]), "not an object"),
    ("config_not_utf8", False, lambda folder: (folder / "config.json").write_bytes(b"\xff\xfe{}"), "config.json"),
    (
        "config_nested_deeply",
        False,
        lambda folder: (folder / "config.json").write_text('{"x":' + "[" * 100_000 + "]" * 100_000 + "}"),
        "nested too deeply",
    ),
    (
        "config_field_wrong_type",
        False,
        lambda folder: _write_config(folder, {**_config(folder), "num_layers": "two"}),
        "buildable",
    ),
    ("index_missing_shard", True, lambda folder: _first_shard(folder).unlink(), "do not exist"),
    ("index_not_json", True, lambda folder: (folder / INDEX).write_text("nope"), "not a valid weight index"),
    ("index_map_a_list", True, _with_weight_map([1, 2]), "weight_map"),
    ("index_map_empty", True, _with_weight_map({}), "weight_map"),
    ("index_map_to_a_number", True, _with_weight_map({"x_embedder.weight": 3}), "not a file name"),
    ("index_map_escapes", True, _with_weight_map({"x_embedder.weight": "../other/" + WEIGHTS}), "'..'"),
    ("index_map_absolute", True, _with_weight_map({"x_embedder.weight": "/etc/passwd"}), "leading '/'"),
    ("shard_truncated", True, lambda folder: _truncate(_first_shard(folder)), "re-download"),
    ("single_file_truncated", False, lambda folder: _truncate(folder / WEIGHTS), "re-download"),
    ("not_safetensors", False, lambda folder: (folder / WEIGHTS).write_bytes(b"hello, not a checkpoint"), "header"),
    ("empty_weights", False, lambda folder: (folder / WEIGHTS).write_bytes(b""), "too short"),
    ("no_weights", False, lambda folder: (folder / WEIGHTS).unlink(), "no weight file"),
]

# A checkpoint whose header is sound but whose tensors do not fit the model: typed in both modes, but the
# failure comes from where it is found (the canonical load, or the streaming producer in REQUIRED).
MISMATCHED: list[tuple[str, Plant]] = [("tensors_missing", _drop_some_tensors), ("tensor_shape_wrong", _wrong_shape)]
# What each mismatch's message says is wrong (the canonical load finds both).
MISMATCH_TEXT = {
    "tensors_missing": "tensor(s) the model needs, e.g.",
    "tensor_shape_wrong": "the checkpoint does not match its config.json",
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[bool, Path]:
    """One real tiny FLUX transformer, saved as a single file and as an index with many shards."""
    base = tmp_path_factory.mktemp("models")
    model = build_model("flux")
    return {
        False: save_model_folder(model, base / "single"),
        True: save_model_folder(model, base / "sharded", max_shard_size="20KB"),
    }


def broken_copy(saved: dict[bool, Path], tmp_path: Path, sharded: bool, plant: Plant) -> Path:
    folder = tmp_path / "model"
    shutil.copytree(saved[sharded], folder)
    if sharded:
        assert (folder / INDEX).is_file()
    plant(folder)
    return folder


def runtime_at(root: Path, mode: RuntimeMode) -> HostWeightRuntime:
    return HostWeightRuntime(HostWeightRuntimeConfig(mode=mode, root=root, lock_timeout_s=60.0))


def assert_nothing_published(root: Path) -> None:
    for name in ("artifacts", "tmp"):
        directory = root / name
        assert not directory.exists() or os.listdir(directory) == [], (name, os.listdir(directory))


@pytest.mark.parametrize("mode", [RuntimeMode.PREFERRED, RuntimeMode.REQUIRED], ids=lambda mode: mode.value)
@pytest.mark.parametrize("case", CASES, ids=[case[0] for case in CASES])
def test_malformed_model_folder_is_a_usage_error_and_publishes_nothing(
    saved: dict[bool, Path], tmp_path: Path, mode: RuntimeMode, case: tuple[str, bool, Plant, str]
) -> None:
    """D14 S10: no config, a config naming os.system / a non-model class / not a JSON object, an index
    naming a missing shard or with a malformed weight map, a truncated or foreign shard: HostWeightUsageError
    saying what to fix, in PREFERRED as in REQUIRED, and no artifact or residue in the domain; torch's default
    dtype is left as it was (diffusers sets it before a build it cannot finish and never puts it back)."""
    _name, sharded, plant, names = case
    folder = broken_copy(saved, tmp_path, sharded, plant)
    root = tmp_path / "hwr"
    with pytest.raises(HostWeightUsageError) as caught:
        load_component(folder, runtime=runtime_at(root, mode))
    assert torch.get_default_dtype() is torch.float32
    message = str(caught.value)
    assert names in message, message
    assert isinstance(caught.value, ValueError) and caught.value.code in (
        FailureCode.INVALID_CONFIGURATION,
        FailureCode.CANONICAL_SOURCE_FAILED,
    )
    assert_nothing_published(root)


@pytest.mark.parametrize(("case", "plant"), MISMATCHED, ids=[case[0] for case in MISMATCHED])
def test_checkpoint_that_does_not_fit_the_model_is_typed_and_never_published(
    saved: dict[bool, Path], tmp_path: Path, case: str, plant: Plant
) -> None:
    """D14: a well-formed checkpoint lacking tensors or holding a wrong shape is CANONICAL_SOURCE_FAILED
    in PREFERRED (never a model with uninitialised tensors, never published as if ok) and a typed HostWeightError
    in REQUIRED; the domain holds nothing afterwards."""
    folder = broken_copy(saved, tmp_path, False, plant)
    preferred_root, required_root = tmp_path / "preferred", tmp_path / "required"
    with pytest.raises(HostWeightUsageError) as preferred:
        load_component(folder, runtime=runtime_at(preferred_root, RuntimeMode.PREFERRED))
    assert preferred.value.code is FailureCode.CANONICAL_SOURCE_FAILED
    message = str(preferred.value)
    assert f"the checkpoint in {folder}" in message or f"diffusers could not load {folder}" in message, message
    assert MISMATCH_TEXT[case] in message, message
    assert message.endswith("re-download the model folder"), message
    with pytest.raises(HostWeightError) as required:
        load_component(folder, runtime=runtime_at(required_root, RuntimeMode.REQUIRED))
    assert required.value.code in (FailureCode.PRODUCER_FAILED, FailureCode.CANONICAL_SOURCE_FAILED)
    assert not required.value.retryable
    assert_nothing_published(preferred_root)
    assert_nothing_published(required_root)


def test_the_intact_folders_load_and_publish(saved: dict[bool, Path], tmp_path: Path) -> None:
    """D14: the same folders unbroken load and publish, so every refusal above is about the planted defect."""
    for sharded, folder in saved.items():
        root = tmp_path / f"hwr-{sharded}"
        with load_component(
            folder, runtime=runtime_at(root, RuntimeMode.PREFERRED), publish_in_background=False
        ) as loaded:
            assert loaded.publication is not None and loaded.publication.failure is None
        assert len(os.listdir(root / "artifacts")) == 1

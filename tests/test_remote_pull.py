"""A node without the checkpoint pulls the artifact by name through the remote's name index (E13).

Node A prewarms a real tiny Flux transformer from a Hugging Face cache snapshot (pinned
commit) and pushes it; the push records the name. Node B has its own domain and an empty
Hugging Face cache (offline): `hwr pull REPO --revision SHA --subfolder transformer` imports
the artifact verified, bit-identical to A's. Unpinned revisions are refused unless allowed;
an unknown name, or an index that points at a key the remote does not hold, exits 1 typed.
Every `hwr` call is a subprocess.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from host_weight_runtime import FilesystemHostWeightStore, ValidationLevel
from host_weight_runtime.manifest import WeightManifest
from host_weight_runtime.remote import ArtifactName, NameIndexEntry
from host_weight_runtime.remote.names import name_of_manifest_metadata
from hwr_tools.synthetic_models import save_hub_snapshot, save_pipeline_folder

from .remote_support import assert_bitwise_equal

REPO_ID = "hwr-test/tiny-flux-pull"
REVISION = hashlib.sha1(b"hwr-test/tiny-flux-pull@1").hexdigest()
SUBFOLDER = "transformer"
RUN_TIMEOUT_S = 300.0


class Hwr:
    def __init__(self, environment: dict[str, str]) -> None:
        self.environment = environment

    def __call__(self, *args: str, **extra: str) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(
            [sys.executable, "-m", "host_weight_runtime.cli", *args],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=RUN_TIMEOUT_S,
            env={**self.environment, **extra},
            check=False,
        )
        assert "Traceback" not in done.stderr, done.stderr
        return done


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Node A built the artifact from its hub cache and pushed it; node B holds nothing."""
    base = tmp_path_factory.mktemp("fleet")
    pipeline = save_pipeline_folder(base / "tiny-flux", "flux", seed=5)
    cache_a = base / "hub-a"
    save_hub_snapshot(cache_a, REPO_ID, pipeline, revision=REVISION)
    environment = {name: value for name, value in os.environ.items() if not name.startswith(("HWR_", "HF_"))}
    environment.update({"HF_HUB_OFFLINE": "1", "COLUMNS": "200"})
    hwr = Hwr(environment)
    root_a, remote = base / "node-a", base / "remote"
    remote.mkdir()
    built = hwr(
        "prewarm",
        REPO_ID,
        "--subfolder",
        SUBFOLDER,
        "--cache-dir",
        str(cache_a),
        "--root",
        str(root_a),
        "--json",
        HF_HUB_CACHE=str(cache_a),
    )
    assert built.returncode == 0, built.stderr
    key = json.loads(built.stdout)["identity_key"]
    pushed = hwr("push", "--all", "--to", f"file://{remote}", "--root", str(root_a), "--json")
    assert pushed.returncode == 0, pushed.stderr
    [entry] = json.loads(pushed.stdout)["artifacts"]
    return {"hwr": hwr, "key": key, "push": entry, "root_a": root_a, "remote": remote, "base": base}


def test_push_records_the_name_it_was_built_from(fleet: dict[str, Any]) -> None:
    """E13: the push names the artifact by repo id, pinned commit, subfolder and dtype; the index object maps
    that name to the key; a second push leaves it as it is."""
    entry = fleet["push"]
    assert entry["key"] == fleet["key"] and entry["status"] == "uploaded"
    assert REPO_ID in entry["name"] and REVISION in entry["name"] and "bfloat16" in entry["name"]
    name = ArtifactName(REPO_ID, REVISION, SUBFOLDER)
    index = fleet["remote"] / name.object_path()
    recorded = NameIndexEntry.from_bytes(index.read_bytes())
    assert recorded.key == fleet["key"] and recorded.name == name
    again = fleet["hwr"]("push", fleet["key"], "--to", f"file://{fleet['remote']}", "--root", str(fleet["root_a"]))
    assert again.returncode == 0 and "already_present" in again.stdout
    assert NameIndexEntry.from_bytes(index.read_bytes()) == recorded


def test_a_node_without_the_checkpoint_pulls_by_name(fleet: dict[str, Any], tmp_path: Path) -> None:
    """E13: node B (own domain, empty HF cache, offline) pulls by name: the import is verified and its tensors
    equal node A's bit for bit; a second pull is a hit."""
    root_b = tmp_path / "node-b"
    empty_cache = tmp_path / "empty-hub"
    empty_cache.mkdir()
    args = ("pull", REPO_ID, "--revision", REVISION, "--subfolder", SUBFOLDER, "--from", f"file://{fleet['remote']}")
    pulled = fleet["hwr"](*args, "--root", str(root_b), "--json", HF_HUB_CACHE=str(empty_cache))
    assert pulled.returncode == 0, pulled.stderr
    report = json.loads(pulled.stdout)
    assert report["status"] == "built" and report["key"] == fleet["key"]
    assert list(empty_cache.iterdir()) == []  # nothing of the model was fetched or cached
    store_a, store_b = FilesystemHostWeightStore(fleet["root_a"]), FilesystemHostWeightStore(root_b)
    manifest = store_a.layout.artifact_dir(fleet["key"]) / "manifest.json"
    identity = WeightManifest.from_bytes(manifest.read_bytes()).identity
    lease_a = store_a.lookup(identity, validation=ValidationLevel.FULL_CHECKSUM).lease
    lease_b = store_b.lookup(identity, validation=ValidationLevel.FULL_CHECKSUM).lease
    assert lease_a is not None and lease_b is not None
    with lease_a, lease_b:
        assert sorted(lease_a.tensors) == sorted(lease_b.tensors)
        for name, tensor in lease_a.tensors.items():
            assert_bitwise_equal(lease_b.tensors[name], tensor)
    again = fleet["hwr"](*args, "--root", str(root_b), "--json", HF_HUB_CACHE=str(empty_cache))
    assert again.returncode == 0 and json.loads(again.stdout)["status"] == "hit"


def test_unpinned_and_unknown_names(fleet: dict[str, Any], tmp_path: Path) -> None:
    """E13: a branch name is a usage error unless allowed (then it is only a name the index lacks: exit 1,
    not_found); an unknown repo or dtype exits 1 not_found; nothing reaches node B's domain."""
    hwr, url, root_b = fleet["hwr"], f"file://{fleet['remote']}", tmp_path / "node-b"
    base = ("pull", REPO_ID, "--subfolder", SUBFOLDER, "--from", url, "--root", str(root_b), "--json")
    unpinned = hwr(*base, "--revision", "main")
    assert unpinned.returncode == 2 and "commit" in json.loads(unpinned.stdout)["error"]["message"]
    allowed = hwr(*base, "--revision", "main", "--allow-unpinned-revision")
    assert allowed.returncode == 1 and json.loads(allowed.stdout)["failure"]["code"] == "not_found"
    other_dtype = hwr(*base, "--revision", REVISION, "--dtype", "float16")
    assert other_dtype.returncode == 1 and json.loads(other_dtype.stdout)["failure"]["code"] == "not_found"
    assert hwr("pull", "not a repo", "--revision", REVISION, "--from", url, "--root", str(root_b)).returncode == 2
    artifacts = root_b / "artifacts"
    assert not artifacts.exists() or list(artifacts.iterdir()) == []


def test_an_index_that_points_at_a_missing_or_different_artifact(fleet: dict[str, Any], tmp_path: Path) -> None:
    """E13, E03: an index object naming a key the remote lacks exits 1 not_found; one whose content digest
    disagrees with the key's descriptor is a non-retryable remote_failed; node B stays empty."""
    name = ArtifactName(REPO_ID, REVISION, SUBFOLDER)
    remote = tmp_path / "remote"
    remote.mkdir()
    (remote / name.object_path()).parent.mkdir(parents=True)
    recorded = NameIndexEntry.from_bytes((fleet["remote"] / name.object_path()).read_bytes())
    root_b = tmp_path / "node-b"
    args = ("pull", REPO_ID, "--revision", REVISION, "--subfolder", SUBFOLDER, "--root", str(root_b), "--json")

    (remote / name.object_path()).write_bytes(
        NameIndexEntry(name, "0" * 64, recorded.representation, recorded.content_sha256, 1).to_bytes()
    )
    missing = fleet["hwr"](*args, "--from", f"file://{remote}")
    assert missing.returncode == 1 and json.loads(missing.stdout)["failure"]["code"] == "not_found"

    lying = fleet["remote"] / name.object_path()
    original = lying.read_bytes()
    try:
        lying.write_bytes(NameIndexEntry(name, recorded.key, recorded.representation, "1" * 64, 2).to_bytes())
        wrong = fleet["hwr"](*args, "--from", f"file://{fleet['remote']}")
    finally:
        lying.write_bytes(original)
    failure = json.loads(wrong.stdout)["failure"]
    assert wrong.returncode == 1 and failure["code"] == "remote_failed" and failure["retryable"] is False
    artifacts = root_b / "artifacts"
    assert not artifacts.exists() or list(artifacts.iterdir()) == []


def _metadata(revision: str = REVISION, subfolder: str | None = SUBFOLDER) -> dict[str, Any]:
    return {"built_from": {"model_id": REPO_ID, "sources": [{"revision": revision, "subfolder": subfolder}]}}


def _files(*names: str) -> dict[str, Any]:
    return {"sources": [{"files": [{"name": name} for name in names]}]}


@pytest.mark.parametrize(
    ("files", "variant", "named"),
    [
        (("diffusion_pytorch_model.safetensors",), None, True),
        (
            (
                "diffusion_pytorch_model-00001-of-00002.safetensors",
                "diffusion_pytorch_model-00002-of-00002.safetensors",
            ),
            None,
            True,
        ),
        (("diffusion_pytorch_model.fp16.safetensors",), "fp16", True),
        (
            (
                "diffusion_pytorch_model.fp16-00001-of-00002.safetensors",
                "diffusion_pytorch_model.fp16-00002-of-00002.safetensors",
            ),
            "fp16",
            True,
        ),
        (("model.safetensors",), None, True),
        (("diffusion_pytorch_model.fp16.safetensors", "diffusion_pytorch_model.safetensors"), None, False),
        (("weights.safetensors",), None, False),
    ],
)
def test_a_manifest_is_named_only_when_its_sources_say_one_name(
    files: tuple[str, ...], variant: str | None, named: bool
) -> None:
    """E13: the variant comes from the source file names; mixed or unknown file names, a branch revision or a
    local folder (no pinned hub commit) leave the artifact unnamed rather than misnamed."""
    name = name_of_manifest_metadata(_metadata(), "torch.bfloat16", _files(*files))
    if not named:
        assert name is None
        return
    assert name == ArtifactName(REPO_ID, REVISION, SUBFOLDER, variant, "bfloat16")
    assert name_of_manifest_metadata(_metadata(revision="main"), "torch.bfloat16", _files(*files)) is None
    assert name_of_manifest_metadata({"built_from": {"model_id": "/models/x", "sources": []}}, "bf16") is None

"""`load_component` and `load_pipeline` on a node without the checkpoint, through the remote's name index (E14).

Node A holds a real tiny Flux pipeline (CLIP + T5 text encoders, VAE, transformer, tokenizers,
scheduler) as a Hugging Face cache snapshot at a pinned commit, prewarms every component and
pushes them all; the push records each name, the checkpoint files' sizes, content ids and tensor
names, and the snapshot's non-weight files. Node B has its own domain and an empty Hugging Face
cache (HF_HOME and HF_HUB_CACHE point at empty folders, offline): it loads by repo id and commit,
over a real `file://` remote and moto's S3 server, and gets node A's models bit for bit.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from host_weight_runtime import FailureCode, HostWeightError
from host_weight_runtime.config import HostWeightRuntimeConfig, RuntimeMode
from host_weight_runtime.diffusion import HostWeightUsageError, load_component, load_pipeline, prewarm_pipeline
from host_weight_runtime.outcomes import ResolutionOutcome
from host_weight_runtime.remote import ArtifactName, FsspecArtifactProvider, NameIndexEntry
from host_weight_runtime.runtime import HostWeightRuntime
from hwr_tools.synthetic_models import save_hub_snapshot
from hwr_tools.synthetic_pipelines import save_tiny_pipeline

from ._pipelines import image
from .remote_support import MotoEndpoint, Remote, assert_bitwise_equal, moto_endpoint

REPO_ID = "hwr-test/tiny-flux-by-name"
REVISION = hashlib.sha1(b"hwr-test/tiny-flux-by-name@1").hexdigest()
SERVED = ("text_encoder", "text_encoder_2", "transformer", "vae")


@dataclass
class NodeA:
    cache: Path
    root: Path
    keys: dict[str, str]


@pytest.fixture(scope="module")
def moto() -> Iterator[MotoEndpoint]:
    with moto_endpoint() as endpoint:
        yield endpoint


def runtime(root: Path, remote: Remote | None = None, mode: RuntimeMode = RuntimeMode.PREFERRED) -> HostWeightRuntime:
    providers = (
        () if remote is None else (FsspecArtifactProvider(remote.read_url, storage_options=remote.read_options),)
    )
    return HostWeightRuntime(
        HostWeightRuntimeConfig(mode=mode, root=root, lock_timeout_s=60.0), remote_providers=providers
    )


@pytest.fixture(scope="module")
def node_a(tmp_path_factory: pytest.TempPathFactory) -> NodeA:
    """Node A prewarmed every component of the pipeline from its hub cache snapshot."""
    base = tmp_path_factory.mktemp("node-a")
    folder = save_tiny_pipeline(base / "tiny-flux", "flux", seed=13)
    cache = base / "hub"
    save_hub_snapshot(cache, REPO_ID, folder, revision=REVISION)
    root = base / "domain"
    built = prewarm_pipeline(REPO_ID, revision=REVISION, cache_dir=cache, runtime=runtime(root))
    assert sorted(built.built) == list(SERVED)
    return NodeA(cache, root, {name: result.identity_key for name, result in built.built.items()})


def node_a_component(node_a: NodeA, name: str) -> torch.nn.Module:
    loaded = load_component(
        REPO_ID, subfolder=name, revision=REVISION, cache_dir=node_a.cache, runtime=runtime(node_a.root)
    )
    assert loaded.outcome is ResolutionOutcome.LOCAL_HIT
    return loaded.model


def assert_same_weights(model: torch.nn.Module, reference: torch.nn.Module) -> None:
    ours, theirs = model.state_dict(), reference.state_dict()
    assert sorted(ours) == sorted(theirs)
    for name, tensor in theirs.items():
        assert_bitwise_equal(ours[name], tensor)


@pytest.mark.parametrize("component", ["transformer", "text_encoder_2"])
def test_load_component_by_name(node_a: NodeA, pushed: Remote, tmp_path: Path, component: str) -> None:
    """E14: node B, holding nothing of the model, loads a diffusers and a transformers component by repo id and
    commit: REMOTE_IMPORT under node A's key, every tensor equal to node A's; the next load is a LOCAL_HIT."""
    root_b = tmp_path / "node-b"
    first = load_component(REPO_ID, subfolder=component, revision=REVISION, runtime=runtime(root_b, pushed))
    assert first.outcome is ResolutionOutcome.REMOTE_IMPORT, first.summary()
    assert first.identity_key == node_a.keys[component]
    assert_same_weights(first.model, node_a_component(node_a, component))
    second = load_component(REPO_ID, subfolder=component, revision=REVISION, runtime=runtime(root_b, pushed))
    assert second.outcome is ResolutionOutcome.LOCAL_HIT and second.identity_key == first.identity_key


def test_load_pipeline_by_name(node_a: NodeA, pushed: Remote, tmp_path: Path) -> None:
    """E14: node B loads the whole pipeline by repo id and commit: every weighted component is imported under
    node A's key, the tokenizers and scheduler come from the recorded files, and the image equals node A's."""
    reference = load_pipeline(REPO_ID, revision=REVISION, cache_dir=node_a.cache, runtime=runtime(node_a.root))
    loaded = load_pipeline(REPO_ID, revision=REVISION, runtime=runtime(tmp_path / "node-b", pushed))
    assert {name: outcome for name, outcome in loaded.outcomes.items()} == dict.fromkeys(
        SERVED, ResolutionOutcome.REMOTE_IMPORT
    )
    for name in SERVED:
        assert loaded.components[name].identity_key == node_a.keys[name]
        assert_same_weights(loaded.components[name].model, reference.components[name].model)
    assert type(loaded.pipeline) is type(reference.pipeline)
    assert torch.equal(image(loaded.pipeline, "flux"), image(reference.pipeline, "flux"))


def _rewrite_entry(remote: Remote, name: ArtifactName, **changes: Any) -> None:
    path = f"{remote.raw_root}/{name.object_path()}"
    entry = NameIndexEntry.from_bytes(bytes(remote.raw.cat_file(path)))
    fields = {field: getattr(entry, field) for field in NameIndexEntry.__dataclass_fields__}
    remote.raw.pipe_file(path, NameIndexEntry(**{**fields, **changes}).to_bytes())


@pytest.mark.parametrize("pushed", ["file"], indirect=True)
def test_bad_names(node_a: NodeA, pushed: Remote, tmp_path: Path) -> None:
    """E14: an unpinned revision is a usage error; a name the index lacks is the cache miss (NOT_FOUND) in
    PREFERRED and REQUIRED alike; an index entry naming another key is a non-retryable REMOTE_FAILED and
    nothing is imported."""
    root_b = tmp_path / "node-b"
    with pytest.raises(HostWeightUsageError, match="commit"):
        load_component(REPO_ID, subfolder="transformer", revision="main", runtime=runtime(root_b, pushed))
    with pytest.raises(HostWeightUsageError, match="commit"):
        load_pipeline(REPO_ID, runtime=runtime(root_b, pushed))
    for mode in (RuntimeMode.PREFERRED, RuntimeMode.REQUIRED):
        with pytest.raises(HostWeightError) as missing:
            load_component(
                REPO_ID, subfolder="transformer", revision=REVISION, torch_dtype=torch.float16,
                runtime=runtime(root_b, pushed, mode),
            )  # fmt: skip
        assert missing.value.failure.code is FailureCode.NOT_FOUND and "float16" in missing.value.failure.message
    _rewrite_entry(pushed, ArtifactName(REPO_ID, REVISION, "transformer"), key=node_a.keys["vae"])
    with pytest.raises(HostWeightError) as other:
        load_component(REPO_ID, subfolder="transformer", revision=REVISION, runtime=runtime(root_b, pushed))
    assert other.value.failure.code is FailureCode.REMOTE_FAILED and not other.value.failure.retryable
    artifacts = root_b / "artifacts"
    assert not artifacts.exists() or list(artifacts.iterdir()) == []


@pytest.mark.parametrize("pushed", ["file"], indirect=True)
def test_a_present_checkpoint_computes_its_own_key(node_a: NodeA, pushed: Remote, tmp_path: Path) -> None:
    """E14: with the checkpoint in the cache, the index is never asked: an entry pointing the name at another
    key changes nothing, the load imports the key the checkpoint computes."""
    _rewrite_entry(pushed, ArtifactName(REPO_ID, REVISION, "transformer"), key=node_a.keys["vae"])
    loaded = load_component(
        REPO_ID, subfolder="transformer", revision=REVISION, cache_dir=node_a.cache,
        runtime=runtime(tmp_path / "node-b", pushed),
    )  # fmt: skip
    assert loaded.outcome is ResolutionOutcome.REMOTE_IMPORT
    assert loaded.identity_key == node_a.keys["transformer"]

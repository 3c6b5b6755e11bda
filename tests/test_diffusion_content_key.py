"""The artifact key follows the checkpoint's content, not the path it was reached by (D05, D14).

A new user's call, `load_component(model_or_path, subfolder="transformer")` with HWR_MODE and
HWR_ROOT in the environment, on a real tiny FluxTransformer2DModel saved as a pipeline folder
and as a Hugging Face cache snapshot. The repo id, the snapshot folder, a copy and a path
through a symlinked parent are one source with one artifact; new weights at the same path are
a new source. Where the artifact was built from is kept in its manifest, for people only.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from host_weight_runtime.diffusion import ComponentLoadPath, LoadedComponent, load_component
from host_weight_runtime.diffusion._source_snapshot import key_content_id
from host_weight_runtime.filesystem.store import FilesystemHostWeightStore
from host_weight_runtime.outcomes import PostLoadPublicationStatus, ResolutionOutcome
from hwr_tools.synthetic_models import save_hub_snapshot, save_pipeline_folder

from ._tiny_flux import (  # noqa: F401 - fixtures the tests take
    KIND,
    MODEL_CLASS,
    REPO_ID,
    SUBFOLDER,
    canonical_flux,
    flux_forward,
    isolate_environment,
    tiny_flux_canonical_output,
    tiny_flux_pipeline,
)
from .support import artifact_keys


@pytest.fixture(autouse=True)
def domain(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """What a new user sets: HWR_MODE=preferred and HWR_ROOT; the hub is offline with an empty default cache."""
    isolate_environment(monkeypatch, tmp_path)
    root = tmp_path / "domain"
    monkeypatch.setenv("HWR_MODE", "preferred")
    monkeypatch.setenv("HWR_ROOT", str(root))
    return root


def _published(loaded: LoadedComponent) -> str:
    """The key of a first load that missed, loaded canonically and published."""
    assert loaded.outcome is ResolutionOutcome.CANONICAL_FALLBACK
    assert loaded.publication is not None and loaded.publication.status is PostLoadPublicationStatus.PUBLISHED
    assert loaded.identity_key is not None
    return loaded.identity_key


def _hit(loaded: LoadedComponent, key: str, expected: torch.Tensor) -> None:
    """A load served from the artifact `key`, bit-identical to canonical."""
    assert loaded.outcome is ResolutionOutcome.LOCAL_HIT
    assert loaded.load_path is ComponentLoadPath.ARTIFACT
    assert loaded.identity_key == key
    assert torch.equal(flux_forward(loaded.model), expected)


def test_repo_id_and_its_snapshot_folder_share_one_artifact(
    tmp_path: Path, domain: Path, pipeline: Path, monkeypatch: pytest.MonkeyPatch, canonical_output: torch.Tensor
) -> None:
    """D05/D14: a cached repo loaded by id publishes; the same snapshot folder loaded by path is a LOCAL_HIT
    on that artifact (no repo id, revision or source kind in the key), bit-identical to canonical."""
    cache = tmp_path / "hub"
    snapshot = save_hub_snapshot(cache, REPO_ID, pipeline)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))

    with load_component(REPO_ID, subfolder=SUBFOLDER, publish_in_background=False) as by_id:
        key = _published(by_id)
        assert torch.equal(flux_forward(by_id.model), canonical_output)
    with load_component(snapshot, subfolder=SUBFOLDER, publish_in_background=False) as by_path:
        _hit(by_path, key, canonical_output)
    assert artifact_keys(domain) == [key]


def test_copied_folders_hit_the_artifact_of_the_original(
    tmp_path: Path, domain: Path, pipeline: Path, canonical_output: torch.Tensor
) -> None:
    """D05/D14: a shutil.copytree of the pipeline folder, and a plain copy of a hub snapshot (its blob
    symlinks become regular files that are hashed), are LOCAL_HITs on the artifact the original published."""
    with load_component(pipeline, subfolder=SUBFOLDER, publish_in_background=False) as original:
        key = _published(original)

    copy = shutil.copytree(pipeline, tmp_path / "elsewhere" / "copy-of-tiny-flux")
    with load_component(copy, subfolder=SUBFOLDER, publish_in_background=False) as copied:
        _hit(copied, key, canonical_output)

    snapshot = save_hub_snapshot(tmp_path / "hub", REPO_ID, pipeline)
    flattened = shutil.copytree(snapshot, tmp_path / "flattened-snapshot")
    assert not (flattened / SUBFOLDER / "diffusion_pytorch_model.safetensors").is_symlink()
    with load_component(flattened, subfolder=SUBFOLDER, publish_in_background=False) as from_snapshot_copy:
        _hit(from_snapshot_copy, key, canonical_output)
    assert artifact_keys(domain) == [key]


def test_a_path_through_a_symlinked_parent_is_the_same_source(
    tmp_path: Path, domain: Path, pipeline: Path, canonical_output: torch.Tensor
) -> None:
    """D05/D14: the folder reached through a symlinked parent (as a container mounts the models directory
    elsewhere) and through a link to the folder itself is a LOCAL_HIT on one artifact."""
    with load_component(pipeline, subfolder=SUBFOLDER, publish_in_background=False) as direct:
        key = _published(direct)
    mount = tmp_path / "mnt" / "models"
    mount.parent.mkdir()
    os.symlink(pipeline.parent, mount)
    with load_component(mount / pipeline.name, subfolder=SUBFOLDER, publish_in_background=False) as through_mount:
        _hit(through_mount, key, canonical_output)
    link = tmp_path / "current-model"
    os.symlink(pipeline, link)
    with load_component(str(link), subfolder=SUBFOLDER, publish_in_background=False) as through_link:
        _hit(through_link, key, canonical_output)
    assert artifact_keys(domain) == [key]


def test_new_weights_at_the_same_path_get_a_new_key_and_never_the_stale_artifact(tmp_path: Path, domain: Path) -> None:
    """D05/D14: weights rewritten in place (same path, same shapes) are new content: a new key, a canonical
    load of the new weights (no hit on the stale artifact), then a LOCAL_HIT on the new artifact."""
    folder = save_pipeline_folder(tmp_path / "models" / "tiny-flux", KIND, seed=7)
    old_output = flux_forward(canonical_flux(folder))
    with load_component(folder, subfolder=SUBFOLDER, publish_in_background=False) as before:
        old_key = _published(before)
        assert torch.equal(flux_forward(before.model), old_output)

    save_pipeline_folder(folder, KIND, seed=8)
    new_output = flux_forward(canonical_flux(folder))
    assert not torch.equal(new_output, old_output)
    with load_component(folder, subfolder=SUBFOLDER, publish_in_background=False) as after:
        new_key = _published(after)
        assert after.load_path is ComponentLoadPath.CANONICAL
        assert torch.equal(flux_forward(after.model), new_output)
    assert new_key != old_key
    with load_component(folder, subfolder=SUBFOLDER, publish_in_background=False) as again:
        _hit(again, new_key, new_output)
    assert artifact_keys(domain) == sorted([old_key, new_key])


def test_the_manifest_records_what_the_artifact_was_built_from(
    tmp_path: Path, domain: Path, pipeline: Path, monkeypatch: pytest.MonkeyPatch, canonical_output: torch.Tensor
) -> None:
    """D14: the repo id, revision and snapshot path the artifact was built from are in its manifest's
    format_metadata and in the domain inspection; the identity (the key) holds none of them (D05)."""
    cache = tmp_path / "hub"
    snapshot = save_hub_snapshot(cache, REPO_ID, pipeline)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    with load_component(REPO_ID, subfolder=SUBFOLDER, publish_in_background=False) as first:
        key = _published(first)

    assert FilesystemHostWeightStore(domain).inspect_artifact(key).model_id == REPO_ID
    with load_component(
        snapshot, subfolder=SUBFOLDER, publish_in_background=False
    ) as second:  # a hit: the record stays the builder's
        _hit(second, key, canonical_output)
        assert second.lease is not None
        manifest = second.lease.manifest
    metadata = manifest.format_metadata.to_value()
    assert isinstance(metadata, dict)
    assert metadata["built_from"] == {
        "model_id": REPO_ID,
        "sources": [
            {
                "model_or_path": REPO_ID,
                "source_kind": "hugging_face_hub",
                "requested_revision": None,
                "revision": snapshot.name,
                "subfolder": SUBFOLDER,
                "path": str(snapshot / SUBFOLDER),
            }
        ],
    }
    source = manifest.identity.source
    assert (source.model_id, source.revision) == (MODEL_CLASS, None)
    identity_text = json.dumps(manifest.identity.to_dict())
    for spelling in (REPO_ID, snapshot.name, str(tmp_path)):
        assert spelling not in identity_text

    with load_component(
        pipeline, subfolder=SUBFOLDER, publish_in_background=False
    ) as local:  # the same bytes as a plain folder: a hit
        _hit(local, key, canonical_output)
    assert FilesystemHostWeightStore(domain).inspect_artifact(key).model_id == REPO_ID


def test_a_cached_lfs_blob_name_is_keyed_as_the_sha256_it_is() -> None:
    """D05: a 64-hex hub blob name (an LFS blob, named by its SHA-256) keys as `sha256:`, so a snapshot and its
    copy agree; a 40-hex git SHA-1 blob keeps its own spelling, since its SHA-256 is unknown without reading it."""
    digest = "ab" * 32
    assert key_content_id(f"hub-blob:{digest}") == f"sha256:{digest}"
    assert key_content_id(f"sha256:{digest}") == f"sha256:{digest}"
    assert key_content_id(f"hub-blob:{'cd' * 20}") == f"hub-blob:{'cd' * 20}"

"""The name index's records for a load by name, parsed strictly (E14, E13).

An index entry lists the checkpoint files the key was computed from; a snapshot file list names
the non-weight files a node fetches. Both come from the remote, so anything but their exact
shape (a path that climbs out of the snapshot, a malformed content id, a file that does not hash
to its recorded SHA-256) is refused typed; the first entry schema still parses, with no files.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from host_weight_runtime import FailureCode, HostWeightError, HostWeightUsageError
from host_weight_runtime.canonical_json import CanonicalJson
from host_weight_runtime.remote import ArtifactName, FsspecArtifactProvider, NameIndexEntry
from host_weight_runtime.remote.names import CheckpointFileRecord, name_of_manifest_metadata, tensor_parallel_names
from host_weight_runtime.remote.snapshot_files import (
    SnapshotFile,
    SnapshotFiles,
    publish_snapshot_files,
    read_snapshot_file,
    read_snapshot_files,
)

REVISION = "a" * 40
NAME = ArtifactName("org/model", REVISION, "transformer")
KEY = "b" * 64


def test_an_entry_round_trips_with_its_checkpoint() -> None:
    """E14: the checkpoint files (name, size, content id, tensor names) survive the canonical bytes."""
    record = CheckpointFileRecord("diffusion_pytorch_model.safetensors", 12, "sha256:" + "c" * 64, ("a.weight",))
    entry = NameIndexEntry(NAME, KEY, "bf16", "d" * 64, 5, (record,))
    parsed = NameIndexEntry.from_bytes(entry.to_bytes())
    assert parsed == entry and parsed.same_target(NameIndexEntry(NAME, KEY, "bf16", "d" * 64, 6, (record,)))


def test_the_first_schema_still_parses_without_files() -> None:
    """E13: an entry written before checkpoint files were recorded parses, with an empty checkpoint."""
    first = CanonicalJson.from_value(
        {
            "schema": "hwr-name-index-v1",
            "name": NAME.to_dict(),
            "key": KEY,
            "representation": "bf16",
            "content_sha256": "d" * 64,
            "uploaded_at_ns": 1,
        }
    ).data
    assert NameIndexEntry.from_bytes(first).checkpoint == ()


@pytest.mark.parametrize(
    "record",
    [
        {"name": "../escape.safetensors", "size": 1, "content_id": "sha256:" + "c" * 64, "tensor_names": []},
        {"name": "model.safetensors", "size": -1, "content_id": "sha256:" + "c" * 64, "tensor_names": []},
        {"name": "model.safetensors", "size": 1, "content_id": "md5:abc", "tensor_names": []},
        {"name": "model.safetensors", "size": 1, "content_id": "sha256:" + "c" * 64, "tensor_names": [""]},
    ],
)
def test_malformed_checkpoint_records_are_refused(record: dict[str, object]) -> None:
    """E14: a record that climbs out of the folder, a negative size, a foreign content id or an empty tensor
    name makes the whole entry invalid."""
    entry = CanonicalJson(NameIndexEntry(NAME, KEY, "bf16", "d" * 64, 1).to_bytes()).to_value()
    assert isinstance(entry, dict)
    data = CanonicalJson.from_value({**entry, "checkpoint": [record]}).data  # type: ignore[dict-item]
    with pytest.raises(ValueError):
        NameIndexEntry.from_bytes(data)


def test_snapshot_files_travel_checked(tmp_path: Path) -> None:
    """E14: push uploads a snapshot's non-weight files by content and lists them; weights never travel; a
    listed file whose bytes were replaced is a non-retryable REMOTE_FAILED; a list naming a path outside the
    snapshot, or a weight file, is refused as invalid."""
    snapshot = tmp_path / "snapshots" / REVISION
    (snapshot / "transformer").mkdir(parents=True)
    (snapshot / "model_index.json").write_text('{"_class_name": "FluxPipeline"}')
    (snapshot / "transformer" / "config.json").write_text('{"_class_name": "FluxTransformer2DModel"}')
    (snapshot / "transformer" / "diffusion_pytorch_model.safetensors").write_bytes(b"weights")
    remote = tmp_path / "remote"
    remote.mkdir()
    location = FsspecArtifactProvider(f"file://{remote}").location
    publish_snapshot_files(location, "org/model", REVISION, snapshot)
    listed = read_snapshot_files(location, "org/model", REVISION)
    assert listed is not None
    assert [file.path for file in listed.files] == ["model_index.json", "transformer/config.json"]
    config = listed.files[1]
    assert read_snapshot_file(location, config) == (snapshot / "transformer" / "config.json").read_bytes()
    (remote / config.object_path).write_bytes(b'{"_class_name": "Other"}')
    with pytest.raises(HostWeightError) as replaced:
        read_snapshot_file(location, config)
    assert replaced.value.failure.code is FailureCode.REMOTE_FAILED and not replaced.value.failure.retryable
    for path in ("../../etc/passwd", "vae/diffusion_pytorch_model.safetensors"):
        hostile = SnapshotFiles("org/model", REVISION, (SnapshotFile(path, hashlib.sha256(b"").hexdigest(), 0),))
        (remote / SnapshotFiles.object_path_for("org/model", REVISION)).write_bytes(hostile.to_bytes())
        with pytest.raises(HostWeightError) as invalid:
            read_snapshot_files(location, "org/model", REVISION)
        assert invalid.value.failure.code is FailureCode.REMOTE_FAILED


def _layout(size: int, rank: int = 0, part: dict[str, object] | None = None, sp: int = 1) -> dict[str, object]:
    metadata: dict[str, object] = {} if part is None else {"part": part, "tensor_parallel_plan": {"name": "p"}}
    return {
        "name": "diffusion-final-module-layout-v1",
        "tensor_parallel_size": size,
        "tensor_parallel_rank": rank,
        "sequence_parallel_size": sp,
        "sequence_parallel_backend": "none" if sp == 1 else "ulysses",
        "metadata": metadata,
    }


def test_each_layout_is_its_own_name() -> None:
    """E14: a TP part's name carries its TP size and part, so it never shares the whole artifact's index object;
    a rank stored whole (no part) and a sequence-parallel layout get no name; a part name round-trips."""
    built_from = {"built_from": {"model_id": "org/model", "sources": [{"revision": REVISION, "subfolder": "t"}]}}
    files = {"sources": [{"files": [{"name": "diffusion_pytorch_model.safetensors"}]}]}
    whole = name_of_manifest_metadata(built_from, "bfloat16", files, _layout(1))
    replicated = name_of_manifest_metadata(built_from, "bfloat16", files, _layout(2, 0, {"kind": "replicated"}))
    shard = name_of_manifest_metadata(built_from, "bfloat16", files, _layout(2, 1, {"kind": "shard", "replicated": KEY}))
    assert whole == ArtifactName("org/model", REVISION, "t")
    assert replicated == ArtifactName("org/model", REVISION, "t", None, "bfloat16", 2, "replicated")
    assert shard == ArtifactName("org/model", REVISION, "t", None, "bfloat16", 2, "shard-1")
    paths = {name.object_path() for name in (whole, replicated, shard) if name is not None}
    assert len(paths) == 3 and shard is not None and shard.object_path().endswith("/bfloat16/tp2/shard-1.json")
    assert name_of_manifest_metadata(built_from, "bfloat16", files, _layout(2, 1)) is None
    assert name_of_manifest_metadata(built_from, "bfloat16", files, _layout(1, sp=2)) is None
    entry = NameIndexEntry(shard, KEY, "final-layout-bf16", "d" * 64, 1)
    assert NameIndexEntry.from_bytes(entry.to_bytes()) == entry
    assert "tensor_parallel_size" not in CanonicalJson(NameIndexEntry(NAME, KEY, "b", "d" * 64, 1).to_bytes()).data.decode()
    assert [part.part for part in tensor_parallel_names(NAME, 2)] == ["replicated", "shard-0", "shard-1"]


@pytest.mark.parametrize(("size", "part"), [(2, None), (1, "replicated"), (2, "shard-2"), (2, "shard-01"), (0, None)])
def test_malformed_layout_names_are_usage_errors(size: int, part: str | None) -> None:
    """E14: a TP name without its part, a TP=1 name with one, a shard rank outside the size are refused."""
    with pytest.raises(HostWeightUsageError):
        ArtifactName("org/model", REVISION, "t", None, "bfloat16", size, part)

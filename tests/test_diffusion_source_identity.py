"""Diffusion source identity: coverage (D02), the node digest cache (D03), hub blobs (D04), replacement (D11)."""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import logging
import os
import socket
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save as save_safetensors

from host_weight_runtime._faults import Fault, FaultAction, armed, disarm_all
from host_weight_runtime.canonical_json import CanonicalJson, JsonValue, decode_json, encode_canonical
from host_weight_runtime.diffusion.contracts import ImplementationIdentity
from host_weight_runtime.diffusion.source_identity import (
    FileState,
    NodeSourceDigestCache,
    PreparedWeightSource,
    WeightSourceKind,
    bind_tensors_to_sources,
    hub_blob_content_id,
    prepare_weight_source,
    resolved_revision,
    snapshot_sources,
)
from host_weight_runtime.failures import FailureCode, HostWeightError, ResolutionStage
from host_weight_runtime.filesystem.locks import try_lock

from .support import recv_within, spawned_child

WEIGHTS = "diffusion_pytorch_model.safetensors"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
OTHER_COMMIT = "fedcba9876543210fedcba9876543210fedcba98"
LOGGER = "host_weight_runtime.diffusion.source_identity"
WAIT_S = 30.0


@pytest.fixture(autouse=True)
def _no_leftover_faults() -> Iterator[None]:
    yield
    disarm_all()


# ----------------------------------------------------------------------------- helpers


def _weights(seed: int) -> bytes:
    """A small, real safetensors file; the same seed gives the same bytes."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {
        "blocks.0.weight": torch.randn(16, 8, generator=generator),
        "blocks.0.bias": torch.randn(16, generator=generator),
    }
    data: bytes = save_safetensors(tensors)
    return data


def _sha256_id(data: bytes) -> str:
    return f"sha256:{hashlib.sha256(data).hexdigest()}"


def _write(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def _model_folder(folder: Path, seed: int = 0, *, name: str = WEIGHTS) -> Path:
    """A diffusers-shaped component folder: config.json plus one weight file."""
    _write(folder / "config.json", b'{"_class_name": "TestTransformer"}')
    _write(folder / name, _weights(seed))
    return folder


def _replace(path: Path, data: bytes) -> None:
    """Replace a file by rename (a new inode), the way a download or a save does."""
    temp = path.with_name(path.name + ".new")
    temp.write_bytes(data)
    os.replace(temp, path)


def _hub_repo(cache: Path, repo_id: str, commit: str, files: dict[str, bytes], refs: dict[str, str]) -> Path:
    """A Hugging Face cache repo built by hand: content-named blobs, relative snapshot symlinks, refs."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    blobs = repo / "blobs"
    blobs.mkdir(parents=True, exist_ok=True)
    snapshot = repo / "snapshots" / commit
    for relative, data in files.items():
        name = hashlib.sha256(data).hexdigest()
        (blobs / name).write_bytes(data)
        link = snapshot / relative
        link.parent.mkdir(parents=True, exist_ok=True)
        os.symlink("../" * (len(Path(relative).parts) + 1) + f"blobs/{name}", link)
    for ref, target in refs.items():
        _write(repo / "refs" / ref, target.encode())
    return snapshot


def _hub_component(cache: Path, seed: int = 0) -> Path:
    """A cached 'org/model' whose snapshot holds a transformer component; returns the snapshot."""
    files = {"transformer/config.json": b'{"_class_name": "TestTransformer"}', f"transformer/{WEIGHTS}": _weights(seed)}
    return _hub_repo(cache, "org/model", COMMIT, files, {"main": COMMIT})


def _source(root: Path, *files: Path, prefix: str = "", **changes: Any) -> PreparedWeightSource:
    source = PreparedWeightSource(str(root), None, root, None, prefix, tuple(sorted(files)), True)
    return dataclasses.replace(source, **changes) if changes else source


def _abstract_source(tmp_path: Path, prefix: str) -> PreparedWeightSource:
    """A source for binding only (binding never touches the files)."""
    return _source(tmp_path, tmp_path / "w.safetensors", prefix=prefix)


def _private(cache: NodeSourceDigestCache) -> None:
    """Create the cache directories the way the cache does (0700), for tests that hold its locks."""
    for directory in (cache.entries.parent, cache.entries, cache.locks):
        directory.mkdir(parents=True, exist_ok=True)
        directory.chmod(0o700)


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [record.getMessage() for record in caplog.records if record.name == LOGGER and record.levelname == "WARNING"]


def _child_content_id(root: str, path: str, conn: Connection) -> None:
    """In a fresh process: ask a fresh cache on `root` for the file's id; report it and the hash count."""
    cache = NodeSourceDigestCache(Path(root))
    content_id = cache.content_id(Path(path), FileState.of(Path(path)))
    conn.send((content_id, cache.hashes_computed))
    conn.close()


# ----------------------------------------------------------------------------- D03: node digest cache


def test_digest_cache_hash_counts_show_reuse(tmp_path: Path) -> None:
    """D03: a file is hashed once; a second lookup and a second cache instance on the same root reuse it."""
    data = _weights(1)
    path = _write(tmp_path / "model" / WEIGHTS, data)
    state = FileState.of(path)
    cache = NodeSourceDigestCache(tmp_path / "root")

    assert cache.content_id(path, state) == _sha256_id(data)
    assert cache.hashes_computed == 1
    assert cache.content_id(path, state) == _sha256_id(data)
    assert cache.hashes_computed == 1

    other = NodeSourceDigestCache(tmp_path / "root")
    assert other.content_id(path, state) == _sha256_id(data)
    assert other.hashes_computed == 0

    entry = cache.entry_path(path, state)
    assert entry.parent == cache.entries
    CanonicalJson(entry.read_bytes())  # the entry is canonical JSON
    recorded = decode_json(entry.read_bytes())
    assert isinstance(recorded, dict)
    assert recorded["digest"] == _sha256_id(data)
    assert recorded["path"] == os.path.realpath(path)
    for directory in (cache.entries.parent, cache.entries, cache.locks):
        assert directory.stat().st_mode & 0o777 == 0o700


def test_digest_cache_reused_by_spawned_child_without_hashing(tmp_path: Path) -> None:
    """D03: a worker in another process reads the entry this process wrote and hashes nothing."""
    data = _weights(2)
    path = _write(tmp_path / "model" / WEIGHTS, data)
    cache = NodeSourceDigestCache(tmp_path / "root")
    assert cache.content_id(path, FileState.of(path)) == _sha256_id(data)
    assert cache.hashes_computed == 1

    with spawned_child(_child_content_id, str(tmp_path / "root"), str(path)) as conn:
        reported = recv_within(conn)
    assert reported == (_sha256_id(data), 0)


def test_digest_cache_waiter_reads_the_entry_after_the_lock(tmp_path: Path) -> None:
    """D03: while one worker holds the entry lock and hashes, another waits and then reuses its result."""
    data = _weights(3)
    path = _write(tmp_path / "model" / WEIGHTS, data)
    state = FileState.of(path)
    first = NodeSourceDigestCache(tmp_path / "root")
    second = NodeSourceDigestCache(tmp_path / "root")
    hashing, proceed, waiting = threading.Event(), threading.Event(), threading.Event()

    def hold_while_hashing(_point: str) -> None:
        hashing.set()
        assert proceed.wait(WAIT_S)

    with ThreadPoolExecutor(max_workers=2) as pool:
        try:
            with armed("source_digest_cache.before_hash", Fault(FaultAction.PAUSE, hook=hold_while_hashing)):
                first_id = pool.submit(first.content_id, path, state)
                assert hashing.wait(WAIT_S)
            # The first worker is inside its critical section: the entry lock is taken, no entry yet.
            assert try_lock(first.lock_path(path, state), exclusive=True) is None
            assert not first.entry_path(path, state).exists()
            with armed("source_digest_cache.before_lock", Fault(FaultAction.PAUSE, hook=lambda _p: waiting.set())):
                second_id = pool.submit(second.content_id, path, state)
                assert waiting.wait(WAIT_S)  # the second found no entry and now waits for the lock
        finally:
            proceed.set()
        assert first_id.result(WAIT_S) == _sha256_id(data)
        assert second_id.result(WAIT_S) == _sha256_id(data)
    assert (first.hashes_computed, second.hashes_computed) == (1, 0)


def test_digest_cache_recovers_from_a_corrupt_entry(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """D03: an entry of garbage bytes is logged, recomputed and rewritten valid."""
    data = _weights(4)
    path = _write(tmp_path / "model" / WEIGHTS, data)
    state = FileState.of(path)
    cache = NodeSourceDigestCache(tmp_path / "root")
    cache.content_id(path, state)
    entry = cache.entry_path(path, state)
    entry.write_bytes(b"\x00\xffnot json at all")

    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert cache.content_id(path, state) == _sha256_id(data)
    assert cache.hashes_computed == 2
    assert any("corrupt" in message for message in _warnings(caplog))
    fresh = NodeSourceDigestCache(tmp_path / "root")
    assert fresh.content_id(path, state) == _sha256_id(data)
    assert fresh.hashes_computed == 0  # the rewritten entry is valid again


def test_digest_cache_recomputes_a_digest_edited_without_its_checksum(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """D03: a tampered digest whose entry_sha256 was not fixed is detected and recomputed, never returned."""
    data = _weights(5)
    path = _write(tmp_path / "model" / WEIGHTS, data)
    state = FileState.of(path)
    cache = NodeSourceDigestCache(tmp_path / "root")
    cache.content_id(path, state)
    entry = cache.entry_path(path, state)
    recorded = decode_json(entry.read_bytes())
    assert isinstance(recorded, dict)
    recorded["digest"] = "sha256:" + "0" * 64
    entry.write_bytes(encode_canonical(recorded))

    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert cache.content_id(path, state) == _sha256_id(data)
    assert cache.hashes_computed == 2
    assert _warnings(caplog)


def test_digest_cache_rejects_an_entry_for_another_file(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """D03: a well-formed entry with a valid checksum that records another file (and digest) is rejected."""
    first_data, second_data = _weights(6), _weights(7)
    first = _write(tmp_path / "model" / "a.safetensors", first_data)
    second = _write(tmp_path / "model" / "b.safetensors", second_data)
    cache = NodeSourceDigestCache(tmp_path / "root")
    cache.content_id(first, FileState.of(first))
    cache.content_id(second, FileState.of(second))
    second_entry = cache.entry_path(second, FileState.of(second))
    second_entry.write_bytes(cache.entry_path(first, FileState.of(first)).read_bytes())

    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert cache.content_id(second, FileState.of(second)) == _sha256_id(second_data)
    assert cache.hashes_computed == 3
    assert any("rejecting" in message for message in _warnings(caplog))
    recorded = decode_json(second_entry.read_bytes())
    assert isinstance(recorded, dict) and recorded["digest"] == _sha256_id(second_data)


def test_digest_cache_invalidated_by_file_change(tmp_path: Path) -> None:
    """D03: a replaced file has a new state, so a new entry and a new hash; a stale state is refused."""
    path = _write(tmp_path / "model" / WEIGHTS, _weights(8))
    old_state = FileState.of(path)
    cache = NodeSourceDigestCache(tmp_path / "root")
    old_id = cache.content_id(path, old_state)

    _replace(path, _weights(9))
    new_state = FileState.of(path)
    assert new_state != old_state
    new_id = cache.content_id(path, new_state)
    assert new_id == _sha256_id(_weights(9)) != old_id
    assert cache.hashes_computed == 2
    with pytest.raises(HostWeightError) as caught:
        cache.content_id(path, old_state)
    assert caught.value.code is FailureCode.CANONICAL_SOURCE_FAILED
    assert cache.hashes_computed == 2


def _replace_file(path: Path, tmp_path: Path) -> None:
    _replace(path.resolve(), _weights(11))


def _append_during_hash(path: Path, tmp_path: Path) -> None:
    with path.open("ab") as stream:
        stream.write(b"\x00")


def _repoint_symlink(path: Path, tmp_path: Path) -> None:
    other = _write(tmp_path / "store" / "other", _weights(11))
    temp = path.with_name("link.new")
    os.symlink(other, temp)
    os.replace(temp, path)


@pytest.mark.parametrize("change", [_replace_file, _append_during_hash, _repoint_symlink])
def test_digest_cache_writes_no_entry_when_the_file_changes_while_hashing(
    tmp_path: Path, change: Callable[[Path, Path], None]
) -> None:
    """D03/D11: a file replaced, rewritten or re-pointed during hashing fails with CANONICAL_SOURCE_FAILED, no entry."""
    target = _write(tmp_path / "store" / "weights", _weights(10))
    path = tmp_path / "model" / WEIGHTS
    path.parent.mkdir()
    os.symlink(target, path)
    state = FileState.of(path)
    cache = NodeSourceDigestCache(tmp_path / "root")

    with (
        armed("source_digest.after_hash", Fault(FaultAction.PAUSE, hook=lambda _p: change(path, tmp_path))),
        pytest.raises(HostWeightError) as caught,
    ):
        cache.content_id(path, state)
    assert caught.value.failure.code is FailureCode.CANONICAL_SOURCE_FAILED
    assert caught.value.failure.stage is ResolutionStage.CANONICAL
    assert not any(cache.entries.iterdir())


def test_digest_cache_lock_timeout_falls_back_to_direct_hashing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """D03: while another holder keeps the entry lock, a worker past its timeout hashes directly, writing nothing."""
    data = _weights(12)
    path = _write(tmp_path / "model" / WEIGHTS, data)
    state = FileState.of(path)
    cache = NodeSourceDigestCache(tmp_path / "root", timeout_seconds=0.0)
    _private(cache)
    holder = try_lock(cache.lock_path(path, state), exclusive=True)  # another open file description
    assert holder is not None
    try:
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            assert cache.content_id(path, state) == _sha256_id(data)
    finally:
        holder.release()
    assert cache.hashes_computed == 1
    assert not cache.entry_path(path, state).exists()
    assert any(FailureCode.LOCK_TIMEOUT.value in message for message in _warnings(caplog))
    assert cache.content_id(path, state) == _sha256_id(data)  # once the lock is free, the entry is written
    assert cache.entry_path(path, state).exists()


def _root_under_a_file(tmp_path: Path) -> Path:
    _write(tmp_path / "a-file", b"x")
    return tmp_path / "a-file" / "root"


def _entries_is_a_file(tmp_path: Path) -> Path:
    _write(tmp_path / "root" / "source-digests-v1" / "entries", b"x")
    return tmp_path / "root"


def _entries_is_group_writable(tmp_path: Path) -> Path:
    entries = tmp_path / "root" / "source-digests-v1" / "entries"
    entries.mkdir(parents=True)
    entries.chmod(0o770)
    return tmp_path / "root"


@pytest.mark.parametrize("broken", [_root_under_a_file, _entries_is_a_file, _entries_is_group_writable, None])
def test_digest_cache_directory_failures_fall_back_to_direct_hashing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, broken: Callable[[Path], Path] | None
) -> None:
    """D03: unusable cache directories, or a failing entry write, cost a hash each time but never fail the load."""
    data = _weights(13)
    path = _write(tmp_path / "model" / WEIGHTS, data)
    state = FileState.of(path)
    root = broken(tmp_path) if broken is not None else tmp_path / "root"
    cache = NodeSourceDigestCache(root)
    write_fails = Fault(FaultAction.RAISE_OSERROR, errno=errno.ENOSPC, times=2)

    with caplog.at_level(logging.WARNING, logger=LOGGER):
        if broken is None:
            with armed("source_digest_cache.before_write", write_fails):
                ids = [cache.content_id(path, state), cache.content_id(path, state)]
        else:
            ids = [cache.content_id(path, state), cache.content_id(path, state)]
    assert ids == [_sha256_id(data)] * 2
    assert cache.hashes_computed == 2
    assert len(_warnings(caplog)) == 2
    assert not cache.entry_path(path, state).exists()


def test_digest_cache_never_believes_entries_behind_a_symlinked_directory(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """D03: an entries directory replaced by a symlink is untrusted: a well-formed forged entry there is ignored."""
    data = _weights(15)
    path = _write(tmp_path / "model" / WEIGHTS, data)
    state = FileState.of(path)
    cache = NodeSourceDigestCache(tmp_path / "root")
    _private(cache)
    cache.entries.rmdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    os.symlink(elsewhere, cache.entries)
    body: dict[str, JsonValue] = {
        "schema": "hwr-source-digest-entry-v1",
        "path": os.path.realpath(path),
        "digest": "sha256:" + "0" * 64,
        **state.to_dict(),
    }
    forged = encode_canonical({**body, "entry_sha256": hashlib.sha256(encode_canonical(body)).hexdigest()})
    (elsewhere / cache.entry_path(path, state).name).write_bytes(forged)

    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert cache.content_id(path, state) == _sha256_id(data)
    assert cache.hashes_computed == 1
    assert _warnings(caplog)
    assert [entry.read_bytes() for entry in elsewhere.iterdir()] == [forged]  # nothing written through the link


# ----------------------------------------------------------------------------- D04: hub blobs


def test_validated_hub_snapshot_uses_blob_names_without_hashing(tmp_path: Path) -> None:
    """D04: files of a validated cache snapshot get 'hub-blob:<name>' ids and nothing is hashed."""
    snapshot = _hub_component(tmp_path / "hub")
    source = prepare_weight_source(
        "org/model", subfolder="transformer", prefix="transformer.", cache_dir=tmp_path / "hub"
    )
    cache = NodeSourceDigestCache(tmp_path / "root")

    context = snapshot_sources([source], cache=cache)
    assert [record.content_id for record in context.files] == [f"hub-blob:{hashlib.sha256(_weights(0)).hexdigest()}"]
    assert [record.path for record in context.files] == [snapshot / "transformer" / WEIGHTS]
    assert cache.hashes_computed == 0
    assert not list(cache.entries.glob("*.json"))  # no digest entry: the blob name is the content id
    assert cache.any_unseen([f"sha256:{hashlib.sha256(_weights(0)).hexdigest()}"]) is False  # identified, by content


def test_hash_named_symlink_outside_hub_topology_is_content_hashed(tmp_path: Path) -> None:
    """D04: a local weight file behind a symlink to a 64-hex-named file is hashed, its name never trusted."""
    data = _weights(14)
    misleading = "ab" * 32  # a well-formed hash name that is not the content's hash
    _write(tmp_path / "store" / misleading, data)
    folder = tmp_path / "model"
    _write(folder / "config.json", b"{}")
    os.symlink(f"../store/{misleading}", folder / WEIGHTS)
    source = prepare_weight_source(folder)
    assert hub_blob_content_id(folder / WEIGHTS) is None
    cache = NodeSourceDigestCache(tmp_path / "root")

    context = snapshot_sources([source], cache=cache)
    assert [record.content_id for record in context.files] == [_sha256_id(data)]
    assert cache.hashes_computed == 1


def _target_outside_blobs(snapshot: Path, link: Path, tmp_path: Path) -> bytes:
    data = _weights(20)
    outside = _write(tmp_path / "elsewhere" / hashlib.sha256(data).hexdigest(), data)
    link.unlink()
    os.symlink(os.path.relpath(outside, link.parent), link)
    return data


def _absolute_target(snapshot: Path, link: Path, tmp_path: Path) -> bytes:
    blob = link.resolve()
    link.unlink()
    os.symlink(blob, link)
    return blob.read_bytes()


def _non_canonical_target(snapshot: Path, link: Path, tmp_path: Path) -> bytes:
    blob = link.resolve()
    link.unlink()
    os.symlink(f"../../../../{blob.parent.parent.name}/blobs/{blob.name}", link)  # same file, unusual spelling
    return blob.read_bytes()


def _blob_name_not_a_hash(snapshot: Path, link: Path, tmp_path: Path) -> bytes:
    blob = link.resolve()
    renamed = blob.with_name("weights")
    blob.rename(renamed)
    link.unlink()
    os.symlink("../../../blobs/weights", link)
    return renamed.read_bytes()


def _blob_is_a_symlink(snapshot: Path, link: Path, tmp_path: Path) -> bytes:
    data = _weights(21)
    blob = link.resolve()
    real = _write(tmp_path / "elsewhere" / "real", data)
    blob.unlink()
    os.symlink(real, blob)
    return data


def _symlinked_subfolder(snapshot: Path, link: Path, tmp_path: Path) -> bytes:
    """A decoy tree whose relative link spells the same blob path but reaches a different file."""
    data = _weights(22)
    name = link.resolve().name
    decoy = tmp_path / "decoy"
    _write(decoy / "blobs" / name, data)
    (decoy / "s" / "r" / "transformer").mkdir(parents=True)
    os.symlink(f"../../../blobs/{name}", decoy / "s" / "r" / "transformer" / WEIGHTS)
    for entry in (snapshot / "transformer").iterdir():
        entry.unlink()
    (snapshot / "transformer").rmdir()
    os.symlink(decoy / "s" / "r" / "transformer", snapshot / "transformer")
    return data


def _blobs_dir_is_a_symlink(snapshot: Path, link: Path, tmp_path: Path) -> bytes:
    blobs = snapshot.parent.parent / "blobs"
    moved = tmp_path / "elsewhere" / "blobs"
    moved.parent.mkdir(parents=True)
    blobs.rename(moved)
    os.symlink(moved, blobs)
    return link.read_bytes()


@pytest.mark.parametrize(
    "breaks_topology",
    [
        _blobs_dir_is_a_symlink,
        _target_outside_blobs,
        _absolute_target,
        _non_canonical_target,
        _blob_name_not_a_hash,
        _blob_is_a_symlink,
        _symlinked_subfolder,
    ],
)
def test_unvalidated_snapshot_symlinks_are_content_hashed(
    tmp_path: Path, breaks_topology: Callable[[Path, Path, Path], bytes]
) -> None:
    """D04: a snapshot symlink that leaves the validated topology is content-hashed, whatever its names say."""
    snapshot = _hub_component(tmp_path / "hub")
    link = snapshot / "transformer" / WEIGHTS
    assert hub_blob_content_id(link) is not None
    data = breaks_topology(snapshot, link, tmp_path)

    assert hub_blob_content_id(link) is None
    source = _source(snapshot / "transformer", link, source_kind=WeightSourceKind.HUGGING_FACE_HUB)
    context = snapshot_sources([source])
    assert [record.content_id for record in context.files] == [_sha256_id(data)]


# ----------------------------------------------------------------------------- D02: coverage


def test_longest_matching_prefix_binds_each_tensor(tmp_path: Path) -> None:
    """D02: each DiT tensor binds to the source with the longest matching prefix; the key loses that prefix."""
    sources = [
        _abstract_source(tmp_path, ""),
        _abstract_source(tmp_path, "transformer."),
        _abstract_source(tmp_path, "transformer.blocks."),
    ]
    names = ["transformer.blocks.0.weight", "transformer.norm.weight", "transformer_2.proj.bias"]
    assert bind_tensors_to_sources(names, sources) == {
        "transformer.blocks.0.weight": (2, "0.weight"),
        "transformer.norm.weight": (1, "norm.weight"),
        "transformer_2.proj.bias": (0, "transformer_2.proj.bias"),
    }


def test_sources_with_the_same_longest_prefix_are_rejected(tmp_path: Path) -> None:
    """D02: two sources tied on the longest matching prefix leave ownership ambiguous and are rejected."""
    sources = [
        _abstract_source(tmp_path, ""),
        _abstract_source(tmp_path, "transformer."),
        _abstract_source(tmp_path, "transformer."),
    ]
    assert bind_tensors_to_sources(["other.weight"], sources) == {"other.weight": (0, "other.weight")}
    with pytest.raises(HostWeightError) as caught:
        bind_tensors_to_sources(["other.weight", "transformer.a.weight"], sources)
    failure = caught.value.failure
    assert (failure.code, failure.stage) == (FailureCode.INVALID_CONFIGURATION, ResolutionStage.CONFIGURATION)
    details = failure.details.to_value()
    assert isinstance(details, dict) and details["ambiguous"] == ["transformer.a.weight"]


def test_uncovered_tensors_are_rejected(tmp_path: Path) -> None:
    """D02: a DiT tensor no source covers fails with the uncovered names (at most ten) and their count."""
    sources = [_abstract_source(tmp_path, "transformer.")]
    names = ["transformer.a"] + [f"transformer_2.block.{index}" for index in range(12)]
    with pytest.raises(HostWeightError) as caught:
        bind_tensors_to_sources(names, sources)
    failure = caught.value.failure
    assert (failure.code, failure.stage) == (FailureCode.INVALID_CONFIGURATION, ResolutionStage.CONFIGURATION)
    details = failure.details.to_value()
    assert isinstance(details, dict)
    assert details["uncovered_count"] == 12
    assert isinstance(details["uncovered"], list) and len(details["uncovered"]) == 10
    assert "transformer.a" not in details["uncovered"]
    with pytest.raises(HostWeightError):
        bind_tensors_to_sources(["transformer."], sources)  # a bare prefix names no tensor


# ----------------------------------------------------------------------------- D11: replacement


def _snapshot_of_two_shards(tmp_path: Path) -> tuple[Path, Path, PreparedWeightSource]:
    folder = tmp_path / "model"
    first = _write(folder / "a.safetensors", _weights(30))
    second = _write(folder / "b.safetensors", _weights(31))
    return first, second, _source(folder, first, second)


def test_ensure_unchanged_fails_after_a_source_is_replaced(tmp_path: Path) -> None:
    """D11: a source replaced (renamed over) after the identity fails with CANONICAL_SOURCE_FAILED."""
    _first, second, source = _snapshot_of_two_shards(tmp_path)
    context = snapshot_sources([source], max_workers=2)
    assert context.unchanged()
    context.ensure_unchanged()

    _replace(second, _weights(31))  # same bytes, new file: the identity must still be re-derived
    assert not context.unchanged()
    with pytest.raises(HostWeightError) as caught:
        context.ensure_unchanged()
    failure = caught.value.failure
    assert (failure.code, failure.stage, failure.retryable) == (
        FailureCode.CANONICAL_SOURCE_FAILED,
        ResolutionStage.CANONICAL,
        False,
    )
    details = failure.details.to_value()
    assert isinstance(details, dict) and details["changed"] == [str(second)]


def _append_a_byte(path: Path) -> None:
    with path.open("ab") as stream:
        stream.write(b"\x00")


def _rewrite_same_size(path: Path) -> None:
    before = path.stat()
    with path.open("r+b") as stream:
        stream.seek(-1, os.SEEK_END)
        stream.write(bytes([path.read_bytes()[-1] ^ 0xFF]))
    # Timestamps come from a coarse kernel clock; pin a distinct mtime so the test cannot race it.
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns + 1_000_000_000))


@pytest.mark.parametrize("change", [_append_a_byte, _rewrite_same_size, Path.unlink])
def test_ensure_unchanged_fails_after_an_in_place_change(tmp_path: Path, change: Callable[[Path], object]) -> None:
    """D11: a source rewritten in place (or removed) after the identity fails with CANONICAL_SOURCE_FAILED."""
    first, _second, source = _snapshot_of_two_shards(tmp_path)
    context = snapshot_sources([source])
    change(first)
    assert not context.unchanged()
    with pytest.raises(HostWeightError) as caught:
        context.ensure_unchanged()
    assert caught.value.code is FailureCode.CANONICAL_SOURCE_FAILED


# ----------------------------------------------------------------------------- fingerprint


def test_fingerprint_follows_content_and_adapter_not_location(tmp_path: Path) -> None:
    """D05 (source content, checkpoint adapter): same bytes elsewhere give the same key; a byte or adapter changes it."""
    left = _model_folder(tmp_path / "left", seed=40)
    right = _model_folder(tmp_path / "right", seed=40)
    changed = _model_folder(tmp_path / "changed", seed=40)
    data = bytearray((changed / WEIGHTS).read_bytes())
    data[-1] ^= 0x01
    (changed / WEIGHTS).write_bytes(bytes(data))

    def fingerprint(folder: Path, **changes: Any) -> str:
        source = dataclasses.replace(prepare_weight_source(folder, prefix="transformer."), **changes)
        return snapshot_sources([source]).fingerprint

    base = fingerprint(left)
    assert fingerprint(right) == base
    assert fingerprint(changed) != base
    adapter = ImplementationIdentity("test.adapter", "1", "c" * 64)
    assert fingerprint(left, checkpoint_adapter=adapter) != base
    assert fingerprint(left, checkpoint_adapter=dataclasses.replace(adapter, version="2")) != fingerprint(
        left, checkpoint_adapter=adapter
    )
    assert fingerprint(left, prefix="other.") != base

    context = snapshot_sources([prepare_weight_source(left, prefix="transformer.")])
    metadata = context.to_metadata()
    assert hashlib.sha256(encode_canonical(metadata)).hexdigest() == context.fingerprint
    assert str(tmp_path) not in json.dumps(metadata)
    assert metadata["sources"] == [
        {
            "prefix": "transformer.",
            "use_safetensors": True,
            "checkpoint_adapter": None,
            "files": [{"name": WEIGHTS, "content_id": _sha256_id(_weights(40)), "size": len(_weights(40))}],
        }
    ]


def test_snapshot_sources_rejects_empty_and_parallel_equals_serial(tmp_path: Path) -> None:
    """D02 (source identity): no sources is an error; hashing shards on threads gives the serial result."""
    with pytest.raises(ValueError, match="at least one"):
        snapshot_sources([])
    _first, _second, source = _snapshot_of_two_shards(tmp_path)
    serial = snapshot_sources([source], max_workers=1)
    parallel = snapshot_sources([source], max_workers=4)
    assert serial == parallel
    assert [record.relative_name for record in serial.files] == ["a.safetensors", "b.safetensors"]


# ----------------------------------------------------------------------------- prepare_weight_source


def test_prepare_local_folder_and_subfolder(tmp_path: Path) -> None:
    """D02 (source selection): a local component folder, or a pipeline folder with a subfolder, names its weights."""
    folder = _model_folder(tmp_path / "model")
    source = prepare_weight_source(folder, prefix="transformer.")
    assert source.source_kind is WeightSourceKind.LOCAL_PATH
    assert (source.resolved_root, source.weight_files, source.use_safetensors) == (folder, (folder / WEIGHTS,), True)
    assert resolved_revision(source) is None

    pipeline = tmp_path / "pipeline"
    _model_folder(pipeline / "transformer")
    source = prepare_weight_source(str(pipeline), subfolder="transformer/")
    assert (source.subfolder, source.resolved_root) == ("transformer", pipeline / "transformer")
    with pytest.raises(ValueError, match='subfolder="transformer"'):
        prepare_weight_source(pipeline)
    with pytest.raises(ValueError, match="subfolder"):
        prepare_weight_source(pipeline, subfolder="../model")


def test_prepare_sharded_index_and_bin_fallback(tmp_path: Path) -> None:
    """D02 (source selection): a sharded index lists its shards once, sorted; .bin is the last resort."""
    folder = tmp_path / "sharded"
    _write(folder / "config.json", b"{}")
    for name in (
        "diffusion_pytorch_model-00002-of-00002.safetensors",
        "diffusion_pytorch_model-00001-of-00002.safetensors",
    ):
        _write(folder / name, _weights(50))
    weight_map = {
        "a": "diffusion_pytorch_model-00002-of-00002.safetensors",
        "b": "diffusion_pytorch_model-00001-of-00002.safetensors",
        "c": "diffusion_pytorch_model-00002-of-00002.safetensors",
    }
    _write(folder / f"{WEIGHTS}.index.json", json.dumps({"metadata": {}, "weight_map": weight_map}).encode())
    source = prepare_weight_source(folder)
    assert [path.name for path in source.weight_files] == sorted(set(weight_map.values()))

    (folder / "diffusion_pytorch_model-00001-of-00002.safetensors").unlink()
    with pytest.raises(ValueError, match="do not exist"):
        prepare_weight_source(folder)

    legacy = _model_folder(tmp_path / "legacy", name="diffusion_pytorch_model.bin")
    source = prepare_weight_source(legacy)
    assert (source.weight_files, source.use_safetensors) == ((legacy / "diffusion_pytorch_model.bin",), False)
    (legacy / "diffusion_pytorch_model.bin").unlink()
    with pytest.raises(ValueError, match="no weight file"):
        prepare_weight_source(legacy)


def test_prepare_hub_repo_from_the_local_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """D04 (hub topology): a repo id resolves through refs/main, a named ref or a commit, only in the local cache."""
    cache = tmp_path / "hub"
    snapshot = _hub_component(cache, seed=0)
    other = _hub_repo(
        cache,
        "org/model",
        OTHER_COMMIT,
        {"transformer/config.json": b"{}", f"transformer/{WEIGHTS}": _weights(1)},
        {"v2": OTHER_COMMIT},
    )

    source = prepare_weight_source("org/model", subfolder="transformer", cache_dir=cache)
    assert source.source_kind is WeightSourceKind.HUGGING_FACE_HUB
    assert source.weight_files == (snapshot / "transformer" / WEIGHTS,)  # the snapshot path, not the blob
    assert resolved_revision(source) == COMMIT
    assert (
        resolved_revision(prepare_weight_source("org/model", subfolder="transformer", revision="v2", cache_dir=cache))
        == OTHER_COMMIT
    )
    by_commit = prepare_weight_source("org/model", subfolder="transformer", revision=OTHER_COMMIT, cache_dir=cache)
    assert (by_commit.resolved_root, by_commit.requested_revision) == (other / "transformer", OTHER_COMMIT)

    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    assert prepare_weight_source("org/model", subfolder="transformer") == source
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    (tmp_path / "home").mkdir()
    (cache).rename(tmp_path / "home" / "hub")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    assert resolved_revision(prepare_weight_source("org/model", subfolder="transformer")) == COMMIT


def _no_network(*_args: object, **_kwargs: object) -> socket.socket:
    raise AssertionError("prepare_weight_source must never open a network connection")


@pytest.mark.parametrize(
    ("repo_id", "revision"), [("org/absent", None), ("org/model", "no-such-branch"), ("org/model", "f" * 40)]
)
def test_prepare_missing_hub_repo_is_not_found_without_network(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, repo_id: str, revision: str | None
) -> None:
    """D04 (hub topology): a repo or revision missing from the local cache is NOT_FOUND, with no network access."""
    _hub_component(tmp_path / "hub")
    monkeypatch.setattr(socket, "socket", _no_network)
    monkeypatch.setattr(socket, "create_connection", _no_network)
    with pytest.raises(HostWeightError) as caught:
        prepare_weight_source(repo_id, subfolder="transformer", revision=revision, cache_dir=tmp_path / "hub")
    failure = caught.value.failure
    assert (failure.code, failure.stage) == (FailureCode.NOT_FOUND, ResolutionStage.CANONICAL)
    details = failure.details.to_value()
    assert isinstance(details, dict) and str(details["looked_in"]).startswith(str(tmp_path / "hub"))


def test_prepared_source_validates_its_fields(tmp_path: Path) -> None:
    """D02 (source identity): a hand-built source with unusable fields is refused with a message saying what to fix."""
    weights = tmp_path / "w.safetensors"
    good = _source(tmp_path, weights, prefix="transformer.")
    bad_changes: list[dict[str, Any]] = [
        {"resolved_root": Path("relative")},
        {"weight_files": ()},
        {"weight_files": (tmp_path / "b.safetensors", tmp_path / "a.safetensors")},
        {"weight_files": (tmp_path.parent / "outside.safetensors",)},
        {"weight_files": (tmp_path / "w.bin",)},
        {"prefix": "transformer"},
        {"subfolder": "transformer"},
        {"model_or_path": ""},
    ]
    for changes in bad_changes:
        with pytest.raises(ValueError):
            dataclasses.replace(good, **changes)


@pytest.mark.timeout(30)
def test_a_fifo_in_place_of_a_weight_file_fails_without_blocking(tmp_path: Path) -> None:
    """D11 (part): a weight path that is not a regular file fails with CANONICAL_SOURCE_FAILED, never hangs."""
    os.mkfifo(tmp_path / WEIGHTS)
    with pytest.raises(HostWeightError) as caught:
        snapshot_sources([_source(tmp_path, tmp_path / WEIGHTS)])
    assert caught.value.code is FailureCode.CANONICAL_SOURCE_FAILED


def test_a_first_workers_node_records_are_never_flushed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """X02: what a first worker records for the node's next one (seen marks, checked headers, derived values)
    is written with no fsync: losing any of it in a crash costs that work again, so the worker's start never
    waits on the disk. Marks are empty files created in place; a record a crash left damaged is ignored."""
    cache = NodeSourceDigestCache(tmp_path / "root")
    ids = [f"sha256:{hashlib.sha256(bytes([index])).hexdigest()}" for index in range(3)]
    assert cache.any_unseen(ids) is True  # `seen/` made on an empty domain: the marks cover it
    weights = tmp_path / WEIGHTS
    weights.write_bytes(_weights(3))
    state = FileState.of(weights)
    derived_key = hashlib.sha256(b"bindings").hexdigest()
    flushed: list[int] = []
    real_fsync = os.fsync

    def counting_fsync(fd: int) -> None:
        flushed.append(fd)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", counting_fsync)
    cache.record_content_seen(ids)
    cache.record_content_seen(ids)  # marked already: nothing is created again
    cache.record_header_checked(weights, state)
    cache.record_derived(derived_key, {"tied": ["a", "b"]})
    monkeypatch.undo()
    assert flushed == []
    assert cache.any_unseen(ids) is False
    assert cache.header_checked(weights, state)
    assert cache.derived_value(derived_key) == {"tied": ["a", "b"]}
    marks = sorted(cache.seen.glob("*.seen"))
    assert marks == sorted(cache.seen_marker(content_id) for content_id in ids)
    assert all(mark.stat().st_size == 0 and mark.stat().st_mode & 0o777 == 0o600 for mark in marks)
    assert sorted(path.name for path in cache.seen.iterdir()) == sorted(["complete", *(mark.name for mark in marks)])
    (cache.derived / f"{derived_key}.json").write_bytes(b"")  # what a crash can leave of an unflushed record
    assert cache.derived_value(derived_key) is None

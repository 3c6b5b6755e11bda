"""What a push checks on the local side and what a failure mid-upload leaves: E08, E09.

A push uploads only bytes this node hashed: a publication its verification ledger vouches
for is not re-hashed unless a payload changed after publication; a push killed between its
objects, or whose upload fails, leaves no descriptor, and the next push completes the copy.
"""

from __future__ import annotations

import errno
import os
import signal
from pathlib import Path

import pytest

from host_weight_runtime import FailureCode, FilesystemHostWeightStore, HostWeightError, StoreStatus
from host_weight_runtime._faults import Fault, FaultAction, arm, armed
from host_weight_runtime.config import BackgroundVerifyMode
from host_weight_runtime.manifest import MANIFEST_FILE_NAME
from host_weight_runtime.remote import (
    DESCRIPTOR_FILE_NAME,
    FsspecArtifactProvider,
    PushStatus,
    RemoteArtifactState,
    import_remote_artifact,
    list_remote,
    push_artifact,
)
from host_weight_runtime.remote.push import unchanged_since_publication

from .remote_support import META, Node, soon
from .support import CHILD_TIMEOUT_S, SPAWN, make_identity

PAYLOADS = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]


def _verifying_node(root: Path) -> Node:
    """A node whose store keeps the verification ledger (the suite turns background verification off)."""
    node = Node(root)
    node.store = FilesystemHostWeightStore(root, background_verify=BackgroundVerifyMode.ONCE)
    return node


def _remote(tmp_path: Path, name: str) -> str:
    folder = tmp_path / name
    folder.mkdir()
    return f"file://{folder}"


def _states(url: str) -> dict[str, RemoteArtifactState]:
    return {item.key: item.state for item in list_remote(url)}


def _touch_after_publication(path: Path, artifact_dir: Path) -> None:
    """Re-seal `path` (0444) until its change time is past its folder's (the kernel's clock ticks coarsely)."""
    os.chmod(path, 0o444)
    while os.stat(path).st_ctime_ns <= os.stat(artifact_dir).st_ctime_ns:
        os.chmod(path, 0o444)


def test_push_trusts_only_a_publication_this_node_hashed(tmp_path: Path) -> None:
    """E08: a fresh build's first push re-hashes it (the ledger then records it); a later push of the same,
    unchanged publication is not re-hashed; both copies import on node B."""
    node_a = _verifying_node(tmp_path / "node-a")
    identity = node_a.build()
    assert node_a.store.background_verification(identity.key) is None
    first_url, second_url = _remote(tmp_path, "first"), _remote(tmp_path, "second")
    first = push_artifact(node_a.store, identity.key, first_url)
    assert first.status is PushStatus.UPLOADED and first.rehashed and first.to_dict()["rehashed"] is True
    record = node_a.store.background_verification(identity.key)
    assert record is not None
    second = push_artifact(node_a.store, identity.key, second_url)
    assert second.status is PushStatus.UPLOADED and not second.rehashed
    assert node_a.store.background_verification(identity.key) == record  # nothing hashed, nothing re-recorded
    for url in (first_url, second_url):
        node_b = Node(tmp_path / f"node-b-{url.rsplit('/', 1)[-1]}")
        result = import_remote_artifact(
            node_b.store, identity, FsspecArtifactProvider(url), validation=META, deadline=soon()
        )
        assert result is not None and result.status is StoreStatus.BUILT and result.lease is not None, result
        result.lease.close()


def test_push_rehashes_a_payload_changed_after_publication(tmp_path: Path) -> None:
    """E08: a payload flipped after the node hashed the publication is re-hashed by the next push, which fails
    CHECKSUM_MISMATCH before any descriptor; the remote offers nothing and the local copy is denied."""
    node_a = _verifying_node(tmp_path / "node-a")
    identity = node_a.build()
    push_artifact(node_a.store, identity.key, _remote(tmp_path, "first"))
    assert node_a.store.background_verification(identity.key) is not None
    artifact_dir = node_a.store.layout.artifact_dir(identity.key)
    payload = artifact_dir / PAYLOADS[1]
    os.chmod(payload, 0o644)
    data = bytearray(payload.read_bytes())
    data[-5] ^= 0x40
    payload.write_bytes(bytes(data))
    _touch_after_publication(payload, artifact_dir)
    second_url = _remote(tmp_path, "second")
    with pytest.raises(HostWeightError) as corrupt:
        push_artifact(node_a.store, identity.key, second_url)
    assert corrupt.value.code is FailureCode.CHECKSUM_MISMATCH
    assert _states(second_url) == {}
    assert not (Path(second_url.removeprefix("file://")) / identity.key).exists()
    assert node_a.store.lookup(identity, validation=META).status is StoreStatus.INVALID


def test_unchanged_since_publication_refuses_what_it_cannot_vouch_for(tmp_path: Path) -> None:
    """E08: a payload re-permissioned after publication, replaced by a symlink, or gone is not vouched for."""
    node_a = Node(tmp_path / "node-a")
    identity = node_a.build()
    artifact_dir = node_a.store.layout.artifact_dir(identity.key)
    lookup = node_a.store.lookup(identity, validation=META)
    assert lookup.lease is not None
    manifest = lookup.lease.manifest
    lookup.lease.close()
    assert unchanged_since_publication(artifact_dir, manifest)
    _touch_after_publication(artifact_dir / PAYLOADS[0], artifact_dir)
    assert not unchanged_since_publication(artifact_dir, manifest)
    assert not unchanged_since_publication(tmp_path / "nowhere", manifest)


def _push_and_die(root: str, key: str, url: str, point: str) -> None:
    """Push `key` and SIGKILL this process at `point` (between the payloads and the manifest, or before the
    descriptor)."""
    arm(point, Fault(FaultAction.CRASH))
    push_artifact(Node(Path(root)).store, key, url)


@pytest.mark.parametrize("point", ["push.after_payloads", "push.before_descriptor"])
def test_a_push_killed_between_objects_leaves_no_descriptor(tmp_path: Path, point: str) -> None:
    """E08, E09: a push killed after some of its objects leaves the key INCOMPLETE (no descriptor: node B's
    runtime sees nothing); the next push completes it and node B imports it."""
    node_a = Node(tmp_path / "node-a")
    identity = node_a.build()
    url = _remote(tmp_path, "remote")
    child = SPAWN.Process(target=_push_and_die, args=(str(node_a.root), identity.key, url, point))
    child.start()
    child.join(CHILD_TIMEOUT_S)
    assert child.exitcode == -signal.SIGKILL
    folder = Path(url.removeprefix("file://")) / identity.key
    assert (folder / PAYLOADS[0]).exists() and not (folder / DESCRIPTOR_FILE_NAME).exists()
    assert (folder / MANIFEST_FILE_NAME).exists() is (point == "push.before_descriptor")
    assert _states(url) == {identity.key: RemoteArtifactState.INCOMPLETE}
    assert FsspecArtifactProvider(url).probe(identity) is None
    assert push_artifact(node_a.store, identity.key, url).status is PushStatus.UPLOADED
    assert _states(url) == {identity.key: RemoteArtifactState.COMPLETE}
    node_b = Node(tmp_path / "node-b")
    result = import_remote_artifact(
        node_b.store, identity, FsspecArtifactProvider(url), validation=META, deadline=soon()
    )
    assert result is not None and result.status is StoreStatus.BUILT and result.lease is not None, result
    result.lease.close()


@pytest.mark.parametrize(("error", "retryable"), [(errno.EIO, True), (errno.EACCES, False)])
def test_a_failing_upload_is_typed_and_leaves_nothing_offered(tmp_path: Path, error: int, retryable: bool) -> None:
    """E08: an upload that fails is REMOTE_FAILED, retryable for an I/O error and not for a refusal (no retry
    helps until the permissions change); no descriptor is written, and the next push uploads the artifact."""
    node_a = Node(tmp_path / "node-a")
    identity = node_a.build(make_identity(tag="failing-put"))
    url = _remote(tmp_path, "remote")
    with (
        armed("remote.upload", Fault(FaultAction.RAISE_OSERROR, errno=error)),
        pytest.raises(HostWeightError) as failed,
    ):
        push_artifact(node_a.store, identity.key, url)
    assert failed.value.code is FailureCode.REMOTE_FAILED and failed.value.retryable is retryable
    details = failed.value.failure.to_dict()["details"]
    assert isinstance(details, dict) and details["object"] == f"{identity.key}/{PAYLOADS[0]}"
    assert FsspecArtifactProvider(url).probe(identity) is None
    assert push_artifact(node_a.store, identity.key, url).status is PushStatus.UPLOADED
    assert _states(url) == {identity.key: RemoteArtifactState.COMPLETE}

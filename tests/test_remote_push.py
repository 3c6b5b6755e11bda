"""Export and listing of remote artifacts: push verifies first, writes the descriptor last (E05, E08, E09)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from host_weight_runtime import FailureCode, HostWeightError, ResolutionStage, StoreStatus
from host_weight_runtime.failures import HostWeightFailure
from host_weight_runtime.identity import WeightArtifactIdentity
from host_weight_runtime.manifest import MANIFEST_FILE_NAME
from host_weight_runtime.remote import (
    DESCRIPTOR_FILE_NAME,
    FsspecArtifactProvider,
    PushResult,
    PushStatus,
    RemoteArtifactState,
    RemoteDescriptorRecord,
    RemoteFileRecord,
    import_remote_artifact,
    list_remote,
    providers_from_urls,
    push_artifact,
    push_in_background,
)

from .remote_support import (
    ACCESS_KEY,
    META,
    SECRET_KEY,
    MotoEndpoint,
    Node,
    Remote,
    http_server,
    make_remote,
    moto_endpoint,
    soon,
)
from .support import make_identity, make_tensors

PAYLOADS = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]


@pytest.fixture(scope="module")
def moto() -> Iterator[MotoEndpoint]:
    with moto_endpoint() as endpoint:
        yield endpoint


@pytest.fixture(params=["s3", "file"])
def remote(request: pytest.FixtureRequest, tmp_path: Path, moto: MotoEndpoint) -> Iterator[Remote]:
    with make_remote(request.param, tmp_path, moto) as value:
        yield value


@pytest.fixture
def node_a(tmp_path: Path) -> Node:
    return Node(tmp_path / "node-a")


def listed(remote: Remote) -> dict[str, RemoteArtifactState]:
    return {item.key: item.state for item in list_remote(remote.read_url, storage_options=remote.read_options)}


def test_push_is_idempotent_and_listed_without_secrets(remote: Remote, node_a: Node) -> None:
    """E08, E09, E05: the first push uploads, the second finds the same bytes; ls shows it COMPLETE; no secret anywhere."""
    identity = node_a.build()
    first = push_artifact(node_a.store, identity.key, remote.push_url, storage_options=remote.push_options)
    assert first.status is PushStatus.UPLOADED and first.bytes_uploaded > first.total_bytes > 0
    second = remote.push(node_a, identity)
    assert second.status is PushStatus.ALREADY_PRESENT and second.bytes_uploaded == 0
    assert (second.manifest_sha256, second.content_sha256) == (first.manifest_sha256, first.content_sha256)
    assert remote.names(identity.key) == sorted([DESCRIPTOR_FILE_NAME, MANIFEST_FILE_NAME, *PAYLOADS])
    (entry,) = list_remote(remote.read_url, storage_options=remote.read_options)
    assert entry.key == identity.key and entry.state is RemoteArtifactState.COMPLETE
    assert entry.model_id == identity.source.model_id and entry.file_count == 2
    assert entry.total_bytes == first.total_bytes and entry.manifest_sha256 == first.manifest_sha256
    descriptor = remote.read(identity.key, DESCRIPTOR_FILE_NAME).decode()
    text = json.dumps([first.to_dict(), entry.to_dict(), descriptor])
    assert SECRET_KEY not in text and ACCESS_KEY not in text


def test_listing_tells_complete_incomplete_and_invalid_apart(remote: Remote, node_a: Node) -> None:
    """E09: no descriptor is INCOMPLETE (an upload running or dead); a descriptor with missing payloads is INVALID."""
    complete = node_a.build(make_identity(tag="complete"))
    incomplete = node_a.build(make_identity(tag="incomplete"))
    invalid = node_a.build(make_identity(tag="invalid"))
    for identity in (complete, incomplete, invalid):
        remote.push(node_a, identity)
    remote.remove(incomplete.key, DESCRIPTOR_FILE_NAME)
    remote.remove(invalid.key, PAYLOADS[1])
    listing = {item.key: item for item in list_remote(remote.read_url, storage_options=remote.read_options)}
    assert {key: item.state for key, item in listing.items()} == {
        complete.key: RemoteArtifactState.COMPLETE,
        incomplete.key: RemoteArtifactState.INCOMPLETE,
        invalid.key: RemoteArtifactState.INVALID,
    }
    problem = listing[invalid.key].problem
    assert problem is not None and problem.code is FailureCode.REMOTE_FAILED and not problem.retryable


def test_push_verifies_the_local_artifact_fully_first(remote: Remote, node_a: Node) -> None:
    """E08: a local artifact with a flipped byte fails FULL_CHECKSUM and nothing is uploaded; a missing key is NOT_FOUND."""
    with pytest.raises(HostWeightError) as missing:
        remote.push(node_a, make_identity())
    assert missing.value.code is FailureCode.NOT_FOUND
    identity = node_a.build()
    payload = node_a.store.layout.artifact_dir(identity.key) / PAYLOADS[0]
    os.chmod(payload, 0o644)
    data = bytearray(payload.read_bytes())
    data[-3] ^= 0xFF
    payload.write_bytes(bytes(data))
    os.chmod(payload, 0o444)
    with pytest.raises(HostWeightError) as corrupt:
        remote.push(node_a, identity)
    assert corrupt.value.code is FailureCode.CHECKSUM_MISMATCH
    assert listed(remote) == {}


def test_push_refuses_a_different_artifact_under_the_same_key(remote: Remote, node_a: Node, tmp_path: Path) -> None:
    """E08: a remote that holds other bytes under the key stays authoritative; the second push is IDENTITY_COLLISION."""
    identity = node_a.build()
    first = remote.push(node_a, identity)
    node_c = Node(tmp_path / "node-c")
    node_c.build(identity, tensors=make_tensors(seed=1))
    with pytest.raises(HostWeightError) as collision:
        remote.push(node_c, identity)
    assert collision.value.code is FailureCode.IDENTITY_COLLISION
    assert collision.value.failure.stage is ResolutionStage.REMOTE and not collision.value.retryable
    descriptor = FsspecArtifactProvider(remote.read_url, storage_options=remote.read_options).probe(identity)
    assert descriptor is not None and descriptor.manifest_sha256 == first.manifest_sha256


@pytest.mark.parametrize("damage", ["dead_upload_leftovers", "payload_lost_after_publication"])
def test_push_repairs_a_dead_or_damaged_upload(remote: Remote, node_a: Node, tmp_path: Path, damage: str) -> None:
    """E08: the next push removes a dead upload's leftovers or replaces a damaged copy; node B then imports it."""
    identity = node_a.build()
    remote.push(node_a, identity)
    if damage == "dead_upload_leftovers":
        remote.remove(identity.key, DESCRIPTOR_FILE_NAME)
        remote.write(identity.key, "leftover.safetensors", b"\0" * 32)
    else:
        remote.remove(identity.key, PAYLOADS[0])
    assert remote.push(node_a, identity).status is PushStatus.UPLOADED
    assert remote.names(identity.key) == sorted([DESCRIPTOR_FILE_NAME, MANIFEST_FILE_NAME, *PAYLOADS])
    node_b = Node(tmp_path / "node-b")
    result = import_remote_artifact(node_b.store, identity, remote.provider(), validation=META, deadline=soon())
    assert result is not None and result.status is StoreStatus.BUILT and result.lease is not None, result
    result.lease.close()


def test_http_remotes_are_read_only_and_unlistable(tmp_path: Path, node_a: Node) -> None:
    """E08, E09: pushing to or listing an http(s) remote is a typed UNSUPPORTED failure."""
    identity = node_a.build()
    with http_server(tmp_path) as base:
        with pytest.raises(HostWeightError) as push:
            push_artifact(node_a.store, identity, base)
        with pytest.raises(HostWeightError) as listing:
            list_remote(base)
    assert push.value.code is FailureCode.UNSUPPORTED and listing.value.code is FailureCode.UNSUPPORTED


@pytest.mark.parametrize(
    "url",
    [
        "s3://reader:hunter2-secret@bucket/fleet",
        "https://host/fleet?X-Amz-Signature=hunter2-secret",
        "https://host/fleet#hunter2-secret",
        "no-scheme/hunter2-secret",
    ],
)
def test_urls_carrying_secrets_are_refused_without_echo(url: str) -> None:
    """E05: credentials and signatures belong to the backend's configuration; such URLs are refused, never echoed."""
    with pytest.raises(ValueError) as refused:
        FsspecArtifactProvider(url)
    assert "hunter2" not in str(refused.value)


def test_providers_from_urls_keeps_order_and_scopes_the_endpoint_to_s3(moto: MotoEndpoint, tmp_path: Path) -> None:
    """HWR_REMOTE: comma-separated URLs become providers in order; the endpoint URL applies to s3 only."""
    providers = providers_from_urls(f" s3://bucket/fleet/ ,file://{tmp_path}/", endpoint_url=moto.url, timeout_s=3)
    assert [p.provider_id for p in providers] == ["s3://bucket/fleet", f"file://{tmp_path}"]
    assert providers[0].location.timeout_s == 3.0
    assert providers_from_urls("") == ()


def _record(**changes: object) -> RemoteDescriptorRecord:
    fields: dict[str, object] = {
        "identity": make_identity(),
        "manifest_sha256": "a" * 64,
        "manifest_size": 1234,
        "content_sha256": "b" * 64,
        "files": (RemoteFileRecord("model-00001-of-00001.safetensors", 4096),),
        "provider_id": "s3://bucket/fleet",
        "uploader": "host-weight-runtime/0.1.0",
        "uploaded_at_ns": 1_700_000_000_000_000_000,
    }
    fields.update(changes)
    return RemoteDescriptorRecord(**fields)


def test_descriptor_bytes_are_pinned_and_parsed_strictly() -> None:
    """E08: the descriptor's exact bytes are pinned; parsing rejects non-canonical bytes, unknown keys and coercions."""
    record = _record()
    data = record.to_bytes()
    identity_json = json.dumps(make_identity().to_dict(), sort_keys=True, separators=(",", ":"))
    assert data == (
        b'{"content_sha256":"' + b"b" * 64 + b'","files":[{"name":"model-00001-of-00001.safetensors","size":4096}],'
        b'"identity":' + identity_json.encode() + b',"identity_key":"' + make_identity().key.encode() + b'",'
        b'"manifest_sha256":"' + b"a" * 64 + b'","manifest_size":1234,"provider_id":"s3://bucket/fleet",'
        b'"schema":"hwr-remote-descriptor","schema_version":1,"total_bytes":4096,'
        b'"uploaded_at_ns":1700000000000000000,"uploader":"host-weight-runtime/0.1.0"}'
    )
    assert RemoteDescriptorRecord.from_bytes(data) == record
    value = json.loads(data)
    bad_variants = [
        json.dumps(value, indent=1).encode(),  # not canonical
        data.replace(b'"manifest_size":1234', b'"manifest_size":"1234"'),  # coerced type (and order kept)
        data.replace(b'"uploader"', b'"unknown":1,"uploader"'),  # unknown key
        data.replace(b'"total_bytes":4096', b'"total_bytes":4097'),  # inconsistent total
        data.replace(b'"schema":"hwr-remote-descriptor"', b'"schema":"other"'),
        b"x" * (1 << 20 + 1),
    ]
    for bad in bad_variants:
        with pytest.raises(ValueError):
            RemoteDescriptorRecord.from_bytes(bad)
    with pytest.raises(ValueError):
        _record(files=())
    with pytest.raises(ValueError):
        _record(files=(RemoteFileRecord("a.safetensors", 9), RemoteFileRecord("a.safetensors", 9)))
    with pytest.raises(ValueError):
        RemoteFileRecord("../escape.safetensors", 100)


def test_descriptor_identity_must_be_exact(tmp_path: Path, node_a: Node) -> None:
    """E03: a descriptor whose identity differs from the request in any field is refused, not offered."""
    identity = node_a.build()
    folder = tmp_path / "remote"
    push_artifact(node_a.store, identity, f"file://{folder}")
    other: WeightArtifactIdentity = make_identity(tag="other")
    (folder / other.key).mkdir()
    for name in os.listdir(folder / identity.key):
        (folder / other.key / name).write_bytes((folder / identity.key / name).read_bytes())
    with pytest.raises(HostWeightError) as refused:
        FsspecArtifactProvider(f"file://{folder}").probe(other)
    assert refused.value.code is FailureCode.REMOTE_FAILED and not refused.value.retryable


def test_background_push_reports_its_result_or_failure(remote: Remote, node_a: Node) -> None:
    """E08: HWR_REMOTE_PUBLISH pushes off the request path and reports a typed outcome instead of raising."""
    outcomes: list[PushResult | HostWeightFailure] = []
    missing = push_in_background(
        node_a.store, make_identity(), remote.push_url, storage_options=remote.push_options, report=outcomes.append
    )
    missing.join(60)
    identity = node_a.build()
    pushed = push_in_background(
        node_a.store, identity, remote.push_url, storage_options=remote.push_options, report=outcomes.append
    )
    pushed.join(60)
    assert not missing.is_alive() and not pushed.is_alive()
    failed, done = outcomes
    assert isinstance(failed, HostWeightFailure) and failed.code is FailureCode.NOT_FOUND
    assert isinstance(done, PushResult) and done.status is PushStatus.UPLOADED
    assert listed(remote) == {identity.key: RemoteArtifactState.COMPLETE}


def test_an_unknown_backend_is_a_configuration_failure() -> None:
    """E05: a URL whose fsspec backend is unknown (or not installed) fails typed at CONFIGURATION."""
    with pytest.raises(HostWeightError) as refused:
        FsspecArtifactProvider("nosuchscheme://bucket/fleet")
    assert refused.value.code is FailureCode.INVALID_CONFIGURATION
    assert refused.value.failure.stage is ResolutionStage.CONFIGURATION

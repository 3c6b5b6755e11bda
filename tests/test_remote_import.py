"""Remote exact artifacts: node A builds and pushes, node B imports verified bytes (E01-E05, E10).

Real remotes only: moto's S3 server on loopback spoken to by s3fs and boto3 over HTTP,
a file:// folder, and a range-serving HTTP server; two domains play two nodes.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from host_weight_runtime import (
    BuildRequest,
    FailureCode,
    LeaseSource,
    ResolutionStage,
    StoreStatus,
    TensorWriteSpec,
)
from host_weight_runtime.failures import HostWeightFailure
from host_weight_runtime.filesystem.writer import StagingArtifactWriter
from host_weight_runtime.manifest import MANIFEST_FILE_NAME, WeightManifest, manifest_sha256
from host_weight_runtime.protocols import (
    ArtifactWriter,
    ProductionMetadata,
    RemoteArtifactDescriptor,
    TensorFileWriter,
    WeightProductionSpec,
)
from host_weight_runtime.remote import (
    DESCRIPTOR_FILE_NAME,
    FsspecArtifactProvider,
    RemoteDescriptorRecord,
    RemoteImportProducer,
    import_remote_artifact,
    push_artifact,
    verify_imported,
)

from .remote_support import (
    ACCESS_KEY,
    FULL,
    META,
    SECRET_KEY,
    MotoEndpoint,
    Node,
    Remote,
    assert_bitwise_equal,
    closed_endpoint,
    http_server,
    make_remote,
    moto_endpoint,
    soon,
    stalled_endpoint,
)
from .support import make_identity, make_tensors


@pytest.fixture(scope="module")
def moto() -> Iterator[MotoEndpoint]:
    with moto_endpoint() as endpoint:
        yield endpoint


@pytest.fixture(params=["s3", "file", "http"])
def remote(request: pytest.FixtureRequest, tmp_path: Path, moto: MotoEndpoint) -> Iterator[Remote]:
    with make_remote(request.param, tmp_path, moto) as value:
        yield value


@pytest.fixture
def s3(tmp_path: Path, moto: MotoEndpoint) -> Iterator[Remote]:
    with make_remote("s3", tmp_path, moto) as value:
        yield value


@pytest.fixture
def node_a(tmp_path: Path) -> Node:
    return Node(tmp_path / "node-a")


@pytest.fixture
def node_b(tmp_path: Path) -> Node:
    return Node(tmp_path / "node-b")


def import_into(node: Node, provider: FsspecArtifactProvider, identity: Any = None) -> Any:
    return import_remote_artifact(node.store, identity or make_identity(), provider, validation=META, deadline=soon())


def assert_secret_free(*values: object) -> None:
    text = json.dumps([v.to_dict() if hasattr(v, "to_dict") else v for v in values], default=str)
    assert SECRET_KEY not in text and ACCESS_KEY not in text


def assert_failed_cleanly(result: Any, node: Node, *, retryable: bool) -> HostWeightFailure:
    """A typed REMOTE_FAILED at the REMOTE stage that left nothing under artifacts/ or tmp/."""
    assert result is not None and result.status is StoreStatus.FAILED and result.lease is None
    problem = result.failure
    assert problem.code is FailureCode.REMOTE_FAILED and problem.stage is ResolutionStage.REMOTE, problem
    assert problem.retryable is retryable, problem
    assert node.visible() == [] and node.temporaries() == []
    assert node.store.lookup(make_identity(), validation=META).status is StoreStatus.MISS
    assert_secret_free(problem)
    return problem


# --------------------------------------------------------------------------- the happy path


def test_push_then_import_gives_a_bit_identical_local_hit(remote: Remote, node_a: Node, node_b: Node) -> None:
    """E01: node A builds and pushes; node B imports once (BUILT), then a plain lookup on B is a bit-identical hit."""
    identity = node_a.build()
    pushed = remote.push(node_a, identity)
    assert remote.names(identity.key) == sorted(
        [
            DESCRIPTOR_FILE_NAME,
            MANIFEST_FILE_NAME,
            "model-00001-of-00002.safetensors",
            "model-00002-of-00002.safetensors",
        ]
    )
    provider = remote.provider(chunk_bytes=4096)
    descriptor = provider.probe(identity)
    assert descriptor is not None and descriptor.identity == identity
    assert descriptor.manifest_sha256 == pushed.manifest_sha256 and descriptor.provider_id == provider.provider_id

    imported = import_into(node_b, provider)
    assert imported is not None and imported.status is StoreStatus.BUILT, imported.failure
    assert (
        imported.lease.manifest.to_bytes() == node_a.store.lookup(identity, validation=META).lease.manifest.to_bytes()
    )
    imported.lease.close()

    hit = node_b.store.lookup(identity, validation=FULL)
    assert hit.status is StoreStatus.HIT and hit.lease is not None
    assert hit.lease.provenance.source is LeaseSource.LOCAL_HIT
    assert manifest_sha256(hit.lease.manifest.to_bytes()) == descriptor.manifest_sha256
    for name, tensor in make_tensors().items():
        assert_bitwise_equal(hit.lease.tensors[name], tensor)
    hit.lease.close()
    assert node_b.temporaries() == []
    assert_secret_free(remote.read(identity.key, DESCRIPTOR_FILE_NAME).decode(), pushed, descriptor.provider_id)


def test_missing_key_and_dead_upload_are_clean_misses(remote: Remote, node_a: Node, node_b: Node) -> None:
    """E02: a remote without the key, or holding only a dead upload's objects (no descriptor), offers nothing."""
    identity = make_identity()
    provider = remote.provider()
    assert provider.probe(identity) is None
    assert import_into(node_b, provider) is None
    node_a.build()
    remote.push(node_a, identity)
    remote.remove(identity.key, DESCRIPTOR_FILE_NAME)  # what an upload that died before its last step leaves
    assert provider.probe(identity) is None
    assert import_into(node_b, provider) is None
    assert node_b.visible() == [] and node_b.temporaries() == []


def test_every_dtype_round_trips_through_ranges_split_inside_tensors(s3: Remote, node_a: Node, node_b: Node) -> None:
    """E10: every dtype (0-dim, empty, rows wider than a range included) arrives bit-exactly through small ranges."""
    generator = torch.Generator().manual_seed(7)
    tensors: dict[str, torch.Tensor] = {
        "wide_rows": torch.randn(3, 3000, generator=generator),  # one row (12 KB) is wider than a 4 KiB range
        "many_rows": torch.randn(700, 9, generator=generator).to(torch.bfloat16),
        "scalar": torch.tensor(3.5, dtype=torch.float64),
        "empty": torch.empty(0, 4, dtype=torch.float32),
        "flags": torch.rand(4099, generator=generator) > 0.5,
        "bytes": torch.randint(0, 255, (5000,), dtype=torch.uint8, generator=generator),
        "small": torch.randint(-9, 9, (3, 5), dtype=torch.int8, generator=generator),
        "halves": torch.randn(2100, generator=generator).to(torch.float16),
        "longs": torch.arange(1500, dtype=torch.int64),
        "ints": torch.arange(-700, 700, dtype=torch.int32),
        "shorts": torch.arange(-300, 300, dtype=torch.int16),
    }
    for name in ("float8_e4m3fn", "float8_e5m2"):
        if hasattr(torch, name):
            tensors[name] = torch.randn(1000, generator=generator).to(getattr(torch, name))
    identity = node_a.build(tensors=tensors, files=3)
    s3.push(node_a, identity)
    imported = import_into(node_b, s3.provider(chunk_bytes=4096, max_concurrency=3))
    assert imported is not None and imported.status is StoreStatus.BUILT, imported.failure
    imported.lease.close()
    node_b.assert_holds(identity, tensors)


# --------------------------------------------------------------------------- bad remote content


def _flip_payload_byte(remote: Remote, key: str) -> None:
    name = "model-00001-of-00002.safetensors"
    data = bytearray(remote.read(key, name))
    header = 8 + int.from_bytes(data[:8], "little")
    data[header + 5] ^= 0xFF
    remote.write(key, name, bytes(data))


def _rewrite_descriptor(remote: Remote, key: str, **changes: Any) -> None:
    value = json.loads(remote.read(key, DESCRIPTOR_FILE_NAME))
    value.update(changes)
    record = RemoteDescriptorRecord.from_bytes(json.dumps(value, sort_keys=True, separators=(",", ":")).encode())
    remote.write(key, DESCRIPTOR_FILE_NAME, record.to_bytes())


def _foreign_manifest(remote: Remote, key: str, other: Node) -> None:
    """Replace manifest.json by a valid manifest of another identity, descriptor digests updated to match it."""
    other_identity = other.build(make_identity(tag="other"))
    lease = other.store.lookup(other_identity, validation=META).lease
    assert lease is not None
    data = lease.manifest.to_bytes()
    lease.close()
    remote.write(key, MANIFEST_FILE_NAME, data)
    manifest = WeightManifest.from_bytes(data)
    _rewrite_descriptor(
        remote,
        key,
        manifest_sha256=manifest_sha256(data),
        manifest_size=len(data),
        content_sha256=manifest.content_digest,
    )


def _foreign_descriptor(remote: Remote, key: str, other: Node) -> None:
    """Put another artifact's (valid) descriptor into this key's folder."""
    other_identity = other.build(make_identity(tag="other"))
    remote.push(other, other_identity)
    remote.write(key, DESCRIPTOR_FILE_NAME, remote.read(other_identity.key, DESCRIPTOR_FILE_NAME))


def _truncate(remote: Remote, key: str) -> None:
    name = "model-00002-of-00002.safetensors"
    remote.write(key, name, remote.read(key, name)[:-16])


def _strip_payloads(remote: Remote, key: str) -> None:
    for name in remote.names(key):
        if name != DESCRIPTOR_FILE_NAME:
            remote.remove(key, name)


BAD_CONTENT: dict[str, Any] = {
    "flipped_payload_byte": lambda remote, key, other: _flip_payload_byte(remote, key),
    "descriptor_manifest_sha256_disagrees": lambda remote, key, other: _rewrite_descriptor(
        remote, key, manifest_sha256="0" * 64
    ),
    "descriptor_content_sha256_disagrees": lambda remote, key, other: _rewrite_descriptor(
        remote, key, content_sha256="1" * 64
    ),
    "manifest_for_another_identity": _foreign_manifest,
    "descriptor_for_another_identity": _foreign_descriptor,
    "truncated_object": lambda remote, key, other: _truncate(remote, key),
    "extra_file": lambda remote, key, other: remote.write(key, "extra.safetensors", b"\0" * 64),
    "missing_file": lambda remote, key, other: remote.remove(key, "model-00001-of-00002.safetensors"),
    "descriptor_without_payloads": lambda remote, key, other: _strip_payloads(remote, key),
    "garbage_descriptor": lambda remote, key, other: remote.write(key, DESCRIPTOR_FILE_NAME, b'{"schema": 1'),
}


@pytest.mark.parametrize("case", sorted(BAD_CONTENT))
def test_bad_remote_content_is_typed_and_leaves_nothing(
    remote: Remote, node_a: Node, node_b: Node, tmp_path: Path, case: str
) -> None:
    """E03: each kind of bad remote content is a non-retryable REMOTE_FAILED; B's artifacts/ and tmp/ stay empty.

    Plain HTTP cannot list a folder: there an object the descriptor does not name is
    never read, so the import succeeds with exactly the promised bytes.
    """
    identity = node_a.build()
    remote.push(node_a, identity)
    BAD_CONTENT[case](remote, identity.key, Node(tmp_path / "node-c"))
    result = import_into(node_b, remote.provider(chunk_bytes=4096))
    if case == "extra_file" and remote.kind == "http":
        assert result is not None and result.status is StoreStatus.BUILT and result.lease is not None
        assert manifest_sha256(result.lease.manifest.to_bytes()) == remote.provider().probe(identity).manifest_sha256
        result.lease.close()
        return
    assert_failed_cleanly(result, node_b, retryable=False)


def test_server_that_ignores_ranges_is_a_typed_failure(tmp_path: Path, node_a: Node, node_b: Node) -> None:
    """E03: an HTTP server that answers a ranged read with the whole object cannot feed an import."""
    folder = tmp_path / "remote"
    identity = node_a.build()
    push_artifact(node_a.store, identity, f"file://{folder}")
    with http_server(folder, ignore_ranges=True) as base:
        problem = assert_failed_cleanly(
            import_into(node_b, FsspecArtifactProvider(base, chunk_bytes=4096)), node_b, retryable=False
        )
    assert "ranges" in problem.message


# --------------------------------------------------------------------------- network failures


@pytest.mark.parametrize("scheme", ["s3", "http"])
def test_endpoint_down_is_retryable(scheme: str, node_b: Node) -> None:
    """E04: a refused connection is a retryable REMOTE_FAILED and leaves nothing behind."""
    endpoint = closed_endpoint()
    if scheme == "s3":
        provider = FsspecArtifactProvider(
            "s3://bucket/fleet",
            storage_options={"endpoint_url": endpoint, "key": ACCESS_KEY, "secret": SECRET_KEY},
            timeout_s=5.0,
        )
    else:
        provider = FsspecArtifactProvider(f"{endpoint}/fleet", timeout_s=5.0)
    assert_failed_cleanly(import_into(node_b, provider), node_b, retryable=True)


@pytest.mark.parametrize("scheme", ["s3", "http"])
def test_stalled_endpoint_times_out_retryably(scheme: str, node_b: Node) -> None:
    """E04: an endpoint that accepts and never answers fails after timeout_s, retryable, leaving nothing."""
    with stalled_endpoint() as endpoint:
        if scheme == "s3":
            provider = FsspecArtifactProvider(
                "s3://bucket/fleet",
                storage_options={"endpoint_url": endpoint, "key": ACCESS_KEY, "secret": SECRET_KEY},
                timeout_s=0.5,
            )
        else:
            provider = FsspecArtifactProvider(f"{endpoint}/fleet", timeout_s=0.5)
        problem = assert_failed_cleanly(import_into(node_b, provider), node_b, retryable=True)
    assert problem.details.to_value()["timeout_s"] == 0.5


def test_bucket_without_read_permission_is_typed_and_secret_free(
    moto: MotoEndpoint, s3: Remote, node_a: Node, node_b: Node
) -> None:
    """E05: a reader whose IAM policy only allows listing gets a non-retryable REMOTE_FAILED naming no secret."""
    identity = node_a.build()
    s3.push(node_a, identity)
    iam = moto.client("iam")
    iam.create_user(UserName="lister")
    keys = iam.create_access_key(UserName="lister")["AccessKey"]
    iam.put_user_policy(
        UserName="lister",
        PolicyName="list-only",
        PolicyDocument=json.dumps(
            {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": ["s3:ListBucket"], "Resource": "*"}]}
        ),
    )
    provider = FsspecArtifactProvider(
        s3.read_url, storage_options=moto.storage_options(access=keys["AccessKeyId"], secret=keys["SecretAccessKey"])
    )
    moto.set_iam_enforced(True)
    try:
        result = import_into(node_b, provider)
    finally:
        moto.set_iam_enforced(False)
    problem = assert_failed_cleanly(result, node_b, retryable=False)
    assert keys["SecretAccessKey"] not in json.dumps(problem.to_dict())
    assert problem.details.to_value()["exception"] == "PermissionError"


# --------------------------------------------------------------------------- writers and verification


class _ForwardingFileWriter:
    """A TensorFileWriter that reports no digests, so the provider must hash what it streams itself."""

    def __init__(self, inner: TensorFileWriter) -> None:
        self._inner = inner

    def write_tensor(self, name: str, tensor: torch.Tensor) -> None:
        self._inner.write_tensor(name, tensor)

    def write_rows(self, name: str, start_row: int, tensor: torch.Tensor) -> None:
        self._inner.write_rows(name, start_row, tensor)

    def close(self) -> None:
        self._inner.close()

    def __enter__(self) -> _ForwardingFileWriter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class _ForwardingWriter:
    def __init__(self, inner: ArtifactWriter) -> None:
        self._inner = inner

    def open_tensor_file(
        self, relative_name: str, specs: tuple[TensorWriteSpec, ...], *, ordered: bool = False
    ) -> TensorFileWriter:
        return _ForwardingFileWriter(self._inner.open_tensor_file(relative_name, specs, ordered=ordered))


class _ForwardingProducer:
    """Imports through a writer that hides the store writer's digests."""

    def __init__(self, inner: RemoteImportProducer, provider: FsspecArtifactProvider) -> None:
        self._inner = inner
        self._provider = provider

    @property
    def spec(self) -> WeightProductionSpec:
        return self._inner.spec

    def produce(self, writer: ArtifactWriter) -> ProductionMetadata:
        assert isinstance(writer, StagingArtifactWriter)
        return self._provider.fetch(self._inner.descriptor, _ForwardingWriter(writer))


@pytest.mark.parametrize("flip", [False, True])
def test_writer_without_digests_gets_bytes_hashed_on_the_way_in(
    s3: Remote, node_a: Node, node_b: Node, flip: bool
) -> None:
    """E03: behind a writer that reports no digests the provider hashes every byte itself and still catches a flip."""
    identity = node_a.build()
    s3.push(node_a, identity)
    if flip:
        _flip_payload_byte(s3, identity.key)
    provider = s3.provider(chunk_bytes=4096)
    descriptor = provider.probe(identity)
    assert descriptor is not None
    producer = _ForwardingProducer(RemoteImportProducer(provider, descriptor), provider)
    result = node_b.store.get_or_build(BuildRequest(identity), producer, validation=META, deadline=soon())
    if not flip:
        assert result.status is StoreStatus.BUILT and result.lease is not None, result.failure
        result.lease.close()
        return
    assert result.status is StoreStatus.FAILED and result.failure is not None
    assert result.failure.code is FailureCode.REMOTE_FAILED and not result.failure.retryable
    assert node_b.visible() == [] and node_b.temporaries() == []


@pytest.mark.parametrize("leased_elsewhere", [False, True])
def test_published_copy_disagreeing_with_its_descriptor_is_removed(node_b: Node, leased_elsewhere: bool) -> None:
    """E03: if a published import ever disagreed with its descriptor, the copy is removed (or reported as kept)."""
    identity = node_b.build()
    result = node_b.store.lookup(identity, validation=META)
    assert result.lease is not None
    other = node_b.store.lookup(identity, validation=META) if leased_elsewhere else None
    descriptor = RemoteArtifactDescriptor("file:///elsewhere", identity, "2" * 64, "3" * 64)
    problem = verify_imported(node_b.store, result, descriptor)
    assert problem is not None and problem.code is FailureCode.REMOTE_FAILED and problem.stage is ResolutionStage.REMOTE
    if other is None:
        assert problem.details.to_value()["local_copy"] == "removed"
        assert node_b.visible() == []
    else:
        assert problem.details.to_value()["local_copy"] == "kept: active_lease"
        assert other.lease is not None
        other.lease.close()

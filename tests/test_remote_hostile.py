"""Hostile remotes during a one-pass import: an object that grows or changes while it is read, a redirect loop,
a stalled endpoint (E03, E04, E12).

Each ends in a typed remote_failed with nothing partial visible on node B, and a PREFERRED
resolve goes on to its local build. The fault seam `remote.fetch.chunk` holds the import
between two ranges so the test can change the remote object at that exact step.
"""

from __future__ import annotations

import contextlib
import http.server
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from host_weight_runtime import (
    FailureCode,
    HostWeightRuntime,
    HostWeightRuntimeConfig,
    ResolutionOutcome,
    RuntimeMode,
    StoreStatus,
)
from host_weight_runtime._faults import Fault, FaultAction, armed
from host_weight_runtime.remote import FsspecArtifactProvider, import_remote_artifact, push_artifact

from .remote_support import (
    META,
    WAIT_S,
    MotoEndpoint,
    Node,
    Remote,
    make_remote,
    moto_endpoint,
    soon,
    stalled_endpoint,
)
from .support import SyntheticProducer, make_identity, make_tensors

PAYLOAD = "model-00001-of-00002.safetensors"
LATER_PAYLOAD = "model-00002-of-00002.safetensors"  # not read yet while the first file's first range is written


@pytest.fixture(scope="module")
def moto() -> Iterator[MotoEndpoint]:
    with moto_endpoint() as endpoint:
        yield endpoint


@pytest.fixture(params=["file", "s3"])
def remote(request: pytest.FixtureRequest, tmp_path: Path, moto: MotoEndpoint) -> Iterator[Remote]:
    with make_remote(request.param, tmp_path, moto) as value:
        yield value


def _import(node: Node, provider: FsspecArtifactProvider) -> Any:
    return import_remote_artifact(node.store, make_identity(), provider, validation=META, deadline=soon())


def _assert_nothing_visible(node: Node) -> None:
    assert node.visible() == [] and node.temporaries() == []


@pytest.mark.parametrize("change", ["grows_with_other_bytes", "grows_by_appending"])
def test_an_object_that_grows_during_the_read(remote: Remote, tmp_path: Path, change: str) -> None:
    """E03, E12: a payload is replaced by a longer object while the import runs. Other bytes inside
    the promised range fail the import (non-retryable remote_failed, nothing visible); bytes only appended
    past the promised size are never read, so the import publishes exactly the pushed tensors."""
    node_a, node_b = Node(tmp_path / "node-a"), Node(tmp_path / "node-b")
    tensors = make_tensors()
    identity = node_a.build(tensors=tensors)
    remote.push(node_a, identity)
    original = remote.read(identity.key, LATER_PAYLOAD)

    def grow(point: str) -> None:
        del point
        data = bytearray(original)
        if change == "grows_with_other_bytes":
            header = 8 + int.from_bytes(data[:8], "little")
            for offset in range(header, len(data), 97):
                data[offset] ^= 0x5A
        remote.write(identity.key, LATER_PAYLOAD, bytes(data) + b"\x01" * 65536)

    with armed("remote.fetch.chunk", Fault(FaultAction.PAUSE, hook=grow)):
        result = _import(node_b, remote.provider(chunk_bytes=4096, max_concurrency=2))
    if change == "grows_by_appending":
        assert result is not None and result.status is StoreStatus.BUILT and result.lease is not None, result
        result.lease.close()
        node_b.assert_holds(identity, tensors)
        return
    assert result is not None and result.status is StoreStatus.FAILED and result.lease is None
    assert result.failure.code is FailureCode.REMOTE_FAILED and result.failure.retryable is False
    _assert_nothing_visible(node_b)


class _RedirectLoop(http.server.BaseHTTPRequestHandler):
    """Answers every request with a redirect to itself."""

    def log_message(self, format: str, *args: Any) -> None:
        del format, args

    def _loop(self) -> None:
        self.send_response(302)
        self.send_header("Location", self.path)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_GET(self) -> None:
        self._loop()

    def do_HEAD(self) -> None:
        self._loop()


@contextlib.contextmanager
def redirect_loop() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _RedirectLoop)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/fleet"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(WAIT_S)


def test_a_redirect_loop_is_a_typed_failure(tmp_path: Path) -> None:
    """E03, E12: an http(s) remote that redirects to itself forever fails typed (remote_failed), leaving nothing."""
    node_b = Node(tmp_path / "node-b")
    with redirect_loop() as url:
        result = _import(node_b, FsspecArtifactProvider(url, timeout_s=10))
    assert result is not None and result.status is StoreStatus.FAILED and result.lease is None
    assert result.failure.code is FailureCode.REMOTE_FAILED
    _assert_nothing_visible(node_b)


@pytest.mark.parametrize("endpoint", ["redirect_loop", "stalled"])
def test_preferred_builds_locally_behind_a_hostile_endpoint(tmp_path: Path, endpoint: str) -> None:
    """E04, E12, R02: with HWR_REMOTE on a redirect loop or a stalled endpoint, PREFERRED records the failed
    remote attempt and builds locally; nothing of the remote reaches the domain."""
    identity = make_identity()
    hostile = redirect_loop() if endpoint == "redirect_loop" else stalled_endpoint()
    with hostile as url:
        config = HostWeightRuntimeConfig(
            root=tmp_path / "node-b", remote=(url,), remote_timeout_s=2.0, mode=RuntimeMode.PREFERRED
        )
        resolved = HostWeightRuntime(config).resolve(identity, SyntheticProducer(identity, make_tensors(), files=1))
    assert resolved.outcome is ResolutionOutcome.LOCAL_PRODUCTION and resolved.lease is not None
    resolved.lease.close()
    [attempt] = [item for item in resolved.report.attempts if item.stage.value == "remote"]
    assert attempt.failure is not None and attempt.failure.code is FailureCode.REMOTE_FAILED


def test_a_remote_that_pushes_then_loses_an_object_mid_import(tmp_path: Path) -> None:
    """E03, E12: a payload removed between two ranges is a typed failure that leaves nothing."""
    node_a, node_b = Node(tmp_path / "node-a"), Node(tmp_path / "node-b")
    identity = node_a.build()
    folder = tmp_path / "remote"
    push_artifact(node_a.store, identity, f"file://{folder}")

    def lose(point: str) -> None:
        del point
        (folder / identity.key / PAYLOAD).unlink(missing_ok=True)

    with armed("remote.fetch.chunk", Fault(FaultAction.PAUSE, hook=lose)):
        result = _import(node_b, FsspecArtifactProvider(f"file://{folder}", chunk_bytes=4096, max_concurrency=1))
    assert result is not None and result.status is StoreStatus.FAILED
    assert result.failure.code is FailureCode.REMOTE_FAILED
    _assert_nothing_visible(node_b)

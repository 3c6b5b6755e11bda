"""Real remotes for the remote-artifact tests: moto's S3 server, a range-serving HTTP server, a stalled endpoint.

Every server listens on a loopback port chosen by the kernel and is stopped by the
fixture that started it; nothing here sleeps or polls.
"""

from __future__ import annotations

import contextlib
import http.server
import logging
import os
import socket
import threading
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from host_weight_runtime import BuildRequest, FilesystemHostWeightStore, StoreStatus, ValidationLevel
from host_weight_runtime.identity import WeightArtifactIdentity
from host_weight_runtime.remote import FsspecArtifactProvider, PushResult, push_artifact

from .support import SyntheticProducer, make_identity, make_tensors

META = ValidationLevel.MANIFEST_AND_METADATA
FULL = ValidationLevel.FULL_CHECKSUM
WAIT_S = 60.0
# Distinctive values: no failure, listing or descriptor may ever contain them.
SECRET_KEY = "hwr-test-secret-3f9c2a71"
ACCESS_KEY = "hwr-test-access-key"
REGION = "us-east-1"


def soon(seconds: float = WAIT_S) -> float:
    return time.monotonic() + seconds


# --------------------------------------------------------------------------- moto


@dataclass
class MotoEndpoint:
    """moto's threaded S3 server on loopback, spoken to over HTTP by boto3 and s3fs."""

    url: str

    def client(self, service: str = "s3", **keys: str) -> Any:
        import boto3

        return boto3.client(
            service,
            endpoint_url=self.url,
            region_name=REGION,
            aws_access_key_id=keys.get("access", ACCESS_KEY),
            aws_secret_access_key=keys.get("secret", SECRET_KEY),
        )

    def new_bucket(self) -> str:
        name = f"hwr-{uuid.uuid4().hex[:20]}"
        self.client().create_bucket(Bucket=name)
        return name

    def storage_options(self, *, access: str = ACCESS_KEY, secret: str = SECRET_KEY) -> dict[str, Any]:
        return {"endpoint_url": self.url, "key": access, "secret": secret, "client_kwargs": {"region_name": REGION}}

    def set_iam_enforced(self, enforced: bool) -> None:
        """Turn moto's IAM checks on (every request needs a known, permitted key) or off, over its HTTP API."""
        request = urllib.request.Request(
            f"{self.url}/moto-api/reset-auth",
            data=b"0" if enforced else b"inf",
            method="POST",
            headers={"Content-Type": "text/plain"},
        )
        with urllib.request.urlopen(request, timeout=WAIT_S) as response:
            response.read()


@contextlib.contextmanager
def moto_endpoint() -> Iterator[MotoEndpoint]:
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        yield MotoEndpoint(f"http://{host}:{port}")
    finally:
        server.stop()


# --------------------------------------------------------------------------- HTTP


class _RangeHandler(http.server.SimpleHTTPRequestHandler):
    """Serves a folder read-only, honouring single `Range: bytes=a-b` requests (unless told to ignore them)."""

    ignore_ranges = False

    def log_message(self, format: str, *args: Any) -> None:
        del format, args

    def do_GET(self) -> None:
        header = self.headers.get("Range")
        path = Path(self.translate_path(self.path))
        if header is None or self.ignore_ranges or not path.is_file():
            super().do_GET()
            return
        first, _, last = header.removeprefix("bytes=").partition("-")
        data = path.read_bytes()
        begin = int(first)
        end = min(int(last) + 1 if last else len(data), len(data))
        body = data[begin:end]
        self.send_response(206)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Range", f"bytes {begin}-{end - 1}/{len(data)}")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@contextlib.contextmanager
def http_server(directory: Path, *, ignore_ranges: bool = False) -> Iterator[str]:
    """A read-only HTTP view of `directory` on loopback; yields its base URL."""
    handler = type("Handler", (_RangeHandler,), {"ignore_ranges": ignore_ranges})

    def make(*args: Any, **kwargs: Any) -> http.server.BaseHTTPRequestHandler:
        return handler(*args, directory=os.fspath(directory), **kwargs)

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), make)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(WAIT_S)


@contextlib.contextmanager
def stalled_endpoint() -> Iterator[str]:
    """A loopback port whose kernel completes TCP handshakes but which never reads or answers."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        listener.close()


def closed_endpoint() -> str:
    """A loopback URL on which nothing listens (connections are refused)."""
    probe = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    return f"http://127.0.0.1:{port}"


# --------------------------------------------------------------------------- nodes


@dataclass
class Node:
    """One node's domain: a store on its own directory."""

    root: Path
    store: FilesystemHostWeightStore = field(init=False)

    def __post_init__(self) -> None:
        self.store = FilesystemHostWeightStore(self.root)

    def build(
        self,
        identity: WeightArtifactIdentity | None = None,
        tensors: dict[str, torch.Tensor] | None = None,
        files: int = 2,
    ) -> WeightArtifactIdentity:
        identity = identity or make_identity()
        producer = SyntheticProducer(identity, tensors if tensors is not None else make_tensors(), files=files)
        result = self.store.get_or_build(BuildRequest(identity), producer, validation=META, deadline=soon())
        assert result.status is StoreStatus.BUILT and result.lease is not None, result.failure
        result.lease.close()
        return identity

    def assert_holds(self, identity: WeightArtifactIdentity, tensors: dict[str, torch.Tensor]) -> None:
        """A FULL_CHECKSUM lookup hits and every tensor equals `tensors` bit for bit."""
        hit = self.store.lookup(identity, validation=FULL)
        assert hit.lease is not None, hit.failure
        try:
            for name, tensor in tensors.items():
                assert_bitwise_equal(hit.lease.tensors[name], tensor)
        finally:
            hit.lease.close()

    def visible(self) -> list[str]:
        return sorted(os.listdir(self.store.layout.artifacts))

    def temporaries(self) -> list[str]:
        return sorted(os.listdir(self.store.layout.tmp))


def assert_bitwise_equal(left: torch.Tensor, right: torch.Tensor) -> None:
    assert left.dtype == right.dtype and left.shape == right.shape
    assert torch.equal(
        left.contiguous().reshape(-1).view(torch.uint8), right.contiguous().reshape(-1).view(torch.uint8)
    )


# --------------------------------------------------------------------------- remotes under test


@dataclass
class Remote:
    """A remote as node A writes it and node B reads it, plus a raw filesystem to damage it with."""

    kind: str
    push_url: str
    push_options: dict[str, Any]
    read_url: str
    read_options: dict[str, Any]
    raw: Any  # an fsspec filesystem on the same objects
    raw_root: str

    def provider(self, **kwargs: Any) -> FsspecArtifactProvider:
        return FsspecArtifactProvider(self.read_url, storage_options=self.read_options, **kwargs)

    def push(self, node: Node, identity: WeightArtifactIdentity) -> PushResult:
        return push_artifact(node.store, identity, self.push_url, storage_options=self.push_options)

    def object(self, key: str, name: str) -> str:
        return f"{self.raw_root}/{key}/{name}"

    def read(self, key: str, name: str) -> bytes:
        return bytes(self.raw.cat_file(self.object(key, name)))

    def write(self, key: str, name: str, data: bytes) -> None:
        self.raw.pipe_file(self.object(key, name), data)

    def remove(self, key: str, name: str) -> None:
        self.raw.rm_file(self.object(key, name))

    def names(self, key: str) -> list[str]:
        self.raw.invalidate_cache()
        return sorted(entry.rstrip("/").rsplit("/", 1)[-1] for entry in self.raw.ls(f"{self.raw_root}/{key}"))


@contextlib.contextmanager
def make_remote(kind: str, tmp_path: Path, moto: MotoEndpoint | None) -> Iterator[Remote]:
    import fsspec

    if kind == "s3":
        assert moto is not None
        bucket = moto.new_bucket()
        options = moto.storage_options()
        url = f"s3://{bucket}/fleet"
        raw = fsspec.filesystem("s3", skip_instance_cache=True, **options)
        yield Remote(kind, url, options, url, options, raw, f"{bucket}/fleet")
        return
    folder = tmp_path / "remote"
    folder.mkdir()
    raw = fsspec.filesystem("file")
    if kind == "file":
        url = f"file://{folder}"
        yield Remote(kind, url, {}, url, {}, raw, str(folder))
        return
    assert kind == "http"
    with http_server(folder) as base:
        yield Remote(kind, f"file://{folder}", {}, base, {}, raw, str(folder))


def use_aws_environment(
    monkeypatch: Any, tmp_path: Path, *, access: str = ACCESS_KEY, secret: str = SECRET_KEY
) -> None:
    """Credentials the way an operator gives them (AWS_* variables), with no profile or config file in reach."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", access)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    monkeypatch.setenv("AWS_DEFAULT_REGION", REGION)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(name, raising=False)


@contextlib.contextmanager
def node_b_with_pushed_remote(
    kind: str, domain_root: Path, keys: list[str], *, tmp_path: Path, monkeypatch: Any, moto: MotoEndpoint | None
) -> Iterator[Remote]:
    """A fresh remote holding every artifact of node A's domain (exactly `keys`); this process (and its children)
    is then node B, whose Hugging Face cache is empty and must stay empty: a load by name never fills it."""
    from host_weight_runtime.remote import push_all_artifacts

    use_aws_environment(monkeypatch, tmp_path)
    with make_remote(kind, tmp_path, moto) as remote:
        outcomes = push_all_artifacts(
            FilesystemHostWeightStore(domain_root), remote.push_url, storage_options=remote.push_options
        )
        assert sorted(outcome.key for outcome in outcomes) == sorted(keys)
        empty = tmp_path / "empty-hf"
        empty.mkdir()
        monkeypatch.setenv("HF_HOME", str(empty))
        monkeypatch.setenv("HF_HUB_CACHE", str(empty / "hub"))
        yield remote
        assert not (empty / "hub").exists() or list((empty / "hub").iterdir()) == []

"""Remote artifacts in the benchmark: node B imports the artifact node A pushed, over file:// and over S3.

Setup pushes the published artifact (`push_artifact`, FULL_CHECKSUM first, descriptor
last) to a `file://` remote in the disk work folder and, where `moto[server]` is
installed, to a bucket of moto's S3 server, started here on a loopback port (no network,
no account; the keys below are moto's placeholders, not secrets). The rows are
`load_component` on an empty domain configured with that remote (time to ready on
node B); the throughput figure times `import_remote_artifact` into an empty domain next
to a plain fsspec copy of the same objects into a folder on the same tmpfs.
"""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from host_weight_runtime import (
    FilesystemHostWeightStore,
    FsspecArtifactProvider,
    StoreStatus,
    ValidationLevel,
    WeightArtifactIdentity,
    import_remote_artifact,
    push_artifact,
)

from ..common import JsonValue, remove_tree
from .fleet import measure_fleet
from .row_names import REMOTE_FILE, REMOTE_S3
from .stats import Stats

__all__ = ["RemoteSetup", "RemoteTarget", "measure_remote_throughput", "remote_targets"]

# moto accepts any key pair; these only satisfy botocore's request signing.
_MOTO_KEY = "hwr-bench-placeholder"
_REGION = "us-east-1"
_BUCKET = "hwr-bench"


@dataclass(frozen=True, slots=True)
class RemoteTarget:
    """One remote holding the artifact: its row, URL and the fsspec options a reader passes."""

    row: str
    kind: str
    url: str
    storage_options: dict[str, Any]
    push_s: float


@dataclass(frozen=True, slots=True)
class RemoteSetup:
    """The remotes the benchmark could set up, and why any other was not measured."""

    targets: tuple[RemoteTarget, ...]
    unavailable: dict[str, str]
    source: FilesystemHostWeightStore | None = None  # node A's domain, which push rows push from

    def to_dict(self) -> dict[str, JsonValue]:
        return {
            "targets": {t.row: {"kind": t.kind, "url": t.url, "push_s": t.push_s} for t in self.targets},
            "unavailable": dict(self.unavailable),
        }


def moto_unavailable_reason() -> str | None:
    """Why the S3 row cannot run here, or None when moto's server and s3fs can be imported."""
    for module, package in (
        ("moto.server", "moto[server]"),
        ("s3fs", "s3fs"),
        ("flask", "moto[server]"),
        ("boto3", "moto[server]"),
    ):
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            return f"{package} is not installed (pip install '{package}'): the S3 row needs a local S3 endpoint"
    return None


@contextlib.contextmanager
def _moto_server() -> Iterator[str]:
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        yield f"http://{host}:{port}"
    finally:
        server.stop()


def _timed_push(store: FilesystemHostWeightStore, key: str, url: str, options: dict[str, Any]) -> float:
    gc.collect()  # off the clock, as `_timed`
    started = time.perf_counter()
    push_artifact(store, key, url, storage_options=options)
    return time.perf_counter() - started


@contextlib.contextmanager
def remote_targets(
    store: FilesystemHostWeightStore, key: str, disk_dir: Path, say: Callable[[str], None]
) -> Iterator[RemoteSetup]:
    """Push the artifact to each remote this machine can run; the moto server lives until the block ends."""
    targets: list[RemoteTarget] = []
    unavailable: dict[str, str] = {}
    file_url = f"file://{disk_dir / 'remote'}"
    say(f"setup: pushing the artifact to {file_url}")
    targets.append(RemoteTarget(REMOTE_FILE, "file", file_url, {}, _timed_push(store, key, file_url, {})))
    with contextlib.ExitStack() as stack:
        reason = moto_unavailable_reason()
        if reason is None:
            import boto3

            endpoint = stack.enter_context(_moto_server())
            options: dict[str, Any] = {
                "endpoint_url": endpoint,
                "key": _MOTO_KEY,
                "secret": _MOTO_KEY,
                "client_kwargs": {"region_name": _REGION},
            }
            boto3.client(
                "s3",
                endpoint_url=endpoint,
                region_name=_REGION,
                aws_access_key_id=_MOTO_KEY,
                aws_secret_access_key=_MOTO_KEY,
            ).create_bucket(Bucket=_BUCKET)
            s3_url = f"s3://{_BUCKET}/fleet"
            say(f"setup: pushing the artifact to {s3_url} on moto at {endpoint}")
            targets.append(RemoteTarget(REMOTE_S3, "s3", s3_url, options, _timed_push(store, key, s3_url, options)))
        else:
            unavailable[REMOTE_S3] = reason
        yield RemoteSetup(tuple(targets), unavailable, store)


def _import_once(
    domain: Path, identity: WeightArtifactIdentity, provider: FsspecArtifactProvider
) -> Callable[[], None]:
    store = FilesystemHostWeightStore(domain)

    def run() -> None:
        result = import_remote_artifact(
            store, identity, provider, validation=ValidationLevel.MANIFEST_AND_METADATA, deadline=time.monotonic() + 600
        )
        if result is None or result.status is not StoreStatus.BUILT or result.lease is None:
            raise RuntimeError(f"the benchmark's remote import failed: {None if result is None else result.failure}")
        result.lease.close()

    return run


def _copy_once(fs: Any, sources: list[str], copy_dir: Path) -> Callable[[], None]:
    def run() -> None:
        copy_dir.mkdir()
        fs.get(sources, [str(copy_dir / source.rsplit("/", 1)[-1]) for source in sources])

    return run


def _measure_target(
    target: RemoteTarget,
    identity: WeightArtifactIdentity,
    workdir: Path,
    runs: int,
    source: FilesystemHostWeightStore | None = None,
) -> dict[str, JsonValue]:
    import fsspec.core

    provider = FsspecArtifactProvider(target.url, storage_options=target.storage_options)
    fs, root = fsspec.core.url_to_fs(target.url, skip_instance_cache=True, **target.storage_options)
    folder = f"{str(root).rstrip('/')}/{identity.key}"
    entries = fs.ls(folder, detail=True)
    sources = sorted(f"{folder}/{str(entry['name']).rstrip('/').rsplit('/', 1)[-1]}" for entry in entries)
    total = sum(int(entry["size"]) for entry in entries)
    import_s: list[float] = []
    copy_s: list[float] = []
    for run in range(runs):
        domain = workdir / f"remote-import-{target.kind}-{run}"
        copy_dir = workdir / f"remote-copy-{target.kind}-{run}"
        try:
            do_import = _import_once(domain, identity, provider)
            do_copy = _copy_once(fs, sources, copy_dir)
            first, second = (do_import, do_copy) if run % 2 == 0 else (do_copy, do_import)
            first_s, second_s = _timed(first), _timed(second)
            import_s.append(first_s if first is do_import else second_s)
            copy_s.append(second_s if first is do_import else first_s)
        finally:
            remove_tree(domain)
            remove_tree(copy_dir)
    imported, copied = Stats.of(import_s), Stats.of(copy_s)
    fleet: dict[str, JsonValue] | None = None
    if source is not None:
        fleet = measure_fleet(source, identity, target.url, target.storage_options, workdir=workdir, runs=runs)
    return {
        "kind": target.kind,
        "object_bytes": total,
        "import_s": imported.to_dict(),
        "plain_copy_s": copied.to_dict(),
        "import_vs_plain_copy": None if imported.median <= 0 else copied.median / imported.median,
        "fleet": fleet,
    }


def measure_remote_throughput(
    setup: RemoteSetup, identity: WeightArtifactIdentity, workdir: Path, runs: int
) -> dict[str, JsonValue]:
    """Per remote: import into an empty domain vs a plain fsspec copy of the same objects, alternating first;
    with node A's domain known, also push vs plain upload and node B's time to ready (`fleet.py`)."""
    return {target.row: _measure_target(target, identity, workdir, runs, setup.source) for target in setup.targets}


def _timed(action: Callable[[], None]) -> float:
    gc.collect()  # garbage left by the run before (or the imports) is collected off the clock, before each side
    started = time.perf_counter()
    action()
    return time.perf_counter() - started

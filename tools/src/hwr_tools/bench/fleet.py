"""The fleet's side of a cold start, next to the plain copies it competes with (one run, alternating first).

For each remote the benchmark set up (file:// and moto S3 on loopback), three pairs:

- `hwr push` of the published artifact to a fresh prefix vs a plain fsspec upload
  (`fs.put`) of the same payload and manifest files to another fresh prefix;
- node B's time to ready, a fresh `HostWeightRuntime` on an empty domain whose remote holds
  the artifact (probe, import, verify, publish, lease), vs a plain fsspec copy of the
  artifact's objects into a folder on the same tmpfs.

(The import-throughput pair lives in `remote.py`.) Goals: push >= 0.8x a plain upload and node
B <= 1.3x the plain copy time.
"""

from __future__ import annotations

import gc
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from host_weight_runtime import (
    FilesystemHostWeightStore,
    HostWeightRuntime,
    HostWeightRuntimeConfig,
    ResolutionOutcome,
    RuntimeMode,
    WeightArtifactIdentity,
    push_artifact,
)

from ..common import JsonValue, remove_tree
from .stats import Stats

__all__ = ["measure_fleet", "measure_push"]


def _timed(action: Callable[[], None]) -> float:
    gc.collect()  # garbage left by the run before (or the imports) is collected off the clock, before each side
    started = time.perf_counter()
    action()
    return time.perf_counter() - started


def _alternate(
    runs: int, left: Callable[[int], Callable[[], None]], right: Callable[[int], Callable[[], None]]
) -> tuple[list[float], list[float]]:
    """Time `left(run)` and `right(run)` `runs` times, alternating which goes first."""
    left_s: list[float] = []
    right_s: list[float] = []
    for run in range(runs):
        do_left, do_right = left(run), right(run)
        if run % 2 == 0:
            left_s.append(_timed(do_left))
            right_s.append(_timed(do_right))
        else:
            right_s.append(_timed(do_right))
            left_s.append(_timed(do_left))
    return left_s, right_s


def _remote_fs(url: str, options: dict[str, Any]) -> tuple[Any, str]:
    import fsspec.core

    fs, root = fsspec.core.url_to_fs(url, skip_instance_cache=True, **options)
    return fs, str(root).rstrip("/")


def _push_vs_upload(
    store: FilesystemHostWeightStore, key: str, url: str, options: dict[str, Any], runs: int
) -> dict[str, JsonValue]:
    fs, root = _remote_fs(url, options)
    artifact_dir = store.layout.artifact_dir(key)
    files = sorted(str(path) for path in artifact_dir.iterdir() if path.is_file())
    prefixes: list[str] = []

    local = "file" in fs.protocol

    def push(run: int) -> Callable[[], None]:
        prefix = f"bench-push-{run}-{uuid.uuid4().hex[:8]}"
        prefixes.append(prefix)

        def run_push() -> None:
            push_artifact(store, key, f"{url}/{prefix}", storage_options=options)

        return run_push

    def upload(run: int) -> Callable[[], None]:
        prefix = f"bench-upload-{run}-{uuid.uuid4().hex[:8]}"
        prefixes.append(prefix)
        target = f"{root}/{prefix}/{key}"

        def run_upload() -> None:
            if local:
                fs.makedirs(target, exist_ok=True)
            fs.put(files, [f"{target}/{Path(name).name}" for name in files])

        return run_upload

    if local:
        fs.makedirs(root, exist_ok=True)
    try:
        push_s, upload_s = _alternate(runs, push, upload)
    finally:
        for prefix in prefixes:
            if fs.exists(f"{root}/{prefix}"):
                fs.rm(f"{root}/{prefix}", recursive=True)
    pushed, uploaded = Stats.of(push_s), Stats.of(upload_s)
    return {
        "push_s": pushed.to_dict(),
        "plain_upload_s": uploaded.to_dict(),
        "push_vs_plain_upload": None if pushed.median <= 0 else uploaded.median / pushed.median,
    }


def measure_push(
    store: FilesystemHostWeightStore, key: str, url: str, options: dict[str, Any], *, runs: int
) -> dict[str, JsonValue]:
    """Only the push pair for one remote: `hwr push` to a fresh prefix vs a plain upload, alternating first."""
    return _push_vs_upload(store, key, url, options, runs)


def _node_b_vs_copy(
    identity: WeightArtifactIdentity, url: str, options: dict[str, Any], workdir: Path, runs: int
) -> dict[str, JsonValue]:
    from host_weight_runtime import FsspecArtifactProvider

    fs, root = _remote_fs(url, options)
    folder = f"{root}/{identity.key}"
    sources = sorted(str(entry).rstrip("/") for entry in fs.ls(folder, detail=False))
    cleanup: list[Path] = []

    def node_b(run: int) -> Callable[[], None]:
        domain = workdir / f"fleet-node-b-{run}"
        cleanup.append(domain)

        def ready() -> None:
            config = HostWeightRuntimeConfig(root=domain, mode=RuntimeMode.REQUIRED)
            runtime = HostWeightRuntime(config, remote_providers=[FsspecArtifactProvider(url, storage_options=options)])
            resolved = runtime.resolve(identity)
            if resolved.outcome is not ResolutionOutcome.REMOTE_IMPORT or resolved.lease is None:
                raise RuntimeError(f"node B did not import: {resolved.report.failure}")
            resolved.lease.close()

        return ready

    def copy(run: int) -> Callable[[], None]:
        target = workdir / f"fleet-copy-{run}"
        cleanup.append(target)

        def run_copy() -> None:
            target.mkdir()
            fs.get(sources, [str(target / source.rsplit("/", 1)[-1]) for source in sources])

        return run_copy

    try:
        ready_s, copy_s = _alternate(runs, node_b, copy)
    finally:
        for path in cleanup:
            remove_tree(path)
    ready, copied = Stats.of(ready_s), Stats.of(copy_s)
    return {
        "node_b_ready_s": ready.to_dict(),
        "plain_copy_s": copied.to_dict(),
        "node_b_vs_plain_copy": None if copied.median <= 0 else ready.median / copied.median,
    }


def measure_fleet(
    store: FilesystemHostWeightStore,
    identity: WeightArtifactIdentity,
    url: str,
    options: dict[str, Any],
    *,
    workdir: Path,
    runs: int,
) -> dict[str, JsonValue]:
    """Push vs plain upload and node B's time to ready vs a plain copy, for one remote."""
    return {
        **_push_vs_upload(store, identity.key, url, options, runs),
        **_node_b_vs_copy(identity, url, options, workdir, runs),
    }

"""The benchmark's setup, done once in the runner's process before any row is measured.

An FP32 Flux checkpoint on disk (a folder, and the same files hard-linked into a Hugging Face
cache snapshot, so the cold rows run from both), an artifact published into a `/dev/shm`
domain and, where a huge-page tmpfs can be mounted, into a domain there; the artifact's
final-layout BF16 tensors written in each peer's format on disk, plus a safetensors copy on
each tmpfs for the bare-mmap-views reference; the artifact pushed to each remote; every
input file read once so the page cache is hot.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import torch

from host_weight_runtime import (
    FilesystemHostWeightStore,
    HostWeightRuntime,
    HostWeightRuntimeConfig,
    RuntimeMode,
    StorageClass,
    WeightArtifactIdentity,
    WeightManifest,
)
from host_weight_runtime.diffusion import PrewarmResult, load_component, prewarm_component

from ..synthetic_models import TRANSFORMER_SUBFOLDER, save_flux_pipeline_folder, save_hub_snapshot
from .peers import PEERS, Peer, PeerFormat, peer_file_name, peer_unavailable_reason, write_peer_files
from .remote import RemoteSetup, remote_targets
from .row_names import HUB_REPO_ID

__all__ = ["SHM", "BenchSetup", "huge_tmpfs", "prepare_setup", "published_identity", "unavailable_peers"]

GIB = 1 << 30
MIB = 1 << 20
SHM = Path("/dev/shm")


@dataclass(frozen=True, slots=True)
class BenchSetup:
    """Where everything the rows load lives, and what setting it up found."""

    disk_dir: Path
    shm_dir: Path
    pipeline: Path
    checkpoint_files: tuple[Path, ...]
    checkpoint_bytes: int
    hub_cache: Path
    hub_blobs: tuple[Path, ...]
    warm_root: Path
    warm_store: FilesystemHostWeightStore
    prewarm: PrewarmResult
    huge_root: Path | None
    huge_status: str
    huge_page_backed: int
    peer_files: dict[PeerFormat, Path]
    unavailable_peers: dict[str, str]
    views_shm: Path
    views_huge: Path | None
    remotes: RemoteSetup
    remote_files: tuple[Path, ...]
    worker_log: IO[bytes]


def prepare_setup(
    disk_dir: Path,
    shm_dir: Path,
    *,
    size_gib: float,
    huge_pages: bool,
    cleanup: contextlib.ExitStack,
    say: Callable[[str], None],
) -> BenchSetup:
    """Build everything in `disk_dir` and `shm_dir`; `cleanup` unmounts, closes and stops what this starts."""
    bf16_bytes = int(size_gib * GIB)
    pipeline = disk_dir / "pipeline"
    say(f"setup: writing a {2 * bf16_bytes / GIB:.2f} GiB FP32 Flux checkpoint to {pipeline}")
    save_flux_pipeline_folder(pipeline, target_bytes=2 * bf16_bytes, seed=0)
    checkpoint_files = _files_under(pipeline / TRANSFORMER_SUBFOLDER)
    for path in checkpoint_files:
        with path.open("rb") as handle:
            os.fsync(handle.fileno())
    hub_cache = disk_dir / "hub-cache"
    say(f"setup: hard-linking the checkpoint into a Hugging Face cache snapshot of {HUB_REPO_ID} in {hub_cache}")
    # Each file is hashed once, here, for its blob name; the hard links share the folder's bytes and pages.
    hub_snapshot = save_hub_snapshot(hub_cache, HUB_REPO_ID, pipeline, hard_link=True)

    warm_root = shm_dir / "domain"
    say(f"setup: publishing the artifact into {warm_root}")
    prewarm = prewarm_component(pipeline, subfolder=TRANSFORMER_SUBFOLDER, runtime=_runtime(warm_root))
    huge_mount, huge_status = cleanup.enter_context(
        huge_tmpfs(disk_dir, 2 * prewarm.total_bytes + 256 * MIB, huge_pages)
    )
    say(f"setup: huge-page tmpfs {huge_status}")
    huge_root = None if huge_mount is None else huge_mount / "domain"
    huge_bytes_before = _huge_page_bytes()
    if huge_root is not None:
        prewarm_component(pipeline, subfolder=TRANSFORMER_SUBFOLDER, runtime=_runtime(huge_root))
    huge_page_backed = _huge_page_bytes() - huge_bytes_before

    say("setup: writing the final-layout BF16 tensors in each peer's format")
    state_dict = _final_layout_state_dict(pipeline, warm_root)
    peer_dir = disk_dir / "peers"
    peer_dir.mkdir()
    worker_log = cleanup.enter_context((disk_dir / "workers.log").open("wb"))
    unavailable_reasons = unavailable_peers(PEERS)
    formats = {peer.file_format for peer in PEERS if peer.name not in unavailable_reasons}
    peer_files = write_peer_files(state_dict, peer_dir, sorted(formats, key=lambda f: f.value))
    del state_dict
    views_shm = _views_copy(shm_dir / "views", peer_files)
    views_huge = None if huge_mount is None else _views_copy(huge_mount / "views", peer_files)
    warm_store = FilesystemHostWeightStore(warm_root)
    remotes = cleanup.enter_context(remote_targets(warm_store, prewarm.identity_key, disk_dir, say))
    remote_files = _files_under(disk_dir / "remote")
    _read_through(checkpoint_files + list(peer_files.values()) + remote_files)
    return BenchSetup(
        disk_dir=disk_dir,
        shm_dir=shm_dir,
        pipeline=pipeline,
        checkpoint_files=tuple(checkpoint_files),
        checkpoint_bytes=sum(path.stat().st_size for path in checkpoint_files),
        hub_cache=hub_cache,
        hub_blobs=tuple(sorted(path.resolve() for path in (hub_snapshot / TRANSFORMER_SUBFOLDER).iterdir())),
        warm_root=warm_root,
        warm_store=warm_store,
        prewarm=prewarm,
        huge_root=huge_root,
        huge_status=huge_status,
        huge_page_backed=huge_page_backed,
        peer_files=peer_files,
        unavailable_peers=unavailable_reasons,
        views_shm=views_shm,
        views_huge=views_huge,
        remotes=remotes,
        remote_files=tuple(remote_files),
        worker_log=worker_log,
    )


def _views_copy(folder: Path, peer_files: dict[PeerFormat, Path]) -> Path:
    """A safetensors copy of the final-layout tensors on a tmpfs, for the bare-mmap-views rows."""
    folder.mkdir()
    shutil.copyfile(peer_files[PeerFormat.SAFETENSORS], folder / peer_file_name(PeerFormat.SAFETENSORS))
    return folder


def _files_under(folder: Path) -> list[Path]:
    return sorted(path for path in folder.rglob("*") if path.is_file())


def _read_through(paths: Sequence[Path]) -> None:
    """Read every byte once so the page cache is hot."""
    for path in paths:
        with path.open("rb") as handle:
            while handle.read(64 * MIB):
                pass


@contextlib.contextmanager
def huge_tmpfs(parent: Path, size_bytes: int, wanted: bool) -> Iterator[tuple[Path | None, str]]:
    """Mount a tmpfs with huge=always for the run where this process may; yield (mountpoint, what happened)."""
    if not wanted:
        yield None, "not asked for (--no-huge-pages)"
        return
    if os.geteuid() != 0:
        yield None, "not mounted: mounting a tmpfs needs root (CAP_SYS_ADMIN); see the README's huge-page section"
        return
    mountpoint = parent / "huge-tmpfs"
    mountpoint.mkdir()
    options = f"size={size_bytes},huge=always,mode=0700"
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "hwr-bench-huge", str(mountpoint)],
        check=False,
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        yield None, f"not mounted: mount -o {options} failed: {done.stderr.strip() or done.returncode}"
        return
    try:
        yield mountpoint, f"mounted tmpfs -o {options} at {mountpoint}"
    finally:
        subprocess.run(["umount", str(mountpoint)], check=False, capture_output=True)


def unavailable_peers(peers: Sequence[Peer]) -> dict[str, str]:
    """Each peer that cannot be imported here, with the reason: listed in the report, never dropped silently."""
    return {peer.name: reason for peer in peers if (reason := peer_unavailable_reason(peer)) is not None}


def _runtime(root: Path) -> HostWeightRuntime:
    config = HostWeightRuntimeConfig(mode=RuntimeMode.PREFERRED, root=root, storage_class=StorageClass.TMPFS)
    return HostWeightRuntime(config)


def _final_layout_state_dict(pipeline: Path, root: Path) -> dict[str, torch.Tensor]:
    """The published artifact's tensors under the model's own state-dict names (a copy, so the lease can close)."""
    with load_component(pipeline, subfolder=TRANSFORMER_SUBFOLDER, runtime=_runtime(root)) as loaded:
        if loaded.outcome.value != "local_hit":
            raise RuntimeError(f"setup expected a local hit on {root}, got {loaded.summary()}")
        return {name: tensor.detach().clone() for name, tensor in loaded.model.state_dict().items()}


def published_identity(store: FilesystemHostWeightStore, key: str) -> WeightArtifactIdentity:
    """The identity of a published artifact, read from its manifest."""
    return WeightManifest.from_bytes((store.layout.artifact_dir(key) / "manifest.json").read_bytes()).identity


def _huge_page_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("ShmemHugePages:"):
            return int(line.split()[1]) * 1024
    return 0



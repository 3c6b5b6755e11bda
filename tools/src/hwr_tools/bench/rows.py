"""The rows of `hwr bench`: what each one loads, from where, and how it is measured."""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from host_weight_runtime import FilesystemHostWeightStore

from ..common import JsonValue
from ..synthetic_models import TRANSFORMER_SUBFOLDER
from .machine import filesystem_type
from .measure import LoadKind, RowSpec
from .peers import PEERS, REFERENCE_PEERS, PeerFormat, peer_file_name, peer_named
from .row_names import (
    CANONICAL,
    CANONICAL_HUB,
    COLD_BACKGROUND,
    COLD_BACKGROUND_HUB,
    COLD_PUBLISH,
    COLD_PUBLISH_HUB,
    COLD_STREAM,
    COLD_STREAM_HUB,
    HUB_REPO_ID,
    VIEWS_HUGE,
    VIEWS_POPULATE_HUGE,
    VIEWS_POPULATE_SHM,
    VIEWS_SHM,
    VIEWS_THREAD_HUGE,
    VIEWS_THREAD_SHM,
    WARM_HUGE,
    WARM_SHM,
    WARM_VERIFY_OFF,
    WARM_VERIFY_ON,
)
from .setup import BenchSetup

__all__ = ["BenchRow", "BenchRows", "bench_rows"]


@dataclass(frozen=True, slots=True)
class BenchRow:
    """One row: the spec its workers load, and how the runner measures it."""

    spec: RowSpec
    description: str
    disk_files: tuple[Path, ...]  # what a cold-cache run evicts first
    fresh_domain: bool = False  # a cold row: every run gets a new, empty domain
    memory_group: bool = True  # measured as 4 concurrent held workers too
    cold_cache: bool = True  # measured with the page cache cold too
    before_run: Callable[[], None] | None = None  # run before each measured run (untimed)
    baseline: str = CANONICAL  # the row its "vs canonical" ratio and goals compare with


@dataclass(frozen=True, slots=True)
class BenchRows:
    """Every row this machine can measure, with why the others are not."""

    rows: list[BenchRow]
    not_measured: dict[str, JsonValue]  # row name: why it was left out
    unavailable_peers: dict[str, JsonValue]  # peer name: why it cannot be imported here


def bench_rows(setup: BenchSetup, *, remote_s3_row: bool) -> BenchRows:
    """The canonical, cold, hub-cache, warm, bare-views, remote and peer rows, in the order they are measured."""
    pipeline = setup.pipeline
    hub_cache = setup.hub_cache
    warm_root = setup.warm_root
    checkpoint_files = setup.checkpoint_files
    hub_blobs = setup.hub_blobs
    warm_store = setup.warm_store
    prewarm = setup.prewarm
    huge_root = setup.huge_root
    views_shm = setup.views_shm
    views_huge = setup.views_huge
    remotes = setup.remotes
    remote_files = setup.remote_files
    peer_files = setup.peer_files
    unavailable_reasons = setup.unavailable_peers

    def spec(name: str, kind: LoadKind, **extra: Any) -> RowSpec:
        return RowSpec(name=name, kind=kind, pipeline=str(pipeline), subfolder=TRANSFORMER_SUBFOLDER, **extra)

    def hub_spec(name: str, kind: LoadKind, **extra: Any) -> RowSpec:
        return RowSpec(
            name=name,
            kind=kind,
            pipeline=HUB_REPO_ID,
            subfolder=TRANSFORMER_SUBFOLDER,
            cache_dir=str(hub_cache),
            **extra,
        )

    checkpoint = tuple(checkpoint_files)
    rows: list[BenchRow] = [
        BenchRow(
            spec(CANONICAL, LoadKind.CANONICAL),
            "diffusers from_pretrained(torch_dtype=bfloat16), FP32 checkpoint",
            checkpoint,
        ),
        BenchRow(
            spec(COLD_PUBLISH, LoadKind.HWR, root=""),
            "load_component on an empty domain: canonical load, then publication (first worker on a node)",
            checkpoint,
            fresh_domain=True,
            memory_group=False,
        ),
        BenchRow(
            spec(COLD_BACKGROUND, LoadKind.HWR, root="", publish_in_background=True),
            "load_component(publish_in_background=True) on an empty domain: canonical load, artifact on a thread",
            checkpoint,
            fresh_domain=True,
            memory_group=False,
        ),
        BenchRow(
            spec(COLD_STREAM, LoadKind.HWR, root="", stream_on_miss=True),
            "load_component(stream_on_miss=True) on an empty domain: streaming producer, then restore",
            checkpoint,
            fresh_domain=True,
            memory_group=False,
        ),
        *_hub_rows(hub_spec, hub_blobs),
        BenchRow(
            spec(WARM_SHM, LoadKind.HWR, root=str(warm_root)), "load_component hit, zero-copy restore", checkpoint
        ),
        BenchRow(
            spec(WARM_VERIFY_OFF, LoadKind.HWR, root=str(warm_root), background_verify="off"),
            "load_component hit with HWR_BACKGROUND_VERIFY=off",
            checkpoint,
            memory_group=False,
            cold_cache=False,
        ),
        BenchRow(
            spec(WARM_VERIFY_ON, LoadKind.HWR, root=str(warm_root), background_verify="once"),
            "load_component hit that starts the background full verification (its record removed before "
            "each run); the verification runs on a thread while the worker touches its weights",
            checkpoint,
            memory_group=False,
            cold_cache=False,
            before_run=functools.partial(_forget_verification, warm_store, prewarm.identity_key),
        ),
    ]
    if huge_root is not None:
        rows.append(
            BenchRow(
                spec(WARM_HUGE, LoadKind.HWR, root=str(huge_root)),
                "load_component hit on a tmpfs mounted huge=always",
                checkpoint,
                cold_cache=False,
            )
        )
    for folder, where, names in (
        (views_shm, "the same tmpfs (/dev/shm)", (VIEWS_SHM, VIEWS_POPULATE_SHM, VIEWS_THREAD_SHM)),
        (views_huge, "the huge-page tmpfs", (VIEWS_HUGE, VIEWS_POPULATE_HUGE, VIEWS_THREAD_HUGE)),
    ):
        if folder is None:
            continue
        views_file = str(folder / peer_file_name(PeerFormat.SAFETENSORS))
        bare = ("safetensors-mmap-views", *(reference.name for reference in REFERENCE_PEERS))
        for name, bare_peer in zip(names, bare, strict=True):
            rows.append(
                BenchRow(
                    spec(name, LoadKind.PEER, peer=bare_peer, peer_file=views_file),
                    f"bare zero-copy mmap views of the same bytes on {where}, assigned into the skeleton: "
                    f"{peer_named(bare_peer).description}",
                    (),
                    cold_cache=False,
                )
            )
    rows_not_measured: dict[str, JsonValue] = {}
    for target in remotes.targets:
        if target.kind == "s3" and not remote_s3_row:
            rows_not_measured[target.row] = "--quick times node B over file:// only; S3 import throughput is measured"
            continue
        rows.append(
            BenchRow(
                spec(
                    target.row,
                    LoadKind.HWR,
                    root="",
                    remote_url=target.url,
                    remote_options=target.storage_options,
                ),
                f"load_component on an empty domain (node B) with the remote {target.url}: import the exact "
                "artifact node A pushed (every byte re-hashed, published atomically), then restore from it",
                tuple(remote_files) if target.kind == "file" else (),
                fresh_domain=True,
                memory_group=False,
                cold_cache=target.kind == "file",
            )
        )
    unavailable: dict[str, JsonValue] = {}
    for peer in PEERS:
        if peer.name in unavailable_reasons:
            unavailable[peer.name] = unavailable_reasons[peer.name]
            continue
        path = peer_files[peer.file_format]
        rows.append(
            BenchRow(
                spec(peer.name, LoadKind.PEER, peer=peer.name, peer_file=str(path)),
                f"{peer.description} (file on {filesystem_type(path)}), assigned into the skeleton",
                (path, *checkpoint),
            )
        )

    return BenchRows(rows, rows_not_measured, unavailable)


def _hub_rows(hub_spec: Callable[..., RowSpec], blobs: tuple[Path, ...]) -> list[BenchRow]:
    """The cold rows again, loaded by repo id from the hub-cache snapshot, each against canonical from there.

    A validated snapshot's blob names are the files' SHA-256, so the first worker on a node
    hashes nothing: the difference to the folder rows is the checkpoint hashing.
    """
    hub = "from the Hugging Face cache snapshot by repo id (content ids from blob names, nothing hashed)"
    return [
        BenchRow(
            hub_spec(CANONICAL_HUB, LoadKind.CANONICAL),
            f"diffusers from_pretrained(repo id, cache_dir=..., torch_dtype=bfloat16) {hub}",
            blobs,
            memory_group=False,
            baseline=CANONICAL_HUB,
        ),
        BenchRow(
            hub_spec(COLD_PUBLISH_HUB, LoadKind.HWR, root=""),
            f"load_component on an empty domain {hub}: canonical load, then publication",
            blobs,
            fresh_domain=True,
            memory_group=False,
            baseline=CANONICAL_HUB,
        ),
        BenchRow(
            hub_spec(COLD_BACKGROUND_HUB, LoadKind.HWR, root="", publish_in_background=True),
            f"load_component(publish_in_background=True) on an empty domain {hub}: canonical load, artifact "
            "on a thread",
            blobs,
            fresh_domain=True,
            memory_group=False,
            baseline=CANONICAL_HUB,
        ),
        BenchRow(
            hub_spec(COLD_STREAM_HUB, LoadKind.HWR, root="", stream_on_miss=True),
            f"load_component(stream_on_miss=True) on an empty domain {hub}: streaming producer, then restore",
            blobs,
            fresh_domain=True,
            memory_group=False,
            baseline=CANONICAL_HUB,
        ),
    ]


def _forget_verification(store: FilesystemHostWeightStore, key: str) -> None:
    """Remove the artifact's background-verification record, so the next hit verifies it again."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(store.layout.verified_marker(key))

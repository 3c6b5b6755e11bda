"""`hwr gc` and the store's gc plan: plan then execute, never touching what a lease or a live build holds (S02)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from host_weight_runtime import GcItemKind, GcItemStatus, GcKeepReason, GcReason
from host_weight_runtime.cli import main
from host_weight_runtime.cli.gc import parse_bytes, parse_duration
from host_weight_runtime.filesystem._fsutil import tree_bytes
from host_weight_runtime.filesystem.store import FilesystemHostWeightStore

from . import _ops_children
from ._ops_children import model_identity
from .support import recv_within
from .test_eviction import NS, build_and_close, child, keys, published, set_last_use


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    """Every path under `root` with its size and mtime: what "changes nothing" compares."""
    found: dict[str, tuple[int, int]] = {}
    for directory, subdirs, files in os.walk(root):
        for name in subdirs + files:
            info = os.lstat(Path(directory) / name)
            found[str(Path(directory) / name)] = (info.st_size, info.st_mtime_ns)
    return found


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict[str, object]]:
    status = main(list(argv))
    out = capsys.readouterr().out
    return status, json.loads(out)


@pytest.fixture
def aged_domain(tmp_path: Path) -> FilesystemHostWeightStore:
    """Four published models, last used 400, 300, 200 and 100 seconds ago."""
    store = FilesystemHostWeightStore(tmp_path / "domain")
    now = time.time_ns()
    for index in range(4):
        build_and_close(store, index)
    for index in range(4):
        set_last_use(store, index, now - (400 - 100 * index) * NS)
    return store


def test_gc_dry_run_changes_nothing_and_yes_frees_exactly_the_plan(
    aged_domain: FilesystemHostWeightStore, capsys: pytest.CaptureFixture[str]
) -> None:
    """`hwr gc --dry-run` changes nothing; `--yes` then frees exactly what the plan listed, least recently used
    first, and reports the bytes freed."""
    store = aged_domain
    root = str(store.root)
    one = tree_bytes(store.layout.artifact_dir(model_identity(0).key))
    target = str(2 * one)
    before = snapshot(store.root)
    status, plan = run_json(capsys, "gc", "--root", root, "--max-bytes", target, "--dry-run", "--json")
    assert status == 0 and plan["dry_run"] is True
    assert snapshot(store.root) == before
    items = plan["items"]
    assert isinstance(items, list)
    assert [item["key"] for item in items] == [model_identity(0).key, model_identity(1).key]
    assert {item["reason"] for item in items} == {GcReason.LEAST_RECENTLY_USED.value}
    assert plan["bytes_to_free"] == 2 * one

    status, done = run_json(capsys, "gc", "--root", root, "--max-bytes", target, "--yes", "--json")
    assert status == 0
    assert done["freed_bytes"] == plan["bytes_to_free"]
    results = done["results"]
    assert isinstance(results, list)
    assert [(r["key"], r["status"]) for r in results] == [(item["key"], "removed") for item in items]
    assert published(store) == keys(2, 3)
    assert tree_bytes(store.root / "artifacts") <= 2 * one


def test_s02_gc_never_plans_or_removes_a_leased_artifact(aged_domain: FilesystemHostWeightStore) -> None:
    """S02: an artifact a live process leases is kept (listed as leased), whatever its age; a lease taken between
    plan and execute keeps its artifact too (status LEASED) and nothing of it changes."""
    store = aged_domain
    with child(_ops_children.hold_lease, str(store.root), 0) as (conn, _):
        assert recv_within(conn)["status"] == "hit"
        plan = store.plan_gc(max_bytes=0)
        planned = {item.key for item in plan.items if item.kind is GcItemKind.ARTIFACT}
        assert planned == keys(1, 2, 3)
        assert [(kept.key, kept.reason) for kept in plan.kept] == [(model_identity(0).key, GcKeepReason.LEASED)]

        older = store.plan_gc(older_than_s=0.0)
        assert model_identity(0).key not in {item.key for item in older.items}

        late = store.lookup(model_identity(1), validation=_ops_children.META)  # a lease after planning
        assert late.lease is not None
        leased_dir = store.layout.artifact_dir(model_identity(1).key)
        before = snapshot(leased_dir)
        result = store.execute_gc(plan)
        by_key = {r.item.key: r.status for r in result.results}
        assert by_key[model_identity(1).key] is GcItemStatus.LEASED
        assert by_key[model_identity(2).key] is GcItemStatus.REMOVED
        assert snapshot(leased_dir) == before
        late.lease.close()
        conn.send("close")
        assert recv_within(conn) == "closed"
    assert published(store) == keys(0, 1)
    assert result.freed_bytes == sum(r.freed_bytes for r in result.results if r.status is GcItemStatus.REMOVED)


def test_gc_removes_dead_builders_leftovers_but_not_a_live_build(tmp_path: Path) -> None:
    """A build whose process was SIGKILLed leaves a staging directory gc removes; a live build's staging (its process
    alive and holding the build lock) is kept and its build then completes."""
    root = tmp_path / "domain"
    store = FilesystemHostWeightStore(root)
    with child(_ops_children.build_model, str(root), 1, crash_at="build.staging_created") as (_c, process):
        process.join(120)  # type: ignore[attr-defined]
        assert process.exitcode == -9  # type: ignore[attr-defined]
    (dead,) = store.layout.staging_dirs(model_identity(1).key)
    with child(_ops_children.build_model, str(root), 2, pause_at=("build.staging_created",)) as (live, _):
        assert recv_within(live) == "build.staging_created"
        (running,) = store.layout.staging_dirs(model_identity(2).key)
        plan = store.plan_gc()
        assert [(item.kind, item.reason, item.path) for item in plan.items] == [
            (GcItemKind.LEFTOVER, GcReason.DEAD_BUILDER, str(dead))
        ]
        assert [(kept.path, kept.reason) for kept in plan.kept] == [(str(running), GcKeepReason.ACTIVE_BUILD)]
        result = store.execute_gc(plan)
        assert [r.status for r in result.results] == [GcItemStatus.REMOVED]
        assert not dead.exists() and running.exists()
        live.send("go")
        assert recv_within(live)["status"] == "built"
    assert published(store) == keys(2)
    assert os.listdir(store.layout.tmp) == []


def test_gc_removes_stale_deny_markers_and_old_quarantine_only(tmp_path: Path) -> None:
    """A deny marker without its artifact and a quarantined copy older than the retention are freed; a denied
    artifact that is still published keeps its marker, and a fresh quarantined copy stays."""
    store = FilesystemHostWeightStore(tmp_path / "domain")
    build_and_close(store, 0)
    layout = store.layout
    stale_key, kept_key = model_identity(5).key, model_identity(0).key
    for key in (stale_key, kept_key):
        layout.deny_marker(key).write_text("{}")
    old = layout.quarantine / f"{stale_key}.{time.time_ns() - 2 * 86400 * NS}.abcd"
    fresh = layout.quarantine / f"{stale_key}.{time.time_ns()}.ef01"
    for copy in (old, fresh):
        copy.mkdir()
        (copy / "payload.safetensors").write_bytes(b"x" * 100)
    plan = store.plan_gc()
    assert sorted((item.kind, item.path) for item in plan.items) == sorted(
        [(GcItemKind.DENY_MARKER, str(layout.deny_marker(stale_key))), (GcItemKind.QUARANTINED, str(old))]
    )
    result = store.execute_gc(plan)
    assert result.ok and result.freed_bytes == plan.bytes_to_free == 100 + 2
    assert not old.exists() and fresh.exists()
    assert not layout.deny_marker(stale_key).exists() and layout.deny_marker(kept_key).exists()
    assert published(store) == keys(0)


def test_gc_refuses_to_remove_unattended_without_yes(
    aged_domain: FilesystemHostWeightStore, capsys: pytest.CaptureFixture[str]
) -> None:
    """Like cleanup: without a terminal to ask on, gc needs --yes (or --dry-run); usage errors exit 2."""
    before = snapshot(aged_domain.root)
    assert main(["gc", "--root", str(aged_domain.root), "--max-bytes", "0"]) == 2
    assert "--yes" in capsys.readouterr().err
    assert snapshot(aged_domain.root) == before


@pytest.mark.parametrize(
    ("text", "seconds"), [("90", 90.0), ("90s", 90.0), ("30m", 1800.0), ("12h", 43200.0), ("7d", 604800.0)]
)
def test_gc_durations(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize(("text", "nbytes"), [("1000", 1000), ("2K", 2048), ("20G", 20 * 1024**3), ("1.5MiB", 1572864)])
def test_gc_sizes(text: str, nbytes: int) -> None:
    assert parse_bytes(text) == nbytes


def test_inspect_shows_last_use_and_live_leases(
    aged_domain: FilesystemHostWeightStore, capsys: pytest.CaptureFixture[str]
) -> None:
    """`hwr inspect --json` reports each artifact's last use and its live leases across processes."""
    store = aged_domain
    with child(_ops_children.hold_lease, str(store.root), 3) as (conn, _):
        assert recv_within(conn)["status"] == "hit"
        status, snapshot = run_json(capsys, "inspect", "--root", str(store.root), "--json")
        conn.send("close")
        assert recv_within(conn) == "closed"
    assert status == 0
    entries = snapshot["artifacts"]
    assert isinstance(entries, list)
    by_key = {entry["key"]: entry for entry in entries}
    assert {key: entry["live_leases"] for key, entry in by_key.items()} == {
        model_identity(index).key: 1 if index == 3 else 0 for index in range(4)
    }
    used = [by_key[model_identity(index).key]["last_used_ns"] for index in range(4)]
    assert used[0] < used[1] < used[2] < used[3]

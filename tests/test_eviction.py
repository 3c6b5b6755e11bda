"""LRU eviction that honours leases, the usage ledger, and the capacity lock between racing builders (S18, S16)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing.connection import Connection, wait
from pathlib import Path

import pytest

from host_weight_runtime.config import CapacityPolicy, EvictionPolicy, HostWeightRuntimeConfig
from host_weight_runtime.failures import FailureCode
from host_weight_runtime.filesystem._fsutil import tree_bytes
from host_weight_runtime.filesystem.store import FilesystemHostWeightStore
from host_weight_runtime.outcomes import ResolutionOutcome, StoreResult, StoreStatus
from host_weight_runtime.protocols import BuildRequest
from host_weight_runtime.runtime import HostWeightRuntime

from . import _ops_children
from ._ops_children import META, model_identity, model_producer
from .support import SPAWN, recv_within

NS = 1_000_000_000


@contextmanager
def child(target: object, *args: object, **kwargs: object) -> Iterator[tuple[Connection, object]]:
    """A spawned child running `target(*args, conn, **kwargs)`; always reaped (killed if it outlives the test)."""
    ours, theirs = SPAWN.Pipe()
    process = SPAWN.Process(target=target, args=(*args, theirs), kwargs=kwargs, daemon=True)
    process.start()
    theirs.close()
    try:
        yield ours, process
    finally:
        process.join(120)
        if process.is_alive():
            process.kill()
            process.join(10)
        ours.close()


@pytest.fixture(scope="module")
def artifact_bytes(tmp_path_factory: pytest.TempPathFactory) -> int:
    """Bytes one test model's artifact occupies (every model has the same shapes)."""
    store = FilesystemHostWeightStore(tmp_path_factory.mktemp("probe") / "domain")
    result = build(store, 0)
    assert result.lease is not None
    result.lease.close()
    return tree_bytes(store.layout.artifact_dir(model_identity(0).key))


def build(store: FilesystemHostWeightStore, index: int) -> StoreResult:
    return store.get_or_build(
        BuildRequest(model_identity(index)), model_producer(index), validation=META, deadline=time.monotonic() + 60
    )


def build_and_close(store: FilesystemHostWeightStore, index: int) -> None:
    result = build(store, index)
    assert result.status is StoreStatus.BUILT, result.failure
    assert result.lease is not None
    result.lease.close()


def published(store: FilesystemHostWeightStore) -> set[str]:
    return set(os.listdir(store.layout.artifacts))


def set_last_use(store: FilesystemHostWeightStore, index: int, ns: int) -> None:
    """Pretend model `index` was last leased at `ns` (the ledger is the lock file's mtime)."""
    os.utime(store.layout.artifact_lock(model_identity(index).key), ns=(ns, ns))


def keys(*indices: int) -> set[str]:
    return {model_identity(index).key for index in indices}


def assert_nothing_partial(store: FilesystemHostWeightStore) -> None:
    assert os.listdir(store.layout.tmp) == []
    assert os.listdir(store.layout.quarantine) == []
    assert store.layout.eviction_dirs() == []


def test_s18_capped_domain_evicts_least_recently_used_unleased_artifacts(tmp_path: Path, artifact_bytes: int) -> None:
    """S18: filling a capped domain model by model evicts the least recently used unleased artifact each time;
    artifacts leased by live processes survive whatever their age; when every artifact is leased the build is the
    typed, retryable STORE_LIMIT_EXCEEDED; every later resolve is a hit or a typed miss and nothing partial remains."""
    root = tmp_path / "domain"
    limit = 3 * artifact_bytes + artifact_bytes // 2
    store = FilesystemHostWeightStore(root, capacity=CapacityPolicy(max_store_bytes=limit))
    for index in range(3):
        build_and_close(store, index)
    now = time.time_ns()
    for index, age_s in ((0, 400), (1, 300), (2, 200)):
        set_last_use(store, index, now - age_s * NS)

    with (
        child(_ops_children.hold_lease, str(root), 0) as (lease_0, _),
        child(_ops_children.hold_lease, str(root), 2) as (lease_2, _),
    ):
        assert recv_within(lease_0)["status"] == "hit"
        build_and_close(store, 3)  # model 0 is the oldest but leased: model 1 goes
        assert published(store) == keys(0, 2, 3)
        assert recv_within(lease_2)["status"] == "hit"
        build_and_close(store, 4)  # 0 and 2 leased; 3 is the only unleased one
        assert published(store) == keys(0, 2, 4)
        build_and_close(store, 5)
        assert published(store) == keys(0, 2, 5)
        assert tree_bytes(root / "artifacts") + tree_bytes(root / "tmp") <= limit

        held = store.lookup(model_identity(5), validation=META)
        assert held.lease is not None
        try:
            refused = build(store, 6)  # every artifact leased: nothing can go
            assert refused.status is StoreStatus.FAILED and refused.failure is not None
            assert refused.failure.code is FailureCode.STORE_LIMIT_EXCEEDED and refused.failure.retryable
            details = refused.failure.details.to_value()
            assert isinstance(details, dict)
            assert details["leased_artifacts"] == 3 and details["evicted_artifacts"] == 0
            assert "HWR_MAX_STORE_BYTES" in refused.failure.message
            assert published(store) == keys(0, 2, 5)
        finally:
            held.lease.close()
        for conn in (lease_0, lease_2):
            conn.send("close")
            assert recv_within(conn) == "closed"

    runtime = HostWeightRuntime(HostWeightRuntimeConfig(root=root))
    outcomes = {}
    for index in range(7):
        resolution = runtime.resolve(model_identity(index))
        outcomes[index] = resolution.outcome
        assert resolution.report.failure is None  # a hit, or a clean (typed) miss: never INVALID or FAILED
        if resolution.lease is not None:
            resolution.lease.close()
    assert {i for i, o in outcomes.items() if o is ResolutionOutcome.LOCAL_HIT} == {0, 2, 5}
    assert {i for i, o in outcomes.items() if o is ResolutionOutcome.CANONICAL_FALLBACK} == {1, 3, 4, 6}
    assert_nothing_partial(store)


def test_lease_records_last_use_without_touching_the_artifact(tmp_path: Path) -> None:
    """The usage ledger: opening and closing a lease moves the key's last use; the artifact's files are untouched."""
    store = FilesystemHostWeightStore(tmp_path / "domain")
    build_and_close(store, 0)
    artifact_dir = store.layout.artifact_dir(model_identity(0).key)
    before = {name: os.stat(artifact_dir / name).st_mtime_ns for name in os.listdir(artifact_dir)}
    old = time.time_ns() - 3600 * NS
    set_last_use(store, 0, old)
    result = store.lookup(model_identity(0), validation=META)
    assert result.lease is not None
    opened = store.inspect_artifact(model_identity(0).key)
    assert opened.last_used_ns is not None and opened.last_used_ns > old
    assert opened.live_leases == 1
    set_last_use(store, 0, old)
    result.lease.close()
    closed = store.inspect_artifact(model_identity(0).key)
    assert closed.last_used_ns is not None and closed.last_used_ns > old
    assert closed.live_leases == 0
    assert {name: os.stat(artifact_dir / name).st_mtime_ns for name in os.listdir(artifact_dir)} == before


def test_eviction_none_only_refuses(tmp_path: Path, artifact_bytes: int) -> None:
    """S18: with HWR_EVICTION=none a full domain keeps its artifacts and the build fails typed, saying eviction is off."""
    store = FilesystemHostWeightStore(
        tmp_path / "domain",
        capacity=CapacityPolicy(max_store_bytes=artifact_bytes + artifact_bytes // 2),
        eviction=EvictionPolicy.NONE,
    )
    build_and_close(store, 0)
    refused = build(store, 1)
    assert refused.status is StoreStatus.FAILED and refused.failure is not None
    assert refused.failure.code is FailureCode.STORE_LIMIT_EXCEEDED and refused.failure.retryable
    assert "HWR_EVICTION=none" in refused.failure.message
    assert published(store) == keys(0)
    assert_nothing_partial(store)


def test_s16_sigkill_between_eviction_move_and_delete_leaves_nothing_visible(
    tmp_path: Path, artifact_bytes: int
) -> None:
    """S16: a builder killed after moving an evicted artifact out of artifacts/ (before deleting it) leaves no
    half-visible artifact: the evicted key is a clean miss, and the next resolve builds and removes the leftover."""
    root = tmp_path / "domain"
    store = FilesystemHostWeightStore(
        root, capacity=CapacityPolicy(max_store_bytes=artifact_bytes + artifact_bytes // 2)
    )
    build_and_close(store, 0)
    with child(_ops_children.build_model, str(root), 1, crash_at="eviction.after_move") as (_conn, process):
        process.join(120)  # type: ignore[attr-defined]
        assert process.exitcode == -9  # type: ignore[attr-defined]
    assert published(store) == set()  # out of artifacts/ before the crash: invisible, not partial
    assert len(store.layout.eviction_dirs()) == 1  # the leftover, invisible to readers
    assert store.lookup(model_identity(0), validation=META).status is StoreStatus.MISS

    runtime = HostWeightRuntime(HostWeightRuntimeConfig(root=root, capacity=None))
    resolution = runtime.resolve(model_identity(1), model_producer(1))
    assert resolution.outcome is ResolutionOutcome.LOCAL_PRODUCTION, resolution.report.failure
    assert resolution.lease is not None
    resolution.lease.close()
    assert published(store) == keys(1)
    assert_nothing_partial(store)


def test_s18_two_builders_racing_for_the_last_bytes_never_exceed_the_limit(tmp_path: Path, artifact_bytes: int) -> None:
    """S18: two builders (processes) paused together at the reservation point race for room for one artifact:
    the store never exceeds max_store_bytes on disk (measured while the winner holds its reservation and after),
    one builds, the other fails typed and retryable, and nothing of the loser remains."""
    root = tmp_path / "domain"
    limit = artifact_bytes + artifact_bytes // 2
    store = FilesystemHostWeightStore(root, capacity=CapacityPolicy(max_store_bytes=limit))
    points = ("capacity.before_reserve", "capacity.reserved")

    def on_disk() -> int:
        return tree_bytes(root / "artifacts") + tree_bytes(root / "tmp") + tree_bytes(root / "quarantine")

    with (
        child(_ops_children.build_model, str(root), 1, pause_at=points, hold=True) as (one, _),
        child(_ops_children.build_model, str(root), 2, pause_at=points, hold=True) as (two, _),
    ):
        assert recv_within(one) == "capacity.before_reserve"
        assert recv_within(two) == "capacity.before_reserve"
        assert on_disk() == 0
        one.send("go")
        two.send("go")
        ready = wait([one, two], timeout=120)
        assert len(ready) >= 1
        winner = ready[0]
        loser = two if winner is one else one
        assert isinstance(winner, Connection)
        assert recv_within(winner) == "capacity.reserved"
        reserved = on_disk()
        assert 0 < reserved <= limit  # the winner's preallocated payload is counted while it holds the lock
        winner.send("go")
        results = {id(conn): recv_within(conn) for conn in (winner, loser)}
        won, lost = results[id(winner)], results[id(loser)]
        assert won["status"] == "built"
        assert lost["status"] == "failed" and lost["code"] == FailureCode.STORE_LIMIT_EXCEEDED.value
        assert on_disk() <= limit
        for conn in (winner, loser):
            conn.send("close")
    assert on_disk() <= limit
    assert len(published(store)) == 1
    assert os.listdir(store.layout.tmp) == []


def test_eviction_policy_from_the_environment() -> None:
    """HWR_EVICTION selects the policy (default lru); a bad value names the variable to fix."""
    assert HostWeightRuntimeConfig.from_env({}).eviction is EvictionPolicy.LRU
    assert HostWeightRuntimeConfig.from_env({"HWR_EVICTION": "none"}).eviction is EvictionPolicy.NONE
    assert HostWeightRuntimeConfig.from_dict({"eviction": "LRU"}).eviction is EvictionPolicy.LRU
    with pytest.raises(ValueError, match="HWR_EVICTION"):
        HostWeightRuntimeConfig.from_env({"HWR_EVICTION": "fifo"})

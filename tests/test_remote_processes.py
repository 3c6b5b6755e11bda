"""Remote imports across processes: a SIGKILL mid-import, and eight importers sharing one fetch (E06, E07)."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from multiprocessing.connection import Connection, wait
from pathlib import Path

import pytest

from host_weight_runtime import StoreStatus
from host_weight_runtime.remote import import_remote_artifact

from . import _remote_children
from .remote_support import META, MotoEndpoint, Node, Remote, make_remote, moto_endpoint, soon
from .support import CHILD_TIMEOUT_S, SPAWN, make_identity, reaped_children

IMPORTERS = 8


@pytest.fixture(scope="module")
def moto() -> Iterator[MotoEndpoint]:
    with moto_endpoint() as endpoint:
        yield endpoint


@pytest.fixture
def s3(tmp_path: Path, moto: MotoEndpoint) -> Iterator[Remote]:
    with make_remote("s3", tmp_path, moto) as value:
        yield value


def test_sigkill_during_import_leaves_a_crashed_build_and_the_next_import_succeeds(s3: Remote, tmp_path: Path) -> None:
    """E06: an importer SIGKILLed mid-fetch leaves only an invisible temporary; the next import publishes and removes it."""
    node_a, node_b = Node(tmp_path / "a"), Node(tmp_path / "b")
    identity = node_a.build()
    s3.push(node_a, identity)
    report, report_child = SPAWN.Pipe(duplex=False)
    control_child, control = SPAWN.Pipe(duplex=False)
    with reaped_children() as children:
        child = SPAWN.Process(
            target=_remote_children.import_in_child,
            args=(str(node_b.root), s3.read_url, s3.read_options, report_child, control_child),
            kwargs={"crash_at": "remote.fetch.chunk"},
        )
        child.start()
        children.append(child)
        assert report.poll(CHILD_TIMEOUT_S) and report.recv() == "build.waiting_for_lock"
        assert report.poll(CHILD_TIMEOUT_S) and report.recv() == "remote.fetch.start"
        control.send("go")
        child.join(CHILD_TIMEOUT_S)
    assert child.exitcode == -signal.SIGKILL
    assert node_b.store.lookup(identity, validation=META).status is StoreStatus.MISS
    assert node_b.visible() == []
    assert [name.split(".", 1)[0] for name in node_b.temporaries()] == [identity.key]
    result = import_remote_artifact(node_b.store, identity, s3.provider(), validation=META, deadline=soon())
    assert result is not None and result.status is StoreStatus.BUILT and result.lease is not None, result
    result.lease.close()
    assert node_b.temporaries() == [] and node_b.visible() == [identity.key]


def test_eight_importers_share_one_fetch_and_all_lease_it(s3: Remote, tmp_path: Path) -> None:
    """E07: eight processes import one remote-only artifact at once: one fetch (BUILT), seven JOINED, one publication."""
    node_a, node_b = Node(tmp_path / "a"), Node(tmp_path / "b")
    identity = node_a.build()
    s3.push(node_a, identity)
    assert make_identity() == identity
    reports: dict[Connection, Connection] = {}
    with reaped_children() as children:
        for _ in range(IMPORTERS):
            report, report_child = SPAWN.Pipe(duplex=False)
            control_child, control = SPAWN.Pipe(duplex=False)
            child = SPAWN.Process(
                target=_remote_children.import_in_child,
                args=(str(node_b.root), s3.read_url, s3.read_options, report_child, control_child),
            )
            child.start()
            children.append(child)
            reports[report] = control
        waiting: set[Connection] = set()
        fetchers: list[Connection] = []
        while len(waiting) < IMPORTERS or not fetchers:
            ready = wait(list(reports), timeout=CHILD_TIMEOUT_S)
            assert ready, "importers did not report in time"
            for conn in ready:
                assert isinstance(conn, Connection)
                message = conn.recv()
                if message == "build.waiting_for_lock":
                    waiting.add(conn)
                else:
                    assert message == "remote.fetch.start", message
                    fetchers.append(conn)
        assert len(fetchers) == 1  # every importer is past its miss; only the lock holder fetches
        reports[fetchers[0]].send("go")
        results = []
        for conn in reports:
            assert conn.poll(CHILD_TIMEOUT_S)
            outcome = conn.recv()
            assert isinstance(outcome, dict), f"a second fetch started: {outcome}"
            results.append(outcome)
        for control in reports.values():
            control.send("close")
    statuses = sorted(outcome["status"] for outcome in results)
    assert statuses == ["built"] + ["joined"] * (IMPORTERS - 1), results
    assert len({outcome["publication_id"] for outcome in results}) == 1
    assert all(child.exitcode == 0 for child in children)
    assert node_b.visible() == [identity.key] and node_b.temporaries() == []

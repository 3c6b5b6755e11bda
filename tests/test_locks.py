"""flock locks: sharing, exclusion, deadlines, downgrade, release, and fork safety (S20)."""

from __future__ import annotations

import errno
import os
import pickle
import select
import signal
import stat
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path

import pytest

from host_weight_runtime.failures import FailureCode, HostWeightError, ResolutionStage
from host_weight_runtime.filesystem.locks import FileLock, acquire_lock, try_lock
from hwr_tools.preimported import preimported_context

from .support import recv_within, spawned_child

TIMEOUT_S = 60.0
_SPAWN = preimported_context()


# ----------------------------------------------------------------- child processes


def _child_try_lock(path: str, exclusive: bool, conn: Connection) -> None:
    """Report whether this (separate) process can take the lock right now."""
    lock = try_lock(Path(path), exclusive=exclusive)
    conn.send(lock is not None)
    if lock is not None:
        lock.release()
    conn.close()


def _child_hold_lock(path: str, exclusive: bool, conn: Connection) -> None:
    """Take the lock, say so, hold it until told to release, then acknowledge."""
    lock = acquire_lock(
        Path(path), exclusive=exclusive, deadline=time.monotonic() + TIMEOUT_S, stage=ResolutionStage.LOOKUP, what="x"
    )
    conn.send("held")
    if conn.poll(TIMEOUT_S) and conn.recv() == "release":
        lock.release()
        conn.send("released")
    conn.close()


def _other_process_can_lock(path: Path, *, exclusive: bool) -> bool:
    with spawned_child(_child_try_lock, str(path), exclusive) as conn:
        result = recv_within(conn)
    assert isinstance(result, bool)
    return result


def _wait_forked(pid: int) -> int:
    """Reap a forked child, killing it if it does not exit in time; returns its exit status."""
    pidfd = os.pidfd_open(pid)
    try:
        ready, _, _ = select.select([pidfd], [], [], TIMEOUT_S)
        if not ready:
            os.kill(pid, signal.SIGKILL)
    finally:
        os.close(pidfd)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


@pytest.fixture
def lock_path(tmp_path: Path) -> Path:
    return tmp_path / "test.lock"


# ----------------------------------------------------------------- tests


def test_shared_locks_coexist(lock_path: Path) -> None:
    """Shared holders coexist, in this process and in another one."""
    first = try_lock(lock_path, exclusive=False)
    assert first is not None
    second = try_lock(lock_path, exclusive=False)
    assert second is not None
    assert _other_process_can_lock(lock_path, exclusive=False)
    assert not _other_process_can_lock(lock_path, exclusive=True)
    first.release()
    second.release()


def test_exclusive_excludes_other_fd_and_other_process(lock_path: Path) -> None:
    """An exclusive lock excludes a second descriptor and a second process, shared or exclusive."""
    lock = try_lock(lock_path, exclusive=True)
    assert lock is not None and lock.held and lock.exclusive
    assert try_lock(lock_path, exclusive=True) is None
    assert try_lock(lock_path, exclusive=False) is None
    assert not _other_process_can_lock(lock_path, exclusive=False)
    lock.release()
    assert _other_process_can_lock(lock_path, exclusive=True)


def test_try_lock_returns_none_while_another_process_holds_it(lock_path: Path) -> None:
    """try_lock never waits: it returns None while another process holds the lock."""
    with spawned_child(_child_hold_lock, str(lock_path), True) as conn:
        assert recv_within(conn) == "held"
        assert try_lock(lock_path, exclusive=True) is None
        assert try_lock(lock_path, exclusive=False) is None
        conn.send("release")
        assert recv_within(conn) == "released"
    relocked = try_lock(lock_path, exclusive=True)
    assert relocked is not None
    relocked.release()


def test_acquire_lock_deadline_times_out_retryable(lock_path: Path) -> None:
    """S15/S23: a waiter whose deadline passes gets a retryable LOCK_TIMEOUT; the holder keeps its lock."""
    holder = try_lock(lock_path, exclusive=True)
    assert holder is not None
    with pytest.raises(HostWeightError) as caught:
        acquire_lock(
            lock_path,
            exclusive=False,
            deadline=time.monotonic() + 0.05,
            stage=ResolutionStage.PRODUCTION,
            what="the build lock of test",
        )
    failure = caught.value.failure
    assert failure.code is FailureCode.LOCK_TIMEOUT
    assert failure.retryable is True
    assert failure.stage is ResolutionStage.PRODUCTION
    assert "the build lock of test" in failure.message and str(lock_path) in failure.message
    assert "HWR_LOCK_TIMEOUT_S" in failure.message
    assert holder.held
    assert try_lock(lock_path, exclusive=False) is None  # the holder was not disturbed
    holder.release()


def test_acquire_lock_with_past_deadline_still_tries_once(lock_path: Path) -> None:
    """A deadline already in the past still takes a free lock (deadlines bound waits only)."""
    lock = acquire_lock(
        lock_path, exclusive=True, deadline=time.monotonic() - 1.0, stage=ResolutionStage.LOOKUP, what="x"
    )
    assert lock.held
    lock.release()


def test_acquire_lock_waits_until_holder_releases(lock_path: Path) -> None:
    """Without a deadline a waiter gets the lock as soon as the other process lets go."""
    acquired: list[FileLock] = []
    errors: list[BaseException] = []

    def wait_for_lock() -> None:
        try:
            acquired.append(
                acquire_lock(lock_path, exclusive=True, deadline=None, stage=ResolutionStage.LOOKUP, what="x")
            )
        except BaseException as exc:  # reported to the test thread below
            errors.append(exc)

    with spawned_child(_child_hold_lock, str(lock_path), True) as conn:
        assert recv_within(conn) == "held"
        waiter = threading.Thread(target=wait_for_lock, daemon=True)
        waiter.start()
        assert not acquired  # the child still holds it; the waiter cannot have it
        conn.send("release")
        assert recv_within(conn) == "released"
        waiter.join(TIMEOUT_S)
        assert not waiter.is_alive()
    assert not errors
    assert len(acquired) == 1 and acquired[0].held
    acquired[0].release()


def test_downgrade_lets_shared_lockers_in(lock_path: Path) -> None:
    """Downgrading exclusive -> shared admits shared lockers but still excludes writers."""
    lock = try_lock(lock_path, exclusive=True)
    assert lock is not None
    assert try_lock(lock_path, exclusive=False) is None
    lock.downgrade()
    assert lock.held and not lock.exclusive
    reader = try_lock(lock_path, exclusive=False)
    assert reader is not None
    assert _other_process_can_lock(lock_path, exclusive=False)
    assert not _other_process_can_lock(lock_path, exclusive=True)
    reader.release()
    lock.release()
    assert _other_process_can_lock(lock_path, exclusive=True)


def test_release_is_idempotent_and_keeps_the_lock_file(lock_path: Path) -> None:
    """release() twice is fine; the lock file stays (lock files are never unlinked) with mode 0600."""
    lock = try_lock(lock_path, exclusive=True)
    assert lock is not None
    lock.release()
    lock.release()
    assert not lock.held
    assert lock_path.is_file()
    assert stat.S_IMODE(lock_path.stat().st_mode) == 0o600
    with pytest.raises(RuntimeError):
        lock.downgrade()
    again = try_lock(lock_path, exclusive=True)
    assert again is not None
    again.release()


def test_release_from_many_threads_at_once(lock_path: Path) -> None:
    """Concurrent releases of one lock close its descriptor exactly once."""
    lock = try_lock(lock_path, exclusive=True)
    assert lock is not None
    start = threading.Barrier(8, timeout=TIMEOUT_S)
    errors: list[BaseException] = []

    def release() -> None:
        try:
            start.wait()
            lock.release()
        except BaseException as exc:  # reported to the test thread below
            errors.append(exc)

    threads = [threading.Thread(target=release, daemon=True) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(TIMEOUT_S)
        assert not thread.is_alive()
    assert not errors
    assert not lock.held


def test_context_manager_releases(lock_path: Path) -> None:
    """A lock used as a context manager is released on exit."""
    lock = try_lock(lock_path, exclusive=True)
    assert lock is not None
    with lock:
        assert try_lock(lock_path, exclusive=True) is None
    assert not lock.held
    assert _other_process_can_lock(lock_path, exclusive=True)


def test_symlinked_lock_file_is_refused(tmp_path: Path) -> None:
    """A lock path that is a symlink is not followed: try_lock raises ELOOP, acquire_lock UNSAFE_PERMISSIONS."""
    target = tmp_path / "elsewhere"
    target.write_bytes(b"")
    link = tmp_path / "link.lock"
    link.symlink_to(target)
    with pytest.raises(OSError) as raw:
        try_lock(link, exclusive=True)
    assert raw.value.errno == errno.ELOOP
    with pytest.raises(HostWeightError) as typed:
        acquire_lock(link, exclusive=True, deadline=None, stage=ResolutionStage.LOOKUP, what="the link lock")
    assert typed.value.code is FailureCode.UNSAFE_PERMISSIONS
    assert typed.value.retryable is False
    assert "symlink" in typed.value.failure.message
    assert target.read_bytes() == b""


def test_file_lock_refuses_pickling(lock_path: Path) -> None:
    """A lock belongs to the process that took it; it cannot travel to another one."""
    lock = try_lock(lock_path, exclusive=False)
    assert lock is not None
    with pytest.raises(TypeError):
        pickle.dumps(lock)
    lock.release()


def test_release_in_forked_child_keeps_parent_lock(lock_path: Path) -> None:
    """S20: a lock released in a forked child does not release the parent's (lease) lock."""
    lock = try_lock(lock_path, exclusive=False)
    assert lock is not None
    pid = os.fork()
    if pid == 0:  # the child: release the inherited lock object and leave
        code = 1
        try:
            held_before = lock.held
            lock.release()
            code = 0 if (not held_before and not lock.held) else 2
        finally:
            os._exit(code)
    assert _wait_forked(pid) == 0
    assert lock.held
    assert try_lock(lock_path, exclusive=True) is None
    assert not _other_process_can_lock(lock_path, exclusive=True)
    lock.release()
    assert _other_process_can_lock(lock_path, exclusive=True)


def test_parent_release_unlocks_even_while_forked_child_keeps_the_descriptor(lock_path: Path) -> None:
    """S20 (other side): the owner's release unlocks although a forked child still has the inherited fd."""
    lock = try_lock(lock_path, exclusive=True)
    assert lock is not None
    ready_r, ready_w = os.pipe()
    go_r, go_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: keep the inherited descriptor open until told to exit
        try:
            os.close(ready_r)
            os.close(go_w)
            os.write(ready_w, b"r")
            readable, _, _ = select.select([go_r], [], [], TIMEOUT_S)
            if readable:
                os.read(go_r, 1)
        finally:
            os._exit(0)
    os.close(ready_w)
    os.close(go_r)
    try:
        readable, _, _ = select.select([ready_r], [], [], TIMEOUT_S)
        assert readable and os.read(ready_r, 1) == b"r"
        lock.release()
        assert _other_process_can_lock(lock_path, exclusive=True)
    finally:
        os.write(go_w, b"g")
        os.close(go_w)
        os.close(ready_r)
        assert _wait_forked(pid) == 0

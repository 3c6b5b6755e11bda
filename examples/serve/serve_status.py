"""Per-worker status files, written by each worker and read by the service's /status endpoint.

Workers are separate processes, so each one writes `worker-<id>.json` (a temporary file renamed
into place: a reader never sees half a file) and the HTTP side reads them all. The file of a
worker that was restarted is replaced by the new process; `starts` counts its processes.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

LOAD_LOCK = "load.lock"


def process_started_at(pid: int | str = "self") -> float:
    """When the process started, in seconds since the epoch (from /proc: boot time + start ticks)."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
        ticks = int(stat.read().rpartition(")")[2].split()[19])
    with open("/proc/stat", encoding="ascii") as system:
        boot = next(int(line.split()[1]) for line in system if line.startswith("btime "))
    return boot + ticks / os.sysconf("SC_CLK_TCK")


def _status_path(state_dir: Path, worker_id: int) -> Path:
    return state_dir / f"worker-{worker_id}.json"


def read_worker(state_dir: Path, worker_id: int) -> dict[str, Any] | None:
    try:
        value = json.loads(_status_path(state_dir, worker_id).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    return value if isinstance(value, dict) else None


def write_worker(state_dir: Path, worker_id: int, status: dict[str, Any]) -> None:
    """Replace the worker's status file atomically."""
    target = _status_path(state_dir, worker_id)
    temporary = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    temporary.write_text(json.dumps(status, sort_keys=True), encoding="utf-8")
    os.replace(temporary, target)


def read_all(state_dir: Path) -> list[dict[str, Any]]:
    """Every worker's last status, by worker id."""
    found = []
    for path in sorted(state_dir.glob("worker-*.json")):
        with contextlib.suppress(FileNotFoundError, ValueError):
            value = json.loads(path.read_text(encoding="utf-8"))
            if isinstance(value, dict):
                found.append(value)
    return sorted(found, key=lambda status: int(status.get("worker_id", -1)))


@contextlib.contextmanager
def one_load_at_a_time(state_dir: Path, timeout_s: float) -> Iterator[float]:
    """Hold the service's load lock; yields the seconds spent waiting for it.

    The first worker to hold it loads canonically and publishes; the next ones then map that
    artifact instead of each loading (and publishing) their own copy. A worker that dies releases
    the lock with its process. After `timeout_s` the worker loads without it.
    """
    started = time.monotonic()
    with open(state_dir / LOAD_LOCK, "a+b") as lock_file:
        locked = False
        while not locked:
            try:
                fcntl.flock(lock_file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                locked = True
            except BlockingIOError:
                if time.monotonic() - started > timeout_s:
                    break
                time.sleep(0.05)
        try:
            yield time.monotonic() - started
        finally:
            if locked:
                fcntl.flock(lock_file.fileno(), fcntl.LOCK_UN)

"""One metrics endpoint per pod: the multiprocess directory the library keeps when the caller set none.

Several worker processes in one container all set `HWR_METRICS_PORT`; only one can bind it.
prometheus_client's multiprocess mode lets that one serve everybody's values, but it must be
switched on (PROMETHEUS_MULTIPROC_DIR) before prometheus_client is first imported. When the
caller has not done so, the first runtime that asks for metrics does it here: a private
directory per uid and port under the temporary directory, shared by every process of the
container that uses the same port. Files of processes that are gone are marked dead, as
prometheus_client's documentation asks, so `livesum` gauges count live processes only.
"""

from __future__ import annotations

import atexit
import importlib
import logging
import os
import re
import stat
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

__all__ = [
    "MULTIPROC_ENV",
    "LiveProcessCollector",
    "enable_pod_multiprocess",
    "mark_dead_processes",
    "multiprocess_directory",
    "multiprocess_enabled",
]

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
_LIVE_FILE = re.compile(r"gauge_live[a-z]*_(\d+)\.db")
_LOG = logging.getLogger("host_weight_runtime.metrics")
_marked: set[Path] = set()  # directories whose dead processes this process already marked


def multiprocess_enabled() -> bool:
    """Whether prometheus_client runs (or will run) in multiprocess mode in this process."""
    return bool(multiprocess_directory())


def multiprocess_directory() -> str:
    """The multiprocess directory in use ("" when multiprocess mode is off)."""
    return os.environ.get(MULTIPROC_ENV, "").strip()


def _pod_directory(port: int) -> Path:
    return Path(tempfile.gettempdir()) / f"hwr-metrics-{os.getuid()}-{port}"


def _private(directory: Path) -> bool:
    """Created if missing; accepted only when it is a directory of ours that nobody else can write to."""
    try:
        directory.mkdir(mode=0o700, exist_ok=True)
        info = os.lstat(directory)
    except OSError as exc:
        _LOG.warning("host weight runtime metrics: cannot create %s (%s); each worker counts alone", directory, exc)
        return False
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o022:
        _LOG.warning(
            "host weight runtime metrics: %s is not a private directory of uid %d; each worker counts alone "
            "(set PROMETHEUS_MULTIPROC_DIR to a directory the pod's workers share)",
            directory,
            os.getuid(),
        )
        return False
    return True


def enable_pod_multiprocess(port: int) -> bool:
    """Switch on multiprocess mode for a fixed `port` unless the caller chose already; True when it is on.

    Port 0 (a free port per process) has no endpoint to share, so it stays single-process.
    """
    if multiprocess_enabled():
        mark_dead_processes(Path(multiprocess_directory()))
        return True
    if port == 0:
        return False
    if "prometheus_client.values" in sys.modules:
        _LOG.warning(
            "host weight runtime metrics: prometheus_client was imported before HWR_METRICS_PORT was read, so "
            "only this process is counted on port %d; set %s to a directory the pod's workers share before they "
            "start to count them all",
            port,
            MULTIPROC_ENV,
        )
        return False
    directory = _pod_directory(port)
    if not _private(directory):
        return False
    os.environ[MULTIPROC_ENV] = str(directory)
    mark_dead_processes(directory)
    _LOG.info("host weight runtime metrics: worker processes on port %d share %s", port, directory)
    return True


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _multiprocess_module() -> Any:
    """prometheus_client.multiprocess (untyped), imported only once the mode is settled."""
    return importlib.import_module("prometheus_client.multiprocess")


def _drop_dead(directory: Path) -> None:
    multiprocess = _multiprocess_module()

    try:
        names = os.listdir(directory)
    except OSError:
        return
    for name in names:
        match = _LIVE_FILE.fullmatch(name)
        if match is not None and not _alive(int(match.group(1))):
            multiprocess.mark_process_dead(int(match.group(1)), str(directory))


def mark_dead_processes(directory: Path) -> None:
    """Drop the live gauges of processes that are gone (a restart, a crash), and ours at a normal exit (once)."""
    multiprocess = _multiprocess_module()

    if directory in _marked:
        return
    _marked.add(directory)
    _drop_dead(directory)
    atexit.register(multiprocess.mark_process_dead, os.getpid(), str(directory))


class LiveProcessCollector:
    """prometheus_client's MultiProcessCollector, after dropping the live gauges of processes that are gone.

    A worker that is killed, or exits through `os._exit` (multiprocessing and forking servers do),
    runs no exit hook; the scrape is where the endpoint notices it.
    """

    def __init__(self, directory: Path) -> None:
        multiprocess = _multiprocess_module()

        self._directory = directory
        self._collector = multiprocess.MultiProcessCollector(None, path=str(directory))

    def collect(self) -> Iterable[Any]:
        _drop_dead(self._directory)
        found: Iterable[Any] = self._collector.collect()
        return found

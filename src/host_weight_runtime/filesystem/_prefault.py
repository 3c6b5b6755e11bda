"""Page tables for a lease, filled on a background thread while the caller restores its model.

A warm start pays one page fault per few pages of every weight the first time it is
read. `madvise(MADV_POPULATE_READ)` (Linux 5.14+) read-faults a whole range in the
kernel instead, and on a thread of its own it overlaps the restore that follows the
lookup. Read faults on a private mapping map the shared page-cache pages: nothing is
copied. The thread starts when the lease's tensors or regions are first asked for, so a
lease that is only held (a prewarm, a background publication, a push) maps nothing it
never reads. Best effort: an older kernel or any error just stops it (recorded in
`error`), and `HWR_PREFAULT=0` turns it off.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from ..config import ENV_PREFAULT, environment_config

__all__ = ["ENV_PREFAULT", "BackgroundPrefault", "prefault_enabled"]

_MADV_POPULATE_READ = 22
_STEP_BYTES = 32 << 20  # between steps the thread checks whether the lease was closed

_log = logging.getLogger(__name__)


def prefault_enabled(environ: Mapping[str, str] | None = None) -> bool:
    """Whether leases prefault their mappings: on unless HWR_PREFAULT is 0, false, no or off (read by `from_env`)."""
    return environment_config((ENV_PREFAULT,), environ).prefault is not False


def _madvise() -> Any:
    """libc's madvise through ctypes, which releases the GIL while the kernel populates; None if missing."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        function = libc.madvise
    except (OSError, AttributeError):
        return None
    function.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    function.restype = ctypes.c_int
    return function


class BackgroundPrefault:
    """Populates the page tables of some mapped regions on a daemon thread once `start()` is called; `stop()`
    ends it early (or keeps it from ever starting)."""

    __slots__ = ("_done", "_guard", "_keepalive", "_regions", "_stop", "_thread", "error", "populated_bytes")

    def __init__(self, regions: Sequence[tuple[int, int]], keepalive: tuple[object, ...]) -> None:
        self._regions = tuple(regions)
        self._keepalive: tuple[object, ...] | None = keepalive  # the mappings stay mapped while the thread runs
        self._stop = threading.Event()
        self._done = threading.Event()
        self._guard = threading.Lock()
        self._thread: threading.Thread | None = None
        self.error: str | None = None
        self.populated_bytes = 0

    @property
    def started(self) -> bool:
        """Whether the thread was started (a stopped prefault that never started never will)."""
        return self._thread is not None

    def start(self) -> None:
        """Start the thread; later calls, and calls after `stop()`, do nothing."""
        with self._guard:
            if self._thread is not None or self._stop.is_set():
                return
            self._thread = threading.Thread(target=self._run, name="hwr-prefault", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        try:
            madvise = _madvise()
            if madvise is None:
                self.error = "madvise is not available"
                return
            page = os.sysconf("SC_PAGE_SIZE")
            for address, length in self._regions:
                start = address - address % page
                end = address + length
                while start < end and not self._stop.is_set():
                    step = min(_STEP_BYTES, end - start)
                    if madvise(start, step, _MADV_POPULATE_READ) != 0:
                        code = ctypes.get_errno()
                        self.error = f"madvise(MADV_POPULATE_READ) failed: {errno.errorcode.get(code, code)}"
                        _log.debug("prefault stopped: %s", self.error)
                        return
                    self.populated_bytes += step
                    start += step
        finally:
            self._keepalive = None
            self._done.set()

    def stop(self) -> None:
        """Ask the thread to stop after its current step and wait for it (or keep it from starting)."""
        with self._guard:
            self._stop.set()
            thread = self._thread
            if thread is None:
                self._keepalive = None
                self._done.set()
                return
        if thread is not threading.current_thread():
            thread.join()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until every region is populated (or the thread stopped); True when it finished."""
        return self._done.wait(timeout)

"""Page tables for a lease, filled on a background thread while the caller restores its model.

A warm start pays one page fault per few pages of every weight the first time it is
read. `madvise(MADV_POPULATE_READ)` (Linux 5.14+) read-faults a whole range in the
kernel instead, and on a thread of its own it overlaps the restore that follows the
lookup. Read faults on a private mapping map the shared page-cache pages: nothing is
copied. The thread starts when the lease's tensors or regions are first asked for, so a
lease that is only held (a prewarm, a background publication, a push) maps nothing it
never reads. The thread is started without waiting until it is scheduled (a `threading.Thread`
blocks its starter that long, which a warm load paid once per component). Best effort: an
older kernel or any error just stops it (recorded in `error`), and `HWR_PREFAULT=0` turns it off.
"""

from __future__ import annotations

import _thread
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

    __slots__ = ("_done", "_guard", "_ident", "_keepalive", "_pid", "_regions", "_stop", "error", "populated_bytes")

    def __init__(self, regions: Sequence[tuple[int, int]], keepalive: tuple[object, ...]) -> None:
        self._regions = tuple(regions)
        self._keepalive: tuple[object, ...] | None = keepalive  # the mappings stay mapped while the thread runs
        self._stop = threading.Event()
        self._done = threading.Event()
        self._guard = threading.Lock()
        self._ident: int | None = None  # the thread's id once started
        self._pid = 0  # the process that started it: a forked child has no such thread to wait for
        self.error: str | None = None
        self.populated_bytes = 0

    @property
    def started(self) -> bool:
        """Whether the thread was started (a stopped prefault that never started never will)."""
        return self._ident is not None

    def start(self) -> None:
        """Start the thread; later calls, and calls after `stop()`, do nothing."""
        with self._guard:
            if self._ident is not None or self._stop.is_set():
                return
            # A daemon thread the interpreter never joins, as `daemon=True` was; `stop()` waits on `_done`.
            self._pid = os.getpid()
            self._ident = _thread.start_new_thread(self._run, ())

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
            ident = self._ident
            if ident is None:
                self._keepalive = None
                self._done.set()
                return
        if ident != threading.get_ident() and self._pid == os.getpid():
            self._done.wait()  # set as the thread's last step: no madvise follows, the mappings are released

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until every region is populated (or the thread stopped); True when it finished."""
        return self._done.wait(timeout)

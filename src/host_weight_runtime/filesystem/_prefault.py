"""Page tables for a lease, filled on background threads while the caller restores its model.

A warm start pays one page fault per few pages of every weight the first time it is read.
Threads of their own take those read faults instead, overlapping the restore that follows
the lookup: each reads one byte of every page of a 32 MiB step (a strided `max` that torch
runs without the GIL). Read faults on a private mapping map the shared page-cache pages:
nothing is copied. They are taken under the mapping's own lock, not the address space's, so
the loading thread's allocations (`brk`, `mmap`) never wait for them; `MADV_POPULATE_READ`,
used before, held the address-space lock for a whole step, and a half-GiB warm pipeline spent
12-19 ms waiting on it. A multi-GiB lease is split over one thread per core beside the loading
one (`prefault_threads`, at most 8; one on a 2-core machine).
The threads start when the lease's tensors or regions are first asked for, so a lease that
is only held (a prewarm, a background publication, a push) maps nothing it never reads.
They are started without waiting until they are scheduled (a `threading.Thread` blocks its
starter that long, which a warm load paid once per component). Best effort: any error just
stops them (recorded in `error`), and `HWR_PREFAULT=0` turns it off. A payload truncated under
a live lease raises SIGBUS in whichever thread reads it first, as it would in the model's
first read (the documented limit of a mapping). The interpreter's exit stops every running
prefault first (`_stop_running`, at exit): a thread still inside torch's read when the
interpreter finalizes would be unwound through C++ and abort the process.
"""

from __future__ import annotations

import _thread
import atexit
import ctypes
import logging
import os
import threading
import weakref
from collections.abc import Mapping, Sequence

from ..config import ENV_PREFAULT, environment_config

__all__ = ["ENV_PREFAULT", "BackgroundPrefault", "prefault_enabled", "prefault_threads"]

_STEP_BYTES = 32 << 20  # between steps a thread checks whether the lease was closed
_BYTES_PER_THREAD = 256 << 20
_MAX_THREADS = 8

_log = logging.getLogger(__name__)


def prefault_enabled(environ: Mapping[str, str] | None = None) -> bool:
    """Whether leases prefault their mappings: on unless HWR_PREFAULT is 0, false, no or off (read by `from_env`)."""
    return environment_config((ENV_PREFAULT,), environ).prefault is not False


def _touch_pages(start: int, length: int, page: int) -> None:
    """Read one byte of every page of [start, start + length): a read fault for each page not mapped yet.

    `max` over a strided `uint8` view runs in torch without the GIL (one thread: a 32 MiB step is below
    torch's parallel grain), so the loading thread keeps the interpreter while the faults are taken.
    """
    import torch

    window = (ctypes.c_char * length).from_address(start)
    torch.frombuffer(window, dtype=torch.uint8)[::page].max()


_RUNNING: weakref.WeakSet[BackgroundPrefault] = weakref.WeakSet()
"""The started prefaults not stopped yet, which the interpreter's exit stops first."""


def _stop_running() -> None:
    for prefault in list(_RUNNING):
        prefault.stop()


atexit.register(_stop_running)


def prefault_threads(total_bytes: int, cores: int | None = None) -> int:
    """How many threads populate a lease: one per core beside the loading thread, at most `_MAX_THREADS`, and
    none beyond one per `_BYTES_PER_THREAD` (the kernel fills one range at memory speed on one core)."""
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    wanted = -(-max(total_bytes, 1) // _BYTES_PER_THREAD)
    return max(1, min(_MAX_THREADS, cores - 1, wanted))


class BackgroundPrefault:
    """Populates the page tables of some mapped regions on daemon threads once `start()` is called; `stop()`
    ends them early (or keeps them from ever starting)."""

    __slots__ = (
        "__weakref__",
        "_done",
        "_guard",
        "_idents",
        "_keepalive",
        "_next_step",
        "_pid",
        "_running",
        "_steps",
        "_stop",
        "_threads",
        "error",
        "populated_bytes",
    )

    def __init__(
        self, regions: Sequence[tuple[int, int]], keepalive: tuple[object, ...], *, threads: int | None = None
    ) -> None:
        page = os.sysconf("SC_PAGE_SIZE")
        steps: list[tuple[int, int]] = []
        for address, length in regions:
            start = address - address % page
            end = address + length
            while start < end:
                steps.append((start, min(_STEP_BYTES, end - start)))
                start += _STEP_BYTES
        self._steps = tuple(steps)
        self._threads = threads if threads is not None else prefault_threads(sum(size for _start, size in steps))
        self._keepalive: tuple[object, ...] | None = keepalive  # the mappings stay mapped while a thread runs
        self._stop = threading.Event()
        self._done = threading.Event()
        self._guard = threading.Lock()
        self._idents: frozenset[int] | None = None  # the threads' ids once started
        self._next_step = 0  # the next step a thread takes (under `_guard`)
        self._running = 0  # threads not finished yet (under `_guard`)
        self._pid = 0  # the process that started them: a forked child has no such thread to wait for
        self.error: str | None = None
        self.populated_bytes = 0

    @property
    def started(self) -> bool:
        """Whether the threads were started (a stopped prefault that never started never will)."""
        return self._idents is not None

    @property
    def threads(self) -> int:
        """How many threads `start()` runs."""
        return self._threads

    def start(self) -> None:
        """Start the threads; later calls, and calls after `stop()`, do nothing."""
        with self._guard:
            if self._idents is not None or self._stop.is_set():
                return
            # Daemon threads the interpreter never joins, as `daemon=True` was; `stop()` waits on `_done`.
            self._pid = os.getpid()
            self._running = self._threads
            _RUNNING.add(self)
            self._idents = frozenset(_thread.start_new_thread(self._run, ()) for _ in range(self._threads))

    def _take_step(self) -> tuple[int, int] | None:
        with self._guard:
            if self._next_step >= len(self._steps) or self._stop.is_set() or self.error is not None:
                return None
            step = self._steps[self._next_step]
            self._next_step += 1
            return step

    def _run(self) -> None:
        try:
            page = os.sysconf("SC_PAGE_SIZE")
            step = self._take_step()
            while step is not None:
                start, length = step
                try:
                    _touch_pages(start, length, page)
                except (RuntimeError, ValueError, ImportError) as exc:
                    with self._guard:
                        self.error = self.error or f"reading the mapping failed: {exc}"
                    _log.debug("prefault stopped: %s", self.error)
                    return
                with self._guard:
                    self.populated_bytes += length
                step = self._take_step()
        finally:
            with self._guard:
                self._running -= 1
                last = self._running == 0
            if last:
                self._keepalive = None
                self._done.set()

    def stop(self) -> None:
        """Ask the threads to stop after their current step and wait for them (or keep them from starting)."""
        _RUNNING.discard(self)
        with self._guard:
            self._stop.set()
            idents = self._idents
            if idents is None:
                self._keepalive = None
                self._done.set()
                return
        if threading.get_ident() not in idents and self._pid == os.getpid():
            self._done.wait()  # set by the last thread as its last step: no madvise follows, the mappings are released

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until every region is populated (or the thread stopped); True when it finished."""
        return self._done.wait(timeout)

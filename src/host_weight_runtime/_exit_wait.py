"""Threads the interpreter waits for at exit, while thread pools still take work.

Shared by the diffusion adapter's background publication and the runtime's background
remote push (HWR_REMOTE_PUBLISH): the first worker on a node must leave its artifact
(and its upload) behind even when the process ends right after loading.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

__all__ = ["wait_at_exit"]

_LOG = logging.getLogger("host_weight_runtime")

_pending: set[threading.Thread] = set()
_guard = threading.Lock()
_registered = threading.Event()


def _join_pending() -> None:
    """Join every registered thread (called once, at interpreter exit)."""
    while True:
        with _guard:
            thread = next(iter(_pending), None)
        if thread is None:
            return
        if thread.ident is not None:  # started; a thread never started has nothing to wait for
            thread.join()
        with _guard:
            _pending.discard(thread)


def _register_hook() -> None:
    """Register `_join_pending` so it runs before executors stop taking work.

    A plain non-daemon thread is not enough: at exit, `threading._shutdown()` first runs the
    callbacks registered with `threading._register_atexit`, newest first, and only then joins
    non-daemon threads. One of those callbacks, registered when `concurrent.futures.thread` is
    imported, makes every executor refuse new work ("cannot schedule new futures after
    interpreter shutdown"), and hashing, writing and uploading go through executors. So the
    wait is registered the same way, after that module is imported, and therefore runs before
    it. The hook is CPython's (3.9+); where it is missing, callers wait for their work themselves.
    """
    import concurrent.futures.thread  # noqa: F401  (its exit callback must be registered before ours)

    register: Callable[[Callable[[], None]], None] | None = getattr(threading, "_register_atexit", None)
    try:
        if register is None:
            raise RuntimeError("this Python has no threading._register_atexit")
        register(_join_pending)
    except RuntimeError as exc:  # also raised when the interpreter is already shutting down
        _LOG.warning("cannot wait for background work at exit (%s); wait for it before exiting", exc)


def wait_at_exit(thread: threading.Thread) -> None:
    """Make interpreter exit join `thread` (register it before starting it); finished threads are dropped."""
    with _guard:
        if not _registered.is_set():
            _register_hook()
            _registered.set()
        for finished in [item for item in _pending if item.ident is not None and not item.is_alive()]:
            _pending.discard(finished)
        _pending.add(thread)

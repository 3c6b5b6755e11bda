"""The reference's advisory file lock, over this runtime's flock primitives."""

from __future__ import annotations

import time
from pathlib import Path
from types import TracebackType

from ....filesystem import locks as native

__all__ = ["FileLock", "FileLockTimeoutError", "lock_is_active"]

_POLL_S = 0.05


class FileLockTimeoutError(TimeoutError):
    """The lock stayed held by someone else until the deadline (or at once, for a non-blocking try)."""


class FileLock:
    """One held flock on `path` (created if missing); `close()` or `with` releases it."""

    def __init__(self, path: Path, *, exclusive: bool, deadline: float | None, nonblocking: bool = False) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        while True:
            held = native.try_lock(path, exclusive=exclusive)
            if held is not None:
                self._lock: native.FileLock = held
                return
            if nonblocking:
                raise FileLockTimeoutError(f"lock is active: {path}")
            if deadline is not None and time.monotonic() >= deadline:
                raise FileLockTimeoutError(f"timed out waiting for {path}")
            time.sleep(_POLL_S if deadline is None else max(0.0, min(_POLL_S, deadline - time.monotonic())))

    def close(self) -> None:
        self._lock.release()

    def __enter__(self) -> FileLock:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.close()


def lock_is_active(path: Path) -> bool:
    """Whether another holder has `path` locked right now (never creates the file)."""
    return native.lock_in_use(path)

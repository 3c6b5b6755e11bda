"""flock-based locks on lock files that live outside the artifact directories.

A `FileLock` is one open descriptor holding one flock. flock locks belong to the
open file description, which a forked child shares: if the child unlocked it, the
parent would silently lose its lock. So a release in a process other than the one
that took the lock only closes the inherited descriptor (S20). Lock files are never
unlinked, because unlinking one while another process waits on it would let two
processes "hold" the same lock on different inodes.

A lock file must be a regular file of this user with one link that nobody else may
write; anything else found at a lock path (a symlink, a FIFO, a directory, a foreign or
hard-linked file) is refused as UnsafeLockFileError and never opened or followed.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import threading
import time
import weakref
from pathlib import Path
from types import TracebackType
from typing import NoReturn

from ..failures import FailureCode, HostWeightError, ResolutionStage, raise_failure
from ._fsutil import failure_from_os_error

__all__ = ["FileLock", "UnsafeLockFileError", "acquire_lock", "lock_in_use", "try_lock"]

_BACKOFF_START_S = 0.001
_BACKOFF_MAX_S = 0.020

# Every live lock, so a forked child can replace their mutexes: a mutex held by some
# other thread at fork time would otherwise stay locked forever in the child.
_live_locks: weakref.WeakSet[FileLock] = weakref.WeakSet()


def _reset_mutexes_after_fork() -> None:
    for lock in list(_live_locks):
        lock._mutex = threading.Lock()


os.register_at_fork(after_in_child=_reset_mutexes_after_fork)


class FileLock:
    """One held flock on one lock file; release it exactly once (further releases do nothing)."""

    __slots__ = ("__weakref__", "_exclusive", "_fd", "_mutex", "_owner_pid", "_path")

    def __init__(self, path: Path, fd: int, *, exclusive: bool) -> None:
        self._path = path
        self._fd = fd
        self._exclusive = exclusive
        self._owner_pid = os.getpid()
        self._mutex = threading.Lock()
        _live_locks.add(self)

    @property
    def path(self) -> Path:
        return self._path

    @property
    def exclusive(self) -> bool:
        return self._exclusive

    @property
    def held(self) -> bool:
        """True while this process holds the lock (never in a forked child)."""
        with self._mutex:
            return self._fd >= 0 and os.getpid() == self._owner_pid

    def release(self) -> None:
        """Unlock and close; in a forked child only close, so the parent keeps its lock."""
        with self._mutex:
            fd, self._fd = self._fd, -1
            if fd < 0:
                return
            try:
                if os.getpid() == self._owner_pid:
                    # Unlock explicitly: a forked child may still share this open file
                    # description, and then closing our descriptor alone would not unlock.
                    fcntl.flock(fd, fcntl.LOCK_UN)
            finally:
                os.close(fd)

    def downgrade(self) -> None:
        """Turn an exclusive lock into a shared one on the same descriptor.

        Linux converts a flock under one spinlock, so no other exclusive holder can
        slip in; flock(2) does not promise that everywhere, so callers that need the
        guarantee re-check what the lock protects afterwards.
        """
        with self._mutex:
            if self._fd < 0 or os.getpid() != self._owner_pid:
                raise RuntimeError(f"cannot downgrade {self._path}: this process does not hold the lock")
            if not self._exclusive:
                return
            fcntl.flock(self._fd, fcntl.LOCK_SH)
            self._exclusive = False

    def __enter__(self) -> FileLock:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.release()

    def __reduce__(self) -> NoReturn:
        raise TypeError("a FileLock cannot be pickled; each process takes its own lock")

    def __del__(self) -> None:
        # A lock that is garbage-collected still releases its descriptor; the explicit
        # release() is the contract, this only keeps a leak from holding a lock forever.
        if getattr(self, "_fd", -1) >= 0:
            self.release()

    def __repr__(self) -> str:
        kind = "exclusive" if self._exclusive else "shared"
        state = "held" if self._fd >= 0 else "released"
        return f"FileLock({str(self._path)!r}, {kind}, {state})"


_SYMLINK = "is a symlink"


class UnsafeLockFileError(OSError):
    """Something other than this user's own private lock file is at a lock path (errno ELOOP for a symlink)."""


def _unsafe_lock_file(info: os.stat_result) -> str | None:
    """Why a lock file must not be used, or None when it is safe."""
    if stat.S_ISLNK(info.st_mode):
        return _SYMLINK
    if not stat.S_ISREG(info.st_mode):
        return "is not a regular file"
    if info.st_uid != os.geteuid():
        return f"belongs to uid {info.st_uid}, not to the current user (uid {os.geteuid()})"
    if info.st_nlink != 1:
        return f"has {info.st_nlink} hard links"
    if info.st_mode & 0o022:
        return f"has mode {stat.S_IMODE(info.st_mode):04o}, writable by group or others"
    return None


def _refuse(path: Path, problem: str) -> UnsafeLockFileError:
    number = errno.ELOOP if problem == _SYMLINK else errno.EPERM
    return UnsafeLockFileError(
        number,
        f"the lock file {path} {problem}; lock files are private regular files of the store's user. "
        "Something planted it: remove it (HWR recreates it)",
        str(path),
    )


def _open_lock_file(path: Path) -> int:
    """Open (creating) a lock file; what is already at the path is checked before it is opened."""
    try:
        listed = os.lstat(path)
    except FileNotFoundError:
        pass
    else:
        problem = _unsafe_lock_file(listed)
        if problem is not None:
            raise _refuse(path, problem)
    # O_NONBLOCK: a FIFO swapped in after the check must not block the open.
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK, 0o600)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise _refuse(path, _SYMLINK) from None
        raise
    try:
        problem = _unsafe_lock_file(os.fstat(fd))
        if problem is not None:
            raise _refuse(path, problem)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _unsafe_failure(exc: UnsafeLockFileError, stage: ResolutionStage, what: str) -> HostWeightError:
    return raise_failure(
        stage, FailureCode.UNSAFE_PERMISSIONS, exc.strerror or str(exc), path=str(exc.filename), what=what
    )


def _try_flock(fd: int, exclusive: bool) -> bool:
    """One non-blocking attempt; False when another process holds a conflicting lock."""
    operation = (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB
    try:
        fcntl.flock(fd, operation)
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return False
        raise
    return True


def try_lock(path: Path, *, exclusive: bool) -> FileLock | None:
    """Take the lock now or return None; never waits. OS errors (UnsafeLockFileError too) propagate as OSError."""
    fd = _open_lock_file(path)
    try:
        if _try_flock(fd, exclusive):
            return FileLock(path, fd, exclusive=exclusive)
    except BaseException:
        os.close(fd)
        raise
    os.close(fd)
    return None


def acquire_lock(
    path: Path,
    *,
    exclusive: bool,
    deadline: float | None,
    stage: ResolutionStage,
    what: str,
) -> FileLock:
    """Wait for the lock until `deadline` (a time.monotonic() value; None waits forever).

    Polls with a short backoff rather than blocking in flock, so a deadline is honoured
    without signals. A timeout raises LOCK_TIMEOUT (retryable) and disturbs nobody:
    the holder keeps its lock and its work.
    """
    started = time.monotonic()
    try:
        fd = _open_lock_file(path)
    except UnsafeLockFileError as exc:
        raise _unsafe_failure(exc, stage, what) from None
    except OSError as exc:
        raise HostWeightError(failure_from_os_error(exc, stage=stage, what=f"opening {what}")) from exc
    backoff = _BACKOFF_START_S
    try:
        while True:
            if _try_flock(fd, exclusive):
                return FileLock(path, fd, exclusive=exclusive)
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                waited = now - started
                kind = "exclusive" if exclusive else "shared"
                raise raise_failure(
                    stage,
                    FailureCode.LOCK_TIMEOUT,
                    f"timed out after {waited:.3f}s waiting for {what} ({path}, {kind}): another process "
                    f"on this node holds it. Retry later; if the holder is a long build, raise the lock "
                    f"timeout (HWR_LOCK_TIMEOUT_S); if no HWR process is running, the holder is stuck and "
                    f"must be stopped (lock files are safe to keep)",
                    retryable=True,
                    path=str(path),
                    what=what,
                    exclusive=exclusive,
                )
            pause = backoff if deadline is None else min(backoff, max(deadline - now, 0.0))
            time.sleep(pause)
            backoff = min(backoff * 2, _BACKOFF_MAX_S)
    except OSError as exc:
        os.close(fd)
        raise HostWeightError(failure_from_os_error(exc, stage=stage, what=f"locking {what}")) from exc
    except BaseException:
        os.close(fd)
        raise


_PROC_LOCKS = Path("/proc/locks")


def _listed_in_proc_locks(info: os.stat_result) -> bool:
    """Whether /proc/locks lists a granted flock on this inode (waiters, marked '->', do not count)."""
    wanted = f"{os.major(info.st_dev):02x}:{os.minor(info.st_dev):02x}:{info.st_ino}"
    with _PROC_LOCKS.open() as table:
        for line in table:
            fields = line.split()
            if len(fields) >= 6 and fields[1] == "FLOCK" and fields[5] == wanted:
                return True
    return False


def lock_in_use(path: Path) -> bool:
    """Whether anyone holds the lock at `path`, disturbing holders and waiters as little as possible.

    A missing lock file means no holder (and is not created). /proc/locks answers without
    touching the lock; since it may hide holders in other PID namespaces, an empty answer
    is confirmed by a non-blocking exclusive probe that is released at once. An unsafe lock
    file (see UnsafeLockFileError) is never opened and counts as in use: nothing proves it free.
    """
    try:
        info = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    if _unsafe_lock_file(info) is not None:
        return True
    try:
        if _listed_in_proc_locks(info):
            return True
    except OSError:
        pass  # no /proc/locks here: the probe below decides
    try:
        probe = try_lock(path, exclusive=True)
    except UnsafeLockFileError:
        return True
    if probe is None:
        return True
    probe.release()
    return False

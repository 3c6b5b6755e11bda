"""The usage ledger: when each artifact was last used, and how many leases hold it now.

Nothing is written into an artifact, and nothing new is counted: the last use is the
mtime of the key's artifact lock file (set when a lease opens and again when it closes:
one `utime`, no fsync, because a lost touch after a power cut only makes an artifact
look older), and the live leases are the shared flocks the kernel lists on that lock
file. A counter of our own could drift when a worker dies; the kernel's locks cannot.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path

from .. import _telemetry
from ._layout import DomainLayout
from .locks import FileLock, try_lock

__all__ = ["LockTable", "UsageRecordingLock", "inode_id", "last_used_ns", "touch_last_use", "touch_lock_file"]

_PROC_LOCKS = Path("/proc/locks")


def touch_last_use(layout: DomainLayout, key: str) -> None:
    """Record a use of `key` now; best effort (a failed touch never fails a lease)."""
    touch_lock_file(layout.artifact_lock(key))


def touch_lock_file(lock_path: Path) -> None:
    """Set an artifact lock file's mtime (the artifact's last use) to now; best effort."""
    with contextlib.suppress(OSError):
        os.utime(lock_path)


def last_used_ns(layout: DomainLayout, key: str) -> int | None:
    """When `key` was last leased (lock file mtime), else when it was published (directory mtime)."""
    for path in (layout.artifact_lock(key), layout.artifact_dir(key)):
        try:
            return os.stat(path, follow_symlinks=False).st_mtime_ns
        except OSError:
            continue
    return None


def inode_id(path: Path) -> str:
    """The `major:minor:inode` name /proc/locks gives a file ("" when it does not exist)."""
    try:
        info = os.stat(path, follow_symlinks=False)
    except OSError:
        return ""
    return f"{os.major(info.st_dev):02x}:{os.minor(info.st_dev):02x}:{info.st_ino}"


class UsageRecordingLock:
    """The lease's shared artifact lock: touches the last-use time when the lease ends, then releases.

    It also keeps the process's live-lease count exact (one open per lease, one close).
    """

    __slots__ = ("_inner", "_released", "_storage_class")

    def __init__(self, inner: FileLock, storage_class: str) -> None:
        self._inner = inner
        self._storage_class = storage_class
        self._released = False
        _telemetry.lease_opened(storage_class)

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        try:
            if self._inner.held:  # never from a forked child, which does not own the lease
                touch_lock_file(self._inner.path)
        finally:
            self._inner.release()
            _telemetry.lease_closed(self._storage_class)


@dataclass(frozen=True, slots=True)
class LockTable:
    """Granted flocks per lock-file inode, read once from /proc/locks (empty where there is none)."""

    holders: dict[str, int]
    available: bool

    @classmethod
    def read(cls) -> LockTable:
        counts: dict[str, int] = {}
        try:
            with _PROC_LOCKS.open() as table:
                for line in table:
                    fields = line.split()
                    # "1: FLOCK ADVISORY READ 1234 00:2f:5678 0 EOF"; waiters read "1: -> FLOCK ...".
                    if len(fields) >= 6 and fields[1] == "FLOCK":
                        counts[fields[5]] = counts.get(fields[5], 0) + 1
        except OSError:
            return cls({}, available=False)
        return cls(counts, available=True)

    def live_leases(self, lock_path: Path) -> int:
        """Holders of the lock at `lock_path`: each live lease holds it shared through its own descriptor.

        /proc/locks may hide holders in other PID namespaces, so an empty answer is
        confirmed with a non-blocking exclusive probe (released at once); a busy probe
        counts as one holder.
        """
        inode = inode_id(lock_path)
        if not inode:
            return 0
        count = self.holders.get(inode, 0)
        if count:
            return count
        try:
            probe = try_lock(lock_path, exclusive=True)
        except OSError:
            return 0
        if probe is None:
            return 1
        probe.release()
        return 0

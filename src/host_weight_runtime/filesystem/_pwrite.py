"""Writing a payload's bytes at a file offset: one buffer (`pwrite`), several in a row (`pwritev`), or another
file's bytes copied inside the kernel (`sendfile`).

Each call passes the writer's fault seams, so tests can fail a write before or after part of it landed.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Sequence

from .._faults import fault_point

__all__ = ["pwrite_all", "pwritev_all", "send_at"]


def pwrite_all(fd: int, data: bytes | bytearray | memoryview, offset: int) -> None:
    """Write all of `data` at `offset`; a pwrite that makes no progress is an I/O error."""
    done = 0
    total = len(data)
    while done < total:
        fault_point("writer.pwrite")
        written = os.pwrite(fd, data[done:], offset + done)
        if written <= 0:
            raise OSError(errno.EIO, "pwrite wrote no bytes")
        done += written
        fault_point("writer.after_pwrite")  # part of the payload is on disk: the mid-write ENOSPC/EIO seam


_IOV_MAX = 1024
"""Buffers per `pwritev` call (Linux's IOV_MAX)."""


def pwritev_all(fd: int, parts: Sequence[memoryview], offset: int) -> None:
    """Write the concatenation of `parts` at `offset` in as few `pwritev` calls as the kernel allows."""
    pending = [part for part in parts if part.nbytes]
    while pending:
        fault_point("writer.pwrite")
        batch = pending[:_IOV_MAX]
        written = os.pwritev(fd, batch, offset)
        if written <= 0:
            raise OSError(errno.EIO, "pwritev wrote no bytes")
        offset += written
        fault_point("writer.after_pwrite")  # part of the payload is on disk: the mid-write ENOSPC/EIO seam
        taken = 0
        while taken < len(batch) and written >= batch[taken].nbytes:
            written -= batch[taken].nbytes
            taken += 1
        pending = pending[taken:]
        if written:  # a short write ended inside this buffer: its rest goes next
            pending[0] = pending[0][written:]


_SENDFILE_REFUSED = frozenset({errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP})
"""What `sendfile` raises where a file system cannot copy between these two files in the kernel."""


def send_at(fd: int, offset: int, source_fd: int, source_offset: int, count: int) -> int:
    """Copy up to `count` bytes of `source_fd` from `source_offset` to `fd` at `offset` in the kernel (no user
    buffer); returns the bytes copied, 0 at the source's end. `fd`'s file position is moved: its other writes
    must not use it. Where the kernel refuses the copy, the bytes go through a buffer instead."""
    fault_point("writer.pwrite")
    try:
        fault_point("writer.sendfile")  # a file system that refuses the kernel copy
        os.lseek(fd, offset, os.SEEK_SET)
        copied = os.sendfile(fd, source_fd, source_offset, count)
    except OSError as exc:
        if exc.errno not in _SENDFILE_REFUSED:
            raise
        data = os.pread(source_fd, count, source_offset)
        pwrite_all(fd, data, offset)
        return len(data)
    fault_point("writer.after_pwrite")
    return copied

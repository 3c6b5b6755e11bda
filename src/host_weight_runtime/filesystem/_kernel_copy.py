"""In-kernel copies into a payload file, and a read-only view of the file's own pages to hash what was stored.

A plain file copy is one kernel copy (`copy_file_range`, or `sendfile` across filesystems) from
the page cache; a payload file filled from a local file the same way costs no user-space copy. What
was stored is then hashed from the destination's pages (a shared read-only mapping, populated before
use): on tmpfs those pages are memory, so hashing them is a read of RAM, not a second copy or a disk read.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os

from .._faults import fault_point

__all__ = ["StoredPages", "kernel_copy"]

# Errors that mean "this pair of files cannot use copy_file_range", never "the copy failed".
_NO_COPY_FILE_RANGE = frozenset({errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EBADF})
_MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # Linux 5.14+; older kernels refuse it (EINVAL)


def kernel_copy(source_fd: int, source_offset: int, target_fd: int, target_offset: int, nbytes: int) -> int:
    """Copy `nbytes` at `source_offset` to `target_offset` in the kernel; fewer only when the source ends early.

    Uses `copy_file_range` (no user-space buffer); where the kernel refuses it for this pair of files
    (different filesystems on some kernels), `sendfile` from the same offsets, as a plain copy does.
    """
    done = 0
    use_range = True
    while done < nbytes:
        fault_point("writer.pwrite")  # the same seam as every other payload write (ENOSPC, EIO)
        count = 0
        if use_range:
            try:
                count = os.copy_file_range(
                    source_fd, target_fd, nbytes - done, source_offset + done, target_offset + done
                )
            except OSError as exc:
                if exc.errno not in _NO_COPY_FILE_RANGE or done:
                    raise
                use_range = False
        if not use_range:
            os.lseek(target_fd, target_offset + done, os.SEEK_SET)
            count = os.sendfile(target_fd, source_fd, source_offset + done, nbytes - done)
        if count == 0:
            break  # end of the source: the caller sees a short copy
        done += count
        fault_point("writer.after_pwrite")
    return done


class StoredPages:
    """A read-only shared mapping of one payload file: views of byte ranges already stored, for hashing.

    Each view must be released by whoever hashes it; `close` unmaps once they are (a view still held by
    a failed hash leaves the mapping to the garbage collector, which never blocks an abort).
    """

    __slots__ = ("_map", "_size")

    def __init__(self, fd: int, size: int) -> None:
        self._size = size
        self._map = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)

    def view(self, offset: int, nbytes: int) -> memoryview:
        """Bytes [offset, offset + nbytes) of the file, their pages mapped in one call before they are read."""
        page = offset - offset % mmap.PAGESIZE
        with contextlib.suppress(OSError, ValueError):  # populating is an optimisation only
            self._map.madvise(_MADV_POPULATE_READ, page, offset + nbytes - page)
        return memoryview(self._map)[offset : offset + nbytes]

    def close(self) -> None:
        with contextlib.suppress(BufferError):
            self._map.close()

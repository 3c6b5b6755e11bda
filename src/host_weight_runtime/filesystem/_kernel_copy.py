"""In-kernel copies into a payload file, and a read-only view of the file's own pages to hash what was stored.

A plain file copy is one kernel copy (`copy_file_range`, or `sendfile` across filesystems) from
the page cache; a payload file filled from a local file the same way costs no user-space copy. What
was stored is then hashed from the destination's pages (a shared read-only mapping of each range, mapped in
and out by the hashing threads, not the copying one): on tmpfs those pages are memory, so hashing them is a
read of RAM, not a second copy or a disk read.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os

from .._faults import fault_point

__all__ = ["StoredRange", "kernel_copy"]

# Errors that mean "this pair of files cannot use copy_file_range", never "the copy failed".
_NO_COPY_FILE_RANGE = frozenset({errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EBADF})


def kernel_copy(
    source_fd: int,
    source_offset: int,
    target_fd: int,
    target_offset: int,
    nbytes: int,
    *,
    use_range: bool = True,
    target_position: int | None = None,
) -> tuple[int, bool]:
    """Copy `nbytes` at `source_offset` to `target_offset` in the kernel; fewer only when the source ends early.

    Uses `copy_file_range` (no user-space buffer); where the kernel refuses it for this pair of files
    (different filesystems on some kernels), `sendfile` from the same offsets, as a plain copy does.
    Returns the bytes copied and whether `copy_file_range` is still worth trying for this pair: a caller
    that copies many ranges between the same two files passes that back as `use_range`, so a refused pair
    costs one refused call per file, not one per range (each a system call and a hand-back of the GIL on
    the copying thread).
    `target_position` is the target's file position when the caller knows it (None: unknown): `sendfile` writes
    there, so the seek before it is skipped when it is already `target_offset` (one system call, and one wait for
    the GIL behind the hashing threads, fewer per range). After a return with `use_range` False every byte went
    through `sendfile`, and the position is `target_offset` plus the bytes copied.
    """
    done = 0
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
            if target_position != target_offset + done:
                os.lseek(target_fd, target_offset + done, os.SEEK_SET)
            target_position = None  # unknown if sendfile raises
            count = os.sendfile(target_fd, source_fd, source_offset + done, nbytes - done)
        if count == 0:
            break  # end of the source: the caller sees a short copy
        done += count
        if not use_range:
            target_position = target_offset + done  # sendfile advanced it past what it wrote
        fault_point("writer.after_pwrite")
    return done, use_range


class StoredRange:
    """One range of a payload file just stored, mapped read-only on its own so that whoever hashes it (the
    hash lane, not the copying thread) also pays for faulting its pages in (`view`) and unmapping them (`close`).

    The view must be released before `close`; a view still held by a failed hash leaves the mapping to
    the garbage collector, which never blocks an abort.
    """

    __slots__ = ("_map", "_nbytes", "_start")

    def __init__(self, fd: int, offset: int, nbytes: int) -> None:
        base = offset - offset % mmap.ALLOCATIONGRANULARITY
        self._start = offset - base
        self._nbytes = nbytes
        self._map = (
            mmap.mmap(fd, self._start + nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ, offset=base)
            if nbytes
            else None
        )

    def __len__(self) -> int:
        return self._nbytes

    def view(self) -> memoryview:
        """The stored bytes. Their pages are mapped in as they are read, so the threads that hash the range's
        leaves side by side also fault its pages in side by side (one populate call would run on one)."""
        if self._map is None:
            return memoryview(b"")
        return memoryview(self._map)[self._start : self._start + self._nbytes]

    def close(self) -> None:
        if self._map is not None:
            with contextlib.suppress(BufferError):
                self._map.close()

"""Small, careful file primitives the store is built from.

Atomic replacement is write-to-temp, fsync, rename, fsync the parent: the parent
fsync is what makes the new name durable. A rename never falls back to copying, so
a half-copied file can never appear under a final name.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path

from .._faults import fault_point
from ..canonical_json import JsonValue
from ..failures import FailureCode, HostWeightFailure, ResolutionStage, failure

__all__ = [
    "DEFAULT_SMALL_FILE_LIMIT",
    "errno_name",
    "failure_from_os_error",
    "fsync_dir",
    "read_small_file",
    "remove_tree",
    "tree_bytes",
    "write_file_atomic",
    "write_new_file",
]

DEFAULT_SMALL_FILE_LIMIT = 16 * 1024 * 1024

_RETRYABLE_CODES: dict[int, FailureCode] = {
    errno.ENOSPC: FailureCode.NO_SPACE,
    errno.EDQUOT: FailureCode.QUOTA_EXCEEDED,
    errno.EIO: FailureCode.IO_ERROR,
}


def list_names(path: Path) -> list[str]:
    """The names in a directory, or none when it does not exist (yet)."""
    try:
        return os.listdir(path)
    except FileNotFoundError:
        return []


def fsync_dir(path: Path) -> None:
    """Make the directory entries of `path` durable (new names, renames, removals)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_new_file(
    path: Path, data: bytes, *, mode: int = 0o600, seam: str | None = None, durable: bool = True
) -> None:
    """Create `path` (it must not exist, and is never a symlink), write all of `data`, fsync it (`durable`).

    `seam` names a fault point between the write and the fsync (a write that fails half done).
    """
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, mode)
    try:
        os.fchmod(fd, mode)  # the umask must not change what the caller asked for
        view = memoryview(data)
        while view:
            written = os.write(fd, view)
            view = view[written:]
        if seam is not None:
            fault_point(seam)
        if durable:
            os.fsync(fd)
    finally:
        os.close(fd)


def remove_tree(path: Path) -> None:
    """Remove a file or directory tree, first making read-only (published) directories writable."""
    if not os.path.lexists(path):
        return
    if path.is_symlink() or not path.is_dir():
        path.unlink()
        return
    for directory, _subdirs, _files in os.walk(path):
        os.chmod(directory, 0o700)
    shutil.rmtree(path)


def unallocated_bytes(top: Path) -> int:
    """Bytes that regular files below `top` are sized for but do not occupy yet (sparse reservations).

    A payload file sized with `ftruncate` reserves its bytes by its size alone; until the writes fill
    it, the filesystem's free space still counts them, so a capacity check subtracts them.
    """
    return sum(max(0, info.st_size - info.st_blocks * 512) for info in _regular_files(top))


def tree_bytes(top: Path) -> int:
    """Sum st_size of regular files below `top` without following symlinks.

    Builds finish and cleanups run concurrently, so an entry that vanishes between
    listing and stat is simply no longer part of the store; other errors propagate.
    """
    return sum(info.st_size for info in _regular_files(top))


def _regular_files(top: Path) -> Iterator[os.stat_result]:
    """The stat of every regular file below `top` (symlinks not followed; entries removed meanwhile skipped)."""
    pending = [top]
    while pending:
        directory = pending.pop()
        try:
            with os.scandir(directory) as listing:
                entries = list(listing)
        except FileNotFoundError:
            continue  # removed concurrently (or the store directory does not exist yet)
        for entry in entries:
            try:
                info = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue  # removed concurrently
            if stat.S_ISDIR(info.st_mode):
                pending.append(Path(entry.path))
            elif stat.S_ISREG(info.st_mode):
                yield info


def write_file_atomic(path: Path, data: bytes, *, mode: int = 0o600, durable: bool = True) -> None:
    """Replace `path` with `data` so readers see the old file or the complete new one.

    The temporary name is unique per process and call and lives in the same directory,
    so the rename cannot cross filesystems; if it still fails with EXDEV that is an
    error, never a copy. On any failure the temporary file is removed. `durable=False`
    skips both flushes, for a cache whose readers reject a damaged record: a crash may then
    lose the file, or leave it empty or cut short.
    """
    parent = path.parent
    temp = parent / f".{path.name}.{os.getpid()}.{secrets.token_hex(6)}.tmp"
    renamed = False
    try:
        write_new_file(temp, data, mode=mode, durable=durable)
        os.rename(temp, path)
        renamed = True
        if durable:
            fsync_dir(parent)
    finally:
        if not renamed:
            _remove_quietly(temp)


def create_empty_file(path: Path, *, mode: int = 0o600) -> bool:
    """Create `path` empty (never through a symlink); False if it already exists. Nothing is forced to disk.

    For markers whose loss after a crash costs only work: an empty file created with O_EXCL can never be
    seen half written, so it needs no temporary name, and with no fsync it costs a worker two syscalls
    instead of two disk flushes.
    """
    try:
        write_new_file(path, b"", mode=mode, durable=False)
    except FileExistsError:
        return False
    return True


def _remove_quietly(path: Path) -> None:
    """Remove a temporary file we created; it being gone already is fine."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def read_small_file(path: Path, limit: int = DEFAULT_SMALL_FILE_LIMIT) -> bytes:
    """Read a small regular file without following a symlink at its final component.

    Raises OSError from the OS (ELOOP for a symlink, ENOENT, ...) and ValueError when
    the path is not a regular file or is larger than `limit` bytes.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(f"{path} is not a regular file")
        if info.st_size > limit:
            raise ValueError(f"{path} is {info.st_size} bytes, more than the {limit}-byte limit")
        chunks: list[bytes] = []
        total = 0
        while True:
            chunk = os.read(fd, min(1 << 20, limit + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
            if total > limit:
                raise ValueError(f"{path} grew past the {limit}-byte limit while being read")
        return b"".join(chunks)
    finally:
        os.close(fd)


def errno_name(number: int | None) -> str:
    """The symbolic errno name (ENOSPC), or UNKNOWN when there is none."""
    if number is None:
        return "UNKNOWN"
    return errno.errorcode.get(number, f"E{number}")


def failure_from_os_error(
    exc: OSError, *, stage: ResolutionStage, what: str, **details: JsonValue
) -> HostWeightFailure:
    """Type an OSError: out-of-space, quota and EIO are retryable; anything else is not.

    `what` names the operation as a gerund phrase ("writing the deny marker").
    """
    name = errno_name(exc.errno)
    code = _RETRYABLE_CODES.get(exc.errno) if exc.errno is not None else None
    retryable = code is not None
    filename = os.fsdecode(exc.filename) if isinstance(exc.filename, (str, bytes, os.PathLike)) else None
    reason = exc.strerror or str(exc)
    if code is FailureCode.NO_SPACE:
        advice = "free space on the domain's filesystem (or lower what other builds use) and retry"
    elif code is FailureCode.QUOTA_EXCEEDED:
        advice = "the user's disk quota is exhausted; free some of it or raise the quota, then retry"
    elif code is FailureCode.IO_ERROR:
        advice = "the device reported an I/O error; retry, and check the disk if it persists"
    else:
        advice = "check the path, its permissions and the filesystem"
    where = f" ({filename})" if filename else ""
    message = f"{what} failed{where}: {reason} [{name}]; {advice}"
    return failure(
        stage,
        code if code is not None else FailureCode.IO_ERROR,
        message,
        retryable=retryable,
        errno=name,
        what=what,
        path=filename,
        **details,
    )

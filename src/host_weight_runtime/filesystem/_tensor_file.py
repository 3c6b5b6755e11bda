"""One payload file being written: created preallocated with its header, filled at fixed offsets, then closed.

A file is accepted at close only when every byte of every declared tensor was written exactly once.
Rows arrive by `pwrite` (`write_tensor`, `write_rows`), or are converted by the writer itself
(`copy_rows`: one pass, each chunk converted into a slot of a reused ring, written from it on the lane's
write thread and its leaves hashed from it on that thread or the converting one, never read back from the
file), or are read piece by piece from another file through the caller's buffers (`read_data`, for a caller
that hashes each piece from the buffer it was written from) or copied from it in the kernel (`send_data`, for a
caller that hashes each piece read back from this file). The record a close produces (coverage check,
manifest entries) is `_written_file`.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Protocol, TypeVar

from .._digest import DigestAlgorithm
from .._faults import fault_point
from ..manifest import TensorManifestEntry
from ..protocols import TensorWriteSpec
from ._cast_buffers import CastBuffers
from ._coverage import RowCoverage, claims_of, rows_of_write
from ._payload_hashing import PayloadHasher
from ._pwrite import pwrite_all, pwritev_all, send_at
from ._safetensors_layout import FileLayout, tensor_bytes
from ._write_failures import os_failed, producer_failed
from ._written_file import WrittenFile, check_caller_digests, check_complete, written_file

if TYPE_CHECKING:
    import torch

__all__ = ["DataPieces", "SentPieces", "StagingTensorFileWriter", "TensorFileOwner", "create_tensor_file"]

_T = TypeVar("_T")


class TensorFileOwner(Protocol):
    """What a payload file needs from the staging writer that opened it (the writer is one; no import back).

    The underscore members are the writer's own plumbing, shared with the files it opens only.
    """

    @property
    def chunk_bytes(self) -> int: ...

    @property
    def digest_algorithm(self) -> DigestAlgorithm: ...

    @property
    def hash_threads(self) -> int | None: ...

    def _executor(self) -> ThreadPoolExecutor: ...

    def _guarded(self, action: Callable[[], _T]) -> _T: ...

    def _check_open(self) -> None: ...


class DataPieces(Protocol):
    """The caller's side of `read_data`: lends the buffers pieces are read into and takes each back once stored."""

    def take(self) -> memoryview: ...

    def stored(self, buffer: memoryview, count: int) -> None: ...


class SentPieces(Protocol):
    """The caller's side of `send_data`: sizes each piece and takes back each stored range (file offsets)."""

    def next_piece(self) -> int: ...

    def sent(self, file_offset: int, count: int) -> None: ...


_FILE_FLAGS = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW
_FILE_MODE = 0o600


def create_tensor_file(
    owner: TensorFileOwner,
    staging_dir: Path,
    name: str,
    layout: FileLayout,
    *,
    ordered: bool,
    caller_hashes: bool = False,
    sparse: bool = False,
) -> StagingTensorFileWriter:
    """Create payload file `name` (it must not exist), preallocate its final size and write its header.

    `sparse` (a file on tmpfs): the file is only sized (`ftruncate`), so the writes that fill
    it allocate its pages as they go instead of waiting for all of them first; its size is still the
    reservation that the capacity check counts (st_size, less what is already allocated, comes off the
    free space). On failure the file is removed again, so a failed open leaves nothing behind.
    """
    path = staging_dir / name
    try:
        fd = os.open(path, _FILE_FLAGS, _FILE_MODE)
    except OSError as exc:
        raise os_failed(exc, f"creating {name} in the staging directory", file=name) from exc
    try:
        try:
            fault_point("writer.preallocate")
            if sparse:
                os.ftruncate(fd, layout.size)
            else:
                os.posix_fallocate(fd, 0, layout.size)
        except OSError as exc:
            raise os_failed(exc, f"preallocating {layout.size} bytes for {name}", file=name, size=layout.size) from exc
        try:
            pwrite_all(fd, layout.header, 0)
        except OSError as exc:
            raise os_failed(exc, f"writing the safetensors header of {name}", file=name) from exc
        return StagingTensorFileWriter(owner, name, fd, layout, ordered=ordered, caller_hashes=caller_hashes)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(path)  # ours (O_EXCL); free its blocks now rather than at cleanup
        raise


class StagingTensorFileWriter:
    """Writes the declared tensors of one payload file at their fixed, preallocated offsets.

    Obtained from `StagingArtifactWriter.open_tensor_file`. Unordered writes may come
    from several threads at once (disjoint rows go to disk in parallel); ordered files
    take writes in `layout` order only.
    """

    __slots__ = (
        "_caller_hashes",
        "_cast",
        "_closed",
        "_coverage",
        "_fd",
        "_hasher",
        "_layout",
        "_lock",
        "_name",
        "_next_byte",
        "_ordered",
        "_owner",
        "_result",
    )

    def __init__(
        self,
        owner: TensorFileOwner,
        name: str,
        fd: int,
        layout: FileLayout,
        *,
        ordered: bool,
        caller_hashes: bool = False,
    ) -> None:
        self._owner = owner
        self._caller_hashes = caller_hashes
        self._name = name
        self._fd = fd
        self._layout = layout
        self._ordered = ordered
        self._lock = threading.Lock()
        self._closed = False
        self._result: WrittenFile | None = None
        self._next_byte = 0  # ordered files: the data offset the next write must start at
        self._cast: CastBuffers | None = None  # made by the first copy_rows
        self._coverage: dict[str, RowCoverage] = {
            placement.spec.name: RowCoverage(placement) for placement in layout.placements
        }
        self._hasher = PayloadHasher(
            fd,
            name,
            layout,
            chunk_bytes=owner.chunk_bytes,
            algorithm=owner.digest_algorithm,
            hash_threads=owner.hash_threads,
            executor=owner._executor,
        )

    # -- read-only facts

    @property
    def name(self) -> str:
        return self._name

    @property
    def ordered(self) -> bool:
        return self._ordered

    @property
    def layout(self) -> tuple[TensorWriteSpec, ...]:
        """The tensors in offset order: the order an ordered file must be written in."""
        return tuple(placement.spec for placement in self._layout.placements)

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def result(self) -> WrittenFile | None:
        """The written file once `close()` succeeded; None before or after a failed close."""
        return self._result

    # -- the TensorFileWriter protocol

    def write_tensor(self, name: str, tensor: torch.Tensor) -> None:
        """Write a whole tensor (the only way to write a 0-dim one)."""
        self._owner._guarded(lambda: self._write(name, None, tensor))

    def write_rows(self, name: str, start_row: int, tensor: torch.Tensor) -> None:
        """Write `tensor.shape[0]` rows of `name` starting at `start_row`."""
        self._owner._guarded(lambda: self._write(name, start_row, tensor))

    def copy_rows(self, name: str, start_row: int, rows: torch.Tensor) -> None:
        """Convert `rows` (any dtype, `Tensor.copy_` rounding) straight into rows `start_row`.. of `name`.

        Ordered files only: the rows are converted into a slot of the reused ring, which the lane
        writes and hashes (on two threads) while the next chunk converts; nothing is read back. A write failure
        raises, typed, from a later call or from `close`.
        Every row of a tensor comes either from `copy_rows` or from `write_rows`, not both.
        """
        self._owner._guarded(lambda: self._copy(name, start_row, rows))

    def read_data(self, source_fd: int, source_offset: int, nbytes: int, pieces: DataPieces) -> int:
        """Store the next `nbytes` of the data section, read from `source_fd` at `source_offset` piece by piece.

        For an ordered file opened with `caller_hashes` (whole rows): each piece is read into a buffer
        `pieces.take()` lends, written from it, and handed back with `pieces.stored(buffer, count)` for the
        caller to hash, so what is hashed is exactly what was stored, while the next piece is read. Returns
        the bytes stored; fewer than `nbytes` means the source ended early, and then none of them count as written.
        """
        return self._owner._guarded(lambda: self._read_data(source_fd, source_offset, nbytes, pieces))

    def send_data(self, source_fd: int, source_offset: int, nbytes: int, pieces: SentPieces) -> int:
        """`read_data` with the kernel copying each piece (`sendfile`, no user buffer): each stored range is
        handed to `pieces.sent(file_offset, count)` for the caller to read back from `reader()` and hash."""
        return self._owner._guarded(lambda: self._send_data(source_fd, source_offset, nbytes, pieces))

    def reader(self) -> int:
        """A descriptor of this file for reading back what was stored (a `dup`, the caller's to close)."""
        return os.dup(self._fd)

    def write_data(self, data: bytes | bytearray | memoryview) -> None:
        """Write `data` as the next bytes of the data section (ordered, caller-hashed files; whole rows), with no
        tensor in between: for a caller that holds the bytes of a laid-out file, such as a ranged remote read."""
        self._owner._guarded(lambda: self._write_data(data))

    def write_data_parts(self, parts: Sequence[memoryview]) -> None:
        """`write_data` of the concatenation of `parts` (flat byte views), written by `pwritev` straight from
        them: for a caller that holds several consecutive tensors' bytes in separate buffers."""
        self._owner._guarded(lambda: self._write_data_parts(parts))

    def close(self) -> None:
        """Check coverage, fsync, hash and release the file; later calls do nothing."""
        if self._caller_hashes and not self._closed:
            self._owner._guarded(self._refuse_unhashed_close)
        self._owner._guarded(self._close)

    def __enter__(self) -> StagingTensorFileWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        """Close on success; after an error leave the file unclosed, so the failed build discards it whole."""
        if exc_type is None:
            self.close()

    def close_hashed(
        self, tensor_digests: Sequence[str], *, expected: Sequence[TensorManifestEntry] | None = None
    ) -> None:
        """Close a file opened with `caller_hashes`: record the caller's digests instead of reading the file back.

        For a caller that hashed every byte it wrote from the very buffers it wrote (a remote
        import hashes each range as it lands), in this writer's chunking and algorithm, one
        digest per tensor in layout order. The file digest is still composed here, from the
        header this writer wrote. `expected`: the entries the caller will compare the result with (an
        import's remote manifest, in layout order); one equal in every field to what this writer records
        is kept as it is instead of being composed and validated again.
        """
        digests = tuple(tensor_digests)
        known = tuple(expected) if expected is not None else None
        self._owner._guarded(lambda: self._close(digests, known))

    def _refuse_unhashed_close(self) -> None:
        raise producer_failed(
            f"{self._name} was opened with caller_hashes: close it with close_hashed(digests)", file=self._name
        )

    # -- writing

    def _coverage_of(self, name: str) -> RowCoverage:
        coverage = self._coverage.get(name) if isinstance(name, str) else None
        if coverage is None:
            raise producer_failed(
                f"{self._name}: tensor {name!r} was not declared for this file; declare every tensor in "
                "open_tensor_file",
                file=self._name,
                tensor=str(name),
            )
        return coverage

    def _write(self, name: str, start_row: int | None, tensor: torch.Tensor) -> None:
        if self._closed:
            raise producer_failed(f"{self._name} is closed; no more writes are accepted", file=self._name)
        self._owner._check_open()
        coverage = self._coverage_of(name)
        placement = coverage.placement
        start, stop = rows_of_write(self._name, placement, start_row, tensor)
        data = tensor_bytes(tensor)
        begin = placement.begin + start * placement.row_bytes
        if len(data) != (stop - start) * placement.row_bytes:  # pragma: no cover - guarded by the shape check
            raise producer_failed(f"{self._name}: tensor {name}: byte count mismatch", file=self._name, tensor=name)
        if self._ordered:
            with self._lock:
                if self._hasher.lane.holds(name):
                    raise self._mixed(name, "copy_rows")
                self._claim(coverage, start, stop, ordered_begin=begin if len(data) else None)
                try:
                    self._pwrite(data, len(self._layout.header) + begin, name, start, stop)
                except BaseException:
                    coverage.pending.remove((start, stop))
                    raise
                coverage.pending.remove((start, stop))
                if stop > start:
                    coverage.mark_done(start, stop)
                if len(data):
                    self._next_byte = begin + len(data)
                if coverage.first_missing() is None and not self._caller_hashes:
                    self._hasher.hash_behind(placement)
            return
        with self._lock:
            self._claim(coverage, start, stop, ordered_begin=None)
        try:
            self._pwrite(data, len(self._layout.header) + begin, name, start, stop)
        except BaseException:
            with self._lock:
                coverage.pending.remove((start, stop))
            raise
        with self._lock:
            coverage.pending.remove((start, stop))
            if stop > start:
                coverage.mark_done(start, stop)

    def _copy(self, name: str, start_row: int, rows: torch.Tensor) -> None:
        if not self._ordered or self._caller_hashes:
            raise producer_failed(
                f"{self._name}: copy_rows needs a file opened ordered (and without caller_hashes); use write_rows",
                file=self._name,
            )
        if self._closed:
            raise producer_failed(f"{self._name} is closed; no more writes are accepted", file=self._name)
        self._owner._check_open()
        coverage = self._coverage_of(name)
        placement = coverage.placement
        start, stop = rows_of_write(self._name, placement, start_row, rows, converts=True)
        if start == stop:
            return  # no bytes: nothing to claim, copy or hash
        begin = placement.begin + start * placement.row_bytes
        end = begin + (stop - start) * placement.row_bytes
        header = len(self._layout.header)
        with self._lock:
            if start > 0 and not self._hasher.lane.holds(name):
                raise self._mixed(name, "write_rows")
            self._claim(coverage, start, stop, ordered_begin=begin)
            try:
                cast = self._cast
                if cast is None:
                    cast = self._cast = CastBuffers()
                slot, target = cast.take(end - begin)
                target.view(placement.spec.dtype).view(rows.shape).copy_(rows)
                data = target.numpy().data
            except BaseException:
                coverage.pending.remove((start, stop))
                raise
            coverage.pending.remove((start, stop))
            coverage.mark_done(start, stop)  # written by the lane; close() waits for it before the fsync
            self._next_byte = end

            def store() -> None:
                self._pwrite(data, header + begin, name, start, stop)

            try:
                cast.hashed_by(
                    slot,
                    self._hasher.lane.feed(
                        name, data, 0, len(data), store, tensor_nbytes=placement.end - placement.begin
                    ),
                )
            except OSError as exc:  # an earlier piece of this file failed to hash
                raise os_failed(exc, f"hashing {self._name}", file=self._name) from exc

    def _store_data(self, nbytes: int, transfer: Callable[[int], int]) -> tuple[int, int]:
        """Claim the next `nbytes` of the data section, `transfer` them to their file offset, mark them written
        when all came; returns how many came and the file offset."""
        if not (self._ordered and self._caller_hashes):
            raise producer_failed(
                f"{self._name}: read_data, send_data and write_data need a file opened ordered with caller_hashes",
                file=self._name,
            )
        if self._closed:
            raise producer_failed(f"{self._name} is closed; no more writes are accepted", file=self._name)
        self._owner._check_open()
        with self._lock:
            begin = self._next_byte
            claims = claims_of(self._name, self._coverage, self._layout.placements, begin, begin + nbytes)
            for coverage, start, stop in claims:
                self._claim(coverage, start, stop, ordered_begin=None)
            offset = len(self._layout.header) + begin
            try:
                done = transfer(offset)
            except OSError as exc:
                what = f"storing data bytes {begin}..{begin + nbytes} of {self._name}"
                raise os_failed(exc, what, file=self._name) from exc
            finally:
                for coverage, start, stop in claims:
                    coverage.pending.remove((start, stop))
            if done == nbytes:
                for coverage, start, stop in claims:
                    coverage.mark_done(start, stop)
                self._next_byte = begin + nbytes
            return done, offset

    def _read_data(self, source_fd: int, source_offset: int, nbytes: int, pieces: DataPieces) -> int:
        def transfer(offset: int) -> int:
            done = 0
            while done < nbytes:
                buffer = pieces.take()
                count = os.preadv(source_fd, [buffer[: min(len(buffer), nbytes - done)]], source_offset + done)
                if count:
                    pwrite_all(self._fd, buffer[:count], offset + done)
                pieces.stored(buffer, count)
                if not count:
                    break  # the source ended early
                done += count
            return done

        return self._store_data(nbytes, transfer)[0]

    def _send_data(self, source_fd: int, source_offset: int, nbytes: int, pieces: SentPieces) -> int:
        def transfer(offset: int) -> int:
            done = 0
            while done < nbytes:
                want = min(pieces.next_piece(), nbytes - done)
                count = send_at(self._fd, offset + done, source_fd, source_offset + done, want)
                if not count:
                    break  # the source ended early
                pieces.sent(offset + done, count)
                done += count
            return done

        return self._store_data(nbytes, transfer)[0]

    def _write_data(self, data: bytes | bytearray | memoryview) -> None:
        def transfer(offset: int) -> int:
            pwrite_all(self._fd, memoryview(data), offset)
            return len(data)

        self._store_data(len(data), transfer)

    def _write_data_parts(self, parts: Sequence[memoryview]) -> None:
        views = [memoryview(part).cast("B") for part in parts]
        nbytes = sum(view.nbytes for view in views)

        def transfer(offset: int) -> int:
            pwritev_all(self._fd, views, offset)
            return nbytes

        self._store_data(nbytes, transfer)

    def _mixed(self, name: str, first: str) -> BaseException:
        return producer_failed(
            f"{self._name}: tensor {name} was begun with {first}; write all of its rows the same way",
            file=self._name,
            tensor=name,
        )

    def _claim(self, coverage: RowCoverage, start: int, stop: int, *, ordered_begin: int | None) -> None:
        """Reserve [start, stop) of a tensor for one write, or fail on overlap or order (lock held)."""
        if self._closed:
            raise producer_failed(f"{self._name} is closed; no more writes are accepted", file=self._name)
        name = coverage.placement.spec.name
        if stop > start:
            clash = coverage.overlaps(start, stop)
            if clash is not None:
                raise producer_failed(
                    f"{self._name}: tensor {name}: rows {start}..{stop} overlap rows {clash[0]}..{clash[1]} "
                    "already written; every byte must be written exactly once",
                    file=self._name,
                    tensor=name,
                    start_row=start,
                    stop_row=stop,
                )
        if ordered_begin is not None and ordered_begin != self._next_byte:
            expected_name, expected_row = self._position_of(self._next_byte)
            raise producer_failed(
                f"{self._name} is ordered: the next write must be tensor {expected_name} row {expected_row} "
                f"(follow .layout, rows in increasing order), got tensor {name} rows {start}..{stop}",
                file=self._name,
                tensor=name,
                start_row=start,
                stop_row=stop,
                expected_tensor=expected_name,
                expected_row=expected_row,
            )
        coverage.pending.append((start, stop))

    def _position_of(self, data_offset: int) -> tuple[str, int]:
        """The tensor and row that hold `data_offset` (for ordered-file messages)."""
        for placement in self._layout.placements:
            if placement.begin <= data_offset < placement.end:
                return placement.spec.name, (data_offset - placement.begin) // max(placement.row_bytes, 1)
        return "<end of file>", 0

    def _pwrite(self, data: memoryview, offset: int, name: str, start: int, stop: int) -> None:
        try:
            pwrite_all(self._fd, data, offset)
        except OSError as exc:
            raise os_failed(
                exc,
                f"writing tensor {name} rows {start}..{stop} of {self._name}",
                file=self._name,
                tensor=name,
            ) from exc

    # -- closing

    def _close(
        self,
        caller_digests: tuple[str, ...] | None = None,
        expected: tuple[TensorManifestEntry, ...] | None = None,
    ) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                check_complete(self._name, self._layout, self._coverage)
                self._wait_lane()
                try:
                    fault_point("writer.fsync")
                    os.fsync(self._fd)
                except OSError as exc:
                    raise os_failed(exc, f"fsyncing {self._name}", file=self._name) from exc
                try:
                    self._result = self._written_file(caller_digests, expected)
                except OSError as exc:  # reading the written bytes back to hash them
                    raise os_failed(exc, f"hashing {self._name}", file=self._name) from exc
            finally:
                self._hasher.drain()
                self._release_fd()

    def _wait_lane(self) -> None:
        """Every row `copy_rows` handed the lane is in the file (its write failure, typed, raises here)."""
        try:
            self._hasher.lane.wait()
        except OSError as exc:  # a piece failed to hash
            raise os_failed(exc, f"hashing {self._name}", file=self._name) from exc

    def _written_file(
        self,
        caller_digests: tuple[str, ...] | None = None,
        expected: tuple[TensorManifestEntry, ...] | None = None,
    ) -> WrittenFile:
        """The manifest's record of this complete file, with the digests of what was written."""
        if caller_digests is None:
            digests = self._hasher.tensor_digests(ordered=self._ordered)
        else:
            digests = check_caller_digests(self._name, self._layout, caller_digests)
        return written_file(self._name, self._layout, digests, self._hasher.file_digest(digests), expected)

    def _release_fd(self) -> None:
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            with contextlib.suppress(OSError):
                os.close(fd)

    def _abandon(self) -> None:
        """Close the descriptor without checks (abort path); never raises."""
        with self._lock:
            self._closed = True
            self._hasher.drain()
            self._release_fd()

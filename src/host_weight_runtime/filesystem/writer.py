"""The store-scoped streaming safetensors writer: the only way a producer puts bytes into a build.

Each payload file is laid out completely when it is opened: the safetensors header is
written first, the file is preallocated to its final size, and every tensor has a fixed,
aligned place. Producers then fill those places in any order (or in layout order, which
lets the writer hash while writing). A file is accepted only when every byte of every
tensor was written exactly once.

File layout (standard safetensors, readable by stock ``safetensors.safe_open``)::

    [u64 little-endian N][N bytes: canonical JSON header, space padded][tensor data]
     `-- 8 + N is a multiple of 8, so the data section starts 8-byte aligned

Tensors are placed in declared order, stable-sorted by element size (largest first),
contiguously and without holes, so each tensor's offset is a multiple of its element
size and a reader can view it zero-copy.
"""

from __future__ import annotations

import bisect
import contextlib
import errno
import mmap
import os
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch

from .._digest import (
    DIGEST_CHUNK_BYTES,
    chunk_digest,
    combine_chunk_digests,
    default_hash_threads,
    file_digest,
    tree_digest,
    tree_digests_parallel,
)
from .._faults import fault_point
from ..canonical_json import JsonValue, encode_canonical
from ..failures import FailureCode, HostWeightError, HostWeightFailure, ResolutionStage, failure
from ..manifest import FileManifestEntry, TensorManifestEntry, validate_file_name
from ..protocols import TensorWriteSpec
from ..tensors import contiguous_strides, dtype_code, dtype_itemsize
from ._fsutil import failure_from_os_error

__all__ = [
    "HEADER_ALIGNMENT",
    "StagingArtifactWriter",
    "StagingTensorFileWriter",
    "WrittenFile",
]

HEADER_ALIGNMENT = 8
_METADATA_KEY = "__metadata__"
_HEADER_METADATA: dict[str, JsonValue] = {"format": "pt"}
_FILE_FLAGS = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW
_FILE_MODE = 0o600

_T = TypeVar("_T")


# --------------------------------------------------------------------------- results


@dataclass(frozen=True, slots=True)
class WrittenFile:
    """One closed, complete, fsynced payload file and the digests the manifest records."""

    name: str
    size: int
    header_size: int
    digest: str
    tensors: tuple[TensorManifestEntry, ...]

    def manifest_entry(self) -> FileManifestEntry:
        """The manifest's view of this file (tensor names in offset order)."""
        return FileManifestEntry(
            name=self.name,
            size=self.size,
            header_size=self.header_size,
            digest=self.digest,
            tensors=tuple(entry.name for entry in self.tensors),
        )


# --------------------------------------------------------------------------- failures


def _producer_failed(message: str, **details: JsonValue) -> HostWeightError:
    """A misuse of the writer by the producer: never retryable, a retry would do the same."""
    return HostWeightError(
        failure(ResolutionStage.PRODUCTION, FailureCode.PRODUCER_FAILED, message, retryable=False, **details)
    )


def _os_failed(exc: OSError, what: str, **details: JsonValue) -> HostWeightError:
    """Type an OSError: no space and quota are retryable capacity failures, EIO a retryable I/O error."""
    return HostWeightError(failure_from_os_error(exc, stage=ResolutionStage.PRODUCTION, what=what, **details))


# --------------------------------------------------------------------------- layout


@dataclass(frozen=True, slots=True)
class _Placement:
    """Where one tensor lives; offsets are relative to the data section, as in the header."""

    spec: TensorWriteSpec
    code: str
    begin: int
    end: int
    rows: int
    row_bytes: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True, slots=True)
class _FileLayout:
    """The complete plan of one payload file, fixed before any byte is written."""

    header: bytes  # the whole prefix: length word, JSON and padding
    placements: tuple[_Placement, ...]  # offset order
    size: int


def _plan_layout(specs: tuple[TensorWriteSpec, ...]) -> _FileLayout:
    """Place tensors by element size (largest first, stable) and build the padded header."""
    itemsizes = {spec.name: dtype_itemsize(spec.dtype) for spec in specs}
    ordered = sorted(specs, key=lambda spec: -itemsizes[spec.name])
    placements: list[_Placement] = []
    position = 0
    header_value: dict[str, JsonValue] = {_METADATA_KEY: dict(_HEADER_METADATA)}
    for spec in ordered:
        code = dtype_code(spec.dtype)
        nbytes = spec.nbytes
        if spec.shape:
            rows = spec.shape[0]
            row_bytes = nbytes // rows if rows else 0
        else:
            rows, row_bytes = 1, nbytes
        placements.append(_Placement(spec, code, position, position + nbytes, rows, row_bytes))
        header_value[spec.name] = {
            "dtype": code,
            "shape": list(spec.shape),
            "data_offsets": [position, position + nbytes],
        }
        position += nbytes
    text = encode_canonical(header_value)
    padding = -(8 + len(text)) % HEADER_ALIGNMENT
    body = text + b" " * padding
    header = len(body).to_bytes(8, "little") + body
    return _FileLayout(header=header, placements=tuple(placements), size=len(header) + position)


def _tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """A flat uint8 view of the tensor's bytes; copies only when the input is not contiguous."""
    source = tensor.detach()
    if source.is_conj():
        source = source.resolve_conj()
    if source.is_neg():
        source = source.resolve_neg()
    return source.contiguous().reshape(-1).view(torch.uint8).numpy().data


# --------------------------------------------------------------------------- per-file writer


def _hash_file_range(fd: int, offset: int, length: int) -> bytes:
    """The chunk digest of `length` bytes at `offset` of a written file, through a mapping of just those bytes."""
    if length == 0:
        return chunk_digest(memoryview(b""))
    aligned = offset - offset % mmap.ALLOCATIONGRANULARITY
    with (
        mmap.mmap(fd, offset - aligned + length, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ, offset=aligned) as mapping,
        memoryview(mapping) as whole,
        whole[offset - aligned :] as piece,
    ):
        return chunk_digest(piece)


class _TensorState:
    """Mutable bookkeeping for one tensor: written row intervals, in-flight claims, chunk hashes in flight."""

    __slots__ = ("chunk_hashes", "done", "index", "pending", "placement")

    def __init__(self, index: int, placement: _Placement) -> None:
        self.index = index
        self.placement = placement
        self.done: list[tuple[int, int]] = []  # sorted, merged, half-open row intervals
        self.pending: list[tuple[int, int]] = []  # claimed by writes still in flight
        self.chunk_hashes: list[Future[bytes]] | None = None  # ordered files: hashing of the written bytes

    def overlaps(self, start: int, stop: int) -> tuple[int, int] | None:
        """The first already written or in-flight interval that meets [start, stop), if any."""
        index = bisect.bisect_left(self.done, stop, key=lambda interval: interval[0])
        if index and self.done[index - 1][1] > start:  # the last interval that begins before `stop`
            return self.done[index - 1]
        for candidate in self.pending:
            if candidate[0] < stop and start < candidate[1]:
                return candidate
        return None

    def mark_done(self, start: int, stop: int) -> None:
        index = bisect.bisect_left(self.done, (start, stop))
        self.done.insert(index, (start, stop))
        merged: list[tuple[int, int]] = []
        for begin, end in self.done[max(index - 1, 0) : index + 2]:
            if merged and merged[-1][1] == begin:
                merged[-1] = (merged[-1][0], end)
            else:
                merged.append((begin, end))
        self.done[max(index - 1, 0) : index + 2] = merged

    def first_missing(self) -> tuple[int, int] | None:
        """The first row interval never written, or None when every byte is covered."""
        if self.placement.nbytes == 0:
            return None
        position = 0
        for begin, end in self.done:
            if begin > position:
                return (position, begin)
            position = end
        if position < self.placement.rows:
            return (position, self.placement.rows)
        return None


class StagingTensorFileWriter:
    """Writes the declared tensors of one payload file at their fixed, preallocated offsets.

    Obtained from `StagingArtifactWriter.open_tensor_file`. Unordered writes may come
    from several threads at once (disjoint rows go to disk in parallel); ordered files
    take writes in `layout` order only.
    """

    __slots__ = (
        "_closed",
        "_fd",
        "_layout",
        "_lock",
        "_name",
        "_next_byte",
        "_ordered",
        "_owner",
        "_result",
        "_states",
    )

    def __init__(self, owner: StagingArtifactWriter, name: str, fd: int, layout: _FileLayout, *, ordered: bool) -> None:
        self._owner = owner
        self._name = name
        self._fd = fd
        self._layout = layout
        self._ordered = ordered
        self._lock = threading.Lock()
        self._closed = False
        self._result: WrittenFile | None = None
        self._next_byte = 0  # ordered files: the data offset the next write must start at
        self._states: dict[str, _TensorState] = {
            placement.spec.name: _TensorState(index, placement) for index, placement in enumerate(layout.placements)
        }

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

    def close(self) -> None:
        """Check coverage, fsync, hash and release the file; later calls do nothing."""
        self._owner._guarded(self._close)

    # -- implementation

    def _state_for(self, name: str) -> _TensorState:
        state = self._states.get(name) if isinstance(name, str) else None
        if state is None:
            raise _producer_failed(
                f"{self._name}: tensor {name!r} was not declared for this file; declare every tensor in "
                "open_tensor_file",
                file=self._name,
                tensor=str(name),
            )
        return state

    def _check_tensor(self, state: _TensorState, start_row: int | None, tensor: torch.Tensor) -> tuple[int, int]:
        """Validate one write against the spec; returns the half-open row interval it covers."""
        spec = state.placement.spec
        where = f"{self._name}: tensor {spec.name}"
        if not isinstance(tensor, torch.Tensor):
            raise _producer_failed(
                f"{where}: expected a torch.Tensor, got {type(tensor).__name__}", file=self._name, tensor=spec.name
            )
        if tensor.device.type != "cpu" or tensor.layout != torch.strided:
            raise _producer_failed(
                f"{where}: expected a dense CPU tensor, got {tensor.device} / {tensor.layout}; move it to the CPU",
                file=self._name,
                tensor=spec.name,
            )
        if tensor.dtype != spec.dtype:
            raise _producer_failed(
                f"{where}: dtype {tensor.dtype} differs from the declared {spec.dtype}",
                file=self._name,
                tensor=spec.name,
            )
        shape = tuple(tensor.shape)
        if start_row is None:
            if shape != spec.shape:
                raise _producer_failed(
                    f"{where}: shape {shape} differs from the declared {spec.shape}", file=self._name, tensor=spec.name
                )
            return (0, state.placement.rows)
        if not spec.shape:
            raise _producer_failed(
                f"{where}: a 0-dim tensor has no rows; use write_tensor", file=self._name, tensor=spec.name
            )
        if type(start_row) is not int or start_row < 0:
            raise _producer_failed(
                f"{where}: start_row must be a non-negative int, got {start_row!r}", file=self._name, tensor=spec.name
            )
        if len(shape) != len(spec.shape) or shape[1:] != spec.shape[1:]:
            raise _producer_failed(
                f"{where}: rows of shape {shape} do not fit the declared {spec.shape} (trailing dims must match)",
                file=self._name,
                tensor=spec.name,
            )
        stop = start_row + shape[0]
        if stop > spec.shape[0]:
            raise _producer_failed(
                f"{where}: rows {start_row}..{stop} run past the declared {spec.shape[0]} rows",
                file=self._name,
                tensor=spec.name,
                start_row=start_row,
                stop_row=stop,
            )
        return (start_row, stop)

    def _write(self, name: str, start_row: int | None, tensor: torch.Tensor) -> None:
        if self._closed:
            raise _producer_failed(f"{self._name} is closed; no more writes are accepted", file=self._name)
        self._owner._check_open()
        state = self._state_for(name)
        start, stop = self._check_tensor(state, start_row, tensor)
        placement = state.placement
        data = _tensor_bytes(tensor)
        begin = placement.begin + start * placement.row_bytes
        if len(data) != (stop - start) * placement.row_bytes:  # pragma: no cover - guarded by the shape check
            raise _producer_failed(f"{self._name}: tensor {name}: byte count mismatch", file=self._name, tensor=name)
        if self._ordered:
            with self._lock:
                self._claim(state, start, stop, ordered_begin=begin if len(data) else None)
                try:
                    self._pwrite(data, len(self._layout.header) + begin, name, start, stop)
                except BaseException:
                    state.pending.remove((start, stop))
                    raise
                state.pending.remove((start, stop))
                if stop > start:
                    state.mark_done(start, stop)
                if len(data):
                    self._next_byte = begin + len(data)
                if state.first_missing() is None:
                    self._hash_behind(state)
            return
        with self._lock:
            self._claim(state, start, stop, ordered_begin=None)
        try:
            self._pwrite(data, len(self._layout.header) + begin, name, start, stop)
        except BaseException:
            with self._lock:
                state.pending.remove((start, stop))
            raise
        with self._lock:
            state.pending.remove((start, stop))
            if stop > start:
                state.mark_done(start, stop)

    def _hash_behind(self, state: _TensorState) -> None:
        """Queue the chunks of a completely written tensor for hashing on the pool, read back from the file.

        Writing goes on while earlier tensors hash, so publication runs at the speed of all
        hash threads together, and the producer may reuse its buffers as soon as a write
        returns. Each chunk maps only its own bytes, so the mapped memory stays bounded.
        Called with the lock held.
        """
        if state.chunk_hashes is not None:
            return
        chunk_bytes = self._owner.chunk_bytes
        begin = len(self._layout.header) + state.placement.begin
        length = state.placement.end - state.placement.begin
        pool = self._owner._executor()
        starts = range(begin, begin + length, chunk_bytes) if length else range(begin, begin + 1)
        state.chunk_hashes = [
            pool.submit(_hash_file_range, self._fd, start, min(chunk_bytes, begin + length - start)) for start in starts
        ]

    def _drain_hashes(self) -> None:
        """Wait for every queued chunk hash, so none reads the file after its descriptor closes; never raises."""
        for state in self._states.values():
            for future in state.chunk_hashes or ():
                future.cancel()
                with contextlib.suppress(BaseException):  # only waiting here; results are read elsewhere
                    future.exception()

    def _claim(self, state: _TensorState, start: int, stop: int, *, ordered_begin: int | None) -> None:
        """Reserve [start, stop) of a tensor for one write, or fail on overlap or order (lock held)."""
        if self._closed:
            raise _producer_failed(f"{self._name} is closed; no more writes are accepted", file=self._name)
        name = state.placement.spec.name
        if stop > start:
            clash = state.overlaps(start, stop)
            if clash is not None:
                raise _producer_failed(
                    f"{self._name}: tensor {name}: rows {start}..{stop} overlap rows {clash[0]}..{clash[1]} "
                    "already written; every byte must be written exactly once",
                    file=self._name,
                    tensor=name,
                    start_row=start,
                    stop_row=stop,
                )
        if ordered_begin is not None and ordered_begin != self._next_byte:
            expected_name, expected_row = self._position_of(self._next_byte)
            raise _producer_failed(
                f"{self._name} is ordered: the next write must be tensor {expected_name} row {expected_row} "
                f"(follow .layout, rows in increasing order), got tensor {name} rows {start}..{stop}",
                file=self._name,
                tensor=name,
                start_row=start,
                stop_row=stop,
                expected_tensor=expected_name,
                expected_row=expected_row,
            )
        state.pending.append((start, stop))

    def _position_of(self, data_offset: int) -> tuple[str, int]:
        """The tensor and row that hold `data_offset` (for ordered-file messages)."""
        for placement in self._layout.placements:
            if placement.begin <= data_offset < placement.end:
                return placement.spec.name, (data_offset - placement.begin) // max(placement.row_bytes, 1)
        return "<end of file>", 0

    def _pwrite(self, data: memoryview, offset: int, name: str, start: int, stop: int) -> None:
        done = 0
        total = len(data)
        try:
            while done < total:
                fault_point("writer.pwrite")
                written = os.pwrite(self._fd, data[done:], offset + done)
                if written <= 0:
                    raise OSError(errno.EIO, "pwrite wrote no bytes")
                done += written
        except OSError as exc:
            raise _os_failed(
                exc,
                f"writing tensor {name} rows {start}..{stop} of {self._name}",
                file=self._name,
                tensor=name,
            ) from exc

    def _close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                self._check_complete()
                try:
                    fault_point("writer.fsync")
                    os.fsync(self._fd)
                except OSError as exc:
                    raise _os_failed(exc, f"fsyncing {self._name}", file=self._name) from exc
                self._result = self._finish_digests()
            finally:
                self._drain_hashes()
                self._release_fd()

    def _check_complete(self) -> None:
        for placement in self._layout.placements:
            state = self._states[placement.spec.name]
            missing = state.first_missing()
            if missing is not None or state.pending:
                begin, end = missing if missing is not None else state.pending[0]
                raise _producer_failed(
                    f"{self._name}: tensor {placement.spec.name} rows {begin}..{end} were never written; "
                    "every byte of every declared tensor must be written before close()",
                    file=self._name,
                    tensor=placement.spec.name,
                    start_row=begin,
                    stop_row=end,
                )

    def _finish_digests(self) -> WrittenFile:
        chunk_bytes = self._owner.chunk_bytes
        header_digest = tree_digest(self._layout.header, chunk_bytes)
        if self._ordered:
            digests = []
            try:
                for placement in self._layout.placements:
                    state = self._states[placement.spec.name]
                    self._hash_behind(state)  # a tensor with no bytes was never written, so never queued
                    assert state.chunk_hashes is not None
                    chunk_results = [future.result() for future in state.chunk_hashes]
                    digests.append(combine_chunk_digests(placement.end - placement.begin, chunk_results))
            finally:
                self._drain_hashes()
        else:
            digests = self._hash_from_file()
        entries = tuple(
            TensorManifestEntry(
                name=placement.spec.name,
                file=self._name,
                dtype=placement.code,
                shape=placement.spec.shape,
                strides=contiguous_strides(placement.spec.shape),
                data_offsets=(placement.begin, placement.end),
                kind=placement.spec.kind,
                role=placement.spec.role,
                digest=digest,
            )
            for placement, digest in zip(self._layout.placements, digests, strict=True)
        )
        return WrittenFile(
            name=self._name,
            size=self._layout.size,
            header_size=len(self._layout.header),
            digest=file_digest(header_digest, digests),
            tensors=entries,
        )

    def _hash_from_file(self) -> list[str]:
        """Hash every tensor from the file itself, chunks spread over the owner's hash threads."""
        header_size = len(self._layout.header)
        try:
            mapping = mmap.mmap(self._fd, self._layout.size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        except OSError as exc:
            raise _os_failed(exc, f"mapping {self._name} to hash it", file=self._name) from exc
        try:
            whole = memoryview(mapping)
            views = [whole[header_size + p.begin : header_size + p.end] for p in self._layout.placements]
            try:
                return tree_digests_parallel(
                    views, chunk_bytes=self._owner.chunk_bytes, threads=self._owner.hash_threads
                )
            finally:
                for view in views:
                    view.release()
                whole.release()
        finally:
            with contextlib.suppress(BufferError):  # a view still alive after an error; it goes with it
                mapping.close()

    def _release_fd(self) -> None:
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            with contextlib.suppress(OSError):
                os.close(fd)

    def _abandon(self) -> None:
        """Close the descriptor without checks (abort path); never raises."""
        with self._lock:
            self._closed = True
            self._drain_hashes()
            self._release_fd()


# --------------------------------------------------------------------------- artifact writer


class StagingArtifactWriter:
    """The `ArtifactWriter` a store hands a producer: one staging directory, typed failures.

    The store owns the directory and its removal; this writer owns the payload files
    inside it, their capacity reservations (via `reserve`) and their digests.
    """

    __slots__ = (
        "_aborted",
        "_bytes_reserved",
        "_chunk_bytes",
        "_failure",
        "_file_names",
        "_files",
        "_finished",
        "_hash_threads",
        "_lock",
        "_pool",
        "_reserve",
        "_staging_dir",
        "_tensor_names",
    )

    def __init__(
        self,
        staging_dir: Path,
        *,
        reserve: Callable[[int], None],
        chunk_bytes: int = DIGEST_CHUNK_BYTES,
        hash_threads: int | None = None,
    ) -> None:
        if type(chunk_bytes) is not int or chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be a positive int, got {chunk_bytes!r}")
        if hash_threads is not None and (type(hash_threads) is not int or hash_threads < 1):
            raise ValueError(f"hash_threads must be None or a positive int, got {hash_threads!r}")
        self._staging_dir = Path(staging_dir)
        self._reserve = reserve
        self._chunk_bytes = chunk_bytes
        self._hash_threads = hash_threads
        self._lock = threading.Lock()
        self._failure: HostWeightFailure | None = None
        self._bytes_reserved = 0
        self._files: list[StagingTensorFileWriter] = []
        self._file_names: set[str] = set()
        self._tensor_names: set[str] = set()
        self._finished: tuple[WrittenFile, ...] | None = None
        self._aborted = False
        self._pool: ThreadPoolExecutor | None = None

    def _executor(self) -> ThreadPoolExecutor:
        """Threads that write and hash ordered files side by side (hashlib and pwrite release the GIL)."""
        with self._lock:
            if self._pool is None:
                workers = max(2, self._hash_threads or default_hash_threads())
                self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="hwr-write")
            return self._pool

    def _shutdown_pool(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)

    # -- read-only facts

    @property
    def staging_dir(self) -> Path:
        return self._staging_dir

    @property
    def chunk_bytes(self) -> int:
        """The digest chunk size; the manifest must record it as `digest_chunk_bytes`."""
        return self._chunk_bytes

    @property
    def hash_threads(self) -> int | None:
        return self._hash_threads

    @property
    def failure(self) -> HostWeightFailure | None:
        """The first failure raised to the producer, even if the producer swallowed or wrapped it."""
        return self._failure

    @property
    def bytes_reserved(self) -> int:
        """Bytes granted by `reserve` so far (a file that later failed to open still counts)."""
        return self._bytes_reserved

    # -- failure plumbing

    def _record(self, value: HostWeightFailure) -> None:
        with self._lock:
            if self._failure is None:
                self._failure = value

    def _guarded(self, action: Callable[[], _T]) -> _T:
        """Run a producer-facing operation so that only HostWeightError escapes, first one recorded."""
        try:
            return action()
        except HostWeightError as exc:
            self._record(exc.failure)
            raise
        except Exception as exc:
            error = _producer_failed(
                f"the writer failed unexpectedly: {type(exc).__name__}: {exc}", exception=type(exc).__name__
            )
            self._record(error.failure)
            raise error from exc

    def _check_open(self) -> None:
        if self._aborted:
            raise _producer_failed("the artifact writer was aborted; the build is over")
        if self._finished is not None:
            raise _producer_failed("the artifact writer is finished; no more writes are accepted")

    # -- the ArtifactWriter protocol

    def open_tensor_file(
        self,
        relative_name: str,
        specs: tuple[TensorWriteSpec, ...],
        *,
        ordered: bool = False,
    ) -> StagingTensorFileWriter:
        """Create, preallocate and header-stamp one payload file for exactly `specs`."""
        return self._guarded(lambda: self._open(relative_name, specs, ordered))

    def _open(self, relative_name: str, specs: Iterable[TensorWriteSpec], ordered: bool) -> StagingTensorFileWriter:
        self._check_open()
        try:
            name = validate_file_name(relative_name)
        except ValueError as exc:
            raise _producer_failed(f"bad payload file name: {exc}", file=str(relative_name)) from None
        declared = self._check_specs(name, specs)
        layout = _plan_layout(declared)
        tensor_names = {spec.name for spec in declared}
        with self._lock:
            if name in self._file_names:
                raise _producer_failed(f"payload file {name} was already opened; each file is written once", file=name)
            clashes = sorted(tensor_names & self._tensor_names)
            if clashes:
                raise _producer_failed(
                    f"{name}: tensor {clashes[0]} is already declared in another file; tensor names are unique "
                    "across the artifact",
                    file=name,
                    tensor=clashes[0],
                )
            self._file_names.add(name)
            self._tensor_names |= tensor_names
        try:
            file_writer = self._create(name, layout, ordered)
        except BaseException:
            with self._lock:
                self._file_names.discard(name)
                self._tensor_names -= tensor_names
            raise
        with self._lock:
            self._files.append(file_writer)
        return file_writer

    def _check_specs(self, name: str, specs: Iterable[TensorWriteSpec]) -> tuple[TensorWriteSpec, ...]:
        try:
            declared = tuple(specs)
        except TypeError:
            raise _producer_failed(f"{name}: specs must be a tuple of TensorWriteSpec", file=name) from None
        if not declared:
            raise _producer_failed(f"{name}: a payload file must declare at least one tensor", file=name)
        seen: set[str] = set()
        for spec in declared:
            if not isinstance(spec, TensorWriteSpec):
                raise _producer_failed(f"{name}: specs must be TensorWriteSpec, got {type(spec).__name__}", file=name)
            if spec.name in seen:
                raise _producer_failed(f"{name}: tensor {spec.name} is declared twice", file=name, tensor=spec.name)
            if spec.name == _METADATA_KEY:
                raise _producer_failed(
                    f"{name}: {_METADATA_KEY} is reserved by safetensors; rename the tensor",
                    file=name,
                    tensor=spec.name,
                )
            try:
                dtype_code(spec.dtype)
            except ValueError as exc:
                raise _producer_failed(f"{name}: tensor {spec.name}: {exc}", file=name, tensor=spec.name) from None
            seen.add(spec.name)
        return declared

    def _create(self, name: str, layout: _FileLayout, ordered: bool) -> StagingTensorFileWriter:
        self._reserve(layout.size)  # capacity failures propagate unchanged (and are recorded)
        with self._lock:
            self._bytes_reserved += layout.size
        path = self._staging_dir / name
        try:
            fd = os.open(path, _FILE_FLAGS, _FILE_MODE)
        except OSError as exc:
            raise _os_failed(exc, f"creating {name} in the staging directory", file=name) from exc
        try:
            try:
                fault_point("writer.preallocate")
                os.posix_fallocate(fd, 0, layout.size)
            except OSError as exc:
                raise _os_failed(
                    exc, f"preallocating {layout.size} bytes for {name}", file=name, size=layout.size
                ) from exc
            done = 0
            try:
                while done < len(layout.header):
                    fault_point("writer.pwrite")
                    written = os.pwrite(fd, layout.header[done:], done)
                    if written <= 0:
                        raise OSError(errno.EIO, "pwrite wrote no bytes")
                    done += written
            except OSError as exc:
                raise _os_failed(exc, f"writing the safetensors header of {name}", file=name) from exc
            return StagingTensorFileWriter(self, name, fd, layout, ordered=ordered)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(path)  # ours (O_EXCL); free its blocks now rather than at cleanup
            raise

    def finish(self) -> tuple[WrittenFile, ...]:
        """All files closed, complete and fsynced (and their names durable); returns them in open order."""
        return self._guarded(self._finish)

    def _finish(self) -> tuple[WrittenFile, ...]:
        if self._finished is not None:
            return self._finished
        try:
            if self._aborted:
                raise _producer_failed("the artifact writer was aborted; nothing can be published")
            if self._failure is not None:
                raise HostWeightError(self._failure)
            with self._lock:
                files = list(self._files)
            if not files:
                raise _producer_failed("the producer wrote no payload file; an artifact needs at least one")
            results: list[WrittenFile] = []
            for file_writer in files:
                if not file_writer.closed:
                    raise _producer_failed(
                        f"{file_writer.name} was never closed; the producer must close() every file it opens",
                        file=file_writer.name,
                    )
                if file_writer.result is None:
                    raise _producer_failed(f"{file_writer.name} is incomplete", file=file_writer.name)
                results.append(file_writer.result)
            try:
                fault_point("writer.fsync")
                fd = os.open(self._staging_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
            except OSError as exc:
                raise _os_failed(exc, "fsyncing the staging directory") from exc
        except BaseException:
            self.abort()
            raise
        self._finished = tuple(results)
        self._shutdown_pool()
        return self._finished

    def abort(self) -> None:
        """Close every open payload descriptor; never raises; the store removes the directory."""
        with self._lock:
            self._aborted = True
            files = list(self._files)
        self._shutdown_pool()
        for file_writer in files:
            with contextlib.suppress(Exception):  # abort must never raise
                file_writer._abandon()

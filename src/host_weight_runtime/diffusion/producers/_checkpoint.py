"""A bounded-memory reader for safetensors checkpoints: header parsing and row-range preads.

The streaming producer reads rows with `os.pread` instead of mapping the checkpoint, so
its resident memory stays at one chunk no matter how large the shards are.
"""

from __future__ import annotations

import errno
import hashlib
import mmap
import os
import struct
import threading
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..._faults import fault_point
from ...canonical_json import decode_json
from ...tensors import dtype_from_code

__all__ = [
    "CheckpointTensor",
    "ScratchBuffer",
    "mapped_rows",
    "read_column_ranges",
    "read_rows",
    "read_safetensors_header",
]

_MAX_HEADER_BYTES = 100 * 2**20
_KEPT_HEADERS = 64
_KEPT_HEADER_BYTES = 2**20
_PARSED_HEADERS: OrderedDict[tuple[str, int, bytes], dict[str, CheckpointTensor]] = OrderedDict()
"""Per process: a header parsed once per exact (path, file size, SHA-256 of the header bytes), the whole input of
the parse. A load checks every header up front and its stream reads them again; the second read still reads the
bytes."""
_PARSED_HEADERS_GUARD = threading.Lock()
_MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # Linux 5.14; Python names it from 3.13 on


class CheckpointFormatError(ValueError):
    """A checkpoint file is not a well-formed safetensors file."""


@dataclass(frozen=True, slots=True)
class CheckpointTensor:
    """Where one tensor's bytes are in a safetensors file."""

    path: Path
    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def row_bytes(self) -> int:
        if not self.shape:
            return self.end - self.begin
        rows = self.shape[0]
        return 0 if rows == 0 else (self.end - self.begin) // rows


def read_safetensors_header(path: Path) -> dict[str, CheckpointTensor]:
    """Parse and check a safetensors header: known dtypes, sizes that match shapes, offsets inside the file."""
    with open(path, "rb") as handle:
        size = os.fstat(handle.fileno()).st_size
        prefix = handle.read(8)
        if len(prefix) != 8:
            raise CheckpointFormatError(f"{path} is too short to be a safetensors file")
        (header_len,) = struct.unpack("<Q", prefix)
        if header_len > _MAX_HEADER_BYTES or 8 + header_len > size:
            raise CheckpointFormatError(f"{path} declares a {header_len}-byte header; the file is {size} bytes")
        raw = handle.read(header_len)
    key = (str(path), size, hashlib.sha256(raw).digest())
    with _PARSED_HEADERS_GUARD:
        parsed = _PARSED_HEADERS.get(key)
        if parsed is not None:
            _PARSED_HEADERS.move_to_end(key)
            return dict(parsed)
    found = _parse_header(path, size, header_len, raw)
    if header_len <= _KEPT_HEADER_BYTES:
        with _PARSED_HEADERS_GUARD:
            _PARSED_HEADERS[key] = found
            while len(_PARSED_HEADERS) > _KEPT_HEADERS:
                _PARSED_HEADERS.popitem(last=False)
    return dict(found)


def _parse_header(path: Path, size: int, header_len: int, raw: bytes) -> dict[str, CheckpointTensor]:
    """The tensors a header's bytes declare, each checked against the file's size."""
    try:
        header: Any = decode_json(raw, max_bytes=_MAX_HEADER_BYTES)
    except ValueError as exc:  # not UTF-8 JSON, duplicate names, nested too deeply, ...
        raise CheckpointFormatError(f"{path} has an unreadable safetensors header: {exc}") from exc
    if not isinstance(header, dict):
        raise CheckpointFormatError(f"{path}: the safetensors header is not a JSON object")
    data_start = 8 + header_len
    found: dict[str, CheckpointTensor] = {}
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        try:
            dtype = dtype_from_code(entry["dtype"])
            shape = tuple(int(dim) for dim in entry["shape"])
            begin, end = (int(offset) for offset in entry["data_offsets"])
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointFormatError(f"{path}: tensor {key!r} has a malformed header entry: {exc}") from exc
        numel = 1
        for dim in shape:
            numel *= dim
        if begin < 0 or end - begin != numel * dtype.itemsize or data_start + end > size:
            raise CheckpointFormatError(f"{path}: tensor {key!r} has data_offsets that do not fit its shape or file")
        found[key] = CheckpointTensor(path, key, dtype, shape, data_start + begin, data_start + end)
    return found


def _row_span(tensor: CheckpointTensor, start_row: int, stop_row: int) -> tuple[int, int, tuple[int, ...]]:
    """File offset, byte length and shape of rows [start_row, stop_row) (a 0-dim tensor: all of it)."""
    if not tensor.shape:
        return tensor.begin, tensor.end - tensor.begin, tensor.shape
    offset = tensor.begin + start_row * tensor.row_bytes
    return offset, (stop_row - start_row) * tensor.row_bytes, (stop_row - start_row, *tensor.shape[1:])


def read_rows(
    fd: int, tensor: CheckpointTensor, start_row: int, stop_row: int, scratch: ScratchBuffer | None = None
) -> torch.Tensor:
    """Rows [start_row, stop_row) of a tensor, read with pread into a fresh buffer (or into `scratch`'s)."""
    offset, length, shape = _row_span(tensor, start_row, stop_row)
    if length == 0:
        return torch.empty(shape, dtype=tensor.dtype)
    if scratch is not None:
        target = scratch.take(length)
        view = target.numpy().data.cast("B")
    else:
        target = None
        buffer = bytearray(length)
        view = memoryview(buffer)
    done = 0
    while done < length:
        got = os.preadv(fd, [view[done:]], offset + done)
        if got == 0:
            raise CheckpointFormatError(f"{tensor.path} ended while reading tensor {tensor.key!r}")
        done += got
    if target is not None:
        return target.view(tensor.dtype).reshape(shape)
    return torch.frombuffer(buffer, dtype=tensor.dtype).reshape(shape)


def mapped_rows(fd: int, tensor: CheckpointTensor, start_row: int, stop_row: int) -> torch.Tensor:
    """Rows [start_row, stop_row) of a tensor as a read-only-in-practice view of the checkpoint's page cache.

    Casting straight from the mapping saves the copy a pread makes (about 0.13 s per GiB of
    FP32 on the 2-core VM); only this chunk is mapped, so the mapped memory stays one chunk.
    Dropping the view unmaps the chunk. The pages are faulted in up front, so a file cut short
    raises CheckpointFormatError here rather than a SIGBUS in the cast; one truncated in place during the cast
    can still raise SIGBUS, as it can under any mmap loader, diffusers' own included.
    """
    offset, length, shape = _row_span(tensor, start_row, stop_row)
    if length == 0:
        return torch.empty(shape, dtype=tensor.dtype)
    aligned = offset - offset % mmap.ALLOCATIONGRANULARITY
    # Private and writable only so torch gets a writable buffer; nothing writes to it, so no page is copied.
    try:
        fault_point("checkpoint.map")
        mapping = mmap.mmap(
            fd, offset - aligned + length, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE, offset=aligned
        )
    except ValueError as exc:  # the range reaches past the end of the file
        raise CheckpointFormatError(f"{tensor.path} ended while reading tensor {tensor.key!r}") from exc
    except OSError:  # a filesystem that cannot map files: read the rows instead
        return read_rows(fd, tensor, start_row, stop_row)
    fault_point("checkpoint.mapped")  # tests cut the file short here, between mapping and faulting in
    try:
        mapping.madvise(_MADV_POPULATE_READ)
    except OSError as exc:
        if exc.errno == errno.EFAULT:  # a page past the end of the file: it was cut short
            raise CheckpointFormatError(f"{tensor.path} ended while reading tensor {tensor.key!r}") from exc
        if exc.errno != errno.EINVAL:  # EINVAL: a kernel before 5.14; the cast faults the pages in
            raise
    # The tensor holds the mapping and unmaps it when the last view is gone: never closed under a live view.
    return (
        torch.frombuffer(mapping, dtype=torch.uint8, count=length, offset=offset - aligned)
        .view(tensor.dtype)
        .reshape(shape)
    )


class ScratchBuffer:
    """One reusable byte buffer, grown to the largest request: a stream of chunks that are each written
    (and so no longer needed) before the next is read allocates and page-faults its memory only once."""

    __slots__ = ("_buffer",)

    def __init__(self) -> None:
        self._buffer = torch.empty(0, dtype=torch.uint8)

    def take(self, nbytes: int) -> torch.Tensor:
        """The first `nbytes` bytes as a flat uint8 tensor; invalidates what an earlier `take` returned."""
        if self._buffer.numel() < nbytes:
            self._buffer = torch.empty(0, dtype=torch.uint8)  # free the old one before the larger one
            self._buffer = torch.empty(nbytes, dtype=torch.uint8)
        return self._buffer[:nbytes]

    def cast(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """`rows.to(dtype)` into this buffer (the same rounding: `to` is an empty tensor plus `copy_`)."""
        if rows.dtype == dtype:
            return rows
        out = self.take(rows.numel() * dtype.itemsize).view(dtype).reshape(rows.shape)
        out.copy_(rows)
        return out


def _pread_exact(fd: int, view: memoryview, offset: int, tensor: CheckpointTensor) -> None:
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got == 0:
            raise CheckpointFormatError(f"{tensor.path} ended while reading tensor {tensor.key!r}")
        done += got


def read_column_ranges(
    fd: int, tensor: CheckpointTensor, start_row: int, stop_row: int, ranges: tuple[tuple[int, int], ...]
) -> torch.Tensor:
    """Rows [start_row, stop_row) of a 2-D tensor, keeping only the column ranges given (a rank's columns).

    One pread per row and range: only the bytes of those columns are read.
    """
    if len(tensor.shape) != 2:
        raise CheckpointFormatError(f"{tensor.path}: {tensor.key!r} is not 2-D; only matrices split by column")
    item = tensor.dtype.itemsize
    width = sum(stop - start for start, stop in ranges)
    rows = stop_row - start_row
    buffer = bytearray(rows * width * item)
    view = memoryview(buffer)
    position = 0
    for row in range(start_row, stop_row):
        row_offset = tensor.begin + row * tensor.row_bytes
        for start, stop in ranges:
            length = (stop - start) * item
            _pread_exact(fd, view[position : position + length], row_offset + start * item, tensor)
            position += length
    if not buffer:
        return torch.empty((rows, width), dtype=tensor.dtype)
    return torch.frombuffer(buffer, dtype=tensor.dtype).reshape(rows, width)


def row_chunks(tensor: CheckpointTensor, chunk_bytes: int) -> Iterator[tuple[int, int]]:
    """Row ranges whose bytes stay within `chunk_bytes` (at least one row each)."""
    if not tensor.shape:
        yield 0, 0
        return
    rows = tensor.shape[0]
    per_chunk = max(1, chunk_bytes // max(tensor.row_bytes, 1))
    for start in range(0, rows, per_chunk):
        yield start, min(rows, start + per_chunk)

"""The streaming producer's read-ahead: the next checkpoint chunk is read on a thread (issue 13).

Real safetensors files, real preads: every chunk it returns must equal a direct read, in
the announced order, off it, and after the file under it was cut short.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from host_weight_runtime.diffusion.producers._checkpoint import (
    CheckpointFormatError,
    CheckpointTensor,
    ReadAhead,
    read_rows,
    read_safetensors_header,
    row_chunks,
)


@pytest.fixture
def checkpoint(tmp_path: Path) -> dict[str, CheckpointTensor]:
    generator = torch.Generator().manual_seed(7)
    path = tmp_path / "model.safetensors"
    save_file(
        {
            "a.weight": torch.randn(37, 11, generator=generator),
            "b.weight": torch.randn(5, 3, 2, generator=generator),
            "c.bias": torch.randn(64, generator=generator),
        },
        path,
    )
    return read_safetensors_header(path)


def _direct(tensor: CheckpointTensor, start: int, stop: int) -> torch.Tensor:
    fd = os.open(tensor.path, os.O_RDONLY)
    try:
        return read_rows(fd, tensor, start, stop).clone()
    finally:
        os.close(fd)


def _plan(index: dict[str, CheckpointTensor], chunk_bytes: int) -> list[tuple[CheckpointTensor, int, int]]:
    return [
        (index[name], start, stop) for name in sorted(index) for start, stop in row_chunks(index[name], chunk_bytes)
    ]


def test_chunks_read_ahead_in_the_announced_order_equal_direct_reads(checkpoint: dict[str, CheckpointTensor]) -> None:
    """Issue 13: the read-ahead returns exactly the bytes a direct pread returns, chunk after chunk."""
    plan = _plan(checkpoint, chunk_bytes=100)
    assert len(plan) > len(checkpoint)  # several chunks per tensor, so the buffers are reused
    reader = ReadAhead()
    try:
        reader.expect(plan)
        for tensor, start, stop in plan:
            rows = reader.rows(tensor, start, stop)
            assert rows.dtype == tensor.dtype
            assert torch.equal(rows, _direct(tensor, start, stop))
    finally:
        reader.close()


def test_a_chunk_stays_valid_while_the_next_one_is_read(checkpoint: dict[str, CheckpointTensor]) -> None:
    """Issue 13: two buffers alternate, so the chunk the caller holds is never the one being read into."""
    plan = _plan(checkpoint, chunk_bytes=64)
    reader = ReadAhead()
    try:
        reader.expect(plan)
        for tensor, start, stop in plan:
            rows = reader.rows(tensor, start, stop)
            expected = _direct(tensor, start, stop)  # meanwhile the thread reads the next chunk
            assert torch.equal(rows, expected)
    finally:
        reader.close()


def test_a_request_off_the_announced_order_is_read_directly(checkpoint: dict[str, CheckpointTensor]) -> None:
    """Issue 13: asking for another chunk than announced still returns the right bytes."""
    plan = _plan(checkpoint, chunk_bytes=100)
    reader = ReadAhead()
    try:
        reader.expect(plan)
        tensor, start, stop = plan[-1]
        assert torch.equal(reader.rows(tensor, start, stop), _direct(tensor, start, stop))
        first = plan[0]
        assert torch.equal(reader.rows(*first), _direct(*first))
        reader.expect(plan[1:])  # announcing again starts over
        for read in plan[1:]:
            assert torch.equal(reader.rows(*read), _direct(*read))
    finally:
        reader.close()


def test_a_file_cut_short_under_a_read_ahead_fails_with_a_format_error(
    checkpoint: dict[str, CheckpointTensor],
) -> None:
    """Issue 13: a prefetched read that hits the end of a truncated file raises when its chunk is asked for."""
    plan = _plan(checkpoint, chunk_bytes=100)
    last_tensor = max(checkpoint.values(), key=lambda tensor: tensor.end)
    os.truncate(last_tensor.path, last_tensor.end - 8)
    reader = ReadAhead()
    try:
        reader.expect(plan)
        with pytest.raises(CheckpointFormatError, match="ended while reading"):
            for read in plan:
                reader.rows(*read)
    finally:
        reader.close()


def test_close_releases_every_descriptor(checkpoint: dict[str, CheckpointTensor]) -> None:
    """Issue 13: closing with a read still in flight waits for it and closes the checkpoint descriptors."""
    plan = _plan(checkpoint, chunk_bytes=100)
    reader = ReadAhead()
    reader.expect(plan)
    fd = reader.descriptor(plan[0][0].path)
    os.fstat(fd)
    reader.close()
    with pytest.raises(OSError):
        os.fstat(fd)

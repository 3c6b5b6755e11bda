"""The streaming producer casts checkpoint rows straight from a mapping of the file.

Real safetensors files: every chunk a mapping gives must equal a pread of the same rows,
and a file cut short must fail as a damaged checkpoint, not kill the process.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from host_weight_runtime._faults import Fault, FaultAction, armed
from host_weight_runtime.diffusion.producers._checkpoint import (
    CheckpointFormatError,
    CheckpointTensor,
    mapped_rows,
    read_rows,
    read_safetensors_header,
    row_chunks,
)


@pytest.fixture
def checkpoint(tmp_path: Path) -> dict[str, CheckpointTensor]:
    generator = torch.Generator().manual_seed(11)
    path = tmp_path / "model.safetensors"
    save_file(
        {
            "a.weight": torch.randn(2000, 3, generator=generator),  # spans pages, so most chunks start unaligned
            "b.weight": torch.randn(7, 5, 2, generator=generator).to(torch.bfloat16),
            "c.scale": torch.tensor(0.5),
            "d.empty": torch.zeros(0, 4),
        },
        path,
    )
    return read_safetensors_header(path)


def test_mapped_chunks_equal_preads_of_the_same_rows(checkpoint: dict[str, CheckpointTensor]) -> None:
    """A mapped chunk has the bytes, dtype and shape a pread gives, for every chunk size, for as long
    as the caller keeps it."""
    fd = os.open(next(iter(checkpoint.values())).path, os.O_RDONLY)
    kept: list[tuple[torch.Tensor, torch.Tensor]] = []
    try:
        for chunk_bytes in (1, 100, 5000, 1 << 20):
            for tensor in checkpoint.values():
                for start, stop in row_chunks(tensor, chunk_bytes):
                    expected = read_rows(fd, tensor, start, stop)
                    rows = mapped_rows(fd, tensor, start, stop)
                    assert rows.dtype == expected.dtype
                    assert rows.shape == expected.shape
                    assert torch.equal(rows, expected)
                    kept.append((rows, expected))
        for rows, expected in kept:  # views outlive the loop: each keeps its own chunk mapped
            assert torch.equal(rows, expected)
    finally:
        os.close(fd)


@pytest.mark.parametrize("when", ["before mapping", "after mapping"])
def test_a_file_cut_short_fails_as_a_damaged_checkpoint(checkpoint: dict[str, CheckpointTensor], when: str) -> None:
    """Rows past the end of a file truncated before or after the chunk was mapped raise
    CheckpointFormatError, never SIGBUS (the pages are faulted in before anything reads them)."""
    first = min(checkpoint.values(), key=lambda tensor: tensor.begin)
    assert first.shape and first.shape[0] > 1000
    cut_at = (first.begin // 4096 + 1) * 4096  # leave the chunk's first page, remove the rest
    fd = os.open(first.path, os.O_RDONLY)
    try:
        with pytest.raises(CheckpointFormatError, match="ended while reading"):
            if when == "before mapping":
                os.truncate(first.path, cut_at)
                mapped_rows(fd, first, 0, first.shape[0])
            else:
                hook = Fault(FaultAction.PAUSE, hook=lambda _point: os.truncate(first.path, cut_at))
                with armed("checkpoint.mapped", hook):
                    mapped_rows(fd, first, 0, first.shape[0])
    finally:
        os.close(fd)


def test_a_file_that_cannot_be_mapped_is_read_instead(checkpoint: dict[str, CheckpointTensor]) -> None:
    """Where the filesystem refuses to map the checkpoint (ENODEV), the rows are read with pread."""
    tensor = checkpoint["a.weight"]
    fd = os.open(tensor.path, os.O_RDONLY)
    try:
        expected = read_rows(fd, tensor, 3, 1500)
        with armed("checkpoint.map", Fault(FaultAction.RAISE_OSERROR, errno=errno.ENODEV)):
            rows = mapped_rows(fd, tensor, 3, 1500)
        assert torch.equal(rows, expected)
    finally:
        os.close(fd)


def test_a_header_read_again_is_parsed_once_yet_a_changed_file_is_checked_afresh(tmp_path: Path) -> None:
    """S10: the second read of an unchanged checkpoint header gives the first parse (a copy), while a header
    rewritten in place, or a file cut short under the same header, is parsed and checked again and refused."""
    path = tmp_path / "model.safetensors"
    save_file({"w": torch.arange(64, dtype=torch.float32).reshape(8, 8)}, path)
    first = read_safetensors_header(path)
    again = read_safetensors_header(path)
    assert again == first and again is not first
    again.clear()  # a caller's copy: the kept parse is not changed through it
    assert read_safetensors_header(path) == first

    save_file({"w": torch.zeros(4, 8, dtype=torch.float32)}, path)  # another header at the same path
    assert read_safetensors_header(path)["w"].shape == (4, 8)

    with open(path, "r+b") as handle:  # same header bytes, but the data no longer fits in the file
        handle.truncate(os.path.getsize(path) - 8)
    with pytest.raises(CheckpointFormatError):
        read_safetensors_header(path)

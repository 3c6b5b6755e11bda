"""`copy_rows`: rows converted by the writer itself, written once and hashed from its buffer behind the write.

The one-pass path must give exactly the bytes and digests of the pwrite path, refuse what the
pwrite path refuses, type its I/O failures, and leave no writable mapping of the file behind.
"""

from __future__ import annotations

import errno
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from host_weight_runtime._faults import Fault, FaultAction, armed, disarm_all
from host_weight_runtime.failures import FailureCode, HostWeightError
from host_weight_runtime.filesystem.writer import StagingArtifactWriter, WrittenFile
from host_weight_runtime.protocols import RowCopyingTensorFileWriter, TensorWriteSpec

from .test_writer import SMALL_CHUNK, expect_producer_failed, new_writer, random_tensor

_SOURCES = {
    # FP32 rows converted to BF16 (the streaming producer's cast), FP32 kept as FP32, and an FP16 source
    "blocks.0.weight": (random_tensor((40, 24), torch.float32, 1), torch.bfloat16),
    "blocks.0.norm": (random_tensor((17, 3), torch.float32, 2), torch.float32),
    "blocks.1.proj": (random_tensor((9, 8), torch.float16, 3), torch.bfloat16),
}


@pytest.fixture(autouse=True)
def _no_leftover_faults() -> Iterator[None]:
    yield
    disarm_all()


def _specs() -> tuple[TensorWriteSpec, ...]:
    return tuple(TensorWriteSpec(name, tuple(rows.shape), dtype) for name, (rows, dtype) in _SOURCES.items())


def _write(root: Path, *, copy: bool, rows_per_step: int = 5) -> tuple[StagingArtifactWriter, WrittenFile]:
    writer = new_writer(root, chunk_bytes=SMALL_CHUNK)
    file_writer = writer.open_tensor_file("model.safetensors", _specs(), ordered=True)
    assert isinstance(file_writer, RowCopyingTensorFileWriter)
    for spec in file_writer.layout:
        source, dtype = _SOURCES[spec.name]
        for start in range(0, source.shape[0], rows_per_step):
            rows = source[start : start + rows_per_step]
            if copy:
                file_writer.copy_rows(spec.name, start, rows)
            else:
                file_writer.write_rows(spec.name, start, rows.to(dtype))
    file_writer.close()
    (written,) = writer.finish()
    return writer, written


def test_s05_s06_copied_rows_give_the_bytes_and_digests_of_written_rows(tmp_path: Path) -> None:
    """S05/S06: rows converted by copy_rows (in steps that cut digest chunks anywhere) give a file byte for
    byte equal to write_rows of `rows.to(dtype)`, the same digests, and stock safe_open reads them."""
    copied_writer, copied = _write(tmp_path / "copied", copy=True)
    written_writer, written = _write(tmp_path / "written", copy=False, rows_per_step=7)
    copied_path = copied_writer.staging_dir / "model.safetensors"
    assert copied_path.read_bytes() == (written_writer.staging_dir / "model.safetensors").read_bytes()
    assert copied == written
    with safe_open(str(copied_path), framework="pt") as handle:
        for name, (source, dtype) in _SOURCES.items():
            read = handle.get_tensor(name)  # random bit patterns hold NaNs: compare the bytes
            assert torch.equal(read.view(torch.uint8), source.to(dtype).contiguous().view(torch.uint8))


def test_no_writable_mapping_of_the_file_is_left_after_close(tmp_path: Path) -> None:
    """S03: once the file is closed no mapping of it is left in the process, so nothing here can change
    the bytes that are about to be published."""
    writer, _written = _write(tmp_path, copy=True)
    path = str((writer.staging_dir / "model.safetensors").resolve())
    with open("/proc/self/maps", encoding="utf-8") as maps:
        assert not [line for line in maps if line.rstrip().endswith(path)]


def test_s04_copy_rows_refuses_mixing_order_and_overlap(tmp_path: Path) -> None:
    """S04: a tensor begun with write_rows cannot go on with copy_rows (nor the reverse), rows must come in
    layout order, and copy_rows needs an ordered file."""
    writer = new_writer(tmp_path, chunk_bytes=SMALL_CHUNK)
    file_writer = writer.open_tensor_file("model.safetensors", _specs(), ordered=True)
    assert isinstance(file_writer, RowCopyingTensorFileWriter)
    first = file_writer.layout[0]
    source, dtype = _SOURCES[first.name]
    file_writer.write_rows(first.name, 0, source[:2].to(dtype))
    expect_producer_failed(writer, lambda: file_writer.copy_rows(first.name, 2, source[2:4]), "begun with write_rows")

    other = new_writer(tmp_path / "other", chunk_bytes=SMALL_CHUNK)
    ordered = other.open_tensor_file("model.safetensors", _specs(), ordered=True)
    assert isinstance(ordered, RowCopyingTensorFileWriter)
    ordered.copy_rows(first.name, 0, source[:2])
    expect_producer_failed(other, lambda: ordered.write_rows(first.name, 2, source[2:4].to(dtype)), "copy_rows")
    expect_producer_failed(other, lambda: ordered.copy_rows(first.name, 1, source[1:3]), "overlap")
    expect_producer_failed(other, lambda: ordered.copy_rows(first.name, 5, source[5:6]), "is ordered")

    unordered_writer = new_writer(tmp_path / "unordered", chunk_bytes=SMALL_CHUNK)
    unordered = unordered_writer.open_tensor_file("model.safetensors", _specs(), ordered=False)
    assert isinstance(unordered, RowCopyingTensorFileWriter)
    expect_producer_failed(unordered_writer, lambda: unordered.copy_rows(first.name, 0, source[:2]), "ordered")


def test_s04_a_file_with_rows_never_copied_is_refused_at_close(tmp_path: Path) -> None:
    """S04: copy_rows counts toward coverage exactly like write_rows: a missing row fails the close."""
    writer = new_writer(tmp_path, chunk_bytes=SMALL_CHUNK)
    file_writer = writer.open_tensor_file("model.safetensors", _specs(), ordered=True)
    assert isinstance(file_writer, RowCopyingTensorFileWriter)
    first = file_writer.layout[0]
    source, _dtype = _SOURCES[first.name]
    file_writer.copy_rows(first.name, 0, source[:-1])
    expect_producer_failed(writer, file_writer.close, "never written")


def test_s13_a_hash_failure_behind_the_copy_is_a_typed_io_error(tmp_path: Path) -> None:
    """S13 (writer side): an EIO while the lane hashes copied rows fails the file as a typed I/O error
    (never a raw exception, never a silently wrong digest)."""
    writer = new_writer(tmp_path, chunk_bytes=SMALL_CHUNK)
    file_writer = writer.open_tensor_file("model.safetensors", _specs(), ordered=True)
    assert isinstance(file_writer, RowCopyingTensorFileWriter)
    with (
        armed("writer.hash", Fault(FaultAction.RAISE_OSERROR, errno=errno.EIO)),
        pytest.raises(HostWeightError) as caught,
    ):
        for spec in file_writer.layout:
            source, _dtype = _SOURCES[spec.name]
            file_writer.copy_rows(spec.name, 0, source)
        file_writer.close()
    assert caught.value.code is FailureCode.IO_ERROR
    assert writer.failure is not None and writer.failure.code is FailureCode.IO_ERROR


def test_copied_rows_are_hashed_behind_the_copy_and_never_read_back(tmp_path: Path) -> None:
    """S05: every hash of a copied file runs as rows are copied, one step per leaf a piece completes or cuts,
    on the copying thread or on the lane's write thread right after its write; none reads the file back
    after it was written (the writer pool's read-back, on its `hwr-write` threads, never runs)."""
    threads: list[str] = []

    def record(_point: str) -> None:
        threads.append(threading.current_thread().name)

    with armed("writer.hash", Fault(FaultAction.PAUSE, hook=record, times=1_000_000)):
        _write(tmp_path, copy=True)
    steps = sum(
        _leaf_steps(rows.numel() * dtype.itemsize, 5 * rows[0].numel() * dtype.itemsize, SMALL_CHUNK)
        for rows, dtype in _SOURCES.values()
    )
    assert len(threads) == steps
    copying = threading.current_thread().name
    assert all(name == copying or name.startswith("hwr-write-lane") for name in threads), set(threads)


def _leaf_steps(total: int, piece_bytes: int, chunk: int) -> int:
    """Leaf hashes of a tensor fed in pieces: one for each leaf a piece completes, one for a leaf it cuts."""
    steps = 0
    for begin in range(0, total, piece_bytes):
        at, end = begin, min(total, begin + piece_bytes)
        while at < end:
            at = min(end, (at // chunk + 1) * chunk, total)
            steps += 1
    return steps


@pytest.mark.parametrize("point", ["writer.pwrite", "writer.after_pwrite"])
def test_s18_enospc_while_the_lane_writes_copied_rows_is_typed_and_leaves_nothing(tmp_path: Path, point: str) -> None:
    """S18: copied rows are written by the lane, so an ENOSPC there surfaces from a later copy_rows or
    from close as a typed, retryable NO_SPACE; the file is never accepted and the writer cannot finish."""
    writer = new_writer(tmp_path, chunk_bytes=SMALL_CHUNK)
    file_writer = writer.open_tensor_file("model.safetensors", _specs(), ordered=True)
    assert isinstance(file_writer, RowCopyingTensorFileWriter)
    with (
        armed(point, Fault(FaultAction.RAISE_OSERROR, errno=errno.ENOSPC)),
        pytest.raises(HostWeightError) as caught,
    ):
        for spec in file_writer.layout:
            source, _dtype = _SOURCES[spec.name]
            for start in range(0, source.shape[0], 5):
                file_writer.copy_rows(spec.name, start, source[start : start + 5])
        file_writer.close()
    assert caught.value.code is FailureCode.NO_SPACE and caught.value.failure.retryable
    assert writer.failure is not None and writer.failure.code is FailureCode.NO_SPACE
    assert file_writer.result is None  # never accepted
    with pytest.raises(HostWeightError) as finished:
        writer.finish()
    assert finished.value.code is FailureCode.NO_SPACE
    writer.abort()


def test_s05_copied_rows_are_written_on_the_lane_in_order_before_close_returns(tmp_path: Path) -> None:
    """S05: the producer's thread only converts; every pwrite of copied rows runs on the lane's write thread
    (beside its hash thread), in the file's order, and all of them are done when close returns (the fsynced
    file holds every byte)."""
    writes: list[str] = []

    def record(_point: str) -> None:
        writes.append(threading.current_thread().name)

    with armed("writer.pwrite", Fault(FaultAction.PAUSE, hook=record, times=1_000_000)):
        writer, written = _write(tmp_path, copy=True)
    pieces = sum(-(-rows.shape[0] // 5) for rows, _dtype in _SOURCES.values())
    assert writes[0] == threading.current_thread().name  # the header, written when the file is created
    assert len(writes) == 1 + pieces
    assert all(name.startswith("hwr-write-lane") for name in writes[1:])
    _reference_writer, reference = _write(tmp_path / "reference", copy=False)
    assert written == reference
    path = writer.staging_dir / "model.safetensors"
    assert path.read_bytes() == (_reference_writer.staging_dir / "model.safetensors").read_bytes()

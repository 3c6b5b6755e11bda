"""The writer's lane: converted rows written on the lane's write thread, the leaves they complete hashed on
the converting thread or on the write thread after its write, whichever has spent less CPU.

Where a leaf is hashed must not change a byte or a digest: what the lane hashes piece by piece is the
serial tree digest of the bytes, whatever the piece sizes (odd sizes, pieces that cut leaves anywhere,
many small tensors) and whichever thread hashes each leaf. A failure on either thread is typed, leaves
no artifact or staging residue, and leaves no lane thread running.
"""

from __future__ import annotations

import errno
import random
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from host_weight_runtime import BuildRequest, FilesystemHostWeightStore, StoreStatus, ValidationLevel
from host_weight_runtime._digest import DigestAlgorithm, tree_digest
from host_weight_runtime._faults import Fault, FaultAction, arm, disarm_all
from host_weight_runtime.failures import FailureCode
from host_weight_runtime.filesystem._payload_hashing import InOrderHashLane
from host_weight_runtime.protocols import (
    ArtifactWriter,
    ProductionMetadata,
    RowCopyingTensorFileWriter,
    TensorWriteSpec,
)

from .support import SyntheticProducer, make_identity, make_tensors
from .test_write_faults import assert_nothing_left, assert_usable_after, soon
from .test_writer import SMALL_CHUNK, new_writer, random_tensor

ALGORITHMS = list(DigestAlgorithm)
_LANE_THREADS = ("hwr-hash-lane", "hwr-write-lane")


@pytest.fixture(autouse=True)
def _no_leftover_faults() -> Iterator[None]:
    yield
    disarm_all()


@pytest.fixture
def lane_threads_before() -> set[threading.Thread]:
    """Lane threads already running (writers that other tests left open keep theirs); a test adds none."""
    return set(_lane_threads())


def _lane_threads() -> list[threading.Thread]:
    return [thread for thread in threading.enumerate() if thread.name.startswith(_LANE_THREADS)]


def _new_lane_threads(before: set[threading.Thread]) -> list[str]:
    return [thread.name for thread in _lane_threads() if thread not in before]


@pytest.mark.parametrize("algorithm", ALGORITHMS, ids=lambda algorithm: algorithm.value)
def test_s05_the_split_lane_gives_the_serial_tree_digest_for_any_pieces(
    algorithm: DigestAlgorithm, lane_threads_before: set[threading.Thread]
) -> None:
    """S05: tensors of odd sizes (empty, shorter than a leaf, exactly a leaf, many leaves plus a partial one),
    fed in pieces of random sizes that cut leaves anywhere, interleaved, get the serial tree digest of their
    bytes, and the write thread stores exactly those bytes."""
    chunk = 96
    sizes = {"empty": 0, "short": 7, "one-leaf": chunk, "leaf-plus-one": chunk + 1, "many": 11 * chunk + 37}
    rng = random.Random(5)
    data = {name: bytes(rng.getrandbits(8) for _ in range(size)) for name, size in sizes.items()}
    stored = {name: bytearray() for name in sizes}
    lane = InOrderHashLane(chunk_bytes=chunk, algorithm=algorithm)
    try:
        for name, payload in data.items():
            position = 0
            while True:
                step = min(len(payload) - position, rng.choice((1, 5, chunk - 1, chunk, 2 * chunk + 3)))
                whole = memoryview(payload)
                begin, end = position, position + step

                def store(target: bytearray = stored[name], piece: bytes = payload[begin:end]) -> None:
                    target += piece

                lane.feed(name, whole, begin, end, store, tensor_nbytes=len(payload))
                position = end
                if position == len(payload):
                    break
        for name, payload in data.items():
            assert lane.digest(name) == tree_digest(payload, chunk, algorithm), name
            assert bytes(stored[name]) == payload
    finally:
        lane.drain()
    assert _new_lane_threads(lane_threads_before) == []


@pytest.mark.parametrize("algorithm", ALGORITHMS, ids=lambda algorithm: algorithm.value)
def test_s05_leaves_go_to_the_thread_that_spent_less_cpu_and_keep_the_digest(
    algorithm: DigestAlgorithm, lane_threads_before: set[threading.Thread]
) -> None:
    """S05: a piece's completed leaves are hashed by whichever thread has spent less CPU on the lane (the
    lane's clock, here one the test moves), a leaf cut by a piece is continued across pieces and across
    threads, and the tensor's digest is the serial tree digest of its bytes either way."""
    chunk = 64
    rng = random.Random(11)
    payload = bytes(rng.getrandbits(8) for _ in range(9 * chunk + 13))
    whole = memoryview(payload)
    cpu = {"caller": 0.0, "writer": 0.0}
    stored = bytearray()

    def clock() -> float:
        return cpu["writer" if threading.current_thread().name.startswith("hwr-write-lane") else "caller"]

    def store(begin: int, end: int, writer_seconds: float = 0.0) -> None:
        cpu["writer"] += writer_seconds
        stored.extend(payload[begin:end])

    lane = InOrderHashLane(chunk_bytes=chunk, algorithm=algorithm, clock=clock)
    try:
        # nothing spent yet, and the write thread has this piece's write to do: this thread hashes leaf 0,
        # and starts leaf 1 (cut at byte 100)
        lane.feed("t", whole, 0, 100, lambda: store(0, 100), tensor_nbytes=len(payload)).result()
        assert lane.hashed_while_writing == 0
        # this thread has spent 5 s, the write thread nothing: it finishes leaf 1 and hashes leaves 2 and 3;
        # the write below costs it 10 s
        cpu["caller"] = 5.0
        lane.feed("t", whole, 100, 300, lambda: store(100, 300, 10.0), tensor_nbytes=len(payload)).result()
        assert lane.hashed_while_writing == 3
        # now the write thread has spent more: this thread finishes leaf 4 and hashes the rest (the last,
        # short leaf included)
        lane.feed("t", whole, 300, len(payload), lambda: store(300, len(payload)), tensor_nbytes=len(payload))
        assert lane.hashed_while_writing == 3
        assert lane.digest("t") == tree_digest(payload, chunk, algorithm)
        assert bytes(stored) == payload
    finally:
        lane.drain()
    assert _new_lane_threads(lane_threads_before) == []


def test_s05_a_piece_past_the_tensors_end_or_a_digest_before_its_last_byte_is_refused() -> None:
    """S05: the lane never digests bytes that do not make up the whole tensor: a piece longer than what is
    left of it, a different length for the same tensor, or a digest before every byte was fed, are refused."""
    lane = InOrderHashLane(chunk_bytes=64, algorithm=DigestAlgorithm.BLAKE3_TREE_V1)
    data = memoryview(bytes(range(100)))
    try:
        lane.feed("t", data, 0, 60, lambda: None, tensor_nbytes=100).result()
        with pytest.raises(ValueError, match="do not fit a tensor of 100 bytes"):
            lane.feed("t", data, 0, 41, lambda: None, tensor_nbytes=100)
        with pytest.raises(ValueError, match="fed as 90"):
            lane.feed("t", data, 0, 10, lambda: None, tensor_nbytes=90)
        with pytest.raises(ValueError, match="only 60 of its 100 bytes"):
            lane.digest("t")
        lane.feed("t", data, 60, 100, lambda: None, tensor_nbytes=100)
        assert lane.digest("t") == tree_digest(bytes(range(100)), 64, DigestAlgorithm.BLAKE3_TREE_V1)
    finally:
        lane.drain()


@pytest.mark.parametrize("algorithm", ALGORITHMS, ids=lambda algorithm: algorithm.value)
def test_s05_s06_many_small_copied_tensors_match_the_written_ones(
    tmp_path: Path, algorithm: DigestAlgorithm, lane_threads_before: set[threading.Thread]
) -> None:
    """S05/S06: many small tensors of odd row counts, copied (converted FP32 -> BF16) in odd steps through the
    split lane, give the file bytes and digests of `write_rows` of the converted rows; no lane thread stays."""
    sources = {
        f"blocks.{index:02d}.weight": random_tensor((index % 7 + 1, 3 + index % 5), torch.float32, index)
        for index in range(40)
    }
    results = []
    for copy in (True, False):
        writer = new_writer(tmp_path / str(copy), chunk_bytes=SMALL_CHUNK)
        writer.adopt_digest_algorithm(algorithm)
        specs = tuple(TensorWriteSpec(name, tuple(rows.shape), torch.bfloat16) for name, rows in sources.items())
        file_writer = writer.open_tensor_file("model.safetensors", specs, ordered=True)
        assert isinstance(file_writer, RowCopyingTensorFileWriter)
        for spec in file_writer.layout:
            rows = sources[spec.name]
            for start in range(0, rows.shape[0], 3):
                if copy:
                    file_writer.copy_rows(spec.name, start, rows[start : start + 3])
                else:
                    file_writer.write_rows(spec.name, start, rows[start : start + 3].to(torch.bfloat16))
        file_writer.close()
        (written,) = writer.finish()
        results.append((written, (writer.staging_dir / "model.safetensors").read_bytes()))
    assert results[0] == results[1]
    assert _new_lane_threads(lane_threads_before) == []


class _CopyingProducer(SyntheticProducer):
    """The synthetic producer, writing every tensor through `copy_rows` (the lane) in steps of a few rows."""

    def produce(self, writer: ArtifactWriter) -> ProductionMetadata:
        self.calls += 1
        names = sorted(self.tensors)
        specs = tuple(
            TensorWriteSpec(name=name, shape=tuple(self.tensors[name].shape), dtype=self.tensors[name].dtype)
            for name in names
        )
        file_writer = writer.open_tensor_file("model-00001-of-00001.safetensors", specs, ordered=True)
        assert isinstance(file_writer, RowCopyingTensorFileWriter)
        for spec in file_writer.layout:
            tensor = self.tensors[spec.name]
            for start in range(0, tensor.shape[0], 4):
                file_writer.copy_rows(spec.name, start, tensor[start : start + 4])
        file_writer.close()
        return ProductionMetadata(producer_schema=self.producer_schema, restorer_schema=self.restorer_schema)


def _hash_thread_raises(_point: str) -> None:
    raise RuntimeError("the hash thread broke")


@pytest.mark.parametrize(
    ("point", "fault", "code"),
    [
        ("writer.after_pwrite", Fault(FaultAction.RAISE_OSERROR, errno=errno.ENOSPC), FailureCode.NO_SPACE),
        ("writer.pwrite", Fault(FaultAction.RAISE_OSERROR, errno=errno.EIO), FailureCode.IO_ERROR),
        ("writer.hash", Fault(FaultAction.RAISE_OSERROR, errno=errno.EIO), FailureCode.IO_ERROR),
        ("writer.hash", Fault(FaultAction.PAUSE, hook=_hash_thread_raises), FailureCode.PRODUCER_FAILED),
    ],
    ids=["enospc-mid-write", "eio-write", "eio-hash", "exception-in-hash-thread"],
)
def test_s18_a_failure_on_either_lane_thread_is_typed_leaves_nothing_and_no_thread(
    tmp_path: Path, point: str, fault: Fault, code: FailureCode, lane_threads_before: set[threading.Thread]
) -> None:
    """S18 S16: ENOSPC/EIO on the lane's write thread, EIO or an unexpected exception on its hash thread,
    ends the build as one typed failure (ENOSPC/EIO retryable, the exception a non-retryable
    PRODUCER_FAILED); nothing is published, no staging residue stays, no lane thread is left running, and
    the same key then builds and verifies."""
    store = FilesystemHostWeightStore(tmp_path / "hwr")
    identity = make_identity()
    # a PAUSE without a hook only counts a pass: the header and two pieces are written (two pieces hashed) first
    arm(point, Fault(FaultAction.PAUSE, times=2 if point == "writer.hash" else 3))
    arm(point, fault)
    result = store.get_or_build(
        BuildRequest(identity),
        _CopyingProducer(identity, make_tensors(scale=3)),
        validation=ValidationLevel.MANIFEST_AND_METADATA,
        deadline=soon(),
    )
    disarm_all()
    assert result.status is StoreStatus.FAILED and result.lease is None
    assert result.failure is not None and result.failure.code is code, result.failure
    assert result.failure.retryable is (code is not FailureCode.PRODUCER_FAILED)
    assert_nothing_left(store)
    assert _new_lane_threads(lane_threads_before) == []
    assert_usable_after(store)

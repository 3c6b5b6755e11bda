"""A `file://` import copies each range in the kernel and hashes the staged file's own pages (E12): what is
hashed is exactly what is stored, misuse of the writer's `copy_data` is a typed producer failure (S04), and
running out of space mid-copy is a typed, retryable NO_SPACE with nothing left behind (S18).
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import torch

from host_weight_runtime import BuildRequest, FailureCode, StoreStatus, TensorWriteSpec
from host_weight_runtime._faults import Fault, FaultAction, arm, armed, disarm_all
from host_weight_runtime.remote import FsspecArtifactProvider, import_remote_artifact, push_artifact

from .remote_support import META, Node, assert_bitwise_equal, soon
from .support import SyntheticProducer, make_identity, make_tensors

PAYLOAD = "model-00001-of-00002.safetensors"


def test_a_source_changed_after_its_range_was_stored_does_not_change_what_is_published(tmp_path: Path) -> None:
    """E12: every remote range after the first flips the first data byte of the source again; the bytes
    already copied stay as pushed, the hash of the stored pages agrees with the manifest, and a FULL_CHECKSUM
    lookup confirms every published byte equals the pushed tensors."""
    node_a, node_b = Node(tmp_path / "node-a"), Node(tmp_path / "node-b")
    tensors = make_tensors()
    identity = node_a.build(tensors=tensors)
    folder = tmp_path / "remote"
    push_artifact(node_a.store, identity, f"file://{folder}")
    source = folder / identity.key / PAYLOAD
    header_end = 8 + int.from_bytes(source.read_bytes()[:8], "little")
    calls: list[str] = []

    def flip_first_range(point: str) -> None:
        calls.append(point)
        if len(calls) < 2:
            return  # the first range of the first file is about to be copied: leave it
        fd = os.open(source, os.O_RDWR)
        try:
            byte = os.pread(fd, 1, header_end)
            os.pwrite(fd, bytes([byte[0] ^ 0xFF]), header_end)
        finally:
            os.close(fd)

    provider = FsspecArtifactProvider(f"file://{folder}", chunk_bytes=4096, max_concurrency=2)
    with armed("remote.fetch.chunk", Fault(FaultAction.PAUSE, hook=flip_first_range, times=10_000)):
        result = import_remote_artifact(node_b.store, identity, provider, validation=META, deadline=soon())
    assert len(calls) > 2  # the first file spans several ranges, so the source changed after its first copy
    assert result is not None and result.status is StoreStatus.BUILT and result.lease is not None, result
    result.lease.close()
    node_b.assert_holds(identity, tensors)


def test_copy_data_refuses_misuse(tmp_path: Path) -> None:
    """S04, E12: copy_data needs an ordered caller-hashed file and whole rows inside the data section;
    otherwise PRODUCER_FAILED and nothing is published or left in tmp/."""
    identity = make_identity()
    spec = TensorWriteSpec(name="w", shape=(4, 4), dtype=torch.float32)
    source = tmp_path / "source.bin"
    source.write_bytes(bytes(range(256)) * 4)

    class Producer(SyntheticProducer):
        def __init__(self, mode: str) -> None:
            super().__init__(identity, {"w": torch.zeros(4, 4)}, files=1)
            self.mode = mode

        def produce(self, writer):  # type: ignore[no-untyped-def]
            hashed = self.mode != "not_caller_hashed"
            file_writer = writer.open_tensor_file("a.safetensors", (spec,), ordered=True, caller_hashes=hashed)
            fd = os.open(source, os.O_RDONLY)
            try:
                nbytes = {"not_caller_hashed": 16, "splits_a_row": 8, "past_the_end": 128}[self.mode]
                file_writer.copy_data(fd, 0, nbytes)
            finally:
                os.close(fd)
            raise AssertionError("unreachable: the writer refuses")

    for mode in ("not_caller_hashed", "splits_a_row", "past_the_end"):
        node = Node(tmp_path / mode)
        result = node.store.get_or_build(BuildRequest(identity), Producer(mode), validation=META, deadline=soon())
        assert result.status is StoreStatus.FAILED and result.failure is not None
        assert result.failure.code is FailureCode.PRODUCER_FAILED, (mode, result.failure)
        assert node.visible() == [] and node.temporaries() == []


def test_no_space_during_a_kernel_copy_is_typed_and_leaves_nothing(tmp_path: Path) -> None:
    """S18, E12: ENOSPC from the payload write seam while a file:// import copies in the kernel is a typed,
    retryable NO_SPACE failure with nothing visible; the next import, with space, publishes."""
    node_a, node_b = Node(tmp_path / "node-a"), Node(tmp_path / "node-b")
    tensors = make_tensors()
    identity = node_a.build(tensors=tensors)
    url = f"file://{tmp_path / 'remote'}"
    push_artifact(node_a.store, identity, url)
    provider = FsspecArtifactProvider(url, chunk_bytes=4096)

    def fill_the_disk(point: str) -> None:
        del point  # the file's header is written: the next payload write is this range's kernel copy
        arm("writer.pwrite", Fault(FaultAction.RAISE_OSERROR, errno=errno.ENOSPC))

    try:
        with armed("remote.fetch.chunk", Fault(FaultAction.PAUSE, hook=fill_the_disk)):
            failed = import_remote_artifact(node_b.store, identity, provider, validation=META, deadline=soon())
    finally:
        disarm_all()
    assert failed is not None and failed.status is StoreStatus.FAILED and failed.failure is not None
    assert failed.failure.code is FailureCode.NO_SPACE and failed.failure.retryable
    assert node_b.visible() == [] and node_b.temporaries() == []
    again = import_remote_artifact(node_b.store, identity, provider, validation=META, deadline=soon())
    assert again is not None and again.status is StoreStatus.BUILT and again.lease is not None
    for name, tensor in tensors.items():
        assert_bitwise_equal(again.lease.tensors[name], tensor)
    again.lease.close()


def test_kernel_copy_between_filesystems_copies_every_range_and_stops_retrying_a_refused_copy_file_range(
    tmp_path: Path,
) -> None:
    """E12: ranges copied from a disk file into a tmpfs file (as a `file://` remote on disk feeds a domain on
    /dev/shm) land byte for byte at their offsets, whether the kernel takes `copy_file_range` for the pair or
    refuses it; once refused, the caller's `use_range=False` sends the later ranges through `sendfile`, and a
    range passed `use_range=False` is never reported as copy_file_range-capable again."""
    from host_weight_runtime.filesystem._kernel_copy import kernel_copy

    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else tmp_path
    data = os.urandom(3 * 65536 + 123)
    source = tmp_path / "source.bin"
    source.write_bytes(data)
    target = shm / f"hwr-kernel-copy-{os.getpid()}.bin"
    source_fd = os.open(source, os.O_RDONLY)
    target_fd = os.open(target, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(target_fd, len(data))
        use_range = True
        seen: list[bool] = []
        for start in range(0, len(data), 65536):
            count = min(65536, len(data) - start)
            done, use_range = kernel_copy(source_fd, start, target_fd, start, count, use_range=use_range)
            assert done == count
            seen.append(use_range)
        assert os.pread(target_fd, len(data), 0) == data
        assert seen == [seen[0]] * len(seen)  # one answer per pair of files, decided by the first range
        done, again = kernel_copy(source_fd, 0, target_fd, 0, 100, use_range=False)
        assert (done, again) == (100, False)
        assert os.pread(target_fd, 100, 0) == data[:100]
        short, _ = kernel_copy(source_fd, len(data) - 10, target_fd, 0, 100, use_range=use_range)
        assert short == 10  # the source ends early: a short copy, never an error
    finally:
        os.close(source_fd)
        os.close(target_fd)
        target.unlink()


def test_sendfile_ranges_with_a_known_position_land_at_their_offsets_and_a_wrong_one_is_corrected(
    tmp_path: Path,
) -> None:
    """E12: a caller that passes the target's file position (as the staged writer does between ranges) gets
    every range at its own offset through `sendfile`, in order and out of order; a stale position (the file
    moved since) is never trusted into writing elsewhere: the range still lands at `target_offset`."""
    from host_weight_runtime.filesystem._kernel_copy import kernel_copy

    data = os.urandom(4 * 4096 + 7)
    source = tmp_path / "source.bin"
    source.write_bytes(data)
    target = tmp_path / "target.bin"
    source_fd = os.open(source, os.O_RDONLY)
    target_fd = os.open(target, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(target_fd, len(data))
        position: int | None = None
        for start in range(0, len(data), 4096):
            count = min(4096, len(data) - start)
            done, use_range = kernel_copy(
                source_fd, start, target_fd, start, count, use_range=False, target_position=position
            )
            assert (done, use_range) == (count, False)
            assert os.lseek(target_fd, 0, os.SEEK_CUR) == start + count  # what the caller keeps as the position
            position = start + done
        assert os.pread(target_fd, len(data), 0) == data
        os.pwrite(target_fd, bytes(len(data)), 0)
        done, _ = kernel_copy(source_fd, 8192, target_fd, 8192, 4096, use_range=False, target_position=0)
        assert done == 4096
        assert os.pread(target_fd, len(data), 0) == bytes(8192) + data[8192:12288] + bytes(len(data) - 12288)
    finally:
        os.close(source_fd)
        os.close(target_fd)

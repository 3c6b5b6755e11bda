"""A `file://` import hashes each piece as stored, from the buffer it was written from or read back after a kernel
copy (E12): what is hashed is exactly what is stored, misuse of the writer's `read_data` or `send_data` is a typed producer failure (S04), and
running out of space mid-copy is a typed, retryable NO_SPACE with nothing left behind (S18).
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import torch

from host_weight_runtime import BuildRequest, FailureCode, StoreStatus, TensorWriteSpec
from host_weight_runtime._faults import Fault, FaultAction, arm, armed, disarm_all
from host_weight_runtime.remote import FsspecArtifactProvider, import_remote_artifact, push_artifact
from host_weight_runtime.remote import provider as provider_module

from .remote_support import META, Node, assert_bitwise_equal, soon
from .support import SyntheticProducer, make_identity, make_tensors

PAYLOAD = "model-00001-of-00002.safetensors"


@pytest.mark.parametrize("threaded", [False, True])
def test_a_source_changed_after_its_piece_was_stored_does_not_change_what_is_published(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, threaded: bool
) -> None:
    """E12: every piece after the first flips the first data byte of the source again; the bytes
    already copied (through a buffer, or in the kernel with a hash lane) stay as pushed, the hash of the stored
    pages agrees with the manifest, and a FULL_CHECKSUM lookup confirms every published byte equals the pushed
    tensors."""
    monkeypatch.setattr(provider_module, "hash_on_a_lane", lambda: threaded)
    node_a, node_b = Node(tmp_path / "node-a"), Node(tmp_path / "node-b")
    tensors = make_tensors()
    identity = node_a.build(tensors=tensors)
    folder = tmp_path / "remote"
    push_artifact(node_a.store, identity, f"file://{folder}")
    source = folder / identity.key / PAYLOAD
    header_end = 8 + int.from_bytes(source.read_bytes()[:8], "little")
    calls: list[str] = []

    def flip_first_piece(point: str) -> None:
        calls.append(point)
        if len(calls) < 2:
            return  # the first piece of the first file is about to be copied: leave it
        fd = os.open(source, os.O_RDWR)
        try:
            byte = os.pread(fd, 1, header_end)
            os.pwrite(fd, bytes([byte[0] ^ 0xFF]), header_end)
        finally:
            os.close(fd)

    provider = FsspecArtifactProvider(f"file://{folder}", chunk_bytes=4096, max_concurrency=2)
    with armed("remote.fetch.chunk", Fault(FaultAction.PAUSE, hook=flip_first_piece, times=10_000)):
        result = import_remote_artifact(node_b.store, identity, provider, validation=META, deadline=soon())
    assert len(calls) > 2  # the first file spans several pieces, so the source changed after its first copy
    assert result is not None and result.status is StoreStatus.BUILT and result.lease is not None, result
    result.lease.close()
    node_b.assert_holds(identity, tensors)


class _Pieces:
    """The caller's side of `read_data` (one buffer, lent and taken back) and of `send_data`."""

    def __init__(self) -> None:
        self.buffer = memoryview(bytearray(64))
        self.stored_bytes = 0

    def take(self) -> memoryview:
        return self.buffer

    def stored(self, buffer: memoryview, count: int) -> None:
        self.stored_bytes += count

    def next_piece(self) -> int:
        return len(self.buffer)

    def sent(self, file_offset: int, count: int) -> None:
        self.stored_bytes += count


@pytest.mark.parametrize("method", ["read_data", "send_data"])
def test_read_data_refuses_misuse(tmp_path: Path, method: str) -> None:
    """S04, E12: read_data and send_data need an ordered caller-hashed file and whole rows inside the data
    section; otherwise PRODUCER_FAILED and nothing is published or left in tmp/."""
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
                getattr(file_writer, method)(fd, 0, nbytes, _Pieces())
            finally:
                os.close(fd)
            raise AssertionError("unreachable: the writer refuses")

    for mode in ("not_caller_hashed", "splits_a_row", "past_the_end"):
        node = Node(tmp_path / mode)
        result = node.store.get_or_build(BuildRequest(identity), Producer(mode), validation=META, deadline=soon())
        assert result.status is StoreStatus.FAILED and result.failure is not None
        assert result.failure.code is FailureCode.PRODUCER_FAILED, (mode, result.failure)
        assert node.visible() == [] and node.temporaries() == []


def test_no_space_during_a_local_copy_is_typed_and_leaves_nothing(tmp_path: Path) -> None:
    """S18, E12: ENOSPC from the payload write seam while a file:// import copies a piece is a typed,
    retryable NO_SPACE failure with nothing visible; the next import, with space, publishes."""
    node_a, node_b = Node(tmp_path / "node-a"), Node(tmp_path / "node-b")
    tensors = make_tensors()
    identity = node_a.build(tensors=tensors)
    url = f"file://{tmp_path / 'remote'}"
    push_artifact(node_a.store, identity, url)
    provider = FsspecArtifactProvider(url, chunk_bytes=4096)

    def fill_the_disk(point: str) -> None:
        del point  # the file's header is written: the next payload write is this piece's
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


def test_close_hashed_keeps_an_expected_entry_only_when_it_is_exactly_the_record(tmp_path: Path) -> None:
    """E12, S04: an import hands close_hashed the remote manifest's entries; one equal in every field to what
    the writer records is kept as it is, and one that differs in anything (digest, role, offsets) is never
    adopted: the writer records its own entry, with the digests the caller hashed."""
    import dataclasses

    from host_weight_runtime._digest import tree_digest
    from host_weight_runtime.manifest import TensorManifestEntry
    from host_weight_runtime.protocols import ProductionMetadata

    identity = make_identity()
    tensor = torch.arange(16, dtype=torch.float32).reshape(4, 4)
    spec = TensorWriteSpec(name="w", shape=(4, 4), dtype=torch.float32)
    seen: dict[str, TensorManifestEntry] = {}

    class Producer(SyntheticProducer):
        def __init__(self, change: dict[str, object]) -> None:
            super().__init__(identity, {"w": tensor}, files=1)
            self.change = change

        def produce(self, writer):  # type: ignore[no-untyped-def]
            file_writer = writer.open_tensor_file("a.safetensors", (spec,), ordered=True, caller_hashes=True)
            data = tensor.numpy().tobytes()
            file_writer.write_data(data)
            digest = tree_digest(data, writer.chunk_bytes, writer.digest_algorithm)
            exact = TensorManifestEntry(
                name="w", file="a.safetensors", dtype="F32", shape=(4, 4), strides=(4, 1), data_offsets=(0, 64),
                kind=spec.kind, role=spec.role, digest=digest,
            )  # fmt: skip
            offered = dataclasses.replace(exact, **self.change)  # type: ignore[arg-type]
            file_writer.close_hashed([digest], expected=[offered])
            seen["offered"], seen["recorded"] = offered, file_writer.result.tensors[0]
            return ProductionMetadata(producer_schema=self.producer_schema, restorer_schema=self.restorer_schema)

    other = "f" * 64
    for name, change in {
        "exact": {},
        "digest": {"digest": other},
        "role": {"role": "another"},
        "offsets": {"data_offsets": (0, 64), "shape": (2, 8), "strides": (8, 1)},
    }.items():
        node = Node(tmp_path / name)
        result = node.store.get_or_build(BuildRequest(identity), Producer(change), validation=META, deadline=soon())
        assert result.status is StoreStatus.BUILT and result.lease is not None, (name, result.failure)
        recorded = result.lease.manifest.tensors[0]
        result.lease.close()
        assert (seen["recorded"] is seen["offered"]) == (name == "exact"), name
        assert (recorded.shape, recorded.role, recorded.digest) == ((4, 4), spec.role, seen["recorded"].digest)
        assert recorded.digest != other

"""A remote import reads, hashes and writes each range once (E12): no second pass hashes the staged file (a
`file://` lane reads each piece back right after its copy, not the writer), and the final verification is unchanged (every tensor and file digest equals the remote manifest's).
"""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
import torch

from host_weight_runtime import BuildRequest, FailureCode, StoreStatus, TensorWriteSpec
from host_weight_runtime._faults import Fault, FaultAction, armed
from host_weight_runtime.remote import FsspecArtifactProvider, import_remote_artifact, push_artifact

from .remote_support import META, Node, soon
from .support import SyntheticProducer, make_identity, make_tensors


def test_an_import_never_hashes_what_it_wrote_in_a_second_pass(tmp_path: Path) -> None:
    """E12: with the writer's read-back hashing seam armed to fail, a local build fails but an import publishes
    (it hashed each range as it stored it); a FULL_CHECKSUM lookup then confirms every byte on disk."""
    node_a, node_b = Node(tmp_path / "node-a"), Node(tmp_path / "node-b")
    tensors = make_tensors()
    identity = node_a.build(tensors=tensors)
    url = f"file://{tmp_path / 'remote'}"
    push_artifact(node_a.store, identity, url)
    provider = FsspecArtifactProvider(url, chunk_bytes=4096, max_concurrency=3)
    with armed("writer.hash", Fault(FaultAction.RAISE_OSERROR, errno=errno.EIO, times=10_000)):
        built_locally = Node(tmp_path / "node-c").store.get_or_build(
            BuildRequest(identity), SyntheticProducer(identity, tensors, files=2), validation=META, deadline=soon()
        )
        imported = import_remote_artifact(node_b.store, identity, provider, validation=META, deadline=soon())
    assert built_locally.status is StoreStatus.FAILED  # the seam is live: a local build hashes by reading back
    assert imported is not None and imported.status is StoreStatus.BUILT and imported.lease is not None
    imported.lease.close()
    node_b.assert_holds(identity, tensors)


def test_a_caller_hashed_file_needs_its_digests(tmp_path: Path) -> None:
    """E12, S04: a file opened with caller_hashes refuses a plain close() and a wrong number of digests
    (PRODUCER_FAILED, nothing published), and unordered files cannot be caller-hashed."""
    identity = make_identity()
    spec = TensorWriteSpec(name="w", shape=(4, 4), dtype=torch.float32)

    class Producer(SyntheticProducer):
        def __init__(self, mode: str) -> None:
            super().__init__(identity, {"w": torch.zeros(4, 4)}, files=1)
            self.mode = mode

        def produce(self, writer):  # type: ignore[no-untyped-def]
            ordered = self.mode != "unordered"
            file_writer = writer.open_tensor_file("a.safetensors", (spec,), ordered=ordered, caller_hashes=True)
            file_writer.write_tensor("w", torch.zeros(4, 4))
            if self.mode == "plain_close":
                file_writer.close()
            else:
                file_writer.close_hashed(())
            raise AssertionError("unreachable: the writer refuses")

    for mode in ("plain_close", "no_digests", "unordered"):
        node = Node(tmp_path / mode)
        result = node.store.get_or_build(BuildRequest(identity), Producer(mode), validation=META, deadline=soon())
        assert result.status is StoreStatus.FAILED and result.failure is not None
        assert result.failure.code is FailureCode.PRODUCER_FAILED, (mode, result.failure)
        assert node.visible() == [] and node.temporaries() == []


@pytest.mark.parametrize("chunk_bytes", [4096, 1 << 20])
def test_one_pass_still_catches_a_flipped_byte(tmp_path: Path, chunk_bytes: int) -> None:
    """E03, E12: hashing in flight compares every tensor against the remote manifest before publication."""
    node_a, node_b = Node(tmp_path / "node-a"), Node(tmp_path / "node-b")
    identity = node_a.build(tensors=make_tensors())
    folder = tmp_path / "remote"
    push_artifact(node_a.store, identity, f"file://{folder}")
    payload = folder / identity.key / "model-00002-of-00002.safetensors"
    data = bytearray(payload.read_bytes())
    data[-2] ^= 0x01
    payload.write_bytes(bytes(data))
    provider = FsspecArtifactProvider(f"file://{folder}", chunk_bytes=chunk_bytes)
    result = import_remote_artifact(node_b.store, identity, provider, validation=META, deadline=soon())
    assert result is not None and result.status is StoreStatus.FAILED
    assert result.failure.code is FailureCode.REMOTE_FAILED and not result.failure.retryable
    assert node_b.visible() == [] and node_b.temporaries() == []

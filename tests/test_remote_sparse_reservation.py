"""A `file://` import into a tmpfs domain sizes each payload file (`ftruncate`) instead of preallocating it, so
the copy allocates as it goes (E12). The size is still the reservation: a concurrent build counts the
bytes the file does not occupy yet, and running out of space inside the copy is a typed, retryable NO_SPACE
with nothing left behind (S18). Both on a real size-capped tmpfs, where the kernel's own ENOSPC arrives.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from host_weight_runtime import (
    BuildRequest,
    CapacityPolicy,
    FailureCode,
    FilesystemHostWeightStore,
    StoreResult,
    StoreStatus,
    WeightArtifactIdentity,
)
from host_weight_runtime._faults import Fault, FaultAction, armed
from host_weight_runtime.remote import FsspecArtifactProvider, import_remote_artifact, push_artifact

from .remote_support import META, Node, assert_bitwise_equal, soon
from .support import SyntheticProducer, make_identity, make_tensors
from .test_write_faults import Filler, capped_tmpfs

NO_FREE_MINIMUM = CapacityPolicy(min_free_bytes=0)


def _pushed(tmp_path: Path, scale: int) -> tuple[str, dict[str, torch.Tensor], WeightArtifactIdentity]:
    """Node A (on disk) builds one single-file artifact of about 12.5 KB x `scale` and pushes it to file://."""
    node_a = Node(tmp_path / "node-a")
    tensors = make_tensors(scale=scale)
    identity = node_a.build(tensors=tensors, files=1)
    url = f"file://{tmp_path / 'remote'}"
    push_artifact(node_a.store, identity, url)
    return url, tensors, identity


def _nothing_left(store: FilesystemHostWeightStore) -> None:
    assert os.listdir(store.layout.artifacts) == [] and os.listdir(store.layout.tmp) == []


def test_enospc_inside_the_copy_of_a_sized_file_is_typed_and_leaves_nothing(tmp_path: Path) -> None:
    """S18, E12: the import's capacity check passes and its payload file is sized; then another tenant fills
    the tmpfs before the first piece is copied, so the kernel's own ENOSPC arrives inside the copy (not at a
    preallocation): typed, retryable NO_SPACE, nothing published or left in tmp/; with the space freed the
    same import publishes every byte as pushed."""
    url, tensors, identity = _pushed(tmp_path, scale=64)
    with capped_tmpfs(tmp_path / "mnt") as mount_point:
        store = FilesystemHostWeightStore(mount_point / "hwr", capacity=NO_FREE_MINIMUM)
        filler = Filler(mount_point)
        provider = FsspecArtifactProvider(url, chunk_bytes=64 << 10)
        with armed("remote.fetch.chunk", Fault(FaultAction.PAUSE, hook=filler.fill)):
            failed = import_remote_artifact(store, identity, provider, validation=META, deadline=soon())
        assert filler.fired == ["remote.fetch.chunk"]
        assert failed is not None and failed.status is StoreStatus.FAILED and failed.failure is not None
        assert failed.failure.code is FailureCode.NO_SPACE and failed.failure.retryable, failed.failure
        details = failed.failure.details.to_value()
        assert isinstance(details, dict) and details["errno"] == "ENOSPC"
        assert str(details["what"]).startswith("storing data bytes"), details  # inside the copy itself
        assert "injected" not in failed.failure.message  # the kernel's error, not a seam's
        _nothing_left(store)
        filler.free()
        again = import_remote_artifact(store, identity, provider, validation=META, deadline=soon())
        assert again is not None and again.status is StoreStatus.BUILT and again.lease is not None, again
        for name, tensor in tensors.items():
            assert_bitwise_equal(again.lease.tensors[name], tensor)
        again.lease.close()


def test_a_sized_file_is_a_reservation_that_a_concurrent_build_counts(tmp_path: Path) -> None:
    """S18, E12: while an import's sized payload file holds no data yet (paused before its first range), a
    build on the same tmpfs that the filesystem's free space alone would admit, but not once the import's
    reserved bytes are counted, fails typed (INSUFFICIENT_CAPACITY, retryable) with nothing of its own left;
    the import then completes and publishes."""
    url, tensors, identity = _pushed(tmp_path, scale=200)  # about 2.5 MB of the 4 MiB tmpfs
    with capped_tmpfs(tmp_path / "mnt") as mount_point:
        root = mount_point / "hwr"
        importing = FilesystemHostWeightStore(root, capacity=NO_FREE_MINIMUM)
        other_identity = make_identity(tag="a concurrent build")
        other_tensors = make_tensors(seed=1, scale=160)  # about 2.0 MB: fits free space, not free - reserved
        other_bytes = sum(t.numel() * t.element_size() for t in other_tensors.values())
        seen: list[tuple[int, StoreResult]] = []

        def build_beside(point: str) -> None:
            del point
            if seen:
                return  # only while the first range waits to be copied
            info = os.statvfs(mount_point)
            assert info.f_bavail * info.f_frsize > other_bytes  # the free space alone would admit it
            other = FilesystemHostWeightStore(root, capacity=NO_FREE_MINIMUM)
            producer = SyntheticProducer(other_identity, other_tensors, files=1)
            result = other.get_or_build(BuildRequest(other_identity), producer, validation=META, deadline=soon())
            seen.append((len(os.listdir(other.layout.tmp)), result))

        provider = FsspecArtifactProvider(url, chunk_bytes=64 << 10)
        with armed("remote.fetch.chunk", Fault(FaultAction.PAUSE, hook=build_beside, times=10_000)):
            imported = import_remote_artifact(importing, identity, provider, validation=META, deadline=soon())
        assert len(seen) == 1
        staged_during, other_result = seen[0]
        assert staged_during == 1  # only the import's staging directory: the refused build left nothing
        assert other_result.status is StoreStatus.FAILED
        other_failure = other_result.failure
        assert other_failure is not None and other_failure.code is FailureCode.INSUFFICIENT_CAPACITY, other_failure
        assert other_failure.retryable
        assert imported is not None and imported.status is StoreStatus.BUILT and imported.lease is not None, imported
        for name, tensor in tensors.items():
            assert_bitwise_equal(imported.lease.tensors[name], tensor)
        imported.lease.close()
        assert os.listdir(importing.layout.artifacts) == [identity.key]
        assert os.listdir(importing.layout.tmp) == []

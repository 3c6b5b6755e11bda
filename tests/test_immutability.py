"""Never rewrite a file that someone may have mapped (S02, S03, S08, S17, S21).

safetensors once rewrote files in place and pages already mapped by readers read back
as zeros. Our published artifacts are immutable: these tests hold a lease (a live
mapping), run every store operation that could touch its key, and prove that the
leased tensors still read the bytes they read at first and that no payload file was
replaced, rewritten or resized (same inode, mtime and size). They run on local disk
and on tmpfs, whose page-cache behaviour for mapped files differs.
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from host_weight_runtime import (
    ArtifactState,
    BuildRequest,
    CleanupStatus,
    FailureCode,
    FilesystemHostWeightStore,
    HostWeightLease,
    StoreStatus,
    ValidationLevel,
)
from host_weight_runtime.identity import WeightArtifactIdentity
from host_weight_runtime.testing.store_conformance import TensorDictProducer

from .support import SyntheticProducer, make_identity, make_tensors

META = ValidationLevel.MANIFEST_AND_METADATA
FULL = ValidationLevel.FULL_CHECKSUM
WAIT_S = 60.0
SHM = Path("/dev/shm")
SCALE = 8  # a few pages per tensor file, so a mapping spans more than one page

LEASED = make_identity(tp_size=2, tp_rank=0, tag="immutability")
SIBLING = make_identity(tp_size=2, tp_rank=1, tag="immutability")
OTHER = make_identity(tag="immutability-other")
VICTIM = make_identity(tag="immutability-victim")

FileStamp = tuple[int, int, int]


def soon() -> float:
    return time.monotonic() + WAIT_S


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def remove_domain(path: Path) -> None:
    if not path.exists():
        return
    for directory, _subdirs, _files in os.walk(path):
        os.chmod(directory, 0o700)
    shutil.rmtree(path)


@pytest.fixture(params=["disk", "tmpfs"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[FilesystemHostWeightStore]:
    if request.param == "disk":
        base = tmp_path
    else:
        if not SHM.is_dir() or not os.access(SHM, os.W_OK):
            pytest.skip("/dev/shm is not available")
        base = Path(tempfile.mkdtemp(prefix="hwr-immutability-", dir=SHM))
    try:
        store = FilesystemHostWeightStore(base / "domain")
        if request.param == "tmpfs":
            assert store.domain.fs_type == "tmpfs"
        yield store
    finally:
        remove_domain(base / "domain")
        if request.param == "tmpfs":
            remove_domain(base)


def build(
    store: FilesystemHostWeightStore, identity: WeightArtifactIdentity, seed: int, *, files: int = 2
) -> HostWeightLease:
    producer = SyntheticProducer(identity, make_tensors(seed, scale=SCALE), files=files)
    result = store.get_or_build(BuildRequest(identity), producer, validation=META, deadline=soon())
    assert result.status is StoreStatus.BUILT and result.lease is not None, (result.status, result.failure)
    return result.lease


def stamps(directory: Path) -> dict[str, FileStamp]:
    """(st_ino, st_mtime_ns, st_size) of every file in an artifact directory, and of the directory itself."""
    result = {}
    for path in [directory, *sorted(directory.iterdir())]:
        info = path.lstat()
        result[path.name] = (info.st_ino, info.st_mtime_ns, info.st_size)
    return result


def flip_first_tensor_byte(payload: Path) -> None:
    with payload.open("r+b") as handle:
        header_length = int.from_bytes(handle.read(8), "little")
        header = json.loads(handle.read(header_length))
        begin = min(
            info["data_offsets"][0]
            for name, info in header.items()
            if name != "__metadata__" and info["data_offsets"][1] > info["data_offsets"][0]
        )
        handle.seek(8 + header_length + begin)
        value = handle.read(1)[0]
        handle.seek(8 + header_length + begin)
        handle.write(bytes([value ^ 0xFF]))


@dataclass
class Held:
    """A live lease of LEASED, what its tensors read when it was opened, and its files' stamps."""

    store: FilesystemHostWeightStore
    lease: HostWeightLease
    recorded: dict[str, torch.Tensor]
    stamps: dict[str, FileStamp]

    @property
    def directory(self) -> Path:
        return self.store.layout.artifact_dir(LEASED.key)

    def assert_untouched(self) -> None:
        assert not self.lease.closed
        tensors = self.lease.tensors
        assert set(tensors) == set(self.recorded)
        for name, recorded in self.recorded.items():
            assert torch.equal(as_bytes(tensors[name]), as_bytes(recorded)), f"leased tensor {name} changed"
        assert stamps(self.directory) == self.stamps
        payload_inodes = {
            (info.st_dev, info.st_ino) for info in (p.lstat() for p in self.directory.glob("*.safetensors"))
        }
        assert {(region.device, region.inode) for region in self.lease.mapped_regions} == payload_inodes


@pytest.fixture
def held(store: FilesystemHostWeightStore) -> Iterator[Held]:
    build(store, LEASED, seed=0).close()
    found = store.lookup(LEASED, validation=META, deadline=soon())
    assert found.status is StoreStatus.HIT and found.lease is not None
    lease = found.lease
    recorded = {name: tensor.clone() for name, tensor in lease.tensors.items()}
    for name, tensor in make_tensors(0, scale=SCALE).items():
        assert torch.equal(as_bytes(recorded[name]), as_bytes(tensor))
    state = Held(store, lease, recorded, stamps(store.layout.artifact_dir(LEASED.key)))
    try:
        yield state
    finally:
        lease.close()


# --------------------------------------------------------------------------- operations


def cleanup_is_refused(held: Held) -> None:
    """S02: cleanup (and its dry run) of the leased key reports ACTIVE_LEASE and removes nothing."""
    for dry_run in (False, True):
        result = held.store.cleanup(LEASED.key, dry_run=dry_run)
        assert result.status is CleanupStatus.ACTIVE_LEASE and result.removed_paths == ()


def get_or_build_same_key_hits(held: Held) -> None:
    """get_or_build of the leased key is a HIT at either level; the (different, failing) producer never runs."""
    for validation in (META, FULL):
        producer = TensorDictProducer(LEASED, make_tensors(7, scale=SCALE), fail_after=0)
        result = held.store.get_or_build(BuildRequest(LEASED), producer, validation=validation, deadline=soon())
        assert result.status is StoreStatus.HIT and result.lease is not None, (result.status, result.failure)
        assert producer.calls == 0 and result.publication_id == held.lease.publication_id
        result.lease.close()


def full_lookup_hits(held: Held) -> None:
    """A FULL_CHECKSUM lookup re-hashes the leased files and hits."""
    result = held.store.lookup(LEASED, validation=FULL, deadline=soon())
    assert result.status is StoreStatus.HIT and result.lease is not None
    result.lease.close()


def inspection_reads_only(held: Held) -> None:
    """inspect_artifact at both levels and inspect_domain see the artifact and the live lease."""
    for validation in (META, FULL):
        report = held.store.inspect_artifact(LEASED, validation=validation)
        assert report.state is ArtifactState.READY and report.locks.lease_active
    domain = held.store.inspect_domain()
    assert [entry.state for entry in domain.artifacts if entry.key == LEASED.key] == [ArtifactState.READY]


def build_and_remove_another_key(held: Held) -> None:
    """Another key is built, leased, closed and cleaned up (through tmp/) beside the leased one."""
    build(held.store, OTHER, seed=1).close()
    assert held.store.cleanup(OTHER.key).status is CleanupStatus.REMOVED


def failed_sibling_build(held: Held) -> None:
    """S04/S18: the sibling rank's producer writes one file and raises; its staging is discarded."""
    producer = TensorDictProducer(SIBLING, make_tensors(2, scale=SCALE), files=2, fail_after=1)
    result = held.store.get_or_build(BuildRequest(SIBLING), producer, validation=META, deadline=soon())
    assert result.status is StoreStatus.FAILED and result.failure is not None
    assert result.failure.code is FailureCode.PRODUCER_FAILED
    assert os.listdir(held.store.layout.tmp) == []


def quarantine_of_another_corrupted_key(held: Held) -> None:
    """S08: another key is corrupted, denied by a FULL lookup, then quarantined and rebuilt."""
    store = held.store
    build(store, VICTIM, seed=3).close()
    directory = store.layout.artifact_dir(VICTIM.key)
    payload = sorted(directory.glob("*.safetensors"))[0]
    os.chmod(directory, 0o755)
    os.chmod(payload, 0o644)
    flip_first_tensor_byte(payload)
    os.chmod(payload, 0o444)
    os.chmod(directory, 0o555)
    denied = store.lookup(VICTIM, validation=FULL, deadline=soon())
    assert denied.status is StoreStatus.INVALID and denied.failure is not None
    assert denied.failure.code is FailureCode.CHECKSUM_MISMATCH
    rebuilt = build(store, VICTIM, seed=3)
    rebuilt.close()
    assert len(os.listdir(store.layout.quarantine)) == 1


def another_lease_writes_and_closes(held: Held) -> None:
    """S03, S21: a second lease of the same key writes into its tensors (copy-on-write) and closes twice."""
    other = held.store.lookup(LEASED, validation=META, deadline=soon())
    assert other.lease is not None
    for tensor in other.lease.tensors.values():
        if tensor.numel():
            tensor.view(torch.uint8).fill_(0x5A)
    other.lease.close()
    other.lease.close()


OPERATIONS: dict[str, Callable[[Held], None]] = {
    "cleanup_refused": cleanup_is_refused,
    "get_or_build_same_key": get_or_build_same_key_hits,
    "full_lookup": full_lookup_hits,
    "inspection": inspection_reads_only,
    "build_and_remove_other_key": build_and_remove_another_key,
    "failed_sibling_build": failed_sibling_build,
    "quarantine_other_key": quarantine_of_another_corrupted_key,
    "other_lease_writes_and_closes": another_lease_writes_and_closes,
}


@pytest.mark.parametrize("operation", list(OPERATIONS))
def test_operation_never_changes_what_a_lease_reads(held: Held, operation: str) -> None:
    """S02, S03, S08: each store operation leaves a live lease's bytes and its files' (inode, mtime, size) alone."""
    held.assert_untouched()
    OPERATIONS[operation](held)
    held.assert_untouched()


def test_all_operations_in_sequence_never_change_what_a_lease_reads(held: Held) -> None:
    """S02, S03, S08: every operation in turn, checking the lease after each one and again at the end."""
    for operation in OPERATIONS.values():
        operation(held)
        held.assert_untouched()
    again = held.store.lookup(LEASED, validation=META)
    assert again.lease is not None and again.publication_id == held.lease.publication_id
    again.lease.close()
    held.assert_untouched()


def test_competing_publication_cannot_replace_a_leased_artifact(store: FilesystemHostWeightStore) -> None:
    """S17: a lockless racer that built different bytes cannot publish over a leased artifact; it fails retryably."""
    racer = FilesystemHostWeightStore(store.root)
    captured: list[Held] = []

    def publish_first_and_lease() -> None:
        # While the racer is producing, the key is published normally and leased.
        lease = build(store, LEASED, seed=0)
        recorded = {name: tensor.clone() for name, tensor in lease.tensors.items()}
        captured.append(Held(store, lease, recorded, stamps(store.layout.artifact_dir(LEASED.key))))

    competitor = SyntheticProducer(LEASED, make_tensors(99, scale=SCALE), files=2, before_write=publish_first_and_lease)
    # The seam: a builder that skipped the build lock. Its expired deadline means it never waits.
    outcome = racer._build_locked(LEASED, competitor, validation=META, deadline=time.monotonic())
    assert len(captured) == 1
    held = captured[0]
    try:
        assert outcome.status is StoreStatus.FAILED and outcome.failure is not None, outcome.status
        assert outcome.failure.code is FailureCode.LOCK_TIMEOUT and outcome.failure.retryable
        assert os.listdir(store.layout.tmp) == []
        held.assert_untouched()
        for name, tensor in make_tensors(0, scale=SCALE).items():
            assert torch.equal(as_bytes(held.lease.tensors[name]), as_bytes(tensor))
    finally:
        held.lease.close()


def test_tensors_kept_after_close_and_removal_still_read_their_bytes(store: FilesystemHostWeightStore) -> None:
    """S02, S21: closing a lease never unmaps memory a tensor still views, even after cleanup and a rebuild.

    The test keeps tensor references from a lease, closes the lease, removes the
    artifact with cleanup, rebuilds the same key with other bytes, and reads the kept
    tensors: they still read the original bytes (the mapping outlives the files), and
    nothing crashes.
    """
    lease = build(store, LEASED, seed=0)
    kept = dict(lease.tensors)
    recorded = {name: tensor.clone() for name, tensor in kept.items()}
    lease.close()
    lease.close()
    removed = store.cleanup(LEASED.key)
    assert removed.status is CleanupStatus.REMOVED, removed.status
    assert not store.layout.artifact_dir(LEASED.key).exists()
    assert os.listdir(store.layout.tmp) == []
    assert store.lookup(LEASED, validation=META).status is StoreStatus.MISS
    del lease
    gc.collect()
    for name, tensor in kept.items():
        assert torch.equal(as_bytes(tensor), as_bytes(recorded[name])), f"kept tensor {name} changed"
    rebuilt = build(store, LEASED, seed=5)
    try:
        for name, tensor in make_tensors(5, scale=SCALE).items():
            assert torch.equal(as_bytes(rebuilt.tensors[name]), as_bytes(tensor))
    finally:
        rebuilt.close()
    gc.collect()
    for name, tensor in kept.items():
        assert torch.equal(as_bytes(tensor), as_bytes(recorded[name])), f"kept tensor {name} changed after rebuild"

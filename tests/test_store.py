"""Behaviour tests of the filesystem store (S01-S18, S21, S24), with real files, locks and processes."""

from __future__ import annotations

import errno
import json
import os
import pickle
import shutil
import signal
import stat
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from host_weight_runtime import (
    ArtifactState,
    BuildRequest,
    CapacityPolicy,
    CleanupStatus,
    CoordinationScope,
    FailureCode,
    FilesystemHostWeightStore,
    HostWeightError,
    LeaseSource,
    ProductionMetadata,
    StoreStatus,
    TensorWriteSpec,
    ValidationLevel,
)
from host_weight_runtime._faults import Fault, FaultAction, armed
from host_weight_runtime.manifest import MANIFEST_FILE_NAME, READY_FILE_NAME
from host_weight_runtime.protocols import ArtifactWriter

from . import _children
from ._hostile import reseal
from .support import SPAWN, SyntheticProducer, make_identity, make_tensors, production_count, reaped_children

META = ValidationLevel.MANIFEST_AND_METADATA
FULL = ValidationLevel.FULL_CHECKSUM
WAIT_S = 60.0


def soon(seconds: float = WAIT_S) -> float:
    return time.monotonic() + seconds


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "domain"


@pytest.fixture
def store(root: Path) -> FilesystemHostWeightStore:
    return FilesystemHostWeightStore(root)


def build(store: FilesystemHostWeightStore, seed: int = 0, **kwargs: object) -> SyntheticProducer:
    """Build the standard identity, close the lease, return the producer."""
    identity = make_identity()
    producer = SyntheticProducer(identity, make_tensors(seed), **kwargs)  # type: ignore[arg-type]
    result = store.get_or_build(BuildRequest(identity), producer, validation=META, deadline=soon())
    assert result.status is StoreStatus.BUILT, result.failure
    assert result.lease is not None
    result.lease.close()
    return producer


def artifact_dir(store: FilesystemHostWeightStore) -> Path:
    return store.layout.artifact_dir(make_identity().key)


def payloads(store: FilesystemHostWeightStore) -> list[Path]:
    return sorted(artifact_dir(store).glob("*.safetensors"))


@pytest.fixture
def tamper(store: FilesystemHostWeightStore) -> Iterator[Path]:
    """Publish the standard artifact, then make it writable for a test that corrupts it on purpose."""
    build(store, files=2)
    directory = artifact_dir(store)
    os.chmod(directory, 0o755)
    for path in directory.iterdir():
        os.chmod(path, 0o644)
    yield directory
    if directory.exists():
        for path in directory.iterdir():
            if path.is_file() and not path.is_symlink():
                os.chmod(path, 0o444)
        os.chmod(directory, 0o555)


def flip_byte_in_data(path: Path) -> None:
    header_length = int.from_bytes(path.read_bytes()[:8], "little")
    with path.open("r+b") as handle:
        handle.seek(8 + header_length + 3)
        value = handle.read(1)[0]
        handle.seek(8 + header_length + 3)
        handle.write(bytes([value ^ 0xFF]))


def assert_bitwise_equal(left: torch.Tensor, right: torch.Tensor) -> None:
    assert left.dtype == right.dtype and left.shape == right.shape
    assert torch.equal(
        left.contiguous().reshape(-1).view(torch.uint8), right.contiguous().reshape(-1).view(torch.uint8)
    )


def test_build_then_lookup_same_publication_and_backing(store: FilesystemHostWeightStore) -> None:
    """S01: build then lookup give the same publication id and backing; regions are non-empty; inspection sees the lease."""
    identity = make_identity()
    built = store.get_or_build(
        BuildRequest(identity), SyntheticProducer(identity, make_tensors(), files=2), validation=META, deadline=soon()
    )
    assert built.status is StoreStatus.BUILT and built.lease is not None
    assert built.lease.provenance.source is LeaseSource.BUILT
    found = store.lookup(identity, validation=FULL)
    assert found.status is StoreStatus.HIT and found.lease is not None
    assert found.publication_id == built.publication_id == found.lease.publication_id
    assert found.lease.mapped_regions and all(region.length > 0 for region in found.lease.mapped_regions)
    backing = sorted((r.file, r.device, r.inode) for r in found.lease.mapped_regions)
    assert backing == sorted((r.file, r.device, r.inode) for r in built.lease.mapped_regions)
    for name, tensor in make_tensors().items():
        assert_bitwise_equal(found.lease.tensors[name], tensor)
    assert store.inspect_artifact(identity.key).locks.lease_active
    built.lease.close()
    found.lease.close()
    assert not store.inspect_artifact(identity.key).locks.lease_active


def test_cleanup_refuses_live_lease(store: FilesystemHostWeightStore) -> None:
    """S02: cleanup during a lease reports ACTIVE_LEASE and changes nothing; after close it removes; then MISS."""
    build(store)
    identity = make_identity()
    lease = store.lookup(identity, validation=META).lease
    assert lease is not None
    before = {path.name: path.read_bytes() for path in artifact_dir(store).iterdir()}
    refused = store.cleanup(identity.key)
    assert refused.status is CleanupStatus.ACTIVE_LEASE
    assert {path.name: path.read_bytes() for path in artifact_dir(store).iterdir()} == before
    assert_bitwise_equal(lease.tensors["blocks.0.weight"], make_tensors()["blocks.0.weight"])
    lease.close()
    removed = store.cleanup(identity.key)
    assert removed.status is CleanupStatus.REMOVED and removed.removed_bytes > 0
    assert store.lookup(identity, validation=META).status is StoreStatus.MISS


def test_cleanup_dry_run_and_active_build(store: FilesystemHostWeightStore) -> None:
    """S02: a dry run lists what would go and removes nothing; a held build lock reports ACTIVE_BUILD."""
    build(store)
    key = make_identity().key
    plan = store.cleanup(key, dry_run=True)
    assert plan.status is CleanupStatus.PLANNED and plan.dry_run and plan.removed_paths
    assert artifact_dir(store).exists()
    from host_weight_runtime.filesystem.locks import try_lock

    held = try_lock(store.layout.build_lock(key), exclusive=True)
    assert held is not None
    try:
        assert store.cleanup(key).status is CleanupStatus.ACTIVE_BUILD
    finally:
        held.release()
    assert artifact_dir(store).exists()


def test_published_artifact_is_read_only(store: FilesystemHostWeightStore) -> None:
    """S03: the published directory is 0555 and every file 0444."""
    build(store, files=2)
    directory = artifact_dir(store)
    assert stat.S_IMODE(directory.stat().st_mode) == 0o555
    files = list(directory.iterdir())
    assert {path.name for path in files} >= {MANIFEST_FILE_NAME, READY_FILE_NAME}
    assert all(stat.S_IMODE(path.stat().st_mode) == 0o444 for path in files)


class _BadProducer(SyntheticProducer):
    def __init__(self, mode: str) -> None:
        super().__init__(make_identity(), make_tensors())
        self.mode = mode

    def produce(self, writer: ArtifactWriter) -> ProductionMetadata:
        tensor = torch.arange(8, dtype=torch.float32).reshape(4, 2)
        file_writer = writer.open_tensor_file(
            "model.safetensors", (TensorWriteSpec("w", (4, 2), torch.float32),), ordered=False
        )
        file_writer.write_rows("w", 0, tensor[:2])
        if self.mode == "overlap":
            file_writer.write_rows("w", 1, tensor[1:3])
        file_writer.close()
        return ProductionMetadata(self.producer_schema, self.restorer_schema)


@pytest.mark.parametrize("mode", ["incomplete", "overlap"])
def test_incomplete_or_overlapping_producer_leaves_nothing(store: FilesystemHostWeightStore, mode: str) -> None:
    """S04: incomplete or overlapping writes fail with PRODUCER_FAILED; tmp/ and artifacts/ stay empty."""
    identity = make_identity()
    result = store.get_or_build(BuildRequest(identity), _BadProducer(mode), validation=META, deadline=soon())
    assert result.status is StoreStatus.FAILED and result.failure is not None
    assert result.failure.code is FailureCode.PRODUCER_FAILED and not result.failure.retryable
    assert os.listdir(store.layout.tmp) == [] and os.listdir(store.layout.artifacts) == []


def _all_dtypes() -> dict[str, torch.Tensor]:
    from host_weight_runtime.tensors import SAFETENSORS_DTYPES

    generator = torch.Generator().manual_seed(5)
    tensors: dict[str, torch.Tensor] = {}
    for code, dtype in SAFETENSORS_DTYPES.items():
        raw = torch.randint(0, 256, (3 * 5 * dtype.itemsize,), dtype=torch.uint8, generator=generator)
        if dtype is torch.bool:
            tensors[code] = raw[:15].reshape(3, 5) % 2 == 1
        else:
            tensors[code] = raw.view(dtype).reshape(3, 5)
    tensors["scalar"] = torch.tensor(2.5, dtype=torch.float64)
    tensors["empty"] = torch.zeros(0, 4, dtype=torch.bfloat16)
    return tensors


def test_every_dtype_round_trips_and_opens_with_stock_safetensors(store: FilesystemHostWeightStore) -> None:
    """S05, S06: every supported dtype (float8 included) round-trips bit-exactly; stock safe_open agrees with the lease."""
    identity = make_identity()
    tensors = _all_dtypes()
    assert {"F8_E4M3", "F8_E5M2"} <= set(tensors)
    result = store.get_or_build(
        BuildRequest(identity), SyntheticProducer(identity, tensors, files=3), validation=FULL, deadline=soon()
    )
    assert result.lease is not None, result.failure
    with result.lease as lease:
        for name, tensor in tensors.items():
            assert_bitwise_equal(lease.tensors[name], tensor)
        seen: set[str] = set()
        for path in payloads(store):
            with safe_open(str(path), framework="pt") as handle:
                for name in handle.keys():  # noqa: SIM118 - safe_open handles are not mappings
                    assert_bitwise_equal(handle.get_tensor(name), lease.tensors[name])
                    seen.add(name)
        assert seen == set(tensors)


def test_copy_on_write_never_reaches_the_artifact(store: FilesystemHostWeightStore) -> None:
    """S03: a consumer that writes into a leased tensor gets a private page; the artifact and other leases are unchanged."""
    build(store)
    identity = make_identity()
    first = store.lookup(identity, validation=META).lease
    second = store.lookup(identity, validation=META).lease
    assert first is not None and second is not None
    first.tensors["blocks.0.weight"].fill_(7)
    assert_bitwise_equal(second.tensors["blocks.0.weight"], make_tensors()["blocks.0.weight"])
    first.close()
    second.close()
    assert store.lookup(identity, validation=FULL).status is StoreStatus.HIT


def test_orphan_deny_marker_is_a_miss(store: FilesystemHostWeightStore) -> None:
    """S07: a deny marker without an artifact is a miss, and a build still succeeds and clears it."""
    identity = make_identity()
    store.layout.deny_marker(identity.key).write_text("{}")
    assert store.lookup(identity, validation=META).status is StoreStatus.MISS
    build(store)
    assert not store.layout.deny_marker(identity.key).exists()
    assert store.lookup(identity, validation=META).status is StoreStatus.HIT


def test_flipped_byte_denied_by_full_checksum_then_rebuilt_once(
    store: FilesystemHostWeightStore, tamper: Path, tmp_path: Path
) -> None:
    """S08: metadata lookup still hits; inspection reports without denying; FULL denies; next build quarantines and rebuilds once."""
    identity = make_identity()
    flip_byte_in_data(sorted(tamper.glob("*.safetensors"))[0])
    for path in tamper.iterdir():
        os.chmod(path, 0o444)
    os.chmod(tamper, 0o555)
    weak = store.lookup(identity, validation=META)
    assert weak.status is StoreStatus.HIT and weak.lease is not None
    weak.lease.close()
    inspected = store.inspect_artifact(identity.key, validation=FULL)
    assert inspected.state is ArtifactState.INVALID and inspected.problem is not None
    assert inspected.problem.code is FailureCode.CHECKSUM_MISMATCH
    assert not store.layout.deny_marker(identity.key).exists()
    strong = store.lookup(identity, validation=FULL)
    assert strong.status is StoreStatus.INVALID and strong.failure is not None
    assert strong.failure.code is FailureCode.CHECKSUM_MISMATCH
    assert store.layout.deny_marker(identity.key).exists()
    assert store.lookup(identity, validation=META).status is StoreStatus.INVALID
    counter = tmp_path / "count"
    producer = SyntheticProducer(identity, make_tensors(), counter_path=counter)
    rebuilt = store.get_or_build(BuildRequest(identity), producer, validation=FULL, deadline=soon())
    assert rebuilt.status is StoreStatus.BUILT and rebuilt.lease is not None
    rebuilt.lease.close()
    assert production_count(counter) == 1
    assert len(os.listdir(store.layout.quarantine)) == 1
    again = store.get_or_build(BuildRequest(identity), producer, validation=FULL, deadline=soon())
    assert again.status is StoreStatus.HIT and again.lease is not None
    again.lease.close()
    assert production_count(counter) == 1


def test_weaker_lookup_cannot_return_after_stronger_denial(store: FilesystemHostWeightStore, tamper: Path) -> None:
    """S09: a metadata lookup paused after validating cannot return a lease once a FULL lookup has denied the artifact."""
    flip_byte_in_data(sorted(tamper.glob("*.safetensors"))[0])
    for path in tamper.iterdir():
        os.chmod(path, 0o444)
    os.chmod(tamper, 0o555)
    report_parent, report_child = SPAWN.Pipe(duplex=False)
    control_child, control_parent = SPAWN.Pipe(duplex=False)
    with reaped_children() as children:
        weak = SPAWN.Process(
            target=_children.lookup_in_child,
            args=(str(store.root), report_child, control_child),
            kwargs={"validation": META.value, "pause_at": "lookup.before_deny_recheck"},
        )
        weak.start()
        children.append(weak)
        assert report_parent.poll(WAIT_S)
        assert report_parent.recv() == "lookup.before_deny_recheck"
        strong = store.lookup(make_identity(), validation=FULL)
        assert strong.status is StoreStatus.INVALID
        control_parent.send("go")
        assert report_parent.poll(WAIT_S)
        outcome = report_parent.recv()
    assert outcome["status"] == "invalid" and outcome["code"] == FailureCode.ARTIFACT_DENIED.value
    assert outcome["backing"] is None


def _rewrite_manifest(directory: Path, change: dict[str, object], *, content_digest: str | None = None) -> None:
    manifest = json.loads((directory / MANIFEST_FILE_NAME).read_bytes())
    manifest.update(change)
    from host_weight_runtime.canonical_json import encode_canonical

    reseal(directory, encode_canonical(manifest), content_digest=content_digest)


def _corrupt(directory: Path, case: str) -> None:
    payload = sorted(directory.glob("*.safetensors"))[0]
    if case == "malformed_header":
        data = bytearray(payload.read_bytes())
        data[8] = ord("[")
        payload.write_bytes(bytes(data))
    elif case == "huge_header_length":
        data = bytearray(payload.read_bytes())
        data[:8] = (2**60).to_bytes(8, "little")
        payload.write_bytes(bytes(data))
    elif case == "truncated":
        os.truncate(payload, payload.stat().st_size - 16)
    elif case == "grown":
        with payload.open("ab") as handle:
            handle.write(b"\0" * 8)
    elif case == "extra_file":
        (directory / "extra.safetensors").write_bytes(b"x")
    elif case == "missing_file":
        payload.unlink()
    elif case == "writable_dir":
        return  # the tamper fixture leaves the directory 0755 for this case
    elif case == "garbage_ready":
        (directory / READY_FILE_NAME).write_bytes(b'{"nope":1}')
    elif case == "hard_link":
        os.link(payload, directory.parent.parent / "tmp" / "stray-link")
    else:
        raise AssertionError(case)


@pytest.mark.parametrize(
    "case",
    [
        "malformed_header",
        "huge_header_length",
        "truncated",
        "grown",
        "extra_file",
        "missing_file",
        "writable_dir",
        "garbage_ready",
        "hard_link",
    ],
)
def test_damaged_artifacts_are_typed_invalid(store: FilesystemHostWeightStore, tamper: Path, case: str) -> None:
    """S10: malformed headers, truncation, extra/missing files, wrong sizes and writable directories are typed INVALID."""
    _corrupt(tamper, case)
    if case != "writable_dir":
        for path in tamper.iterdir():
            os.chmod(path, 0o444)
        os.chmod(tamper, 0o555)
    result = store.lookup(make_identity(), validation=META)
    assert result.status is StoreStatus.INVALID and result.failure is not None
    assert result.failure.code in {FailureCode.PAYLOAD_INVALID, FailureCode.MANIFEST_INVALID}
    assert store.layout.deny_marker(make_identity().key).exists()


def test_manifest_schema_mismatch_is_incompatible(store: FilesystemHostWeightStore, tamper: Path) -> None:
    """S11: a manifest whose producer or restorer schema differs from the identity's is MANIFEST_INCOMPATIBLE."""
    _rewrite_manifest(tamper, {"restorer_schema": "some-other-restorer-v9"})
    for path in tamper.iterdir():
        os.chmod(path, 0o444)
    os.chmod(tamper, 0o555)
    result = store.lookup(make_identity(), validation=META)
    assert result.status is StoreStatus.INVALID and result.failure is not None
    assert result.failure.code is FailureCode.MANIFEST_INCOMPATIBLE


def test_forged_content_digest_is_caught_by_full_checksum(store: FilesystemHostWeightStore, tamper: Path) -> None:
    """S08: a manifest (and READY) whose content digest does not follow from its tensor digests fails FULL_CHECKSUM."""
    forged = "f" * 64
    _rewrite_manifest(tamper, {"content_digest": forged}, content_digest=forged)
    for path in tamper.iterdir():
        os.chmod(path, 0o444)
    os.chmod(tamper, 0o555)
    result = store.lookup(make_identity(), validation=FULL)
    assert result.status is StoreStatus.INVALID and result.failure is not None
    assert result.failure.code is FailureCode.MANIFEST_INVALID


def test_producer_reporting_other_schema_fails(root: Path) -> None:
    """S11: a producer that reports schemas other than its identity's cannot publish."""
    store = FilesystemHostWeightStore(root)
    identity = make_identity()
    producer = SyntheticProducer(identity, make_tensors(), producer_schema="other-manifest-v2")
    result = store.get_or_build(BuildRequest(identity), producer, validation=META, deadline=soon())
    assert result.failure is not None and result.failure.code is FailureCode.PRODUCER_FAILED
    assert os.listdir(store.layout.artifacts) == []


def test_symlinked_payload_is_rejected_unfollowed(
    store: FilesystemHostWeightStore, tamper: Path, tmp_path: Path
) -> None:
    """S12: a payload replaced by a symlink to an identical copy is rejected, so it was not followed."""
    payload = sorted(tamper.glob("*.safetensors"))[0]
    copy = tmp_path / "copy.safetensors"
    shutil.copyfile(payload, copy)
    os.chmod(copy, 0o444)
    payload.unlink()
    payload.symlink_to(copy)
    for path in tamper.iterdir():
        if not path.is_symlink():
            os.chmod(path, 0o444)
    os.chmod(tamper, 0o555)
    result = store.lookup(make_identity(), validation=FULL)
    assert result.status is StoreStatus.INVALID and result.failure is not None
    assert result.failure.code is FailureCode.PAYLOAD_INVALID
    assert "symlink" in result.failure.message


def test_read_eio_is_retryable_and_denies_nothing(store: FilesystemHostWeightStore) -> None:
    """S13: an EIO while reading a valid artifact is a retryable failure and writes no deny marker."""
    build(store)
    identity = make_identity()
    with armed("reader.read_payload_header", Fault(FaultAction.RAISE_OSERROR, errno=errno.EIO)):
        result = store.lookup(identity, validation=META)
    assert result.status is StoreStatus.FAILED and result.failure is not None
    assert result.failure.code is FailureCode.IO_ERROR and result.failure.retryable
    assert not store.layout.deny_marker(identity.key).exists()
    again = store.lookup(identity, validation=META)
    assert again.status is StoreStatus.HIT and again.lease is not None
    again.lease.close()


def test_eio_writing_deny_marker_is_retryable_and_excludes(store: FilesystemHostWeightStore, tamper: Path) -> None:
    """S13: EIO while writing the deny marker is a retryable failure, not a denial, and no lease is handed out."""
    _corrupt(tamper, "truncated")
    for path in tamper.iterdir():
        os.chmod(path, 0o444)
    os.chmod(tamper, 0o555)
    with armed("store.write_deny", Fault(FaultAction.RAISE_OSERROR, errno=errno.EIO)):
        result = store.lookup(make_identity(), validation=META)
    assert result.status is StoreStatus.FAILED and result.lease is None and result.failure is not None
    assert result.failure.code is FailureCode.IO_ERROR and result.failure.retryable
    assert not store.layout.deny_marker(make_identity().key).exists()


def test_two_processes_build_once(root: Path, tmp_path: Path) -> None:
    """S14: two processes ask for the same missing key: one BUILT, one JOINED, one production, same backing."""
    FilesystemHostWeightStore(root)
    counter = tmp_path / "count"
    a_report, a_report_child = SPAWN.Pipe(duplex=False)
    a_control_child, a_control = SPAWN.Pipe(duplex=False)
    b_report, b_report_child = SPAWN.Pipe(duplex=False)
    b_control_child, b_control = SPAWN.Pipe(duplex=False)
    with reaped_children() as children:
        builder = SPAWN.Process(
            target=_children.build_in_child,
            args=(str(root), str(counter), a_report_child),
            kwargs={"pause_at": "build.staging_created", "control": a_control_child},
        )
        builder.start()
        children.append(builder)
        assert a_report.poll(WAIT_S) and a_report.recv() == "build.staging_created"
        joiner = SPAWN.Process(
            target=_children.build_in_child,
            args=(str(root), str(counter), b_report_child),
            kwargs={"notify_at": "build.waiting_for_lock", "control": b_control_child},
        )
        joiner.start()
        children.append(joiner)
        assert b_report.poll(WAIT_S) and b_report.recv() == "build.waiting_for_lock"
        a_control.send("go")
        assert a_report.poll(WAIT_S)
        built = a_report.recv()
        assert b_report.poll(WAIT_S)
        joined = b_report.recv()
        a_control.send("close")
        b_control.send("close")
    assert built["status"] == "built" and joined["status"] == "joined"
    assert joined["source"] == LeaseSource.JOINED.value
    assert built["publication_id"] == joined["publication_id"]
    assert built["backing"] == joined["backing"]
    assert production_count(counter) == 1


def test_reader_misses_and_waiter_times_out_during_build(root: Path, tmp_path: Path) -> None:
    """S15: during an in-flight build a reader sees a miss and a short-deadline waiter times out; the builder finishes."""
    store = FilesystemHostWeightStore(root)
    counter = tmp_path / "count"
    report, report_child = SPAWN.Pipe(duplex=False)
    control_child, control = SPAWN.Pipe(duplex=False)
    identity = make_identity()
    with reaped_children() as children:
        builder = SPAWN.Process(
            target=_children.build_in_child,
            args=(str(root), str(counter), report_child),
            kwargs={"pause_at": "publication.after_ready", "control": control_child},
        )
        builder.start()
        children.append(builder)
        assert report.poll(WAIT_S) and report.recv() == "publication.after_ready"
        assert store.lookup(identity, validation=FULL).status is StoreStatus.MISS
        waiter = store.get_or_build(
            BuildRequest(identity),
            SyntheticProducer(identity, make_tensors()),
            validation=META,
            deadline=time.monotonic() + 0.2,
        )
        assert waiter.status is StoreStatus.FAILED and waiter.failure is not None
        assert waiter.failure.code is FailureCode.LOCK_TIMEOUT and waiter.failure.retryable
        control.send("go")
        assert report.poll(WAIT_S)
        built = report.recv()
        control.send("close")
    assert built["status"] == "built"
    hit = store.lookup(identity, validation=FULL)
    assert hit.status is StoreStatus.HIT and hit.publication_id == built["publication_id"] and hit.lease is not None
    hit.lease.close()
    assert production_count(counter) == 1


CRASH_POINTS = [
    "build.staging_created",
    "writer.pwrite",
    "writer.fsync",
    "publication.before_manifest",
    "publication.after_manifest",
    "publication.after_ready",
    "publication.after_harden",
    "publication.after_rename",
    "publication.after_commit",
]


@pytest.mark.parametrize("point", CRASH_POINTS)
def test_builder_killed_at_each_step_leaves_hit_or_invisible_temporary(root: Path, tmp_path: Path, point: str) -> None:
    """S16: a builder SIGKILLed at any publication step leaves a valid hit or an invisible temporary; the next builder cleans up."""
    store = FilesystemHostWeightStore(root)
    counter = tmp_path / "count"
    _report, report_child = SPAWN.Pipe(duplex=False)
    with reaped_children() as children:
        builder = SPAWN.Process(
            target=_children.build_in_child, args=(str(root), str(counter), report_child), kwargs={"crash_at": point}
        )
        builder.start()
        children.append(builder)
        builder.join(WAIT_S)
    assert builder.exitcode == -signal.SIGKILL
    identity = make_identity()
    after_crash = store.lookup(identity, validation=FULL)
    assert after_crash.status in (StoreStatus.MISS, StoreStatus.HIT)
    if after_crash.lease is not None:
        after_crash.lease.close()
    visible = os.listdir(store.layout.artifacts)
    assert visible in ([], [identity.key])
    producer = SyntheticProducer(identity, make_tensors(), counter_path=counter)
    next_result = store.get_or_build(BuildRequest(identity), producer, validation=FULL, deadline=soon())
    expected = StoreStatus.HIT if after_crash.status is StoreStatus.HIT else StoreStatus.BUILT
    assert next_result.status is expected and next_result.lease is not None
    next_result.lease.close()
    assert os.listdir(store.layout.tmp) == []
    assert not store.layout.deny_marker(identity.key).exists()


def test_competing_publication_is_identity_collision(store: FilesystemHostWeightStore) -> None:
    """S17: a different artifact published under the same key by a lockless racer wins; ours is IDENTITY_COLLISION and quarantined."""
    identity = make_identity()
    racer_store = FilesystemHostWeightStore(store.root)

    def publish_competitor() -> None:
        # The seam: a second builder that skipped the build lock publishes different bytes first.
        other = SyntheticProducer(identity, make_tensors(seed=99))
        result = racer_store._build_locked(identity, other, validation=META, deadline=soon())
        assert result.status is StoreStatus.BUILT and result.lease is not None
        result.lease.close()

    loser = SyntheticProducer(identity, make_tensors(seed=0), before_write=publish_competitor)
    outcome = store.get_or_build(BuildRequest(identity), loser, validation=META, deadline=soon())
    assert outcome.status is StoreStatus.FAILED and outcome.failure is not None
    assert outcome.failure.code is FailureCode.IDENTITY_COLLISION and not outcome.failure.retryable
    winner = store.lookup(identity, validation=FULL)
    assert winner.lease is not None
    assert_bitwise_equal(winner.lease.tensors["blocks.0.weight"], make_tensors(seed=99)["blocks.0.weight"])
    winner.lease.close()
    assert len(os.listdir(store.layout.quarantine)) == 1
    assert os.listdir(store.layout.tmp) == []


def test_identical_racing_publication_joins(store: FilesystemHostWeightStore) -> None:
    """S17: when the lockless racer published the same bytes, the loser joins it instead of failing."""
    identity = make_identity()
    racer_store = FilesystemHostWeightStore(store.root)

    def publish_same() -> None:
        result = racer_store._build_locked(
            identity, SyntheticProducer(identity, make_tensors()), validation=META, deadline=soon()
        )
        assert result.lease is not None
        result.lease.close()

    outcome = store.get_or_build(
        BuildRequest(identity),
        SyntheticProducer(identity, make_tensors(), before_write=publish_same),
        validation=META,
        deadline=soon(),
    )
    assert outcome.status is StoreStatus.JOINED and outcome.lease is not None
    outcome.lease.close()
    assert os.listdir(store.layout.quarantine) == [] and os.listdir(store.layout.tmp) == []


@pytest.mark.parametrize(
    ("policy", "code"),
    [
        (CapacityPolicy(max_artifact_bytes=1024), FailureCode.ARTIFACT_TOO_LARGE),
        (CapacityPolicy(max_store_bytes=1024), FailureCode.STORE_LIMIT_EXCEEDED),
        (CapacityPolicy(min_free_bytes=2**62), FailureCode.INSUFFICIENT_CAPACITY),
    ],
)
def test_capacity_limits_are_typed_retryable_and_clean(
    tmp_path: Path, policy: CapacityPolicy, code: FailureCode
) -> None:
    """S18: capacity limits are typed, retryable failures checked before writing, and leave no staging behind."""
    store = FilesystemHostWeightStore(tmp_path / "domain", capacity=policy)
    identity = make_identity()
    result = store.get_or_build(
        BuildRequest(identity), SyntheticProducer(identity, make_tensors(scale=8)), validation=META, deadline=soon()
    )
    assert result.status is StoreStatus.FAILED and result.failure is not None
    assert result.failure.code is code and result.failure.retryable
    assert os.listdir(store.layout.tmp) == [] and os.listdir(store.layout.artifacts) == []


@pytest.mark.parametrize(
    ("point", "error", "code"),
    [
        ("writer.preallocate", errno.ENOSPC, FailureCode.NO_SPACE),
        ("writer.pwrite", errno.ENOSPC, FailureCode.NO_SPACE),
        ("writer.pwrite", errno.EDQUOT, FailureCode.QUOTA_EXCEEDED),
    ],
)
def test_out_of_space_is_typed_retryable_and_clean(
    store: FilesystemHostWeightStore, point: str, error: int, code: FailureCode
) -> None:
    """S18: ENOSPC and EDQUOT while writing are typed, retryable, and leave no staging behind."""
    identity = make_identity()
    with armed(point, Fault(FaultAction.RAISE_OSERROR, errno=error)):
        result = store.get_or_build(
            BuildRequest(identity), SyntheticProducer(identity, make_tensors()), validation=META, deadline=soon()
        )
    assert result.failure is not None and result.failure.code is code and result.failure.retryable
    assert os.listdir(store.layout.tmp) == [] and os.listdir(store.layout.artifacts) == []


def test_producer_exception_is_not_retryable(store: FilesystemHostWeightStore) -> None:
    """S18: a producer that itself raises stays a non-retryable PRODUCER_FAILED."""
    identity = make_identity()

    def explode() -> None:
        raise RuntimeError("checkpoint shard is corrupt")

    result = store.get_or_build(
        BuildRequest(identity),
        SyntheticProducer(identity, make_tensors(), before_write=explode),
        validation=META,
        deadline=soon(),
    )
    assert result.failure is not None and result.failure.code is FailureCode.PRODUCER_FAILED
    assert not result.failure.retryable and "checkpoint shard is corrupt" in result.failure.message
    assert os.listdir(store.layout.tmp) == []


def test_lease_close_in_forked_child_keeps_parent_lock(store: FilesystemHostWeightStore) -> None:
    """S20: a lease closed in a forked child does not release the parent's lease lock."""
    build(store)
    identity = make_identity()
    lease = store.lookup(identity, validation=META).lease
    assert lease is not None
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the forked child
        try:
            lease.close()
            os.write(write_end, b"closed")
        finally:
            os._exit(0)
    os.close(write_end)
    assert os.read(read_end, 16) == b"closed"
    os.close(read_end)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    assert store.cleanup(identity.key).status is CleanupStatus.ACTIVE_LEASE
    assert_bitwise_equal(lease.tensors["blocks.0.weight"], make_tensors()["blocks.0.weight"])
    lease.close()
    assert store.cleanup(identity.key).status is CleanupStatus.REMOVED


def test_concurrent_close_waits_for_teardown(store: FilesystemHostWeightStore) -> None:
    """S21: a second close() waits until the first one's teardown finishes; close is idempotent; leases refuse pickling."""
    build(store)
    identity = make_identity()
    lease = store.lookup(identity, validation=META).lease
    assert lease is not None
    with pytest.raises(TypeError, match="HostWeightLease cannot be pickled"):
        pickle.dumps(lease)
    in_teardown = threading.Event()
    release_teardown = threading.Event()
    second_entered = threading.Event()
    observed: list[tuple[bool, CleanupStatus]] = []

    def hold(point: str) -> None:
        in_teardown.set()
        assert release_teardown.wait(WAIT_S)

    def second_closer() -> None:
        lease.close()
        observed.append((lease.closed, store.cleanup(identity.key, dry_run=True).status))

    with armed("lease.teardown", Fault(FaultAction.PAUSE, hook=hold)):
        first = threading.Thread(target=lease.close)
        first.start()
        assert in_teardown.wait(WAIT_S)
        with armed("lease.close_enter", Fault(FaultAction.PAUSE, hook=lambda _point: second_entered.set())):
            second = threading.Thread(target=second_closer)
            second.start()
            assert second_entered.wait(WAIT_S)
        second.join(timeout=0.2)
        assert second.is_alive(), "the second close() returned while teardown was still running"
        release_teardown.set()
        first.join(WAIT_S)
        second.join(WAIT_S)
    assert observed == [(True, CleanupStatus.PLANNED)]
    lease.close()
    assert lease.closed


def test_unimplemented_coordination_scopes_are_unsupported(root: Path) -> None:
    """S24: GROUP_COHORT and ARTIFACT_BUNDLE are typed UNSUPPORTED failures, never silent defaults."""
    for scope in (CoordinationScope.GROUP_COHORT, CoordinationScope.ARTIFACT_BUNDLE):
        with pytest.raises(HostWeightError) as raised:
            FilesystemHostWeightStore(root, scope=scope)
        assert raised.value.code is FailureCode.UNSUPPORTED
        store = FilesystemHostWeightStore(root)
        identity = make_identity()
        producer = SyntheticProducer(identity, make_tensors(), scope=scope)
        result = store.get_or_build(BuildRequest(identity), producer, validation=META, deadline=soon())
        assert result.failure is not None and result.failure.code is FailureCode.UNSUPPORTED
        assert producer.calls == 0


def test_cleanup_also_removes_quarantined_copies(store: FilesystemHostWeightStore, tamper: Path) -> None:
    """S08: a quarantined copy is kept for inspection until the operator cleans the key up; it counts as store bytes."""
    _corrupt(tamper, "truncated")
    for path in tamper.iterdir():
        os.chmod(path, 0o444)
    os.chmod(tamper, 0o555)
    identity = make_identity()
    assert store.lookup(identity, validation=META).status is StoreStatus.INVALID
    rebuilt = store.get_or_build(
        BuildRequest(identity), SyntheticProducer(identity, make_tensors()), validation=META, deadline=soon()
    )
    assert rebuilt.lease is not None
    rebuilt.lease.close()
    quarantined = store.layout.quarantined_dirs(identity.key)
    assert len(quarantined) == 1
    published = sum(path.stat().st_size for path in artifact_dir(store).iterdir())
    assert store.inspect_domain().capacity.store_bytes > published
    result = store.cleanup(identity.key)
    assert result.status is CleanupStatus.REMOVED and str(quarantined[0]) in result.removed_paths
    assert store.layout.quarantined_dirs(identity.key) == []


def test_inspection_creates_no_lock_files_and_reports_unverified_when_locked(store: FilesystemHostWeightStore) -> None:
    """S01: inspecting an unknown key creates nothing; an artifact that cannot be locked in time is UNVERIFIED, not READY."""
    unknown = make_identity(tag="never-built").key
    before = sorted(os.listdir(store.layout.locks))
    assert store.inspect_artifact(unknown).state is ArtifactState.MISSING
    assert sorted(os.listdir(store.layout.locks)) == before
    build(store)
    key = make_identity().key
    from host_weight_runtime.filesystem.locks import try_lock

    publisher = try_lock(store.layout.artifact_lock(key), exclusive=True)
    assert publisher is not None
    try:
        inspected = store.inspect_artifact(key, deadline=time.monotonic())
    finally:
        publisher.release()
    assert inspected.state is ArtifactState.UNVERIFIED and inspected.problem is not None
    assert inspected.problem.code is FailureCode.LOCK_TIMEOUT and inspected.locks.lease_active

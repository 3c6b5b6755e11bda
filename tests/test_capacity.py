"""Capacity limits and typed out-of-space failures (S18), and tmpfs reported as memory."""

from __future__ import annotations

import errno
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from host_weight_runtime.config import CapacityPolicy, StorageClass
from host_weight_runtime.failures import FailureCode, HostWeightError, ResolutionStage
from host_weight_runtime.filesystem._layout import DomainLayout
from host_weight_runtime.filesystem.capacity import CapacityGuard, CapacitySnapshot, failure_from_os_error
from host_weight_runtime.filesystem.domain import DomainInfo, open_domain
from host_weight_runtime.protocols import CoordinationScope


def _open(root: Path, policy: CapacityPolicy | None = None) -> DomainInfo:
    return open_domain(
        root,
        storage_class=StorageClass.AUTO,
        capacity=policy,
        scope=CoordinationScope.SINGLE_PROCESS,
        init_timeout_s=60.0,
    )


def _guard(info: DomainInfo) -> CapacityGuard:
    return CapacityGuard(info.layout, info.capacity, info.storage_class)


def _expect(code: FailureCode, guard: CapacityGuard, *, artifact_bytes: int, additional_bytes: int) -> HostWeightError:
    with pytest.raises(HostWeightError) as caught:
        guard.check(artifact_bytes=artifact_bytes, additional_bytes=additional_bytes)
    error = caught.value
    assert error.code is code, error.failure.message
    assert error.retryable is True
    assert error.failure.stage is ResolutionStage.PRODUCTION
    return error


def _free_bytes(path: Path) -> int:
    info = os.statvfs(path)
    return info.f_bavail * info.f_frsize


@pytest.fixture
def shm_dir() -> Iterator[Path]:
    """A unique directory on the real tmpfs at /dev/shm, removed afterwards."""
    path = Path("/dev/shm") / f"hwr-test-{uuid.uuid4().hex}"
    path.mkdir(mode=0o700)
    try:
        yield path
    finally:
        shutil.rmtree(path)


def test_artifact_too_large(tmp_path: Path) -> None:
    """S18: an artifact above max_artifact_bytes is ARTIFACT_TOO_LARGE, retryable, naming the setting."""
    guard = _guard(_open(tmp_path / "domain", CapacityPolicy(max_artifact_bytes=100)))
    guard.check(artifact_bytes=100, additional_bytes=100)
    error = _expect(FailureCode.ARTIFACT_TOO_LARGE, guard, artifact_bytes=101, additional_bytes=1)
    assert "HWR_MAX_ARTIFACT_BYTES" in error.failure.message
    details = error.failure.details.to_value()
    assert isinstance(details, dict)
    assert details["artifact_bytes"] == 101 and details["max_artifact_bytes"] == 100


def test_store_limit_counts_artifacts_tmp_and_quarantine_but_not_symlinks(tmp_path: Path) -> None:
    """S18: published, in-flight and quarantined bytes occupy the medium and count toward max_store_bytes; symlink targets do not."""
    info = _open(tmp_path / "domain", CapacityPolicy(max_store_bytes=200))
    layout = info.layout
    published = layout.artifacts / ("a" * 64)
    published.mkdir()
    (published / "payload.safetensors").write_bytes(b"x" * 100)
    staging = layout.tmp / f"{'b' * 64}.1.abc"
    (staging / "nested").mkdir(parents=True)
    (staging / "nested" / "part").write_bytes(b"y" * 50)
    outside = tmp_path / "big"
    outside.write_bytes(b"z" * 10_000)
    (staging / "link").symlink_to(outside)
    (layout.quarantine / "old").write_bytes(b"q" * 30)
    guard = _guard(info)
    assert guard.store_bytes() == 180
    guard.check(artifact_bytes=20, additional_bytes=20)
    error = _expect(FailureCode.STORE_LIMIT_EXCEEDED, guard, artifact_bytes=21, additional_bytes=21)
    assert "HWR_MAX_STORE_BYTES" in error.failure.message
    details = error.failure.details.to_value()
    assert isinstance(details, dict)
    assert details["store_bytes"] == 180 and details["max_store_bytes"] == 200


def test_insufficient_capacity_for_min_free(tmp_path: Path) -> None:
    """S18: writing that would leave less than min_free_bytes free is INSUFFICIENT_CAPACITY."""
    root = tmp_path / "domain"
    impossible_reserve = _free_bytes(tmp_path) * 4 + 1
    guard = _guard(_open(root, CapacityPolicy(min_free_bytes=impossible_reserve)))
    error = _expect(FailureCode.INSUFFICIENT_CAPACITY, guard, artifact_bytes=1, additional_bytes=1)
    assert "HWR_MIN_FREE_BYTES" in error.failure.message
    assert "min_free_bytes" in error.failure.message


def test_insufficient_capacity_when_bytes_exceed_free_space(tmp_path: Path) -> None:
    """S18: more bytes than the filesystem has free is INSUFFICIENT_CAPACITY even without a reserve."""
    guard = _guard(_open(tmp_path / "domain"))
    too_many = os.statvfs(tmp_path).f_blocks * os.statvfs(tmp_path).f_frsize * 2
    error = _expect(FailureCode.INSUFFICIENT_CAPACITY, guard, artifact_bytes=too_many, additional_bytes=too_many)
    assert "free" in error.failure.message
    guard.check(artifact_bytes=1, additional_bytes=1)


def test_artifact_limit_is_checked_before_store_limit(tmp_path: Path) -> None:
    """The most specific limit is the one reported when several are broken."""
    guard = _guard(_open(tmp_path / "domain", CapacityPolicy(max_artifact_bytes=10, max_store_bytes=10)))
    _expect(FailureCode.ARTIFACT_TOO_LARGE, guard, artifact_bytes=20, additional_bytes=20)


def test_check_rejects_negative_sizes_and_guard_rejects_auto(tmp_path: Path) -> None:
    """Negative byte counts are programming errors; the guard needs the detected storage class."""
    info = _open(tmp_path / "domain")
    guard = _guard(info)
    with pytest.raises(ValueError):
        guard.check(artifact_bytes=-1, additional_bytes=0)
    with pytest.raises(ValueError):
        guard.check(artifact_bytes=0, additional_bytes=-1)
    with pytest.raises(ValueError):
        CapacityGuard(info.layout, info.capacity, StorageClass.AUTO)


def test_store_bytes_of_missing_directories_is_zero(tmp_path: Path) -> None:
    """A store whose directories are not there (yet) holds nothing."""
    guard = CapacityGuard(DomainLayout(tmp_path / "nowhere"), CapacityPolicy(), StorageClass.DISK)
    assert guard.store_bytes() == 0


def test_snapshot_on_tmpfs_reports_memory(shm_dir: Path) -> None:
    """tmpfs bytes are memory and are reported as such."""
    info = _open(shm_dir / "domain", CapacityPolicy(max_store_bytes=1 << 30))
    (info.layout.tmp / "staging").write_bytes(b"m" * 4096)
    snapshot = _guard(info).snapshot()
    assert isinstance(snapshot, CapacitySnapshot)
    assert snapshot.is_memory is True
    assert snapshot.store_bytes == 4096
    assert 0 <= snapshot.free_bytes <= snapshot.total_bytes
    assert snapshot.total_bytes > 0
    assert snapshot.policy == CapacityPolicy(max_store_bytes=1 << 30)


def test_capacity_failure_on_tmpfs_says_memory(shm_dir: Path) -> None:
    """On tmpfs a capacity failure says the bytes are memory."""
    guard = _guard(_open(shm_dir / "domain", CapacityPolicy(max_artifact_bytes=1)))
    error = _expect(FailureCode.ARTIFACT_TOO_LARGE, guard, artifact_bytes=2, additional_bytes=2)
    assert "memory" in error.failure.message
    details = error.failure.details.to_value()
    assert isinstance(details, dict) and details["is_memory"] is True


def test_snapshot_on_disk_is_not_memory(tmp_path: Path) -> None:
    """A disk domain's snapshot is not memory."""
    snapshot = _guard(_open(tmp_path / "domain")).snapshot()
    assert snapshot.is_memory is False
    assert snapshot.store_bytes == 0


@pytest.mark.parametrize(
    ("number", "code", "retryable"),
    [
        (errno.ENOSPC, FailureCode.NO_SPACE, True),
        (errno.EDQUOT, FailureCode.QUOTA_EXCEEDED, True),
        (errno.EIO, FailureCode.IO_ERROR, True),
        (errno.EACCES, FailureCode.IO_ERROR, False),
        (errno.ENOENT, FailureCode.IO_ERROR, False),
        (errno.EROFS, FailureCode.IO_ERROR, False),
    ],
)
def test_failure_from_os_error(number: int, code: FailureCode, retryable: bool) -> None:
    """S18: ENOSPC/EDQUOT/EIO are typed and retryable; other errors are non-retryable I/O errors."""
    exc = OSError(number, os.strerror(number), "/some/file")
    failure = failure_from_os_error(exc, stage=ResolutionStage.PUBLICATION, what="writing the manifest")
    assert failure.code is code
    assert failure.retryable is retryable
    assert failure.stage is ResolutionStage.PUBLICATION
    assert failure.details.to_value() == {
        "errno": errno.errorcode[number],
        "what": "writing the manifest",
        "path": "/some/file",
    }
    assert "writing the manifest" in failure.message and errno.errorcode[number] in failure.message


def test_failure_from_os_error_without_errno() -> None:
    """An OSError without an errno is still typed (non-retryable), never a raw exception."""
    failure = failure_from_os_error(OSError("odd"), stage=ResolutionStage.LOOKUP, what="reading")
    assert failure.code is FailureCode.IO_ERROR
    assert failure.retryable is False
    details = failure.details.to_value()
    assert isinstance(details, dict)
    assert details["errno"] == "UNKNOWN" and details["path"] is None

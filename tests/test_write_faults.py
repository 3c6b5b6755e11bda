"""ENOSPC and EIO in the middle of a payload write: at every named seam of the write path, and
for real on a size-capped tmpfs.

A failed build must end as one typed, retryable failure (NO_SPACE for ENOSPC, IO_ERROR for EIO), leave
nothing in artifacts/, tmp/, deny/ or quarantine/, and leave the domain usable: the next build of the same
key succeeds and verifies fully. Through `HostWeightRuntime.resolve`, PREFERRED falls back to the
canonical load and REQUIRED fails with the same typed failure.
"""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from host_weight_runtime import BuildRequest, FilesystemHostWeightStore, StoreStatus, ValidationLevel
from host_weight_runtime._faults import Fault, FaultAction, arm, disarm_all
from host_weight_runtime.config import CapacityPolicy, HostWeightRuntimeConfig, RuntimeMode
from host_weight_runtime.failures import FailureCode
from host_weight_runtime.outcomes import AttemptAction, AttemptResult, ResolutionOutcome, StoreResult
from host_weight_runtime.runtime import HostWeightRuntime

from ._hostile import assert_served_exactly
from .support import SyntheticProducer, make_identity, make_tensors

FULL = ValidationLevel.FULL_CHECKSUM
META = ValidationLevel.MANIFEST_AND_METADATA
WAIT_S = 60.0
FILES = 2
CODES = {errno.ENOSPC: FailureCode.NO_SPACE, errno.EIO: FailureCode.IO_ERROR}

# (seam, passes to let through before it fires): every place of the write path where an I/O error can
# arrive, from the first byte of the first payload to the fsync of artifacts/ after the commit rename.
SEAMS: list[tuple[str, int]] = [
    ("writer.preallocate", 0),  # the first payload file
    ("writer.preallocate", 1),  # the second file, after the first was written completely
    ("writer.pwrite", 0),  # the safetensors header
    ("writer.pwrite", 2),  # a tensor in the middle of the first payload
    ("writer.after_pwrite", 1),  # the header and one tensor are on disk
    ("writer.after_pwrite", 6),  # inside the second payload
    ("writer.hash", 0),  # reading written bytes back to hash them
    ("writer.fsync", 0),
    ("writer.fsync", 1),
    ("writer.fsync_staging", 0),
    ("publication.before_manifest", 0),
    ("publication.write_manifest", 0),  # manifest.json written but not yet fsynced
    ("publication.after_manifest", 0),
    ("publication.write_ready", 0),  # READY.json written but not yet fsynced
    ("publication.after_ready", 0),
    ("publication.fsync_sealed", 0),
    ("publication.after_harden", 0),
    ("publication.after_rename", 0),  # already renamed into artifacts/: the build withdraws it
    ("publication.after_commit", 0),
]


def soon() -> float:
    return time.monotonic() + WAIT_S


def arm_after(point: str, skip: int, error: int) -> None:
    """Arm `point` to let `skip` passes through and raise `error` on the next one."""
    if skip:
        arm(point, Fault(FaultAction.PAUSE, times=skip))  # a PAUSE without a hook only counts a pass
    arm(point, Fault(FaultAction.RAISE_OSERROR, errno=error))


@pytest.fixture(autouse=True)
def _disarm() -> Iterator[None]:
    yield
    disarm_all()


def producer() -> SyntheticProducer:
    return SyntheticProducer(make_identity(), make_tensors(), files=FILES)


def assert_nothing_left(store: FilesystemHostWeightStore) -> None:
    """No artifact, no staging residue, no deny marker, nothing quarantined."""
    layout = store.layout
    for directory in (layout.artifacts, layout.tmp, layout.deny, layout.quarantine):
        assert os.listdir(directory) == [], (directory, os.listdir(directory))


def assert_usable_after(store: FilesystemHostWeightStore) -> None:
    """The same key builds again, and the result verifies fully and serves the exact tensors."""
    identity = make_identity()
    rebuilt = store.get_or_build(BuildRequest(identity), producer(), validation=FULL, deadline=soon())
    assert rebuilt.status is StoreStatus.BUILT and rebuilt.lease is not None, rebuilt.failure
    rebuilt.lease.close()
    assert_verifies(store)


def assert_verifies(store: FilesystemHostWeightStore) -> None:
    """The published artifact passes FULL_CHECKSUM and serves exactly the produced tensors; tmp/ is empty."""
    hit = store.lookup(make_identity(), validation=FULL)
    assert hit.status is StoreStatus.HIT and hit.lease is not None
    try:
        assert_served_exactly(hit.lease.tensors, make_tensors())
    finally:
        hit.lease.close()
    assert os.listdir(store.layout.tmp) == []


def assert_typed(result: StoreResult, code: FailureCode) -> None:
    assert result.status is StoreStatus.FAILED and result.lease is None
    assert result.failure is not None and result.failure.code is code, result.failure
    assert result.failure.retryable, result.failure


@pytest.mark.parametrize("error", sorted(CODES), ids=lambda number: errno.errorcode[number])
@pytest.mark.parametrize(("point", "skip"), SEAMS, ids=[f"{point}-{skip}" for point, skip in SEAMS])
def test_io_error_at_each_write_seam_is_typed_and_leaves_nothing(
    tmp_path: Path, point: str, skip: int, error: int
) -> None:
    """S18 S16: ENOSPC or EIO at any step of writing a payload, sealing or committing it is a typed,
    retryable NO_SPACE / IO_ERROR; nothing is visible, no residue stays in tmp/, and the next build verifies."""
    store = FilesystemHostWeightStore(tmp_path / "hwr")
    arm_after(point, skip, error)
    result = store.get_or_build(BuildRequest(make_identity()), producer(), validation=META, deadline=soon())
    disarm_all()
    assert_typed(result, CODES[error])
    assert_nothing_left(store)
    assert_usable_after(store)


@pytest.mark.parametrize("error", sorted(CODES), ids=lambda number: errno.errorcode[number])
def test_mid_write_error_through_resolve_falls_back_or_fails_typed(tmp_path: Path, error: int) -> None:
    """R10 S18: a mid-payload ENOSPC/EIO is retryable, so PREFERRED falls back to the canonical load (the failed
    production attempt recorded) while REQUIRED fails with the same code; neither leaves residue."""
    root = tmp_path / "hwr"
    outcomes = {}
    for mode in (RuntimeMode.PREFERRED, RuntimeMode.REQUIRED):
        runtime = HostWeightRuntime(HostWeightRuntimeConfig(mode=mode, root=root, lock_timeout_s=WAIT_S))
        arm_after("writer.after_pwrite", 2, error)
        resolution = runtime.resolve(make_identity(), producer())
        disarm_all()
        assert resolution.lease is None
        production = [attempt for attempt in resolution.report.attempts if attempt.result is AttemptResult.FAILED]
        assert len(production) == 1 and production[0].failure is not None
        assert production[0].failure.code is CODES[error] and production[0].failure.retryable
        outcomes[mode] = (resolution.outcome, production[0].action, resolution.report.failure)
        assert_nothing_left(FilesystemHostWeightStore(root))
    assert outcomes[RuntimeMode.PREFERRED][:2] == (ResolutionOutcome.CANONICAL_FALLBACK, AttemptAction.FALL_BACK)
    failed_outcome, _action, failed = outcomes[RuntimeMode.REQUIRED]
    assert failed_outcome is ResolutionOutcome.FAILED and failed is not None and failed.code is CODES[error]
    runtime = HostWeightRuntime(HostWeightRuntimeConfig(mode=RuntimeMode.REQUIRED, root=root, lock_timeout_s=WAIT_S))
    built = runtime.resolve(make_identity(), producer())
    assert built.outcome is ResolutionOutcome.LOCAL_PRODUCTION and built.lease is not None
    built.lease.close()
    assert_verifies(FilesystemHostWeightStore(root))


# --------------------------------------------------------------------------- a real ENOSPC on a capped tmpfs

TMPFS_BYTES = 4 * 2**20


@contextlib.contextmanager
def capped_tmpfs(mount_point: Path) -> Iterator[Path]:
    """A private tmpfs of TMPFS_BYTES at `mount_point`; skipped (with the reason) where it cannot be mounted."""
    if os.geteuid() != 0:
        pytest.skip("mounting a size-capped tmpfs needs root; the seam tests above cover ENOSPC without it")
    mount_point.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={TMPFS_BYTES},mode=0700", "tmpfs", str(mount_point)],
        capture_output=True,
        text=True,
        check=False,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({mounted.stderr.strip()}); the seam tests cover ENOSPC without it")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=True)


class Filler:
    """Another tenant of the same filesystem that takes every free byte when told to, and gives them back."""

    def __init__(self, mount_point: Path) -> None:
        self.path = mount_point / "filler"
        self.fired: list[str] = []

    def fill(self, point: str) -> None:
        self.fired.append(point)
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            chunk = b"\xa5" * 65536
            while True:
                try:
                    os.write(fd, chunk)
                except OSError as exc:
                    if exc.errno != errno.ENOSPC:
                        raise
                    if len(chunk) == 1:
                        break
                    chunk = chunk[: len(chunk) // 2]
        finally:
            os.close(fd)
        info = os.statvfs(self.path)
        assert info.f_bavail == 0, "the filler left free blocks"

    def free(self) -> None:
        self.path.unlink()


@pytest.mark.parametrize(
    ("point", "skip"),
    [
        ("writer.preallocate", 0),  # the first payload file's allocation, just after its capacity check
        ("writer.preallocate", 1),  # mid-payload: the second file's allocation, the first one written in full
        ("publication.before_manifest", 0),  # every payload written; manifest.json does not fit
        ("publication.after_manifest", 0),  # manifest written; READY.json does not fit
    ],
)
def test_real_enospc_mid_build_on_a_capped_tmpfs(tmp_path: Path, point: str, skip: int) -> None:
    """S18: the capacity pre-check passes, then another tenant fills the tmpfs (synchronised by a PAUSE
    seam hook, no sleeps) and the kernel's own ENOSPC arrives mid-build (payload files are preallocated, so
    it arrives at an allocation: a payload file's, the manifest's or READY's, never inside a preallocated file): typed retryable NO_SPACE, no residue in
    tmp/, nothing published; once the space is freed the same key builds and verifies fully."""
    with capped_tmpfs(tmp_path / "mnt") as mount_point:
        store = FilesystemHostWeightStore(mount_point / "hwr", capacity=CapacityPolicy(min_free_bytes=0))
        filler = Filler(mount_point)
        if skip:
            arm(point, Fault(FaultAction.PAUSE, times=skip))
        arm(point, Fault(FaultAction.PAUSE, hook=filler.fill))
        result = store.get_or_build(BuildRequest(make_identity()), producer(), validation=META, deadline=soon())
        disarm_all()
        assert filler.fired == [point]
        assert_typed(result, FailureCode.NO_SPACE)
        assert result.failure is not None
        details = result.failure.details.to_value()
        assert isinstance(details, dict) and details["errno"] == "ENOSPC"
        assert "injected" not in result.failure.message  # the kernel's error, not a seam's
        assert_nothing_left(store)
        filler.free()
        assert_usable_after(store)


def test_real_enospc_through_load_component_publishes_nothing_then_recovers(tmp_path: Path) -> None:
    """D14 S18: a real diffusers model loaded in PREFERRED onto a domain whose tmpfs another tenant fills
    between the capacity check and the allocation: the model still loads canonically, the post-load publication
    fails typed (NO_SPACE), nothing is published or left in tmp/; with the space freed the next load publishes."""
    from host_weight_runtime.diffusion import load_component
    from hwr_tools.synthetic_models import build_model, save_model_folder

    folder = save_model_folder(build_model("flux"), tmp_path / "model")
    with capped_tmpfs(tmp_path / "mnt") as mount_point:
        root = mount_point / "hwr"
        config = HostWeightRuntimeConfig(
            mode=RuntimeMode.PREFERRED, root=root, lock_timeout_s=WAIT_S, capacity=CapacityPolicy(min_free_bytes=0)
        )
        filler = Filler(mount_point)
        arm("writer.preallocate", Fault(FaultAction.PAUSE, hook=filler.fill))
        with load_component(folder, runtime=HostWeightRuntime(config), publish_in_background=False) as loaded:
            disarm_all()
            assert filler.fired == ["writer.preallocate"]
            assert loaded.lease is None and loaded.outcome is ResolutionOutcome.CANONICAL_FALLBACK
            assert loaded.publication is not None and loaded.publication.failure is not None
            assert loaded.publication.failure.code is FailureCode.NO_SPACE and loaded.publication.failure.retryable
        store = FilesystemHostWeightStore(root)
        assert os.listdir(store.layout.artifacts) == [] and os.listdir(store.layout.tmp) == []
        filler.free()
        with load_component(folder, runtime=HostWeightRuntime(config), publish_in_background=False) as again:
            assert again.publication is not None and again.publication.failure is None
        with load_component(folder, runtime=HostWeightRuntime(config), publish_in_background=False) as hit:
            assert hit.outcome is ResolutionOutcome.LOCAL_HIT and hit.lease is not None
        assert len(os.listdir(store.layout.artifacts)) == 1 and os.listdir(store.layout.tmp) == []

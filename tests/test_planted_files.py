"""Planted files: what a hostile or broken co-tenant can leave in the domain is refused, typed, never followed.

Symlinks, hard links, FIFOs, directories where files belong and files of another uid, in the artifact,
tmp/, locks/, deny/, quarantine/ and the domain's own directories and files. A symlink planted here
always points at something that would pass if it were followed (an identical copy) or that would hang
or be damaged if it were (a FIFO, a victim file), so a typed refusal proves it was not followed.
"""

from __future__ import annotations

import os
import shutil
import stat
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from host_weight_runtime import BuildRequest, FilesystemHostWeightStore, HostWeightError, StoreStatus, ValidationLevel
from host_weight_runtime.failures import FailureCode
from host_weight_runtime.manifest import MANIFEST_FILE_NAME, READY_FILE_NAME
from host_weight_runtime.outcomes import CleanupStatus

from ._hostile import assert_served_exactly, manifest_value
from .support import SyntheticProducer, make_identity, make_tensors

META = ValidationLevel.MANIFEST_AND_METADATA
FULL = ValidationLevel.FULL_CHECKSUM
OTHER_UID = 12345
IS_ROOT = os.geteuid() == 0
needs_root = pytest.mark.skipif(
    not IS_ROOT, reason="making a file belong to another uid needs root (chown); this run is not root"
)


def soon() -> float:
    return time.monotonic() + 60.0


def test_this_suite_runs_as_root_here() -> None:
    """The uid tests below are skipped only off root; say loudly when that happens, so a skip is never a pass."""
    if not IS_ROOT:
        pytest.skip("not root: the other-uid planted-file tests are skipped in this run")
    assert os.geteuid() == 0


@pytest.fixture
def store(tmp_path: Path) -> FilesystemHostWeightStore:
    return FilesystemHostWeightStore(tmp_path / "hwr")


def publish(store: FilesystemHostWeightStore) -> Path:
    identity = make_identity()
    result = store.get_or_build(
        BuildRequest(identity), SyntheticProducer(identity, make_tensors(), files=2), validation=META, deadline=soon()
    )
    assert result.status is StoreStatus.BUILT and result.lease is not None, result.failure
    result.lease.close()
    return store.layout.artifact_dir(identity.key)


def member_names(directory: Path) -> dict[str, str]:
    files = manifest_value(directory)["files"]
    assert isinstance(files, list)
    return {"payload": files[0]["name"], "manifest": MANIFEST_FILE_NAME, "ready": READY_FILE_NAME}


def replace_member(directory: Path, name: str, plant: Callable[[Path], None]) -> None:
    """Swap one member of a published artifact for something else, restoring the directory's 0555."""
    os.chmod(directory, 0o755)
    target = directory / name
    os.chmod(target, 0o644)
    target.unlink()
    plant(target)
    os.chmod(directory, 0o555)


def assert_invalid_then_rebuilt(store: FilesystemHostWeightStore, *, code: FailureCode) -> None:
    """The lookup is typed INVALID with `code` and denied; the next build quarantines and rebuilds a hit."""
    identity = make_identity()
    for level in (FULL, META):
        result = store.lookup(identity, validation=level)
        assert result.status is StoreStatus.INVALID and result.lease is None and result.failure is not None
        assert result.failure.code in {code, FailureCode.ARTIFACT_DENIED}, result.failure
    assert store.layout.deny_marker(identity.key).exists()
    tensors = make_tensors()
    rebuilt = store.get_or_build(
        BuildRequest(identity), SyntheticProducer(identity, tensors), validation=FULL, deadline=soon()
    )
    assert rebuilt.status is StoreStatus.BUILT and rebuilt.lease is not None, rebuilt.failure
    assert_served_exactly(rebuilt.lease.tensors, tensors)
    rebuilt.lease.close()
    assert len(store.layout.quarantined_dirs(identity.key)) == 1


# --------------------------------------------------------------------------- inside the artifact


@pytest.mark.parametrize("member", ["payload", "manifest", "ready"])
@pytest.mark.parametrize("kind", ["symlink_to_copy", "symlink_to_fifo", "hard_link", "directory", "fifo"])
def test_planted_artifact_member_is_refused_unfollowed(
    store: FilesystemHostWeightStore, tmp_path: Path, member: str, kind: str
) -> None:
    """S12 S10: a payload, manifest.json or READY.json replaced by a symlink (to an identical copy, or to a
    FIFO that would block if opened), a hard link, a directory or a FIFO is typed PAYLOAD_INVALID at every
    level, is never followed or opened, and the next build quarantines it and rebuilds."""
    directory = publish(store)
    name = member_names(directory)[member]
    outside = tmp_path / "outside"
    outside.mkdir()
    copy = outside / name
    shutil.copyfile(directory / name, copy)
    os.chmod(copy, 0o444)
    original = copy.read_bytes()

    def plant(target: Path) -> None:
        if kind == "symlink_to_copy":
            target.symlink_to(copy)
        elif kind == "symlink_to_fifo":
            os.mkfifo(outside / "fifo")
            target.symlink_to(outside / "fifo")
        elif kind == "hard_link":
            os.link(copy, target)
        elif kind == "directory":
            target.mkdir()
        elif kind == "fifo":
            os.mkfifo(target)

    replace_member(directory, name, plant)
    assert_invalid_then_rebuilt(store, code=FailureCode.PAYLOAD_INVALID)
    assert copy.read_bytes() == original and stat.S_IMODE(copy.stat().st_mode) == 0o444


@pytest.mark.parametrize("kind", ["symlink_to_copy", "regular_file"])
def test_planted_artifact_directory_is_refused_unfollowed(
    store: FilesystemHostWeightStore, tmp_path: Path, kind: str
) -> None:
    """S12: the artifact directory replaced by a symlink to an identical published copy, or by a regular file,
    is PAYLOAD_INVALID (the copy would pass if followed); the rebuild moves the link itself to quarantine
    and the copy's files are unchanged (its mode: see the xfail test below)."""
    directory = publish(store)
    copy = tmp_path / "copy"
    shutil.copytree(directory, copy, symlinks=True)
    os.chmod(directory, 0o755)
    shutil.rmtree(directory)
    if kind == "symlink_to_copy":
        directory.symlink_to(copy, target_is_directory=True)
    else:
        directory.write_bytes(b"not a directory")
    before = {path.name: path.read_bytes() for path in copy.iterdir()}
    assert_invalid_then_rebuilt(store, code=FailureCode.PAYLOAD_INVALID)
    assert {path.name: path.read_bytes() for path in copy.iterdir()} == before
    [quarantined] = store.layout.quarantined_dirs(make_identity().key)
    assert quarantined.is_symlink() == (kind == "symlink_to_copy")


def test_quarantining_a_symlinked_artifact_directory_leaves_the_target_mode(
    store: FilesystemHostWeightStore, tmp_path: Path
) -> None:
    """S12: the rebuild that quarantines a planted artifact-directory symlink changes nothing it points at."""
    directory = publish(store)
    victim = tmp_path / "victim"
    victim.mkdir()
    os.chmod(victim, 0o750)
    os.chmod(directory, 0o755)
    shutil.rmtree(directory)
    directory.symlink_to(victim, target_is_directory=True)
    identity = make_identity()
    assert store.lookup(identity, validation=META).status is StoreStatus.INVALID
    rebuilt = store.get_or_build(
        BuildRequest(identity), SyntheticProducer(identity, make_tensors()), validation=META, deadline=soon()
    )
    assert rebuilt.status is StoreStatus.BUILT and rebuilt.lease is not None
    rebuilt.lease.close()
    assert stat.S_IMODE(victim.stat().st_mode) == 0o750


@needs_root
@pytest.mark.parametrize("what", ["directory", "payload", "manifest", "ready"])
def test_artifact_owned_by_another_uid_is_refused(store: FilesystemHostWeightStore, what: str) -> None:
    """S10: an artifact directory or member that belongs to another uid is PAYLOAD_INVALID, then rebuilt."""
    directory = publish(store)
    target = directory if what == "directory" else directory / member_names(directory)[what]
    os.chown(target, OTHER_UID, OTHER_UID, follow_symlinks=False)
    assert_invalid_then_rebuilt(store, code=FailureCode.PAYLOAD_INVALID)


# --------------------------------------------------------------------------- tmp/, deny/, quarantine/


def test_planted_symlinks_in_tmp_deny_and_quarantine_are_never_followed(
    store: FilesystemHostWeightStore, tmp_path: Path
) -> None:
    """S12: symlinks planted where builds, deny markers and quarantined copies live, named like the key's
    own entries, are removed as links by builds and cleanup; the victims they point at are untouched."""
    directory = publish(store)
    key = make_identity().key
    victim_dir = tmp_path / "victim"
    victim_dir.mkdir()
    (victim_dir / "keep.txt").write_bytes(b"precious")
    os.chmod(victim_dir, 0o750)
    victim_file = tmp_path / "victim.txt"
    victim_file.write_bytes(b"precious")
    (store.layout.tmp / f"{key}.1.deadbeef0000").symlink_to(victim_dir, target_is_directory=True)
    (store.layout.quarantine / f"{key}.1.deadbeef").symlink_to(victim_dir, target_is_directory=True)

    # A stale build's name in tmp/ is removed by the next build of the key; it is a link, so only the link goes.
    os.chmod(directory, 0o755)
    shutil.rmtree(directory)
    identity = make_identity()
    built = store.get_or_build(
        BuildRequest(identity), SyntheticProducer(identity, make_tensors()), validation=META, deadline=soon()
    )
    assert built.status is StoreStatus.BUILT and built.lease is not None
    built.lease.close()
    assert not os.path.lexists(store.layout.tmp / f"{key}.1.deadbeef0000")

    # A deny marker that is a symlink still denies; the rebuild removes the link, not the victim file.
    store.layout.deny_marker(key).symlink_to(victim_file)
    denied = store.lookup(identity, validation=META)
    assert denied.status is StoreStatus.INVALID and denied.failure is not None
    assert denied.failure.code is FailureCode.ARTIFACT_DENIED
    rebuilt = store.get_or_build(
        BuildRequest(identity), SyntheticProducer(identity, make_tensors()), validation=META, deadline=soon()
    )
    assert rebuilt.status is StoreStatus.BUILT and rebuilt.lease is not None
    rebuilt.lease.close()
    assert not os.path.lexists(store.layout.deny_marker(key))

    inventory = store.inspect_domain()
    assert {entry.state.value for entry in inventory.artifacts} >= {"ready", "quarantined"}
    assert victim_file.read_bytes() == b"precious"
    assert (victim_dir / "keep.txt").read_bytes() == b"precious"
    assert stat.S_IMODE(victim_dir.stat().st_mode) == 0o750


def test_cleanup_of_a_symlinked_artifact_directory_leaves_the_target_alone(
    store: FilesystemHostWeightStore, tmp_path: Path
) -> None:
    """S12: `cleanup` of a key whose artifact directory is a planted symlink removes the link and touches
    nothing it points at (neither the target's files nor its mode)."""
    directory = publish(store)
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep.txt").write_bytes(b"precious")
    os.chmod(victim, 0o750)
    os.chmod(directory, 0o755)
    shutil.rmtree(directory)
    directory.symlink_to(victim, target_is_directory=True)
    result = store.cleanup(make_identity().key)
    assert result.status is CleanupStatus.REMOVED
    assert not os.path.lexists(directory)
    assert (victim / "keep.txt").read_bytes() == b"precious"
    assert stat.S_IMODE(victim.stat().st_mode) == 0o750


# --------------------------------------------------------------------------- locks/


def plant_lock(path: Path, kind: str, victim: Path) -> None:
    if kind == "symlink_to_victim":
        path.symlink_to(victim)
    elif kind == "dangling_symlink":
        path.symlink_to(victim.parent / "created-through-the-link")
    elif kind == "fifo":
        os.mkfifo(path, 0o600)
    elif kind == "directory":
        path.mkdir(0o700)
    elif kind == "hard_link":
        os.link(victim, path)
    elif kind == "group_writable":
        path.write_bytes(b"")
        os.chmod(path, 0o660)
    elif kind == "other_uid":
        path.write_bytes(b"")
        os.chmod(path, 0o600)
        os.chown(path, OTHER_UID, OTHER_UID)
    else:
        raise AssertionError(kind)


LOCK_KINDS = [
    "symlink_to_victim",
    "dangling_symlink",
    "fifo",
    "directory",
    "hard_link",
    "group_writable",
    pytest.param("other_uid", marks=needs_root),
]


@pytest.mark.parametrize("kind", LOCK_KINDS)
@pytest.mark.parametrize("which", ["artifact", "build"])
def test_planted_lock_file_is_refused_and_never_opened(
    store: FilesystemHostWeightStore, tmp_path: Path, kind: str, which: str
) -> None:
    """S12: a lock path holding a symlink (to a victim or dangling), a FIFO, a directory, a hard link, a
    group-writable file or another uid's file is UNSAFE_PERMISSIONS for the lookup or build that needs it;
    nothing is created through it, the victim is unchanged, and no call hangs on the FIFO."""
    identity = make_identity()
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"precious")
    os.chmod(victim, 0o600)
    path = store.layout.artifact_lock(identity.key) if which == "artifact" else store.layout.build_lock(identity.key)
    plant_lock(path, kind, victim)
    producer = SyntheticProducer(identity, make_tensors())
    result = store.get_or_build(BuildRequest(identity), producer, validation=META, deadline=soon())
    assert result.status is StoreStatus.FAILED and result.lease is None and result.failure is not None
    assert result.failure.code is FailureCode.UNSAFE_PERMISSIONS, result.failure
    assert producer.calls == 0
    assert victim.read_bytes() == b"precious" and stat.S_IMODE(victim.stat().st_mode) == 0o600
    assert not (tmp_path / "created-through-the-link").exists()
    assert os.listdir(store.layout.artifacts) == [] and os.listdir(store.layout.tmp) == []
    activity = store.inspect_artifact(identity.key).locks  # inspection never opens the planted file either
    assert (activity.lease_active if which == "artifact" else activity.build_active) is True


# --------------------------------------------------------------------------- the domain itself


@pytest.mark.parametrize("subdir", ["", "locks", "artifacts", "tmp", "quarantine", "deny"])
@pytest.mark.parametrize("kind", ["group_writable", "other_writable", "symlink", "file", "other_uid"])
def test_unsafe_domain_root_or_subdirectory_is_refused(tmp_path: Path, subdir: str, kind: str) -> None:
    """S12: a domain root or store subdirectory that is writable by group or others, a symlink, a file or
    another uid's is UNSAFE_PERMISSIONS when the store opens, before anything is read or written; a root
    that is a file cannot be opened at all and is DOMAIN_UNAVAILABLE (R11)."""
    if kind == "other_uid" and not IS_ROOT:
        pytest.skip("making a directory belong to another uid needs root (chown); this run is not root")
    root = tmp_path / "hwr"
    FilesystemHostWeightStore(root)
    target = root / subdir if subdir else root
    if kind in ("group_writable", "other_writable"):
        os.chmod(target, 0o770 if kind == "group_writable" else 0o707)
    elif kind == "other_uid":
        os.chown(target, OTHER_UID, OTHER_UID)
    else:
        elsewhere = tmp_path / "elsewhere"
        shutil.move(target, elsewhere)
        if kind == "symlink":
            target.symlink_to(elsewhere, target_is_directory=True)
        else:
            target.write_bytes(b"")
    with pytest.raises(HostWeightError) as caught:
        FilesystemHostWeightStore(root)
    if kind == "file" and not subdir:  # a root that cannot be opened is unavailable, not unsafe (R11)
        assert caught.value.code is FailureCode.DOMAIN_UNAVAILABLE and caught.value.retryable, caught.value
        return
    assert caught.value.code is FailureCode.UNSAFE_PERMISSIONS, caught.value
    message = caught.value.failure.message
    problem = {
        "group_writable": f"has mode 0770, writable by group or others; run `chmod go-w {target}`",
        "other_writable": f"has mode 0707, writable by group or others; run `chmod go-w {target}`",
        "symlink": "is a symlink; it must be a real directory",
        "file": "is not a directory",
        "other_uid": f"belongs to uid {OTHER_UID}, not to the current user",
    }[kind]
    assert f"{target} {problem}" in message, message
    assert message.endswith("fix it or set HWR_ROOT to a fresh path"), message


@pytest.mark.parametrize("kind", ["other_uid", "group_writable", "hard_link", "symlink", "directory"])
@pytest.mark.parametrize("name", ["domain.json", "domain-policy.json"])
def test_planted_domain_files_are_refused(tmp_path: Path, name: str, kind: str) -> None:
    """S12: domain.json or domain-policy.json of another uid, group-writable, hard-linked, a symlink or a
    directory is refused with a typed error when the store opens; a symlink's target is never read."""
    if kind == "other_uid" and not IS_ROOT:
        pytest.skip("making a file belong to another uid needs root (chown); this run is not root")
    root = tmp_path / "hwr"
    FilesystemHostWeightStore(root)
    path = root / name
    copy = tmp_path / f"copy-{name}"
    shutil.copyfile(path, copy)
    if kind == "other_uid":
        os.chown(path, OTHER_UID, OTHER_UID)
    elif kind == "group_writable":
        os.chmod(path, 0o620)
    elif kind == "hard_link":
        os.link(path, tmp_path / "second-link")
    else:
        path.unlink()
        if kind == "symlink":
            path.symlink_to(copy)
        else:
            path.mkdir()
    with pytest.raises(HostWeightError) as caught:
        FilesystemHostWeightStore(root)
    assert caught.value.code in {FailureCode.UNSAFE_PERMISSIONS, FailureCode.DOMAIN_INVALID}, caught.value


def test_cleanup_with_a_planted_lock_file_is_a_typed_failure(store: FilesystemHostWeightStore, tmp_path: Path) -> None:
    """S12: `cleanup` of a key whose build lock is a planted symlink reports a typed failure and removes nothing."""
    directory = publish(store)
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"precious")
    lock_path = store.layout.build_lock(make_identity().key)
    lock_path.unlink(missing_ok=True)  # the co-tenant replaces the store's lock file with a link
    lock_path.symlink_to(victim)
    result = store.cleanup(make_identity().key)
    assert result.status is CleanupStatus.FAILED and result.failure is not None
    assert result.failure.code is FailureCode.UNSAFE_PERMISSIONS
    assert directory.is_dir() and victim.read_bytes() == b"precious"

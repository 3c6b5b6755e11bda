"""Opening a domain: locality (S19), ownership and modes, the first policy (S22), the init lock (S23)."""

from __future__ import annotations

import errno
import json
import os
import shutil
import stat
import time
import uuid
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from pathlib import Path

import pytest

from host_weight_runtime._faults import Fault, FaultAction, arm, armed
from host_weight_runtime.config import CapacityPolicy, StorageClass
from host_weight_runtime.failures import FailureCode, HostWeightError, ResolutionStage
from host_weight_runtime.filesystem._fsutil import read_small_file, write_file_atomic
from host_weight_runtime.filesystem._layout import STORE_DIRS, DomainLayout
from host_weight_runtime.filesystem.domain import (
    DomainInfo,
    MountEntry,
    MountTable,
    classify_filesystem,
    open_domain,
    read_mount_table,
)
from host_weight_runtime.filesystem.locks import acquire_lock
from host_weight_runtime.protocols import CoordinationScope
from hwr_tools.preimported import preimported_context

from .support import recv_within, spawned_child

TIMEOUT_S = 60.0
_SPAWN = preimported_context()
_SCOPE = CoordinationScope.SINGLE_PROCESS


# ----------------------------------------------------------------- helpers


def _escape(text: str) -> str:
    """Escape a field the way the kernel does in mountinfo."""
    return "".join(f"\\{ord(ch):03o}" if ch in " \t\n\\" else ch for ch in text)


def _write_mountinfo(path: Path, mounts: list[tuple[str, str, str, str]]) -> Path:
    """A mountinfo file: "/" on ext4 first, then (mount_point, fs_type, source, super_options)."""
    lines = ["1 0 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw,errors=remount-ro"]
    for number, (mount_point, fs_type, source, super_options) in enumerate(mounts, start=2):
        lines.append(
            f"{number} 1 0:{number} / {_escape(mount_point)} rw,nosuid,relatime shared:{number} master:1 "
            f"- {_escape(fs_type)} {_escape(source)} {super_options}"
        )
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _fake_table(tmp_path: Path, mount_point: Path, fs_type: str, super_options: str = "rw") -> MountTable:
    """A mount table that puts `mount_point` (an existing directory) on `fs_type`."""
    real = os.path.realpath(mount_point)
    return read_mount_table(
        _write_mountinfo(tmp_path / "mountinfo", [(real, fs_type, "server:/export", super_options)])
    )


def _open(
    root: Path,
    *,
    capacity: CapacityPolicy | None = None,
    storage_class: StorageClass = StorageClass.AUTO,
    init_timeout_s: float = TIMEOUT_S,
    mount_table: MountTable | None = None,
) -> DomainInfo:
    return open_domain(
        root,
        storage_class=storage_class,
        capacity=capacity,
        scope=_SCOPE,
        init_timeout_s=init_timeout_s,
        mount_table=mount_table,
    )


def _expect_failure(code: FailureCode, call: Callable[[], object]) -> HostWeightError:
    with pytest.raises(HostWeightError) as caught:
        call()
    assert caught.value.code is code, caught.value.failure.message
    assert caught.value.failure.stage is ResolutionStage.DOMAIN
    return caught.value


@pytest.fixture
def shm_dir() -> Iterator[Path]:
    """A unique directory on the real tmpfs at /dev/shm, removed afterwards."""
    path = Path("/dev/shm") / f"hwr-test-{uuid.uuid4().hex}"
    path.mkdir(mode=0o700)
    try:
        yield path
    finally:
        shutil.rmtree(path)


# ----------------------------------------------------------------- mount table


def test_real_mountinfo_parses_and_finds_root_and_shm() -> None:
    """The kernel's mountinfo parses; "/" is found, and /dev/shm resolves to a tmpfs mount."""
    table = read_mount_table()
    assert any(entry.mount_point == "/" for entry in table.entries)
    assert table.find(Path("/")).mount_point == "/"
    shm = table.find(Path("/dev/shm") / f"missing-{uuid.uuid4().hex}" / "deeper")
    assert shm.mount_point == "/dev/shm"
    assert shm.fs_type == "tmpfs"
    assert classify_filesystem(shm.fs_type) is StorageClass.TMPFS


def test_mountinfo_escapes_optional_fields_and_longest_prefix(tmp_path: Path) -> None:
    """Octal escapes (\\040 etc.) are decoded, optional fields skipped, and the longest prefix wins."""
    base = Path(os.path.realpath(tmp_path))
    outer_dir = base / "with space"
    inner_dir = outer_dir / "inner\tdir"
    sibling = base / "with"
    for directory in (inner_dir, sibling, base / "withheld"):
        directory.mkdir(parents=True)
    mountinfo = _write_mountinfo(
        tmp_path / "mountinfo",
        [
            (str(outer_dir), "nfs4", "server:/a b", "rw,vers=4.2"),
            (str(inner_dir), "tmpfs", "tmp\\fs", "rw,size=1k,huge=always"),
            (str(sibling), "ext4", "/dev/sdb", "rw"),
        ],
    )
    text = mountinfo.read_text(encoding="utf-8")
    assert "\\040" in text and "\\011" in text and "\\134" in text
    table = read_mount_table(mountinfo)
    # The nearest existing ancestor decides: missing components below a mount point do not matter.
    outer = table.find(outer_dir / "missing" / "x")
    assert outer == MountEntry(str(outer_dir), "nfs4", "server:/a b", "rw,vers=4.2,rw,nosuid,relatime")
    inner = table.find(inner_dir / "y")
    assert inner.mount_point == str(inner_dir)
    assert inner.fs_type == "tmpfs" and inner.source == "tmp\\fs"
    assert inner.option("huge") == "always" and inner.option("nosuid") == "" and inner.option("uid") is None
    # "<base>/with" is a string prefix of "<base>/withheld" but not a path prefix of it.
    assert table.find(base / "withheld").mount_point == "/"
    assert table.find(sibling / "z").fs_type == "ext4"


def test_mount_lookup_resolves_symlinks(tmp_path: Path) -> None:
    """A path reached through a symlink belongs to the mount of the symlink's target."""
    base = Path(os.path.realpath(tmp_path))
    target = base / "target"
    target.mkdir()
    (base / "alias").symlink_to(target)
    table = read_mount_table(_write_mountinfo(tmp_path / "mountinfo", [(str(target), "nfs", "s:/x", "rw")]))
    assert table.find(base / "alias" / "domain").fs_type == "nfs"


def test_later_mount_on_same_point_covers_earlier(tmp_path: Path) -> None:
    """Two mounts on one point: the later one (on top) is the one that holds the files."""
    data = Path(os.path.realpath(tmp_path))
    table = read_mount_table(
        _write_mountinfo(
            tmp_path / "mountinfo", [(str(data), "ext4", "/dev/sdc", "rw"), (str(data), "nfs", "s:/x", "rw")]
        )
    )
    assert table.find(data / "domain").fs_type == "nfs"


def test_malformed_mountinfo_line_is_rejected(tmp_path: Path) -> None:
    """A line without the ' - ' separator is an error, not a silently skipped mount."""
    bad = tmp_path / "mountinfo"
    bad.write_text("1 0 8:1 / / rw ext4 /dev/sda1 rw\n", encoding="utf-8")
    with pytest.raises(ValueError):
        read_mount_table(bad)


@pytest.mark.parametrize(
    ("fs_type", "expected"),
    [
        ("tmpfs", StorageClass.TMPFS),
        ("ramfs", StorageClass.TMPFS),
        *[(name, StorageClass.DISK) for name in ("ext2", "ext3", "ext4", "xfs", "btrfs", "zfs", "f2fs", "overlay")],
        ("bcachefs", StorageClass.DISK),
        ("jfs", StorageClass.DISK),
        *[
            (name, None)
            for name in (
                "nfs",
                "nfs4",
                "cifs",
                "smb3",
                "smbfs",
                "lustre",
                "ceph",
                "fuse",
                "fuse.sshfs",
                "fuse.s3fs",
                "glusterfs",
                "gpfs",
                "beegfs",
                "9p",
                "mysteryfs",
            )
        ],
    ],
)
def test_classify_filesystem(fs_type: str, expected: StorageClass | None) -> None:
    """S19: memory and local-disk filesystems are classified; network, FUSE and unknown ones are None."""
    assert classify_filesystem(fs_type) is expected


# ----------------------------------------------------------------- locality (S19)


@pytest.mark.parametrize("fs_type", ["nfs4", "cifs", "lustre", "ceph", "fuse.sshfs", "mysteryfs"])
def test_unsupported_filesystem_refused_and_root_not_created(tmp_path: Path, fs_type: str) -> None:
    """S19: NFS, CIFS, Lustre, Ceph, FUSE and unknown types cannot back a domain; nothing is created."""
    mount_point = tmp_path / "mnt"
    mount_point.mkdir()
    root = mount_point / "nested" / "domain"
    table = _fake_table(tmp_path, mount_point, fs_type)
    error = _expect_failure(FailureCode.UNSUPPORTED_FILESYSTEM, lambda: _open(root, mount_table=table))
    assert error.retryable is False
    assert f"{root} is on {fs_type}" in error.failure.message
    assert "HWR_ROOT" in error.failure.message and "node-local" in error.failure.message
    assert not root.exists()
    assert not (mount_point / "nested").exists()
    assert os.listdir(mount_point) == []


def test_path_on_no_listed_mount_is_refused(tmp_path: Path) -> None:
    """S19: a table that covers nothing (unknown locality) fails closed before creating anything."""
    empty = tmp_path / "mountinfo"
    empty.write_text("", encoding="utf-8")
    root = tmp_path / "domain"
    _expect_failure(FailureCode.UNSUPPORTED_FILESYSTEM, lambda: _open(root, mount_table=read_mount_table(empty)))
    assert not root.exists()


def test_tmpfs_mount_accepted_with_huge_pages(tmp_path: Path) -> None:
    """S19: a tmpfs root is accepted as TMPFS and reports its huge= setting."""
    table = _fake_table(tmp_path, tmp_path, "tmpfs", "rw,size=64g,huge=within_size")
    info = _open(tmp_path / "domain", mount_table=table)
    assert info.storage_class is StorageClass.TMPFS and info.is_memory
    assert info.fs_type == "tmpfs"
    assert info.huge_pages == "within_size"
    assert info.mount_point == os.path.realpath(tmp_path)


def test_ext4_mount_accepted_as_disk(tmp_path: Path) -> None:
    """S19: a local-disk root is accepted as DISK and has no huge-page setting."""
    table = _fake_table(tmp_path, tmp_path, "ext4")
    info = _open(tmp_path / "domain", storage_class=StorageClass.DISK, mount_table=table)
    assert info.storage_class is StorageClass.DISK and not info.is_memory
    assert info.fs_type == "ext4"
    assert info.huge_pages is None


def test_real_tmpfs_domain(shm_dir: Path) -> None:
    """A domain under the real /dev/shm, with the real mount table, is a tmpfs (memory) domain."""
    info = _open(shm_dir / "domain", storage_class=StorageClass.TMPFS)
    assert info.storage_class is StorageClass.TMPFS
    assert info.fs_type == "tmpfs"
    assert info.huge_pages is not None  # "never" unless the mount says otherwise


def test_real_disk_domain_creates_private_layout(tmp_path: Path) -> None:
    """A new domain gets 0700 directories, a canonical domain.json and the default policy."""
    root = tmp_path / "parents" / "domain"
    info = _open(root)
    assert info.root == root and info.storage_class is StorageClass.DISK
    assert info.scope is _SCOPE
    assert info.capacity == CapacityPolicy()
    assert len(info.domain_id) == 32
    layout = DomainLayout(root)
    for path in (root, *(root / name for name in STORE_DIRS)):
        mode = os.lstat(path).st_mode
        assert stat.S_ISDIR(mode) and stat.S_IMODE(mode) == 0o700, path
    assert layout.domain_init_lock.is_file()
    record = json.loads(layout.domain_file.read_bytes())
    assert record == {
        "schema_version": 1,
        "domain_id": info.domain_id,
        "scope": "single_process",
        "storage_class": "disk",
        "fs_type": info.fs_type,
        "created_at_ns": info.created_at_ns,
    }
    assert layout.domain_file.read_bytes() == json.dumps(record, sort_keys=True, separators=(",", ":")).encode()
    assert json.loads(layout.policy_file.read_bytes()) == {
        "schema_version": 1,
        "max_artifact_bytes": None,
        "max_store_bytes": None,
        "min_free_bytes": 0,
    }
    assert sorted(os.listdir(root)) == sorted([*STORE_DIRS, "domain.json", "domain-policy.json"])


@pytest.mark.parametrize(
    ("configured", "table_fs"),
    [(StorageClass.TMPFS, "ext4"), (StorageClass.DISK, "tmpfs")],
)
def test_storage_class_mismatch(tmp_path: Path, configured: StorageClass, table_fs: str) -> None:
    """The configured storage class must match what the mount table says; nothing is created."""
    table = _fake_table(tmp_path, tmp_path, table_fs)
    root = tmp_path / "domain"
    error = _expect_failure(
        FailureCode.STORAGE_CLASS_MISMATCH, lambda: _open(root, storage_class=configured, mount_table=table)
    )
    assert error.retryable is False
    assert "HWR_STORAGE_CLASS" in error.failure.message
    assert not root.exists()


def test_storage_class_mismatch_on_real_shm(shm_dir: Path) -> None:
    """Configuring disk for a root under the real /dev/shm is refused."""
    root = shm_dir / "domain"
    _expect_failure(FailureCode.STORAGE_CLASS_MISMATCH, lambda: _open(root, storage_class=StorageClass.DISK))
    assert not root.exists()


def test_relative_root_is_a_configuration_error() -> None:
    """A relative root is refused before anything is probed."""
    error = _expect_failure(FailureCode.INVALID_CONFIGURATION, lambda: _open(Path("relative/domain")))
    assert error.retryable is False


# ----------------------------------------------------------------- ownership and modes (S19)


@pytest.mark.parametrize("mode", [0o770, 0o707, 0o777, 0o720])
def test_shared_writable_root_refused(tmp_path: Path, mode: int) -> None:
    """S19: a group- or world-writable existing root is refused, and nothing is created inside."""
    root = tmp_path / "domain"
    root.mkdir()
    os.chmod(root, mode)
    error = _expect_failure(FailureCode.UNSAFE_PERMISSIONS, lambda: _open(root))
    assert error.retryable is False
    assert f"{mode:04o}" in error.failure.message
    assert os.listdir(root) == []


def test_readable_but_not_writable_root_accepted(tmp_path: Path) -> None:
    """Group/world read access is not a safety problem; only write access is."""
    root = tmp_path / "domain"
    root.mkdir()
    os.chmod(root, 0o755)
    assert _open(root).root == root


def test_symlinked_root_refused(tmp_path: Path) -> None:
    """S19: the root must be a real directory, not a symlink to one."""
    target = tmp_path / "target"
    target.mkdir(mode=0o700)
    root = tmp_path / "domain"
    root.symlink_to(target)
    error = _expect_failure(FailureCode.UNSAFE_PERMISSIONS, lambda: _open(root))
    assert "symlink" in error.failure.message
    assert os.listdir(target) == []


def test_root_that_is_a_file_is_unavailable(tmp_path: Path) -> None:
    """R11: a regular file where the root should be cannot be opened: DOMAIN_UNAVAILABLE, retryable, untouched."""
    root = tmp_path / "domain"
    root.write_bytes(b"")
    error = _expect_failure(FailureCode.DOMAIN_UNAVAILABLE, lambda: _open(root))
    assert error.retryable is True
    assert "is not a directory" in error.failure.message
    assert root.read_bytes() == b""


@pytest.mark.skipif(os.geteuid() != 0, reason="changing a directory's owner needs root")
def test_root_owned_by_another_user_refused(tmp_path: Path) -> None:
    """S19: a root that belongs to another user is refused."""
    root = tmp_path / "domain"
    root.mkdir(mode=0o700)
    os.chown(root, 65534, -1)
    error = _expect_failure(FailureCode.UNSAFE_PERMISSIONS, lambda: _open(root))
    assert "uid 65534" in error.failure.message


def test_shared_writable_store_directory_refused(tmp_path: Path) -> None:
    """Store directories get the same ownership and mode check as the root."""
    root = tmp_path / "domain"
    _open(root)
    os.chmod(root / "artifacts", 0o777)
    error = _expect_failure(FailureCode.UNSAFE_PERMISSIONS, lambda: _open(root))
    assert "artifacts" in error.failure.message


# ----------------------------------------------------------------- domain.json


def test_domain_record_is_stable_across_reopen(tmp_path: Path) -> None:
    """Reopening a domain keeps its id and creation time; domain.json is not rewritten."""
    root = tmp_path / "domain"
    first = _open(root)
    before = (root / "domain.json").read_bytes()
    second = _open(root)
    assert second.domain_id == first.domain_id
    assert second.created_at_ns == first.created_at_ns
    assert (root / "domain.json").read_bytes() == before


@pytest.mark.parametrize(
    "damage",
    [
        b"not json at all",
        b"[1, 2, 3]",
        b'{"schema_version": 1}',
        "extra-key",
        "string-version",
        "bad-scope",
        "bad-domain-id",
        "future-version",
    ],
)
def test_corrupted_domain_record_is_domain_invalid(tmp_path: Path, damage: bytes | str) -> None:
    """A damaged or foreign domain.json is DOMAIN_INVALID, never silently replaced."""
    root = tmp_path / "domain"
    _open(root)
    path = root / "domain.json"
    if isinstance(damage, bytes):
        data = damage
    else:
        record = json.loads(path.read_bytes())
        if damage == "extra-key":
            record["owner"] = "someone"
        elif damage == "string-version":
            record["schema_version"] = "1"
        elif damage == "bad-scope":
            record["scope"] = "everyone"
        elif damage == "bad-domain-id":
            record["domain_id"] = "../../etc"
        elif damage == "future-version":
            record["schema_version"] = 2
        data = json.dumps(record).encode()
    os.chmod(path, 0o600)
    path.write_bytes(data)
    error = _expect_failure(FailureCode.DOMAIN_INVALID, lambda: _open(root))
    assert error.retryable is False
    assert "domain.json" in error.failure.message
    assert path.read_bytes() == data


def test_symlinked_domain_record_is_domain_invalid(tmp_path: Path) -> None:
    """domain.json is read without following a symlink."""
    root = tmp_path / "domain"
    _open(root)
    elsewhere = tmp_path / "elsewhere.json"
    os.rename(root / "domain.json", elsewhere)
    (root / "domain.json").symlink_to(elsewhere)
    error = _expect_failure(FailureCode.DOMAIN_INVALID, lambda: _open(root))
    assert "symlink" in error.failure.message


def test_domain_moved_to_another_storage_class_is_invalid(tmp_path: Path) -> None:
    """A domain recorded as tmpfs that now sits on disk was moved or copied: DOMAIN_INVALID."""
    root = tmp_path / "domain"
    _open(root, mount_table=_fake_table(tmp_path, tmp_path, "tmpfs"))
    error = _expect_failure(
        FailureCode.DOMAIN_INVALID, lambda: _open(root, mount_table=_fake_table(tmp_path, tmp_path, "xfs"))
    )
    assert "moved or copied" in error.failure.message


# ----------------------------------------------------------------- capacity policy (S22)


def test_first_capacity_policy_is_authoritative(tmp_path: Path) -> None:
    """S22: the first writer's policy wins; a conflicting later one is DOMAIN_POLICY_CONFLICT; None adopts."""
    root = tmp_path / "domain"
    first_policy = CapacityPolicy(max_artifact_bytes=1_000, max_store_bytes=10_000, min_free_bytes=5)
    assert _open(root, capacity=first_policy).capacity == first_policy

    conflicting = CapacityPolicy(max_artifact_bytes=2_000, max_store_bytes=10_000, min_free_bytes=5)
    error = _expect_failure(FailureCode.DOMAIN_POLICY_CONFLICT, lambda: _open(root, capacity=conflicting))
    assert error.retryable is False
    message = error.failure.message
    assert "authoritative" in message
    assert "1000" in message and "2000" in message
    details = error.failure.details.to_value()
    assert isinstance(details, dict)
    assert details["stored"] == first_policy.to_dict()
    assert details["requested"] == conflicting.to_dict()

    assert _open(root, capacity=None).capacity == first_policy
    assert _open(root, capacity=CapacityPolicy(1_000, 10_000, 5)).capacity == first_policy
    stored = json.loads((root / "domain-policy.json").read_bytes())
    assert stored["max_artifact_bytes"] == 1_000


def test_default_policy_is_written_when_none_given_and_then_authoritative(tmp_path: Path) -> None:
    """S22: a new domain opened without a policy stores the defaults, which then bind later callers."""
    root = tmp_path / "domain"
    assert _open(root, capacity=None).capacity == CapacityPolicy()
    _expect_failure(FailureCode.DOMAIN_POLICY_CONFLICT, lambda: _open(root, capacity=CapacityPolicy(min_free_bytes=1)))


def test_corrupted_policy_is_domain_invalid(tmp_path: Path) -> None:
    """A policy file with a string-typed number or a negative limit is DOMAIN_INVALID."""
    root = tmp_path / "domain"
    _open(root)
    path = root / "domain-policy.json"
    for bad in (
        {"schema_version": 1, "max_artifact_bytes": "10", "max_store_bytes": None, "min_free_bytes": 0},
        {"schema_version": 1, "max_artifact_bytes": -1, "max_store_bytes": None, "min_free_bytes": 0},
        {"schema_version": 1, "max_store_bytes": None, "min_free_bytes": 0},
    ):
        path.write_bytes(json.dumps(bad).encode())
        error = _expect_failure(FailureCode.DOMAIN_INVALID, lambda: _open(root, capacity=None))
        assert "domain-policy.json" in error.failure.message


# ----------------------------------------------------------------- the init lock (S23)


def _child_hold_init_lock(root: str, conn: Connection) -> None:
    """Hold domain-init.lock exclusively, as a stalled initialiser would, until told to let go."""
    lock = acquire_lock(
        DomainLayout(Path(root)).domain_init_lock,
        exclusive=True,
        deadline=time.monotonic() + TIMEOUT_S,
        stage=ResolutionStage.DOMAIN,
        what="the domain-init lock",
    )
    conn.send("held")
    if conn.poll(TIMEOUT_S) and conn.recv() == "release":
        lock.release()
        conn.send("released")
    conn.close()


def _child_open_domain_paused(root: str, conn: Connection) -> None:
    """Open a domain but stop right after taking the init lock until the parent says go."""

    def hook(point: str) -> None:
        conn.send(point)
        if not (conn.poll(TIMEOUT_S) and conn.recv() == "go"):
            raise RuntimeError("parent never said go")

    arm("domain.init_locked", Fault(FaultAction.PAUSE, hook=hook))
    info = _open(Path(root))
    conn.send(info.domain_id)
    conn.close()


def _child_open_domain(root: str, conn: Connection) -> None:
    conn.send(_open(Path(root)).domain_id)
    conn.close()


def test_stalled_init_lock_holder_times_out_then_succeeds(tmp_path: Path) -> None:
    """S23: while another process holds domain-init.lock, opening times out (retryable); after, it works."""
    root = tmp_path / "domain"
    (root / "locks").mkdir(parents=True, mode=0o700)
    os.chmod(root, 0o700)
    with spawned_child(_child_hold_init_lock, str(root)) as conn:
        assert recv_within(conn) == "held"
        error = _expect_failure(FailureCode.LOCK_TIMEOUT, lambda: _open(root, init_timeout_s=0.2))
        assert error.retryable is True
        assert "domain-init lock" in error.failure.message and str(root) in error.failure.message
        assert not (root / "domain.json").exists()  # nothing was initialised without the lock
        conn.send("release")
        assert recv_within(conn) == "released"
    info = _open(root, init_timeout_s=0.2)
    assert (root / "domain.json").is_file()
    assert _open(root).domain_id == info.domain_id


def test_open_domain_paused_under_init_lock_blocks_others(tmp_path: Path) -> None:
    """S23: a process stalled inside initialisation makes others time out; once it goes on, all agree."""
    root = tmp_path / "domain"
    with spawned_child(_child_open_domain_paused, str(root)) as conn:
        assert recv_within(conn) == "domain.init_locked"
        _expect_failure(FailureCode.LOCK_TIMEOUT, lambda: _open(root, init_timeout_s=0.2))
        conn.send("go")
        child_domain_id = recv_within(conn)
    assert _open(root).domain_id == child_domain_id


def test_concurrent_first_openers_agree_on_one_domain(tmp_path: Path) -> None:
    """Several processes creating the same domain at once all see one domain id."""
    root = tmp_path / "domain"
    ids: list[object] = []
    with spawned_child(_child_open_domain, str(root)) as first, spawned_child(_child_open_domain, str(root)) as second:
        ids.extend([recv_within(first), recv_within(second)])
    ids.append(_open(root).domain_id)
    assert len(set(ids)) == 1


def test_failure_under_init_lock_releases_it(tmp_path: Path) -> None:
    """An I/O error while initialising is typed (EIO retryable) and does not leave the init lock held."""
    root = tmp_path / "domain"
    with armed("domain.init_locked", Fault(FaultAction.RAISE_OSERROR, errno=errno.EIO)):
        error = _expect_failure(FailureCode.IO_ERROR, lambda: _open(root))
    assert error.retryable is True
    with armed("domain.init_locked", Fault(FaultAction.RAISE_OSERROR, errno=errno.EACCES)):
        error = _expect_failure(FailureCode.STORE_INIT_FAILED, lambda: _open(root))
    assert error.retryable is False
    assert _open(root, init_timeout_s=0.0).root == root


# ----------------------------------------------------------------- file primitives the domain files use


def test_write_file_atomic_replaces_with_exact_mode_and_leaves_no_temp(tmp_path: Path) -> None:
    """Atomic writes set the requested mode whatever the umask and leave only the final name."""
    target = tmp_path / "file.json"
    old_umask = os.umask(0o077)
    try:
        write_file_atomic(target, b"first", mode=0o644)
    finally:
        os.umask(old_umask)
    assert stat.S_IMODE(target.stat().st_mode) == 0o644
    write_file_atomic(target, b"second")
    assert target.read_bytes() == b"second"
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
    assert os.listdir(tmp_path) == ["file.json"]


def test_write_file_atomic_failure_removes_its_temporary(tmp_path: Path) -> None:
    """When the final rename fails, the temporary file is removed and the error propagates."""
    occupied = tmp_path / "occupied"
    (occupied / "child").mkdir(parents=True)
    with pytest.raises(OSError) as caught:
        write_file_atomic(occupied, b"data")
    assert caught.value.errno in (errno.EISDIR, errno.ENOTEMPTY, errno.EEXIST)
    assert sorted(os.listdir(tmp_path)) == ["occupied"]


def test_read_small_file_refuses_symlinks_oversize_and_non_regular(tmp_path: Path) -> None:
    """Small-file reads never follow a final symlink, never read past the limit, never block on a FIFO."""
    regular = tmp_path / "regular"
    regular.write_bytes(b"12345")
    assert read_small_file(regular) == b"12345"
    assert read_small_file(regular, limit=5) == b"12345"
    with pytest.raises(ValueError):
        read_small_file(regular, limit=4)
    link = tmp_path / "link"
    link.symlink_to(regular)
    with pytest.raises(OSError) as caught:
        read_small_file(link)
    assert caught.value.errno == errno.ELOOP
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(ValueError):
        read_small_file(fifo)
    with pytest.raises(ValueError):
        read_small_file(tmp_path)


def test_damaged_domain_gains_no_directories(tmp_path: Path) -> None:
    """S19: opening a root whose domain.json is damaged fails before creating any store directory in it."""
    root = tmp_path / "domain"
    root.mkdir(mode=0o700)
    (root / "domain.json").write_bytes(b"not json at all")
    _expect_failure(FailureCode.DOMAIN_INVALID, lambda: _open(root))
    assert sorted(os.listdir(root)) == ["domain.json", "locks"]

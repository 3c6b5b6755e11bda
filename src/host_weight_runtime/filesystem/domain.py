"""Opening a domain: locality and ownership checks, then the domain's files under one lock.

Everything that decides whether a path may host a domain happens before anything is
created, so a refused root (a network filesystem, a mismatched storage class) leaves
no trace. The directories and the two domain files are created under
`locks/domain-init.lock`, so concurrent first openers agree on one domain id and one
capacity policy.
"""

from __future__ import annotations

import errno
import math
import os
import re
import stat
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from .._faults import fault_point
from .._strict import get_int, get_str, require_exact_keys, require_object
from ..canonical_json import JsonValue, decode_json, encode_canonical
from ..config import CapacityPolicy, StorageClass
from ..failures import FailureCode, HostWeightError, ResolutionStage, raise_failure
from ..protocols import CoordinationScope
from ._fsutil import errno_name, failure_from_os_error, read_small_file, write_file_atomic
from ._layout import ARTIFACTS_DIR, DENY_DIR, QUARANTINE_DIR, TMP_DIR, VERIFIED_DIR, DomainLayout
from .locks import acquire_lock

__all__ = [
    "DOMAIN_SCHEMA_VERSION",
    "POLICY_SCHEMA_VERSION",
    "DomainInfo",
    "MountEntry",
    "MountTable",
    "classify_filesystem",
    "open_domain",
    "read_mount_table",
]

DOMAIN_SCHEMA_VERSION = 1
POLICY_SCHEMA_VERSION = 1

_STAGE = ResolutionStage.DOMAIN
_DIR_MODE = 0o700
_DOMAIN_KEYS = frozenset({"schema_version", "domain_id", "scope", "storage_class", "fs_type", "created_at_ns"})
_POLICY_KEYS = frozenset({"schema_version", "max_artifact_bytes", "max_store_bytes", "min_free_bytes"})
_DOMAIN_ID = re.compile(r"^[0-9a-f]{32}$")

_MEMORY_FILESYSTEMS = frozenset({"tmpfs", "ramfs"})
_DISK_FILESYSTEMS = frozenset({"ext2", "ext3", "ext4", "xfs", "btrfs", "zfs", "f2fs", "overlay", "bcachefs", "jfs"})
_OCTAL_ESCAPE = re.compile(r"\\([0-7]{3})")


# --------------------------------------------------------------------------- mount table


@dataclass(frozen=True, slots=True)
class MountEntry:
    """One line of mountinfo; `options` joins super options and mount options with ','."""

    mount_point: str
    fs_type: str
    source: str
    options: str

    def option(self, name: str) -> str | None:
        """The value of `name=value` in the options, "" for a bare flag, None if absent."""
        found: str | None = None
        for item in self.options.split(","):
            key, sep, value = item.partition("=")
            if key == name:
                found = value if sep else ""
        return found


@dataclass(frozen=True, slots=True)
class MountTable:
    """The mounts of this process, in mountinfo order (later entries cover earlier ones)."""

    entries: tuple[MountEntry, ...]

    def find(self, path: Path) -> MountEntry:
        """The mount holding `path`: longest mount-point prefix of its nearest existing ancestor.

        Raises LookupError when no entry covers the path (only possible with a partial table).
        """
        resolved = os.path.realpath(_nearest_existing_ancestor(path))
        best: MountEntry | None = None
        for entry in self.entries:
            if not _is_under(resolved, entry.mount_point):
                continue
            # ">=": a later mount on the same point covers the earlier one.
            if best is None or len(entry.mount_point) >= len(best.mount_point):
                best = entry
        if best is None:
            raise LookupError(f"no mount in the table covers {resolved}")
        return best


def _nearest_existing_ancestor(path: Path) -> Path:
    """`path` itself if it exists, else its closest existing parent (at worst "/")."""
    current = Path(os.path.abspath(path))
    while not os.path.exists(current) and current != current.parent:
        current = current.parent
    return current


def _is_under(path: str, mount_point: str) -> bool:
    if mount_point == "/":
        return path.startswith("/")
    return path == mount_point or path.startswith(mount_point.rstrip("/") + "/")


def _unescape(field: str) -> str:
    """Undo the kernel's octal escapes (space is \\040, tab \\011, newline \\012, backslash \\134)."""
    return _OCTAL_ESCAPE.sub(lambda match: chr(int(match.group(1), 8)), field)


def _parse_mountinfo_line(line: str, where: str) -> MountEntry:
    # ID PARENT MAJ:MIN ROOT MOUNT_POINT MOUNT_OPTIONS [OPTIONAL...] - FSTYPE SOURCE SUPER_OPTIONS
    fields = line.split(" ")
    try:
        separator = fields.index("-", 6)
    except ValueError:
        raise ValueError(f"{where}: no ' - ' separator in mountinfo line {line!r}") from None
    if len(fields) < separator + 4:
        raise ValueError(f"{where}: malformed mountinfo line {line!r}")
    mount_point = _unescape(fields[4])
    mount_options = _unescape(fields[5])
    fs_type = _unescape(fields[separator + 1])
    source = _unescape(fields[separator + 2])
    super_options = _unescape(" ".join(fields[separator + 3 :]))
    options = ",".join(part for part in (super_options, mount_options) if part)
    return MountEntry(mount_point=mount_point, fs_type=fs_type, source=source, options=options)


def read_mount_table(path: Path = Path("/proc/self/mountinfo")) -> MountTable:
    """Parse a mountinfo file (the kernel's, or one a test wrote). Malformed lines raise ValueError."""
    text = path.read_text(encoding="utf-8", errors="surrogateescape")
    entries = []
    for number, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            entries.append(_parse_mountinfo_line(line, f"{path}:{number}"))
    return MountTable(tuple(entries))


def classify_filesystem(fs_type: str) -> StorageClass | None:
    """TMPFS for memory filesystems, DISK for known local disk ones, None for everything else.

    Network, cluster and FUSE filesystems are refused (None) because flock and rename
    semantics across nodes are not what the store relies on; unknown types fail closed.
    """
    if fs_type in _MEMORY_FILESYSTEMS:
        return StorageClass.TMPFS
    if fs_type in _DISK_FILESYSTEMS:
        return StorageClass.DISK
    return None


# --------------------------------------------------------------------------- the domain


@dataclass(frozen=True, slots=True)
class DomainInfo:
    """An opened domain: where it is, what backs it, and its authoritative capacity policy."""

    root: Path
    domain_id: str
    scope: CoordinationScope
    storage_class: StorageClass
    fs_type: str
    mount_point: str
    huge_pages: str | None
    capacity: CapacityPolicy
    created_at_ns: int

    @property
    def layout(self) -> DomainLayout:
        return DomainLayout(self.root)

    @property
    def is_memory(self) -> bool:
        """tmpfs bytes are memory, and are reported as such."""
        return self.storage_class is StorageClass.TMPFS


def open_domain(
    root: Path,
    *,
    storage_class: StorageClass,
    capacity: CapacityPolicy | None,
    scope: CoordinationScope,
    init_timeout_s: float,
    mount_table: MountTable | None = None,
) -> DomainInfo:
    """Check and (if needed) create the domain at `root`; raise HostWeightError (stage DOMAIN).

    `capacity=None` adopts the stored policy (or the defaults for a new domain); a
    different explicit policy than the stored one is DOMAIN_POLICY_CONFLICT.
    """
    if not isinstance(root, Path) or not root.is_absolute():
        raise raise_failure(
            _STAGE,
            FailureCode.INVALID_CONFIGURATION,
            f"the domain root must be an absolute path, got {root!r}: set HWR_ROOT to an absolute path",
            root=str(root),
        )
    if type(init_timeout_s) not in (int, float) or not math.isfinite(init_timeout_s) or init_timeout_s < 0:
        raise raise_failure(
            _STAGE,
            FailureCode.INVALID_CONFIGURATION,
            f"init_timeout_s must be a finite, non-negative number of seconds, got {init_timeout_s!r}",
        )
    if not isinstance(storage_class, StorageClass):
        raise raise_failure(
            _STAGE, FailureCode.INVALID_CONFIGURATION, f"storage_class must be a StorageClass, got {storage_class!r}"
        )
    if not isinstance(scope, CoordinationScope):
        raise raise_failure(
            _STAGE, FailureCode.INVALID_CONFIGURATION, f"scope must be a CoordinationScope, got {scope!r}"
        )

    # (a) locality, before anything is created
    mount, detected = _check_locality(root, storage_class, mount_table)
    huge_pages = (mount.option("huge") or "never") if detected is StorageClass.TMPFS else None
    layout = DomainLayout(root)

    # (b) the root itself: one that cannot be opened is DOMAIN_UNAVAILABLE (retryable), one refused is not
    _ensure_private_dir(root, "domain root", parents=True, unavailable_if_unopenable=True)

    # (c) the init lock
    _ensure_private_dir(layout.locks, "lock directory")
    init_lock = acquire_lock(
        layout.domain_init_lock,
        exclusive=True,
        deadline=time.monotonic() + init_timeout_s,
        stage=_STAGE,
        what=f"the domain-init lock of {root}",
    )
    try:
        try:
            fault_point("domain.init_locked")
        except OSError as exc:
            raise _os_failure(exc, f"initialising the domain {root}") from exc
        # (d) everything else, under the lock; the records first, so a damaged domain gains nothing
        record = _load_or_create_domain_record(layout, scope, detected, mount.fs_type)
        policy = _load_or_create_policy(layout, capacity)
        for name in (ARTIFACTS_DIR, TMP_DIR, QUARANTINE_DIR, DENY_DIR, VERIFIED_DIR):
            _ensure_private_dir(root / name, f"store directory {name}/")
    finally:
        init_lock.release()

    return DomainInfo(
        root=root,
        domain_id=record.domain_id,
        scope=record.scope,
        storage_class=detected,
        fs_type=mount.fs_type,
        mount_point=mount.mount_point,
        huge_pages=huge_pages,
        capacity=policy,
        created_at_ns=record.created_at_ns,
    )


def _check_locality(
    root: Path, configured: StorageClass, mount_table: MountTable | None
) -> tuple[MountEntry, StorageClass]:
    if mount_table is None:
        try:
            mount_table = read_mount_table()
        except (OSError, ValueError) as exc:
            raise raise_failure(
                _STAGE,
                FailureCode.STORE_INIT_FAILED,
                f"cannot read the mount table to check that {root} is node-local ({exc}); "
                "HWR refuses a domain whose filesystem it cannot identify",
                root=str(root),
            ) from exc
    try:
        mount = mount_table.find(root)
    except LookupError:
        raise raise_failure(
            _STAGE,
            FailureCode.UNSUPPORTED_FILESYSTEM,
            f"the domain root {root} is on no mount the mount table lists; HWR needs a node-local "
            "filesystem (tmpfs or local disk): set HWR_ROOT to a path on one",
            root=str(root),
        ) from None
    detected = classify_filesystem(mount.fs_type)
    if detected is None:
        raise raise_failure(
            _STAGE,
            FailureCode.UNSUPPORTED_FILESYSTEM,
            f"the domain root {root} is on {mount.fs_type} (mounted at {mount.mount_point} from {mount.source}); "
            "HWR needs a node-local filesystem (tmpfs or local disk): set HWR_ROOT to a path on one",
            root=str(root),
            fs_type=mount.fs_type,
            mount_point=mount.mount_point,
            source=mount.source,
        )
    if configured is not StorageClass.AUTO and configured is not detected:
        raise raise_failure(
            _STAGE,
            FailureCode.STORAGE_CLASS_MISMATCH,
            f"the storage class is configured as {configured.value} but the domain root {root} is on "
            f"{mount.fs_type} ({detected.value}): set HWR_STORAGE_CLASS={detected.value} (or auto), "
            f"or set HWR_ROOT to a path on {configured.value}",
            root=str(root),
            configured=configured.value,
            detected=detected.value,
            fs_type=mount.fs_type,
        )
    return mount, detected


# Errors that say the root cannot be opened here and now (missing and not creatable, a file on the path,
# an unreachable mount), as opposed to a root HWR refuses by policy: the first kind is DOMAIN_UNAVAILABLE.
_UNOPENABLE_ERRNOS = frozenset(
    {
        errno.EACCES,
        errno.EPERM,
        errno.EROFS,
        errno.ENOENT,
        errno.ENOTDIR,
        errno.EEXIST,
        errno.ENOTCONN,
        errno.ESTALE,
        errno.EIO,
        errno.ETIMEDOUT,
        errno.EHOSTDOWN,
        errno.ENODEV,
        errno.ENXIO,
    }
)


def _ensure_private_dir(
    path: Path, what: str, *, parents: bool = False, unavailable_if_unopenable: bool = False
) -> None:
    """Create `path` 0700 if missing, then insist it is our own, non-shared-writable directory.

    With `unavailable_if_unopenable` (the root), a path that cannot be created or reached, or that is not a
    directory, is DOMAIN_UNAVAILABLE and retryable: PREFERRED serves canonically instead of failing (R11).
    """

    def os_failure(exc: OSError, doing: str) -> HostWeightError:
        if unavailable_if_unopenable and exc.errno in _UNOPENABLE_ERRNOS:
            return _unavailable(path, f"cannot be {doing}: {errno_name(exc.errno)} ({exc.strerror})", exc.errno)
        return _os_failure(exc, f"{doing} the {what} {path}")

    try:
        if unavailable_if_unopenable:
            fault_point("domain.open_root")  # tests stand in an unreachable mount (ENOTCONN, ESTALE) here
        if parents:
            os.makedirs(path.parent, exist_ok=True)
        os.mkdir(path, _DIR_MODE)
        os.chmod(path, _DIR_MODE)  # exactly 0700 whatever the umask
    except FileExistsError:
        pass  # checked below exactly like a directory we just created
    except OSError as exc:
        raise os_failure(exc, "creating") from exc
    try:
        info = os.lstat(path)
    except OSError as exc:
        raise os_failure(exc, "inspecting") from exc
    problem: str | None = None
    if stat.S_ISLNK(info.st_mode):
        problem = "is a symlink; it must be a real directory"
    elif not stat.S_ISDIR(info.st_mode):
        if unavailable_if_unopenable:
            raise _unavailable(path, "is not a directory", None)
        problem = "is not a directory"
    elif info.st_uid != os.geteuid():
        problem = f"belongs to uid {info.st_uid}, not to the current user (uid {os.geteuid()})"
    elif info.st_mode & 0o022:
        problem = f"has mode {stat.S_IMODE(info.st_mode):04o}, writable by group or others; run `chmod go-w {path}`"
    if problem is not None:
        raise raise_failure(
            _STAGE,
            FailureCode.UNSAFE_PERMISSIONS,
            f"the {what} {path} {problem}. HWR keeps its store private to one user (0700); "
            "fix it or set HWR_ROOT to a fresh path",
            path=str(path),
            mode=stat.S_IMODE(info.st_mode),
            uid=info.st_uid,
        )


def _unavailable(root: Path, problem: str, error_number: int | None) -> HostWeightError:
    return raise_failure(
        _STAGE,
        FailureCode.DOMAIN_UNAVAILABLE,
        f"the domain root {root} {problem}; the domain cannot be opened, so PREFERRED loads canonically and "
        "REQUIRED fails: create the directory (0700, owned by this user) or set HWR_ROOT to one that can be",
        retryable=True,
        root=str(root),
        errno=None if error_number is None else errno_name(error_number),
    )


def _os_failure(exc: OSError, what: str) -> HostWeightError:
    """Out-of-space, quota and EIO keep their retryable codes; anything else is an init failure."""
    typed = failure_from_os_error(exc, stage=_STAGE, what=what)
    if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EIO):
        return HostWeightError(typed)
    return raise_failure(_STAGE, FailureCode.STORE_INIT_FAILED, typed.message, errno=errno_name(exc.errno), what=what)


@dataclass(frozen=True, slots=True)
class _DomainRecord:
    """The parsed domain.json."""

    domain_id: str
    scope: CoordinationScope
    storage_class: StorageClass
    fs_type: str
    created_at_ns: int


def _domain_invalid(path: Path, problem: str) -> HostWeightError:
    return raise_failure(
        _STAGE,
        FailureCode.DOMAIN_INVALID,
        f"{path} {problem}. The domain's own files are damaged or foreign: move the domain root "
        "aside (or delete it) and let HWR recreate it, or set HWR_ROOT to a fresh path",
        path=str(path),
    )


def _read_json_object(path: Path) -> Mapping[str, object] | None:
    """The JSON object at `path`, None if the file is absent; damage is DOMAIN_INVALID."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise _os_failure(exc, f"inspecting {path}") from exc
    if stat.S_ISREG(info.st_mode) and (info.st_uid != os.geteuid() or info.st_mode & 0o022 or info.st_nlink != 1):
        raise raise_failure(
            _STAGE,
            FailureCode.UNSAFE_PERMISSIONS,
            f"{path} belongs to uid {info.st_uid}, has mode {stat.S_IMODE(info.st_mode):04o} and "
            f"{info.st_nlink} link(s); a domain file must be the current user's (uid {os.geteuid()}), "
            "writable by no one else, with one link. Something planted it: move the domain root aside "
            "or set HWR_ROOT to a fresh path",
            path=str(path),
            uid=info.st_uid,
            mode=stat.S_IMODE(info.st_mode),
        )
    try:
        data = read_small_file(path, limit=1 << 20)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise _domain_invalid(path, "is a symlink") from exc
        raise _os_failure(exc, f"reading {path}") from exc
    except ValueError as exc:
        raise _domain_invalid(path, f"cannot be read as a domain file ({exc})") from exc
    try:
        return require_object(decode_json(data), path.name)
    except ValueError as exc:
        raise _domain_invalid(path, f"is not a JSON object ({exc})") from exc


def _write_json(path: Path, value: Mapping[str, object]) -> None:
    try:
        write_file_atomic(path, encode_canonical(dict(value)))
    except OSError as exc:
        raise _os_failure(exc, f"writing {path}") from exc


def _load_or_create_domain_record(
    layout: DomainLayout, scope: CoordinationScope, detected: StorageClass, fs_type: str
) -> _DomainRecord:
    path = layout.domain_file
    stored = _read_json_object(path)
    if stored is None:
        record = _DomainRecord(
            domain_id=uuid.uuid4().hex,
            scope=scope,
            storage_class=detected,
            fs_type=fs_type,
            created_at_ns=time.time_ns(),
        )
        _write_json(
            path,
            {
                "schema_version": DOMAIN_SCHEMA_VERSION,
                "domain_id": record.domain_id,
                "scope": record.scope.value,
                "storage_class": record.storage_class.value,
                "fs_type": record.fs_type,
                "created_at_ns": record.created_at_ns,
            },
        )
        return record
    try:
        require_exact_keys(stored, _DOMAIN_KEYS, path.name)
        version = get_int(stored, "schema_version", path.name)
        if version != DOMAIN_SCHEMA_VERSION:
            raise ValueError(f"schema_version {version} is not the supported {DOMAIN_SCHEMA_VERSION}")
        domain_id = get_str(stored, "domain_id", path.name)
        if not _DOMAIN_ID.match(domain_id):
            raise ValueError(f"domain_id {domain_id!r} is not 32 lowercase hex characters")
        record = _DomainRecord(
            domain_id=domain_id,
            scope=CoordinationScope(get_str(stored, "scope", path.name)),
            storage_class=StorageClass(get_str(stored, "storage_class", path.name)),
            fs_type=get_str(stored, "fs_type", path.name),
            created_at_ns=get_int(stored, "created_at_ns", path.name),
        )
    except ValueError as exc:
        raise _domain_invalid(path, f"is not a valid domain record ({exc})") from exc
    if record.storage_class is not detected:
        raise _domain_invalid(
            path,
            f"records storage class {record.storage_class.value} but the root is now on "
            f"{fs_type} ({detected.value}); the domain was moved or copied between filesystems",
        )
    return record


def _load_or_create_policy(layout: DomainLayout, requested: CapacityPolicy | None) -> CapacityPolicy:
    path = layout.policy_file
    stored_value = _read_json_object(path)
    if stored_value is None:
        policy = requested if requested is not None else CapacityPolicy()
        _write_json(path, {"schema_version": POLICY_SCHEMA_VERSION, **policy.to_dict()})
        return policy
    stored = _parse_policy(path, stored_value)
    if requested is not None and requested != stored:
        raise raise_failure(
            _STAGE,
            FailureCode.DOMAIN_POLICY_CONFLICT,
            f"the domain at {layout.root} already has capacity policy {stored.to_dict()} and the first "
            f"writer's policy is authoritative; this process's capacity policy differs: {requested.to_dict()}. "
            "Give every "
            "worker the same HWR_MAX_ARTIFACT_BYTES / HWR_MAX_STORE_BYTES / HWR_MIN_FREE_BYTES, pass no "
            "capacity policy to adopt the stored one, or use a different HWR_ROOT",
            root=str(layout.root),
            stored=_policy_json(stored),
            requested=_policy_json(requested),
        )
    return stored


def _policy_json(policy: CapacityPolicy) -> dict[str, JsonValue]:
    return dict(policy.to_dict())


def _parse_policy(path: Path, value: Mapping[str, object]) -> CapacityPolicy:
    try:
        require_exact_keys(value, _POLICY_KEYS, path.name)
        version = get_int(value, "schema_version", path.name)
        if version != POLICY_SCHEMA_VERSION:
            raise ValueError(f"schema_version {version} is not the supported {POLICY_SCHEMA_VERSION}")
        limits: dict[str, int | None] = {}
        for name in ("max_artifact_bytes", "max_store_bytes"):
            limits[name] = None if value[name] is None else get_int(value, name, path.name)
        return CapacityPolicy(
            max_artifact_bytes=limits["max_artifact_bytes"],
            max_store_bytes=limits["max_store_bytes"],
            min_free_bytes=get_int(value, "min_free_bytes", path.name),
        )
    except ValueError as exc:
        raise _domain_invalid(path, f"is not a valid capacity policy ({exc})") from exc

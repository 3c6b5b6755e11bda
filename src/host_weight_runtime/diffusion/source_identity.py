"""Canonical diffusion weight-source identity and one-load replacement guard.

The artifact key must describe the exact checkpoint bytes a canonical load would read.
`prepare_weight_source` picks those files the way the ordinary diffusers loader does
(local folder or local Hugging Face cache, never the network); `snapshot_sources`
records every file's stat state and a content id; `FinalLayoutSourceContext` re-checks
the states before anything is published or restored (D11).

A content id is either

    hub-blob:<name>     the blob name of a validated Hugging Face cache snapshot (D04):
                        <cache>/models--<org>--<name>/
                          blobs/<40 or 64 hex>                      regular file
                          snapshots/<revision>/[sub/...]file -> ../../[../...]blobs/<hash>
    sha256:<64 hex>     the SHA-256 of the file's bytes, for everything else

`NodeSourceDigestCache` lets the workers of a node hash a local file once (D03):

    <root>/source-digests-v1/
      entries/<key>.json   canonical JSON: realpath, stat state, digest, entry_sha256
      locks/<key>.lock     exclusive while one worker hashes the file (never unlinked)

where <key> is the SHA-256 of the file's realpath and stat state. The cache is an
optimisation only: a damaged entry is recomputed, and a lock timeout or a directory
failure falls back to hashing directly. Only a source that changes fails a load.
"""

from __future__ import annotations

import contextlib
import enum
import hashlib
import logging
import os
import re
import stat
import threading
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from .._digest import default_hash_threads
from .._faults import fault_point
from ..canonical_json import CanonicalJson, JsonValue, decode_json, encode_canonical
from ..failures import FailureCode, HostWeightError, ResolutionStage, raise_failure
from ..filesystem._fsutil import failure_from_os_error, read_small_file, write_file_atomic
from ..filesystem.locks import acquire_lock
from .contracts import ImplementationIdentity

__all__ = [
    "FileState",
    "FinalLayoutSourceContext",
    "NodeSourceDigestCache",
    "PreparedWeightSource",
    "SourceFileRecord",
    "WeightSourceKind",
    "bind_tensors_to_sources",
    "hub_blob_content_id",
    "is_content_id_known",
    "prepare_weight_source",
    "resolved_revision",
    "snapshot_sources",
]

_LOG = logging.getLogger(__name__)

SOURCES_SCHEMA = "hwr-final-layout-sources-v1"
DIGEST_ENTRY_SCHEMA = "hwr-source-digest-entry-v1"
_CACHE_DIR = "source-digests-v1"
_READ_CHUNK_BYTES = 8 * 1024 * 1024
_ENTRY_LIMIT_BYTES = 64 * 1024
_INDEX_LIMIT_BYTES = 64 * 1024 * 1024
_MAX_LISTED = 10

_SHA256_ID = re.compile(r"sha256:[0-9a-f]{64}")
_HEX64 = re.compile(r"[0-9a-f]{64}")
_HUB_BLOB_NAME = re.compile(r"[0-9a-f]{40}|[0-9a-f]{64}")
_COMMIT = re.compile(r"[0-9a-f]{40}")
_REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?")

# Weight files in the order the ordinary loader prefers them: (name, is_index, use_safetensors).
_WEIGHT_CANDIDATES: tuple[tuple[str, bool, bool], ...] = (
    ("diffusion_pytorch_model.safetensors", False, True),
    ("diffusion_pytorch_model.safetensors.index.json", True, True),
    ("model.safetensors", False, True),
    ("model.safetensors.index.json", True, True),
    ("diffusion_pytorch_model.bin", False, False),
    ("diffusion_pytorch_model.bin.index.json", True, False),
)


class WeightSourceKind(str, enum.Enum):
    """Where the checkpoint files came from (a local folder or the local Hugging Face cache)."""

    HUGGING_FACE_HUB = "hugging_face_hub"
    LOCAL_PATH = "local_path"


def _relative_parts(value: str, what: str) -> tuple[str, ...]:
    """Split a relative POSIX path, refusing absolute paths, `..`, and non-normal spellings."""
    parts = PurePosixPath(value).parts
    if not value or value.startswith("/") or ".." in parts or "/".join(parts) != value:
        raise ValueError(
            f"{what} must be a normalised relative path such as 'transformer' (no leading '/', no '..', "
            f"no '.', no trailing or doubled '/'), got {value!r}"
        )
    return parts


@dataclass(frozen=True, slots=True)
class PreparedWeightSource:
    """Canonical source files and adapter ABI selected by the ordinary loader."""

    model_or_path: str
    requested_revision: str | None
    resolved_root: Path
    subfolder: str | None
    prefix: str
    weight_files: tuple[Path, ...]
    use_safetensors: bool
    source_kind: WeightSourceKind = WeightSourceKind.LOCAL_PATH
    checkpoint_adapter: ImplementationIdentity | None = None

    def __post_init__(self) -> None:
        if type(self.model_or_path) is not str or not self.model_or_path:
            raise ValueError("PreparedWeightSource.model_or_path must be a non-empty str (a folder or 'org/name')")
        if self.requested_revision is not None and (
            type(self.requested_revision) is not str or not self.requested_revision
        ):
            raise ValueError("PreparedWeightSource.requested_revision must be None or a non-empty str")
        if not isinstance(self.resolved_root, Path) or not self.resolved_root.is_absolute():
            raise ValueError(
                f"PreparedWeightSource.resolved_root must be an absolute Path, got {self.resolved_root!r}; "
                f"use prepare_weight_source(...) or Path(...).absolute()"
            )
        if self.subfolder is not None:
            if type(self.subfolder) is not str:
                raise ValueError("PreparedWeightSource.subfolder must be None or a str")
            parts = _relative_parts(self.subfolder, "PreparedWeightSource.subfolder")
            if self.resolved_root.parts[-len(parts) :] != parts:
                raise ValueError(
                    f"PreparedWeightSource.resolved_root {self.resolved_root} must end with its subfolder "
                    f"{self.subfolder!r}"
                )
        if type(self.prefix) is not str:
            raise ValueError("PreparedWeightSource.prefix must be a str")
        if self.prefix and (not self.prefix.endswith(".") or self.prefix.startswith(".") or ".." in self.prefix):
            raise ValueError(
                f"PreparedWeightSource.prefix must be '' or dotted names ending in '.', such as 'transformer.'; "
                f"got {self.prefix!r}"
            )
        self._check_weight_files()
        if type(self.use_safetensors) is not bool:
            raise ValueError("PreparedWeightSource.use_safetensors must be a bool")
        if self.use_safetensors and any(path.suffix != ".safetensors" for path in self.weight_files):
            raise ValueError(
                "PreparedWeightSource.use_safetensors is True but not every weight file ends in .safetensors; "
                "set use_safetensors=False for .bin checkpoints"
            )
        if not isinstance(self.source_kind, WeightSourceKind):
            raise ValueError("PreparedWeightSource.source_kind must be a WeightSourceKind")
        if self.checkpoint_adapter is not None and not isinstance(self.checkpoint_adapter, ImplementationIdentity):
            raise ValueError("PreparedWeightSource.checkpoint_adapter must be None or an ImplementationIdentity")

    def _check_weight_files(self) -> None:
        files = self.weight_files
        if type(files) is not tuple or not files:
            raise ValueError("PreparedWeightSource.weight_files must be a non-empty tuple of Paths")
        for path in files:
            if not isinstance(path, Path) or not path.is_absolute() or ".." in path.parts:
                raise ValueError(
                    f"PreparedWeightSource.weight_files must hold absolute Paths without '..', got {path!r}"
                )
            if path == self.resolved_root or not path.is_relative_to(self.resolved_root):
                raise ValueError(f"weight file {path} is not inside the source's resolved_root {self.resolved_root}")
        if tuple(sorted(set(files))) != files:
            raise ValueError("PreparedWeightSource.weight_files must be sorted and free of duplicates")

    def relative_name(self, path: Path) -> str:
        """The file's name below `resolved_root`, which enters the fingerprint instead of the absolute path."""
        return path.relative_to(self.resolved_root).as_posix()


def resolved_revision(source: PreparedWeightSource) -> str | None:
    """The snapshot (commit) a hub source resolved to; None for local folders."""
    if source.source_kind is not WeightSourceKind.HUGGING_FACE_HUB:
        return None
    snapshot = source.resolved_root
    if source.subfolder is not None:
        depth = len(PurePosixPath(source.subfolder).parts)
        if len(snapshot.parts) <= depth:
            return None
        snapshot = snapshot.parents[depth - 1]
    if snapshot.parent.name != "snapshots":
        return None
    return snapshot.name


# ---------------------------------------------------------------------------- file state


@dataclass(frozen=True, slots=True)
class _FileState:
    """The stat facts that change whenever a file's bytes (or the file behind a name) change."""

    device: int
    inode: int
    size: int
    mtime_ns: int
    ctime_ns: int

    def __post_init__(self) -> None:
        for name in ("device", "inode", "size", "mtime_ns", "ctime_ns"):
            if type(getattr(self, name)) is not int:
                raise ValueError(f"FileState.{name} must be an int")

    @classmethod
    def of(cls, path: Path) -> _FileState:
        """Stat `path`, following symlinks (the state is the target's)."""
        return cls.from_stat(os.stat(path))

    @classmethod
    def from_stat(cls, info: os.stat_result) -> _FileState:
        return cls(info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns)

    def to_dict(self) -> dict[str, JsonValue]:
        return {
            "device": self.device,
            "inode": self.inode,
            "size": self.size,
            "mtime_ns": self.mtime_ns,
            "ctime_ns": self.ctime_ns,
        }

    def differences(self, other: _FileState) -> list[str]:
        """Names of the fields that differ, for messages."""
        return [
            name
            for name in ("device", "inode", "size", "mtime_ns", "ctime_ns")
            if getattr(self, name) != getattr(other, name)
        ]


FileState = _FileState


def _source_changed(path: Path, what: str, **details: JsonValue) -> HostWeightError:
    return raise_failure(
        ResolutionStage.CANONICAL,
        FailureCode.CANONICAL_SOURCE_FAILED,
        f"weight file {path} {what} while HWR was computing its identity, so the artifact key would not "
        f"describe the bytes a load reads. Wait until the checkpoint is completely written (or stop whatever "
        f"modifies it) and load again",
        retryable=False,
        path=str(path),
        **details,
    )


def _stat_source(path: Path, missing: str) -> _FileState:
    """The file's state; a missing file is CANONICAL_SOURCE_FAILED, other OS errors are typed."""
    try:
        return _FileState.of(path)
    except FileNotFoundError as exc:
        raise _source_changed(path, missing) from exc
    except OSError as exc:
        raise HostWeightError(
            failure_from_os_error(exc, stage=ResolutionStage.CANONICAL, what=f"checking weight file {path}")
        ) from exc


def _check_state(path: Path, expected: _FileState) -> None:
    """Raise CANONICAL_SOURCE_FAILED unless `path` still has state `expected`."""
    current = _stat_source(path, "disappeared")
    if current != expected:
        raise _source_changed(path, "changed", changed_fields=list(expected.differences(current)))


def _hash_file(path: Path, state: _FileState) -> str:
    """SHA-256 of the file's bytes, refusing a file whose state differs from `state` before or after."""
    try:
        # O_NONBLOCK: a FIFO planted at the path must not block the load; regular files ignore it.
        with open(os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC), "rb", buffering=0) as stream:
            info = os.fstat(stream.fileno())
            if not stat.S_ISREG(info.st_mode):
                raise _source_changed(path, "is not a regular file")
            opened = _FileState.from_stat(info)
            if opened != state:
                raise _source_changed(path, "changed", changed_fields=list(state.differences(opened)))
            hasher = hashlib.sha256()
            buffer = memoryview(bytearray(max(1, min(_READ_CHUNK_BYTES, state.size))))
            total = 0
            while True:
                count = stream.readinto(buffer)
                if not count:
                    break
                hasher.update(buffer[:count])  # hashlib releases the GIL for large updates
                total += count
            fault_point("source_digest.after_hash")
            after = _FileState.from_stat(os.fstat(stream.fileno()))
    except FileNotFoundError as exc:
        raise _source_changed(path, "disappeared") from exc
    except OSError as exc:
        raise HostWeightError(
            failure_from_os_error(exc, stage=ResolutionStage.CANONICAL, what=f"reading weight file {path}")
        ) from exc
    if after != state or total != state.size:
        raise _source_changed(path, "was modified", changed_fields=list(state.differences(after)))
    _check_state(path, state)  # the name may now point at a different file
    return f"sha256:{hasher.hexdigest()}"


# ---------------------------------------------------------------------------- hub topology


def _is_real_dir(path: Path) -> bool:
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def _validated_hub_blob(repo: Path, link: Path, inner: tuple[str, ...], target: str) -> str | None:
    """The blob name when `link` (below repo/snapshots/inner...) is a well-formed cache symlink."""
    depth = len(inner) + 1  # up from the link's directory, through snapshots/<revision>/..., to the repo
    target_parts = PurePosixPath(target).parts
    if len(target_parts) != depth + 2 or target_parts[:depth] != ("..",) * depth or target_parts[depth] != "blobs":
        return None
    name = target_parts[-1]
    if not _HUB_BLOB_NAME.fullmatch(name):
        return None
    directories = [repo, repo / "snapshots", repo / "blobs"]
    current = repo / "snapshots"
    for part in inner:
        current = current / part
        directories.append(current)
    if not all(_is_real_dir(directory) for directory in directories):
        return None  # a symlinked directory could lead anywhere
    blob = repo / "blobs" / name
    try:
        blob_info = os.lstat(blob)
        link_info = os.stat(link)
    except OSError:
        return None
    if not stat.S_ISREG(blob_info.st_mode):
        return None
    if (blob_info.st_dev, blob_info.st_ino) != (link_info.st_dev, link_info.st_ino):
        return None
    return name


def hub_blob_content_id(path: Path) -> str | None:
    """`hub-blob:<name>` when `path` is a validated Hugging Face cache snapshot symlink, else None (hash it)."""
    link = Path(os.path.abspath(path))
    try:
        if not stat.S_ISLNK(os.lstat(link).st_mode):
            return None
        target = os.readlink(link)
    except OSError:
        return None
    parts = link.parts
    # parts: (..., "models--org--name", "snapshots", revision, [sub...], file)
    for index in range(len(parts) - 3, 1, -1):
        repo_name = parts[index - 1]
        if parts[index] != "snapshots" or not repo_name.startswith("models--") or repo_name == "models--":
            continue
        name = _validated_hub_blob(Path(*parts[:index]), link, parts[index + 1 : -1], target)
        if name is not None:
            return f"hub-blob:{name}"
    return None


# ---------------------------------------------------------------------------- node digest cache


class _EntryVerdict(enum.Enum):
    MISSING = "missing"
    VALID = "valid"
    CORRUPT = "corrupt"
    MISMATCHED = "mismatched"


@dataclass(frozen=True, slots=True)
class _EntryRead:
    verdict: _EntryVerdict
    digest: str | None = None
    reason: str = ""


def _entry_body(realpath: str, state: _FileState) -> dict[str, JsonValue]:
    return {"schema": DIGEST_ENTRY_SCHEMA, "path": realpath, **state.to_dict()}


def _entry_bytes(realpath: str, state: _FileState, digest: str) -> bytes:
    body = {**_entry_body(realpath, state), "digest": digest}
    return encode_canonical({**body, "entry_sha256": hashlib.sha256(encode_canonical(body)).hexdigest()})


def _parse_entry(data: bytes, expected: dict[str, JsonValue]) -> _EntryRead:
    """Check an entry's form, self-checksum and subject; never raises for bad content."""
    try:
        CanonicalJson(data)
        value = decode_json(data)
    except ValueError as exc:
        return _EntryRead(_EntryVerdict.CORRUPT, reason=f"not canonical JSON ({exc})")
    if not isinstance(value, dict) or set(value) != {*expected, "digest", "entry_sha256"}:
        return _EntryRead(_EntryVerdict.CORRUPT, reason="unexpected fields")
    checksum = value.pop("entry_sha256")
    if not isinstance(checksum, str) or hashlib.sha256(encode_canonical(value)).hexdigest() != checksum:
        return _EntryRead(_EntryVerdict.CORRUPT, reason="its entry_sha256 does not match its content")
    digest = value.pop("digest")
    if not isinstance(digest, str) or not _SHA256_ID.fullmatch(digest):
        return _EntryRead(_EntryVerdict.CORRUPT, reason="its digest is not 'sha256:<64 hex>'")
    if value != expected:
        return _EntryRead(_EntryVerdict.MISMATCHED, reason="it records a different file or stat state")
    return _EntryRead(_EntryVerdict.VALID, digest=digest)


class NodeSourceDigestCache:
    """Share content-backed local-source fingerprints across node workers."""

    __slots__ = ("_counter_guard", "entries", "hashes_computed", "locks", "timeout_seconds")

    def __init__(self, root: Path, *, timeout_seconds: float = 30.0) -> None:
        if not isinstance(root, Path):
            raise ValueError(f"NodeSourceDigestCache root must be a Path, got {type(root).__name__}")
        if type(timeout_seconds) not in (int, float) or not 0 <= timeout_seconds < float("inf"):
            raise ValueError(f"timeout_seconds must be a finite number >= 0, got {timeout_seconds!r}")
        self.entries = root / _CACHE_DIR / "entries"
        self.locks = root / _CACHE_DIR / "locks"
        self.timeout_seconds = float(timeout_seconds)
        self.hashes_computed = 0
        self._counter_guard = threading.Lock()

    def __repr__(self) -> str:
        return f"NodeSourceDigestCache({str(self.entries.parent)!r}, hashes_computed={self.hashes_computed})"

    @staticmethod
    def _key(realpath: str, state: _FileState) -> str:
        return hashlib.sha256(encode_canonical({"realpath": realpath, **state.to_dict()})).hexdigest()

    def entry_path(self, path: Path, state: _FileState) -> Path:
        """Where the entry for this file and state lives (for inspection and tests)."""
        return self.entries / f"{self._key(os.path.realpath(path), state)}.json"

    def lock_path(self, path: Path, state: _FileState) -> Path:
        """The lock a worker holds while it hashes this file and state."""
        return self.locks / f"{self._key(os.path.realpath(path), state)}.lock"

    def content_id(self, path: Path, state: _FileState) -> str:
        """`sha256:<hex>` of the file, hashed at most once per node for an unchanged file."""
        _check_state(path, state)
        realpath = os.path.realpath(path)
        key = self._key(realpath, state)
        expected = _entry_body(realpath, state)
        entry = self.entries / f"{key}.json"
        try:
            self._prepare_dirs()  # before any read: an entry in an untrusted directory must not be believed
        except OSError as exc:
            _LOG.warning("source digest cache %s is unusable (%s); hashing %s directly", self.entries.parent, exc, path)
            return self._hash(path, state)
        found = self._read_entry(entry, expected)
        if found.digest is not None:
            return found.digest
        fault_point("source_digest_cache.before_lock")
        try:
            lock = acquire_lock(
                self.locks / f"{key}.lock",
                exclusive=True,
                deadline=time.monotonic() + self.timeout_seconds,
                stage=ResolutionStage.CANONICAL,
                what="the source digest lock",
            )
        except HostWeightError as exc:
            _LOG.warning("source digest cache: %s; hashing %s directly", exc, path)
            return self._hash(path, state)
        with lock:
            found = self._read_entry(entry, expected)  # another worker may have finished meanwhile
            if found.digest is not None:
                return found.digest
            fault_point("source_digest_cache.before_hash")
            digest = self._hash(path, state)
            try:
                fault_point("source_digest_cache.before_write")
                write_file_atomic(entry, _entry_bytes(realpath, state, digest), mode=0o600)
            except OSError as exc:
                _LOG.warning("source digest cache: could not write %s (%s); the digest is not shared", entry, exc)
        return digest

    def cached_content_id(self, path: Path, state: _FileState) -> str | None:
        """The cached `sha256:<hex>` of the file in this state, or None; never hashes, never waits."""
        realpath = os.path.realpath(path)
        try:
            self._prepare_dirs()
        except OSError:
            return None
        entry = self.entries / f"{self._key(realpath, state)}.json"
        return self._read_entry(entry, _entry_body(realpath, state)).digest

    def _hash(self, path: Path, state: _FileState) -> str:
        digest = _hash_file(path, state)
        with self._counter_guard:
            self.hashes_computed += 1
        return digest

    def _read_entry(self, entry: Path, expected: dict[str, JsonValue]) -> _EntryRead:
        """Read and check an entry; damaged or foreign entries are logged and treated as misses."""
        try:
            data = read_small_file(entry, _ENTRY_LIMIT_BYTES)
        except FileNotFoundError:
            return _EntryRead(_EntryVerdict.MISSING)
        except (OSError, ValueError) as exc:
            _LOG.warning("source digest cache: cannot read entry %s (%s); recomputing it", entry, exc)
            return _EntryRead(_EntryVerdict.CORRUPT, reason=str(exc))
        found = _parse_entry(data, expected)
        if found.verdict is _EntryVerdict.CORRUPT:
            _LOG.warning("source digest cache: entry %s is corrupt (%s); recomputing it", entry, found.reason)
        elif found.verdict is _EntryVerdict.MISMATCHED:
            _LOG.warning("source digest cache: rejecting entry %s (%s); recomputing it", entry, found.reason)
        return found

    def _prepare_dirs(self) -> None:
        """Create the private cache directories and refuse ones another user could write."""
        base = self.entries.parent
        for directory in (base, self.entries, self.locks):
            try:
                info = os.lstat(directory)
            except FileNotFoundError:
                if directory is base:
                    os.makedirs(base.parent, mode=0o700, exist_ok=True)
                with contextlib.suppress(FileExistsError):  # a concurrent worker made it: checked below
                    os.mkdir(directory, 0o700)
                info = os.lstat(directory)
            if not stat.S_ISDIR(info.st_mode):
                raise NotADirectoryError(f"{directory} is not a directory (a symlink or a file is in the way)")
            if info.st_uid != os.geteuid() or info.st_mode & 0o022:
                raise PermissionError(f"{directory} is writable by other users or not owned by this user")


# ---------------------------------------------------------------------------- snapshot


@dataclass(frozen=True, slots=True)
class SourceFileRecord:
    """One weight file as it was when the identity was computed."""

    source_index: int
    path: Path
    relative_name: str
    state: _FileState
    content_id: str

    def __post_init__(self) -> None:
        if type(self.source_index) is not int or self.source_index < 0:
            raise ValueError("SourceFileRecord.source_index must be an int >= 0")
        if not isinstance(self.path, Path) or not isinstance(self.state, _FileState):
            raise ValueError("SourceFileRecord.path must be a Path and state a FileState")
        if type(self.relative_name) is not str or not self.relative_name:
            raise ValueError("SourceFileRecord.relative_name must be a non-empty str")
        if type(self.content_id) is not str or not self.content_id.startswith(("sha256:", "hub-blob:")):
            raise ValueError("SourceFileRecord.content_id must be 'sha256:<hex>' or 'hub-blob:<name>'")


def _sources_document(
    sources: Sequence[PreparedWeightSource], files: Sequence[SourceFileRecord]
) -> dict[str, JsonValue]:
    """What identifies the sources: prefixes, adapters and file contents, never absolute paths or stat facts."""
    documents: list[JsonValue] = []
    for index, source in enumerate(sources):
        adapter: dict[str, JsonValue] | None = None
        if source.checkpoint_adapter is not None:
            adapter = {**source.checkpoint_adapter.to_dict()}
        listed: list[JsonValue] = [
            {"name": record.relative_name, "content_id": record.content_id, "size": record.state.size}
            for record in files
            if record.source_index == index
        ]
        documents.append(
            {
                "prefix": source.prefix,
                "subfolder": source.subfolder,
                "source_kind": source.source_kind.value,
                "use_safetensors": source.use_safetensors,
                "checkpoint_adapter": adapter,
                "files": listed,
            }
        )
    return {"schema": SOURCES_SCHEMA, "sources": documents}


@dataclass(frozen=True, slots=True)
class FinalLayoutSourceContext:
    """The sources' content ids and stat states at identity time, to re-check before publish or restore."""

    sources: tuple[PreparedWeightSource, ...]
    files: tuple[SourceFileRecord, ...]
    fingerprint: str

    def __post_init__(self) -> None:
        if type(self.sources) is not tuple or not self.sources:
            raise ValueError("FinalLayoutSourceContext.sources must be a non-empty tuple")
        if type(self.files) is not tuple or not all(isinstance(record, SourceFileRecord) for record in self.files):
            raise ValueError("FinalLayoutSourceContext.files must be a tuple of SourceFileRecord")
        if type(self.fingerprint) is not str or not _HEX64.fullmatch(self.fingerprint):
            raise ValueError("FinalLayoutSourceContext.fingerprint must be 64 lowercase hex characters")
        if hashlib.sha256(encode_canonical(self.to_metadata())).hexdigest() != self.fingerprint:
            raise ValueError("FinalLayoutSourceContext.fingerprint does not match its sources; use snapshot_sources")

    def to_metadata(self) -> dict[str, JsonValue]:
        """The document the fingerprint hashes: per source its files' relative names, content ids and sizes."""
        return _sources_document(self.sources, self.files)

    def changed_files(self) -> tuple[SourceFileRecord, ...]:
        """Records whose file vanished or no longer has the recorded state (symlinks followed)."""
        changed = []
        for record in self.files:
            try:
                current = _FileState.of(record.path)
            except OSError:
                changed.append(record)
                continue
            if current != record.state:
                changed.append(record)
        return tuple(changed)

    def unchanged(self) -> bool:
        return not self.changed_files()

    def ensure_unchanged(self) -> None:
        """Raise CANONICAL_SOURCE_FAILED when any source file changed since the identity was computed."""
        changed = self.changed_files()
        if not changed:
            return
        names = [str(record.path) for record in changed]
        raise raise_failure(
            ResolutionStage.CANONICAL,
            FailureCode.CANONICAL_SOURCE_FAILED,
            f"{len(changed)} weight file(s) changed since the artifact identity was computed: "
            f"{', '.join(names[:_MAX_LISTED])}{' ...' if len(names) > _MAX_LISTED else ''}. The identity no "
            f"longer describes them, so nothing was published or restored; load the model again (a new identity "
            f"is computed) and do not modify checkpoint files while a load runs",
            retryable=False,
            changed=list[JsonValue](names[:_MAX_LISTED]),
            changed_count=len(changed),
        )


def is_content_id_known(path: Path, cache: NodeSourceDigestCache | None) -> bool:
    """Whether the file's content id comes without hashing: a trusted hub blob name, or a cache entry."""
    if hub_blob_content_id(path) is not None:
        return True
    if cache is None:
        return False
    try:
        state = _stat_source(path, "does not exist")
    except HostWeightError:
        return False
    return cache.cached_content_id(path, state) is not None


def _known_content_id(path: Path, cache: NodeSourceDigestCache | None) -> tuple[_FileState, str] | None:
    """The file's state and content id when they come without hashing, else None."""
    state = _stat_source(path, "does not exist")
    content_id = hub_blob_content_id(path)
    if content_id is None and cache is not None:
        content_id = cache.cached_content_id(path, state)
    if content_id is None:
        return None
    _check_state(path, state)
    return state, content_id


def _content_id(path: Path, cache: NodeSourceDigestCache | None) -> tuple[_FileState, str]:
    state = _stat_source(path, "does not exist")
    content_id = hub_blob_content_id(path)
    if content_id is None:
        content_id = cache.content_id(path, state) if cache is not None else _hash_file(path, state)
    _check_state(path, state)
    return state, content_id


def snapshot_sources(
    sources: Sequence[PreparedWeightSource],
    *,
    cache: NodeSourceDigestCache | None = None,
    max_workers: int | None = None,
) -> FinalLayoutSourceContext:
    """Record every source file's state and content id (hashed in parallel), and fingerprint them."""
    sources = tuple(sources)
    if not sources:
        raise ValueError("snapshot_sources needs at least one PreparedWeightSource")
    for source in sources:
        if not isinstance(source, PreparedWeightSource):
            raise ValueError(f"snapshot_sources takes PreparedWeightSource values, got {type(source).__name__}")
    if max_workers is not None and (type(max_workers) is not int or max_workers < 1):
        raise ValueError(f"max_workers must be None or an int >= 1, got {max_workers!r}")
    jobs = [(index, path) for index, source in enumerate(sources) for path in source.weight_files]
    # Content ids that need no hashing (hub blob names, digest-cache entries) come first, without threads.
    found: list[tuple[_FileState, str] | None] = [_known_content_id(path, cache) for _index, path in jobs]
    to_hash = [position for position, known in enumerate(found) if known is None]
    workers = min(len(to_hash), max_workers if max_workers is not None else default_hash_threads())
    if workers <= 1:
        for position in to_hash:
            found[position] = _content_id(jobs[position][1], cache)
    else:
        pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="hwr-source-hash")
        try:
            futures: dict[int, Future[tuple[_FileState, str]]] = {
                position: pool.submit(_content_id, jobs[position][1], cache) for position in to_hash
            }
            for position, future in futures.items():
                found[position] = future.result()
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
    results = [known for known in found if known is not None]
    if len(results) != len(jobs):  # pragma: no cover - every position was filled above
        raise AssertionError("a source file has no content id")
    records = tuple(
        SourceFileRecord(index, path, sources[index].relative_name(path), state, content_id)
        for (index, path), (state, content_id) in zip(jobs, results, strict=True)
    )
    fingerprint = hashlib.sha256(encode_canonical(_sources_document(sources, records))).hexdigest()
    return FinalLayoutSourceContext(sources, records, fingerprint)


# ---------------------------------------------------------------------------- coverage


def _coverage_error(message: str, **details: JsonValue) -> HostWeightError:
    return raise_failure(
        ResolutionStage.CONFIGURATION, FailureCode.INVALID_CONFIGURATION, message, retryable=False, **details
    )


def bind_tensors_to_sources(
    tensor_names: Iterable[str], sources: Sequence[PreparedWeightSource]
) -> dict[str, tuple[int, str]]:
    """Map each DiT tensor to (source index, checkpoint key) by the longest matching prefix (D02)."""
    sources = tuple(sources)
    bindings: dict[str, tuple[int, str]] = {}
    uncovered: list[str] = []
    ties: list[str] = []
    for name in tensor_names:
        best_length = -1
        best: list[int] = []
        for index, source in enumerate(sources):
            length = len(source.prefix)
            if len(name) <= length or not name.startswith(source.prefix) or length < best_length:
                continue
            if length > best_length:
                best_length, best = length, []
            best.append(index)
        if not best:
            uncovered.append(name)
        elif len(best) > 1:
            ties.append(name)
        else:
            bindings[name] = (best[0], name[best_length:])
    prefixes = list[JsonValue]([source.prefix for source in sources])
    if ties:
        ties.sort()
        raise _coverage_error(
            f"{len(ties)} DiT tensor(s) match the same longest prefix in more than one weight source "
            f"(e.g. {ties[:_MAX_LISTED]}); give every source a distinct prefix so each tensor has exactly one owner",
            ambiguous=list[JsonValue](ties[:_MAX_LISTED]),
            ambiguous_count=len(ties),
            prefixes=prefixes,
        )
    if uncovered:
        uncovered.sort()
        raise _coverage_error(
            f"{len(uncovered)} DiT tensor(s) are not supplied by any weight source: {uncovered[:_MAX_LISTED]}"
            f"{' ...' if len(uncovered) > _MAX_LISTED else ''}; add a source whose prefix covers them "
            f"(source prefixes: {[source.prefix for source in sources]})",
            uncovered=list[JsonValue](uncovered[:_MAX_LISTED]),
            uncovered_count=len(uncovered),
            prefixes=prefixes,
        )
    return bindings


# ---------------------------------------------------------------------------- loader-facing resolution


def _hub_cache_dir(cache_dir: Path | None) -> Path:
    """The hub cache the way huggingface_hub finds it: argument, HF_HUB_CACHE, HF_HOME/hub, XDG, ~/.cache."""
    if cache_dir is not None:
        return Path(os.path.abspath(os.path.expanduser(cache_dir)))
    for variable in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        value = os.environ.get(variable)
        if value:
            return Path(os.path.abspath(os.path.expanduser(value)))
    home = os.environ.get("HF_HOME")
    if not home:
        xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache")
        home = os.path.join(xdg, "huggingface")
    return Path(os.path.abspath(os.path.expanduser(home))) / "hub"


def _not_cached(repo_id: str, revision: str, looked_in: Path, reason: str) -> HostWeightError:
    return raise_failure(
        ResolutionStage.CANONICAL,
        FailureCode.NOT_FOUND,
        f"model {repo_id!r} (revision {revision!r}) is not in the local Hugging Face cache: {reason} "
        f"(looked in {looked_in}). HWR never downloads; fetch it first (for example "
        f"`huggingface-cli download {repo_id}`), or pass cache_dir / set HF_HUB_CACHE to the cache that holds it",
        repo_id=repo_id,
        revision=revision,
        looked_in=str(looked_in),
    )


def _hub_snapshot(repo_id: str, revision: str | None, cache_dir: Path | None) -> Path:
    """The snapshot directory of `repo_id` at `revision` in the local cache; never the network."""
    cache = _hub_cache_dir(cache_dir)
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    wanted = revision if revision is not None else "main"
    if not repo.is_dir():
        raise _not_cached(repo_id, wanted, repo, "the repository folder does not exist")
    if _COMMIT.fullmatch(wanted):
        commit = wanted
    else:
        try:
            ref_parts = _relative_parts(wanted, "revision")
        except ValueError as exc:
            raise _not_cached(repo_id, wanted, repo, "the revision is not a commit hash or a ref name") from exc
        ref = repo / "refs" / Path(*ref_parts)
        try:
            commit = ref.read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise _not_cached(repo_id, wanted, ref, f"the ref {wanted!r} is not cached ({exc})") from exc
        if not _COMMIT.fullmatch(commit):
            raise _not_cached(repo_id, wanted, ref, f"the ref file holds {commit[:80]!r}, not a commit hash")
    snapshot = repo / "snapshots" / commit
    if not snapshot.is_dir():
        raise _not_cached(repo_id, wanted, snapshot, f"snapshot {commit} is not cached")
    return snapshot


def _read_index(index: Path) -> list[str]:
    """Shard names from a `*.index.json` weight map (deduplicated, in the index's order of first use)."""
    with open(index, "rb") as stream:
        data = stream.read(_INDEX_LIMIT_BYTES + 1)
    if len(data) > _INDEX_LIMIT_BYTES:
        raise ValueError(f"{index} is larger than {_INDEX_LIMIT_BYTES} bytes")
    value = decode_json(data)
    weight_map = value.get("weight_map") if isinstance(value, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(f"{index} has no non-empty 'weight_map' object")
    shards: dict[str, None] = {}
    for shard in weight_map.values():
        if not isinstance(shard, str):
            raise ValueError(f"{index} maps a tensor to {shard!r}, not a file name")
        _relative_parts(shard, f"shard name in {index}")
        shards[shard] = None
    return list(shards)


def _variant_name(name: str, variant: str | None) -> str:
    """diffusers' spelling of a variant file: the variant goes before the last suffix (`x.fp16.safetensors`)."""
    if variant is None:
        return name
    head, _, suffix = name.rpartition(".")
    return f"{head}.{variant}.{suffix}"


def _variant_files(root: Path) -> list[str]:
    """Names in `root` that are some variant of a weight file the loader reads, e.g. `*.fp16.safetensors`."""
    patterns = [
        re.compile(re.escape(head) + r"\.[^./]+\." + re.escape(suffix))
        for head, _, suffix in (name.rpartition(".") for name, _is_index, _safe in _WEIGHT_CANDIDATES)
    ]
    try:
        names = sorted(entry.name for entry in root.iterdir())
    except OSError:
        return []
    return [name for name in names if any(pattern.fullmatch(name) for pattern in patterns)]


def _select_weight_files_or_none(root: Path, use_safetensors: bool | None) -> bool:
    """Whether `root` holds weights without a variant (for the hint of a variant that is not there)."""
    try:
        _select_weight_files(root, None, use_safetensors)
    except ValueError:
        return False
    return True


def _select_weight_files(
    root: Path, variant: str | None = None, use_safetensors: bool | None = None
) -> tuple[tuple[Path, ...], bool]:
    """The files the ordinary loader would read from `root`; ValueError saying what is missing."""
    candidates = [
        (_variant_name(name, variant), is_index, safe)
        for name, is_index, safe in _WEIGHT_CANDIDATES
        if use_safetensors is None or safe is use_safetensors
    ]
    for name, is_index, safe in candidates:
        candidate = root / name
        if not candidate.is_file():
            continue
        if not is_index:
            return (candidate,), safe
        try:
            shards = _read_index(candidate)
        except OSError as exc:
            raise ValueError(f"cannot read the weight index {candidate}: {exc}") from exc
        files = [root / Path(*PurePosixPath(shard).parts) for shard in shards]
        missing = sorted(str(path) for path in files if not path.is_file())
        if missing:
            raise ValueError(
                f"the weight index {candidate} names shard(s) that do not exist: {missing[:_MAX_LISTED]}; "
                f"download or copy the missing shards"
            )
        return tuple(sorted(set(files))), safe
    names = ", ".join(name for name, _is_index, _safe in candidates)
    variants = _variant_files(root)
    hint = ""
    if variants:
        found = " or ".join(sorted({f'variant="{name.split(".")[-2]}"' for name in variants}))
        hint = f"; it holds variant weight files {variants[:_MAX_LISTED]}: pass {found}"
    elif variant is not None and _select_weight_files_or_none(root, use_safetensors):
        hint = f"; it holds weights without a variant: drop variant={variant!r}"
    raise ValueError(f"{root} holds no weight file the loader reads (looked for {names}){hint}")


def prepare_weight_source(
    model_or_path: str | os.PathLike[str],
    *,
    subfolder: str | None = None,
    revision: str | None = None,
    prefix: str = "",
    cache_dir: Path | None = None,
    variant: str | None = None,
    use_safetensors: bool | None = None,
) -> PreparedWeightSource:
    """Select the checkpoint files a diffusers load of this folder or cached hub repo would read.

    `variant` and `use_safetensors` choose among them as in diffusers' `from_pretrained`.
    """
    text = os.fspath(model_or_path)
    if type(text) is not str or not text:
        raise ValueError(f"model_or_path must be a non-empty folder path or 'org/name', got {model_or_path!r}")
    sub_parts: tuple[str, ...] = ()
    if subfolder is not None:
        if type(subfolder) is not str:
            raise ValueError(f"subfolder must be None or a str, got {type(subfolder).__name__}")
        sub_parts = _relative_parts("/".join(PurePosixPath(subfolder).parts), "subfolder")
    normal_subfolder = "/".join(sub_parts) if sub_parts else None
    if os.path.isdir(text):
        root = Path(os.path.abspath(text)).joinpath(*sub_parts)
        if not (root / "config.json").is_file():
            hint = "" if subfolder else "; for a pipeline folder pass the component, e.g. subfolder='transformer'"
            raise ValueError(f"{root} has no config.json, so it is not a diffusers model folder{hint}")
        files, safe = _select_weight_files(root, variant, use_safetensors)
        return PreparedWeightSource(
            text, revision, root, normal_subfolder, prefix, files, safe, WeightSourceKind.LOCAL_PATH
        )
    if not _REPO_ID.fullmatch(text) or "--" in text or ".." in text:
        raise raise_failure(
            ResolutionStage.CANONICAL,
            FailureCode.NOT_FOUND,
            f"{text!r} is neither an existing local folder nor a Hugging Face repo id ('org/name'); "
            f"check the path or the model name",
            model_or_path=text,
        )
    snapshot = _hub_snapshot(text, revision, cache_dir)
    root = snapshot.joinpath(*sub_parts)
    wanted = revision if revision is not None else "main"
    if not (root / "config.json").is_file():
        raise _not_cached(text, wanted, root, "the snapshot has no config.json there (a partial download?)")
    try:
        files, safe = _select_weight_files(root, variant, use_safetensors)
    except ValueError as exc:
        raise _not_cached(text, wanted, root, str(exc)) from exc
    return PreparedWeightSource(
        text, revision, root, normal_subfolder, prefix, files, safe, WeightSourceKind.HUGGING_FACE_HUB
    )

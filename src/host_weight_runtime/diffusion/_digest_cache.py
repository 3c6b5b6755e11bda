"""`NodeSourceDigestCache`: the workers of a node hash a local checkpoint file once (D03).

    <root>/source-digests-v1/
      entries/<key>.json   canonical JSON: realpath, stat state, digest, entry_sha256
      locks/<key>.lock     exclusive while one worker hashes the file (never unlinked)
      headers/<key>.ok     empty: a worker checked this file's safetensors header in this state
      derived/<key>.json   canonical JSON {"key", "value"}: a result some worker computed from exactly what
                           <key> digests (a transformers skeleton's checkpoint bindings), so the next skips it
      seen/<id>.seen       empty: some worker of this node built an identity from a file with this content id
                           (<id> is the SHA-256 of the id as the key spells it); written before any lookup or
                           build under that identity, so a content id without one has no artifact here
      seen/complete        empty: `seen/` was made while the domain held no artifact, so the marks cover every
                           artifact (a domain a version without marks filled never gets it, and keeps looking up)

where <key> is the SHA-256 of the file's realpath and stat state (a header marker's key also
names the check's version). The cache is an optimisation only: a damaged entry is recomputed,
and a lock timeout or a directory failure falls back to hashing (or reading the header) directly.
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
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from .._faults import fault_point
from ..canonical_json import CanonicalJson, JsonValue, canonical_sha256, decode_json, encode_canonical
from ..failures import HostWeightError, ResolutionStage
from ..filesystem import DomainLayout, create_empty_file, read_small_file, write_file_atomic
from ..filesystem.locks import acquire_lock
from ._file_state import FileState, check_state, hash_file

# Logged under the public module's name, the one logger users configure for source identity.
_LOG = logging.getLogger(__name__.rpartition(".")[0] + ".source_identity")

DIGEST_ENTRY_SCHEMA = "hwr-source-digest-entry-v1"
_CACHE_DIR = "source-digests-v1"
HEADER_CHECK_VERSION = "safetensors-header-check-v1"
"""Names what a header marker vouches for; a stricter check gets a new version, so old markers vouch for nothing."""
_SEEN_COMPLETE = "complete"
_ENTRY_LIMIT_BYTES = 64 * 1024
_DERIVED_LIMIT_BYTES = 16 * 2**20
_HEX_KEY = re.compile(r"[0-9a-f]{64}")
_SHA256_ID = re.compile(r"sha256:[0-9a-f]{64}")


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


def _entry_body(realpath: str, state: FileState) -> dict[str, JsonValue]:
    return {"schema": DIGEST_ENTRY_SCHEMA, "path": realpath, **state.to_dict()}


def _entry_bytes(realpath: str, state: FileState, digest: str) -> bytes:
    body = {**_entry_body(realpath, state), "digest": digest}
    return encode_canonical({**body, "entry_sha256": canonical_sha256(body)})


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
    if not isinstance(checksum, str) or canonical_sha256(value) != checksum:
        return _EntryRead(_EntryVerdict.CORRUPT, reason="its entry_sha256 does not match its content")
    digest = value.pop("digest")
    if not isinstance(digest, str) or not _SHA256_ID.fullmatch(digest):
        return _EntryRead(_EntryVerdict.CORRUPT, reason="its digest is not 'sha256:<64 hex>'")
    if value != expected:
        return _EntryRead(_EntryVerdict.MISMATCHED, reason="it records a different file or stat state")
    return _EntryRead(_EntryVerdict.VALID, digest=digest)


class NodeSourceDigestCache:
    """Share content-backed local-source fingerprints across node workers."""

    __slots__ = (
        "_counter_guard",
        "derived",
        "entries",
        "hashes_computed",
        "headers",
        "locks",
        "seen",
        "timeout_seconds",
    )

    def __init__(self, root: Path, *, timeout_seconds: float = 30.0) -> None:
        if not isinstance(root, Path):
            raise ValueError(f"NodeSourceDigestCache root must be a Path, got {type(root).__name__}")
        if type(timeout_seconds) not in (int, float) or not 0 <= timeout_seconds < float("inf"):
            raise ValueError(f"timeout_seconds must be a finite number >= 0, got {timeout_seconds!r}")
        self.entries = root / _CACHE_DIR / "entries"
        self.locks = root / _CACHE_DIR / "locks"
        self.headers = root / _CACHE_DIR / "headers"
        self.derived = root / _CACHE_DIR / "derived"
        self.seen = root / _CACHE_DIR / "seen"
        self.timeout_seconds = float(timeout_seconds)
        self.hashes_computed = 0
        self._counter_guard = threading.Lock()

    def __repr__(self) -> str:
        return f"NodeSourceDigestCache({str(self.entries.parent)!r}, hashes_computed={self.hashes_computed})"

    @staticmethod
    def _key(realpath: str, state: FileState) -> str:
        return canonical_sha256({"realpath": realpath, **state.to_dict()})

    def entry_path(self, path: Path, state: FileState) -> Path:
        """Where the entry for this file and state lives (for inspection and tests)."""
        return self.entries / f"{self._key(os.path.realpath(path), state)}.json"

    def lock_path(self, path: Path, state: FileState) -> Path:
        """The lock a worker holds while it hashes this file and state."""
        return self.locks / f"{self._key(os.path.realpath(path), state)}.lock"

    def content_id(self, path: Path, state: FileState) -> str:
        """`sha256:<hex>` of the file, hashed at most once per node for an unchanged file."""
        check_state(path, state)
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

    def cached_content_id(self, path: Path, state: FileState) -> str | None:
        """The cached `sha256:<hex>` of the file in this state, or None; never hashes, never waits."""
        realpath = os.path.realpath(path)
        try:
            self._prepare_dirs()
        except OSError:
            return None
        entry = self.entries / f"{self._key(realpath, state)}.json"
        return self._read_entry(entry, _entry_body(realpath, state)).digest

    def header_marker(self, path: Path, state: FileState) -> Path:
        """The marker saying some worker of this node checked this file's safetensors header in exactly this state.

        Keyed like the digest entries (realpath and stat state) plus the check's version: a file rewritten,
        replaced or moved has another key, so a marker never vouches for bytes it was not written for.
        """
        document = {"check": HEADER_CHECK_VERSION, "realpath": os.path.realpath(path), **state.to_dict()}
        return self.headers / f"{canonical_sha256(document)}.ok"

    def header_checked(self, path: Path, state: FileState) -> bool:
        """Whether this file's header was checked in this state on this node; False where the cache is unusable."""
        try:
            self._prepare_dirs()  # a marker in a directory another user could write must not be believed
            return os.path.lexists(self.header_marker(path, state))
        except OSError:
            return False

    def record_header_checked(self, path: Path, state: FileState) -> None:
        """Remember a header checked in `state` (the caller saw that state before and after its check).

        Not forced to disk, as no cache record here is: a crash that loses it costs one check again.
        """
        try:
            self._prepare_dirs()
            create_empty_file(self.header_marker(path, state), mode=0o600)
        except OSError as exc:
            _LOG.info("source digest cache: could not record the checked header of %s (%s)", path, exc)

    def seen_marker(self, content_id: str) -> Path:
        """The marker saying some worker of this node identified a source file with this content id."""
        return self.seen / f"{hashlib.sha256(content_id.encode()).hexdigest()}.seen"

    def any_unseen(self, content_ids: Iterable[str]) -> bool | None:
        """Whether some content id has no seen mark; None where the marks do not cover the domain's artifacts
        (`seen/complete` absent) or the cache is unusable, so their absence proves nothing."""
        try:
            self._prepare_dirs()  # a marker in a directory another user could write must not be believed
            if not os.path.lexists(self.seen / _SEEN_COMPLETE):
                return None
            return any(not os.path.lexists(self.seen_marker(content_id)) for content_id in content_ids)
        except OSError:
            return None

    def record_content_seen(self, content_ids: Iterable[str]) -> None:
        """Mark these content ids as identified here, before any lookup or build under their identity.

        A marker that cannot be written is logged: the next first worker on the node then skips a lookup
        that could have hit, which costs it a canonical load, never a wrong weight. For the same reason a
        marker is not forced to disk (a crash that loses it costs that one load), which keeps two flushes
        per file off a first worker's start on a disk-backed domain.
        """
        try:
            self._prepare_dirs()
            for content_id in content_ids:
                create_empty_file(self.seen_marker(content_id), mode=0o600)  # one already there is kept
        except OSError as exc:
            _LOG.warning("source digest cache: could not record identified sources in %s (%s)", self.seen, exc)

    def derived_value(self, key: str) -> JsonValue | None:
        """The value recorded under `key` (the SHA-256 hex of what it was computed from), or None; never raises."""
        if not _HEX_KEY.fullmatch(key):
            raise ValueError(f"a derived record's key must be 64 lowercase hex digits, got {key!r}")
        try:
            self._prepare_dirs()  # a record in a directory another user could write must not be believed
            data = read_small_file(self.derived / f"{key}.json", _DERIVED_LIMIT_BYTES)
            record = decode_json(data, max_bytes=_DERIVED_LIMIT_BYTES)
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            _LOG.info("source digest cache: ignoring derived record %s (%s)", key, exc)
            return None
        if not isinstance(record, dict) or set(record) != {"key", "value"} or record["key"] != key:
            _LOG.info("source digest cache: ignoring derived record %s (not the record of its key)", key)
            return None
        return record["value"]

    def record_derived(self, key: str, value: JsonValue) -> None:
        """Record `value` under `key` for the node's next worker; a failure only means it is computed again."""
        if not _HEX_KEY.fullmatch(key):
            raise ValueError(f"a derived record's key must be 64 lowercase hex digits, got {key!r}")
        try:
            self._prepare_dirs()
            record = encode_canonical({"key": key, "value": value})
            write_file_atomic(self.derived / f"{key}.json", record, mode=0o600, durable=False)  # damaged: ignored
        except (OSError, ValueError) as exc:
            _LOG.info("source digest cache: could not record derived value %s (%s)", key, exc)

    def _hash(self, path: Path, state: FileState) -> str:
        digest = hash_file(path, state)
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

    def _start_seen_marks(self) -> None:
        """Just made `seen/`: it covers every artifact only if the domain holds none yet (else none is `complete`)."""
        artifacts = DomainLayout(self.entries.parent.parent).artifacts
        try:
            with os.scandir(artifacts) as entries:
                held = any(True for _entry in entries)
        except FileNotFoundError:
            held = False
        except OSError as exc:
            _LOG.info("source digest cache: cannot list %s (%s); loads keep looking up", artifacts, exc)
            return
        if held:
            _LOG.info("source digest cache: %s has artifacts older than seen marks; loads keep looking up", artifacts)
            return
        try:
            write_file_atomic(self.seen / _SEEN_COMPLETE, b"", mode=0o600)
        except OSError as exc:
            _LOG.warning("source digest cache: could not mark %s complete (%s); loads keep looking up", self.seen, exc)

    def _prepare_dirs(self) -> None:
        """Create the private cache directories and refuse ones another user could write."""
        base = self.entries.parent
        for directory in (base, self.entries, self.locks, self.headers, self.derived, self.seen):
            try:
                info = os.lstat(directory)
            except FileNotFoundError:
                if directory is base:
                    os.makedirs(base.parent, mode=0o700, exist_ok=True)
                made = False
                with contextlib.suppress(FileExistsError):  # a concurrent worker made it: checked below
                    os.mkdir(directory, 0o700)
                    made = True
                info = os.lstat(directory)
                if made and directory is self.seen:
                    self._start_seen_marks()
            if not stat.S_ISDIR(info.st_mode):
                raise NotADirectoryError(f"{directory} is not a directory (a symlink or a file is in the way)")
            if info.st_uid != os.geteuid() or info.st_mode & 0o022:
                raise PermissionError(f"{directory} is writable by other users or not owned by this user")

"""Background full verification: each publication's payloads are hashed once per node, after its first lease.

The default lookup (`MANIFEST_AND_METADATA`) checks structure, sizes and headers but does
not hash payloads, so a byte flipped in a published file by a co-tenant is served. To close
that gap without making any lease wait, the first lease of a publication that was not
checked with `FULL_CHECKSUM` (and that this process did not just build or import) starts a
daemon thread that re-hashes every payload through `pread` (never through the mapping, so a
truncated file is a short read, not a SIGBUS) at a lowered CPU priority.

- **Once per node.** Success writes `verified/<key>.json` (atomically, outside the artifact,
  naming the publication id, so a rebuilt artifact is verified again). Concurrent first
  leases do not both hash: the verifier holds `locks/<key>.verify.lock` exclusively while it
  works and a process that cannot take it without waiting skips. A verifier killed or
  abandoned at exit leaves no claim (the kernel drops the flock) and no record.
- **Fail closed for later workers.** A mismatch writes the deny marker, so the next lookup
  falls back and the next build quarantines and rebuilds. The lease that started the
  verification keeps serving (it is never closed under the worker); its `verification`
  says DENIED, a warning is logged and a telemetry event counts it.
- **Bounded by the lease.** The verifier reads under the lease's shared artifact lock;
  closing the lease stops it at the next chunk and nothing is recorded.

`HWR_BACKGROUND_VERIFY=once` (the default) or `off`.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass

from .. import _telemetry
from .._digest import DigestAlgorithm, TreeHasher, file_digest
from .._faults import fault_point
from .._strict import get_int, get_str, require_exact_keys, require_object
from ..canonical_json import decode_json, encode_canonical
from ..config import ENV_BACKGROUND_VERIFY, BackgroundVerifyMode, environment_config
from ..failures import FailureCode, HostWeightFailure, ResolutionStage, failure
from ..lease import VerificationState, start_or_defer
from ..manifest import FileManifestEntry, WeightManifest
from ._deny import DenyMarkers
from ._fsutil import read_small_file, write_file_atomic
from ._layout import DomainLayout
from .locks import try_lock
from .reader import ArtifactReadError, InvalidArtifactError, check_content_digest, open_member, read_error

__all__ = [
    "ENV_BACKGROUND_VERIFY",
    "BackgroundVerification",
    "BackgroundVerifyMode",
    "VerificationLedger",
    "VerificationRecord",
    "background_verify_mode",
]

_RECORD_SCHEMA_VERSION = 1
_RECORD_KEYS = frozenset({"schema_version", "key", "publication_id", "verified_at_ns", "pid", "payload_bytes"})
_RECORD_LIMIT = 4096
VERIFIER_NICE_RAISE = 10
"""How much nicer than the thread that took the lease the verifier runs (a relative raise, as the loader's)."""
_LOWEST_PRIORITY = 19  # the highest nice value Linux allows

_LOG = logging.getLogger("host_weight_runtime")


def background_verify_mode(environ: Mapping[str, str] | None = None) -> BackgroundVerifyMode:
    """HWR_BACKGROUND_VERIFY (read by `from_env`): `once` (default) or `off`; anything else is a ValueError
    that says what to set."""
    mode = environment_config((ENV_BACKGROUND_VERIFY,), environ).background_verify
    return BackgroundVerifyMode.ONCE if mode is None else mode


@dataclass(frozen=True, slots=True)
class VerificationRecord:
    """`verified/<key>.json`: this publication of `key` was fully hashed on this node and matched."""

    key: str
    publication_id: str
    verified_at_ns: int
    pid: int
    payload_bytes: int

    def to_bytes(self) -> bytes:
        return encode_canonical(
            {
                "schema_version": _RECORD_SCHEMA_VERSION,
                "key": self.key,
                "publication_id": self.publication_id,
                "verified_at_ns": self.verified_at_ns,
                "pid": self.pid,
                "payload_bytes": self.payload_bytes,
            }
        )

    @classmethod
    def from_bytes(cls, data: bytes) -> VerificationRecord:
        """Parse strictly; any deviation is a ValueError (the record is then simply not trusted)."""
        where = "verification record"
        obj = require_object(decode_json(data, max_bytes=_RECORD_LIMIT, max_depth=2), where)
        require_exact_keys(obj, _RECORD_KEYS, where)
        if get_int(obj, "schema_version", where) != _RECORD_SCHEMA_VERSION:
            raise ValueError(f"{where}: unknown schema version")
        return cls(
            key=get_str(obj, "key", where),
            publication_id=get_str(obj, "publication_id", where),
            verified_at_ns=get_int(obj, "verified_at_ns", where),
            pid=get_int(obj, "pid", where),
            payload_bytes=get_int(obj, "payload_bytes", where),
        )


class VerificationLedger:
    """The `verified/` records of one domain: which publications were fully hashed on this node."""

    __slots__ = ("_layout",)

    def __init__(self, layout: DomainLayout) -> None:
        self._layout = layout

    def read(self, key: str) -> VerificationRecord | None:
        """The record for `key`, or None when there is none or it is unreadable (then it is not trusted)."""
        try:
            record = VerificationRecord.from_bytes(read_small_file(self._layout.verified_marker(key), _RECORD_LIMIT))
        except (OSError, ValueError):
            return None
        return record if record.key == key else None

    def is_verified(self, key: str, publication_id: str) -> bool:
        record = self.read(key)
        return record is not None and record.publication_id == publication_id

    def record(self, key: str, publication_id: str, payload_bytes: int) -> None:
        """Write the record atomically (raises OSError; the caller decides what a failed write means)."""
        fault_point("verify.write_record")
        record = VerificationRecord(key, publication_id, time.time_ns(), os.getpid(), payload_bytes)
        write_file_atomic(self._layout.verified_marker(key), record.to_bytes())


class _StoppedError(Exception):
    """The lease closed while its verification was running."""


class BackgroundVerification:
    """One publication's full re-hash on a daemon thread, started for a lease; `stop()` abandons it."""

    __slots__ = (
        "_deny",
        "_done",
        "_failure",
        "_held",
        "_inodes",
        "_key",
        "_layout",
        "_ledger",
        "_manifest",
        "_publication_id",
        "_seconds",
        "_start_lock",
        "_state",
        "_stop",
        "_storage_class",
        "_thread",
        "payload_bytes",
    )

    def __init__(
        self,
        *,
        layout: DomainLayout,
        ledger: VerificationLedger,
        deny: DenyMarkers,
        key: str,
        manifest: WeightManifest,
        publication_id: str,
        inodes: Mapping[str, tuple[int, int]],
        storage_class: str,
    ) -> None:
        self._layout = layout
        self._ledger = ledger
        self._deny = deny
        self._key = key
        self._manifest = manifest
        self._publication_id = publication_id
        self._inodes = dict(inodes)
        self._storage_class = storage_class
        self._state = VerificationState.RUNNING
        self._failure: HostWeightFailure | None = None
        self._stop = threading.Event()
        self._done = threading.Event()
        self.payload_bytes = 0
        self._seconds: float | None = None
        self._thread = threading.Thread(target=self._run, name="hwr-verify", daemon=True)
        self._start_lock = threading.Lock()
        self._held = False

    def start(self) -> None:
        """Start the thread (once the lease is certain to be handed out), or, inside the loader's
        `deferred_verifications` block, once the load that took the lease is done."""
        self._held = start_or_defer(self._release)

    @property
    def started(self) -> bool:
        """Whether the thread was started (a held verification waits for its load's end)."""
        return self._thread.ident is not None

    def _release(self) -> None:
        with self._start_lock:
            if self._thread.ident is None and not self._stop.is_set():
                self._thread.start()

    @property
    def state(self) -> VerificationState:
        return self._state

    @property
    def failure(self) -> HostWeightFailure | None:
        """Why the verification DENIED the artifact or FAILED; None otherwise."""
        return self._failure

    @property
    def elapsed_s(self) -> float | None:
        """Seconds the verification ran, once it ended (None while it runs)."""
        return self._seconds if self._done.is_set() else None

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until the verification ended (any state but RUNNING); True when it did. A verification still
        held for its load's end starts now, so the wait cannot outlast a block its own caller is in."""
        if self._held:
            self._release()
        return self._done.wait(timeout)

    def stop(self) -> None:
        """Abandon the verification at its next chunk and wait for the thread (the lease is closing)."""
        with self._start_lock:
            self._stop.set()
            never_started = self._thread.ident is None
        if never_started:  # the lease was withdrawn before it was handed out, or closed while held
            self._finish(VerificationState.ABANDONED)
            self._seconds = 0.0
            self._done.set()
        elif self._thread is not threading.current_thread():
            self._thread.join()

    # ------------------------------------------------------------------ the thread

    def _finish(self, state: VerificationState, problem: HostWeightFailure | None = None) -> None:
        self._failure = problem
        self._state = state

    def _run(self) -> None:
        started = time.monotonic()
        try:
            with contextlib.suppress(OSError, AttributeError):  # this thread only; the serving threads keep theirs
                thread_id = threading.get_native_id()
                nice = os.getpriority(os.PRIO_PROCESS, thread_id)
                os.setpriority(os.PRIO_PROCESS, thread_id, min(_LOWEST_PRIORITY, nice + VERIFIER_NICE_RAISE))
            self._claim_and_verify()
        except Exception as exc:  # never let the verifier take the worker down
            _LOG.exception("background verification of %s... failed unexpectedly", self._key[:16])
            self._finish(
                VerificationState.FAILED,
                failure(
                    ResolutionStage.LOOKUP,
                    FailureCode.IO_ERROR,
                    f"background verification failed unexpectedly ({type(exc).__name__}); nothing was recorded",
                    retryable=True,
                ),
            )
        finally:
            self._seconds = time.monotonic() - started
            if self._state in (VerificationState.VERIFIED, VerificationState.DENIED):
                _telemetry.emit(
                    _telemetry.TelemetryEvent(
                        _telemetry.TelemetryKind.VERIFIED,
                        self._storage_class,
                        nbytes=self.payload_bytes,
                        seconds=self._seconds,
                        ok=self._state is VerificationState.VERIFIED,
                    )
                )
            self._done.set()

    def _claim_and_verify(self) -> None:
        try:
            claim = try_lock(self._layout.verify_lock(self._key), exclusive=True)
        except OSError as exc:
            self._finish(VerificationState.FAILED, read_error(exc, "the verify lock").failure)
            return
        if claim is None:
            self._finish(VerificationState.SKIPPED)  # another process is verifying this artifact now
            return
        try:
            if self._ledger.is_verified(self._key, self._publication_id):
                self._finish(VerificationState.SKIPPED)  # it finished just before we took the claim
                return
            fault_point("verify.claimed")
            try:
                self._verify_payloads()
            except _StoppedError:
                self._finish(VerificationState.ABANDONED)
                return
            except ArtifactReadError as exc:
                self._finish(VerificationState.FAILED, exc.failure)
                return
            except InvalidArtifactError as exc:
                self._deny_artifact(exc.failure)
                return
            try:
                self._ledger.record(self._key, self._publication_id, self.payload_bytes)
            except OSError as exc:
                self._finish(VerificationState.FAILED, read_error(exc, "the verification record").failure)
                return
            self._finish(VerificationState.VERIFIED)
        finally:
            claim.release()

    def _deny_artifact(self, problem: HostWeightFailure) -> None:
        deny_failure = self._deny.write(self._key, problem)
        _LOG.warning(
            "background verification: artifact %s... failed its digests (%s: %s); %s",
            self._key[:16],
            problem.code.value,
            problem.message,
            "it is denied for every later lookup; this worker keeps serving the bytes it already mapped"
            if deny_failure is None
            else f"but its deny marker could not be written ({deny_failure.message})",
        )
        if deny_failure is None:
            self._finish(VerificationState.DENIED, problem)
        else:
            self._finish(VerificationState.FAILED, deny_failure)

    def _verify_payloads(self) -> None:
        """Re-hash every payload file (header and tensors) and compare with the manifest, or raise."""
        check_content_digest(self._manifest)
        artifact_dir = self._layout.artifact_dir(self._key)
        try:
            dir_fd = os.open(artifact_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.ENOENT):
                raise InvalidArtifactError(
                    failure(ResolutionStage.LOOKUP, FailureCode.PAYLOAD_INVALID, f"{artifact_dir} is not a directory")
                ) from None
            raise read_error(exc, str(artifact_dir)) from exc
        try:
            for entry in self._manifest.files:
                self._verify_file(dir_fd, entry)
        finally:
            os.close(dir_fd)

    def _verify_file(self, dir_fd: int, entry: FileManifestEntry) -> None:
        fd, info = open_member(dir_fd, entry.name)
        try:
            if (info.st_dev, info.st_ino) != self._inodes.get(entry.name):
                raise _mismatch(
                    FailureCode.PAYLOAD_INVALID,
                    f"{entry.name} is no longer the file the lease mapped; something replaced a published file",
                    entry.name,
                )
            if info.st_size != entry.size:
                raise _mismatch(
                    FailureCode.PAYLOAD_INVALID,
                    f"{entry.name} is {info.st_size} bytes; the manifest says {entry.size}",
                    entry.name,
                )
            header = self._digest_range(fd, 0, entry.header_size, entry.name)
            tensor_digests = []
            for name in entry.tensors:
                tensor = self._manifest.tensor(name)
                begin, end = tensor.data_offsets
                digest = self._digest_range(fd, entry.header_size + begin, end - begin, entry.name)
                if digest != tensor.digest:
                    raise _mismatch(
                        FailureCode.CHECKSUM_MISMATCH,
                        f"tensor {name} in {entry.name} does not match its recorded digest",
                        entry.name,
                    )
                tensor_digests.append(digest)
            if file_digest(header, tensor_digests) != entry.digest:
                raise _mismatch(
                    FailureCode.CHECKSUM_MISMATCH, f"{entry.name} does not match its recorded digest", entry.name
                )
        finally:
            os.close(fd)

    def _digest_range(self, fd: int, offset: int, length: int, name: str) -> str:
        """Tree digest of `length` bytes at `offset`, read chunk by chunk (a short read means truncation)."""
        chunk_bytes = self._manifest.digest_chunk_bytes
        hasher = TreeHasher(chunk_bytes, DigestAlgorithm.from_name(self._manifest.digest_algorithm))
        position, end = offset, offset + length
        while position < end:
            if self._stop.is_set():
                raise _StoppedError
            try:
                fault_point("verify.read")
                data = os.pread(fd, min(chunk_bytes, end - position), position)
            except OSError as exc:
                raise read_error(exc, name) from exc
            if not data:
                raise _mismatch(FailureCode.PAYLOAD_INVALID, f"{name} is shorter than the manifest says", name)
            hasher.update(data)
            position += len(data)
            self.payload_bytes += len(data)
        return hasher.hexdigest()


def _mismatch(code: FailureCode, message: str, name: str) -> InvalidArtifactError:
    return InvalidArtifactError(failure(ResolutionStage.LOOKUP, code, f"background verification: {message}", file=name))

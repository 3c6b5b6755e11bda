"""A source file's stat state, and hashing its bytes only while it stays in that state."""

from __future__ import annotations

import hashlib
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from .._faults import fault_point
from ..canonical_json import JsonValue
from ..failures import FailureCode, HostWeightError, ResolutionStage, raise_failure
from ..filesystem import failure_from_os_error

_READ_CHUNK_BYTES = 512 * 1024  # read into a buffer that stays in the core's cache while it is hashed


@dataclass(frozen=True, slots=True)
class FileState:
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
    def of(cls, path: Path) -> FileState:
        """Stat `path`, following symlinks (the state is the target's)."""
        return cls.from_stat(os.stat(path))

    @classmethod
    def from_stat(cls, info: os.stat_result) -> FileState:
        return cls(info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns)

    def to_dict(self) -> dict[str, JsonValue]:
        return {
            "device": self.device,
            "inode": self.inode,
            "size": self.size,
            "mtime_ns": self.mtime_ns,
            "ctime_ns": self.ctime_ns,
        }

    def differences(self, other: FileState) -> list[str]:
        """Names of the fields that differ, for messages."""
        return [
            name
            for name in ("device", "inode", "size", "mtime_ns", "ctime_ns")
            if getattr(self, name) != getattr(other, name)
        ]


def source_changed(path: Path, what: str, **details: JsonValue) -> HostWeightError:
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


def stat_source(path: Path, missing: str) -> FileState:
    """The file's state; a missing file is CANONICAL_SOURCE_FAILED, other OS errors are typed."""
    try:
        return FileState.of(path)
    except FileNotFoundError as exc:
        raise source_changed(path, missing) from exc
    except OSError as exc:
        raise HostWeightError(
            failure_from_os_error(exc, stage=ResolutionStage.CANONICAL, what=f"checking weight file {path}")
        ) from exc


def check_state(path: Path, expected: FileState) -> None:
    """Raise CANONICAL_SOURCE_FAILED unless `path` still has state `expected`."""
    current = stat_source(path, "disappeared")
    if current != expected:
        raise source_changed(path, "changed", changed_fields=list(expected.differences(current)))


def hash_file(path: Path, state: FileState) -> str:
    """SHA-256 of the file's bytes, refusing a file whose state differs from `state` before or after."""
    try:
        # O_NONBLOCK: a FIFO planted at the path must not block the load; regular files ignore it.
        with open(os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC), "rb", buffering=0) as stream:
            info = os.fstat(stream.fileno())
            if not stat.S_ISREG(info.st_mode):
                raise source_changed(path, "is not a regular file")
            opened = FileState.from_stat(info)
            if opened != state:
                raise source_changed(path, "changed", changed_fields=list(state.differences(opened)))
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
            after = FileState.from_stat(os.fstat(stream.fileno()))
    except FileNotFoundError as exc:
        raise source_changed(path, "disappeared") from exc
    except OSError as exc:
        raise HostWeightError(
            failure_from_os_error(exc, stage=ResolutionStage.CANONICAL, what=f"reading weight file {path}")
        ) from exc
    if after != state or total != state.size:
        raise source_changed(path, "was modified", changed_fields=list(state.differences(after)))
    check_state(path, state)  # the name may now point at a different file
    return f"sha256:{hasher.hexdigest()}"

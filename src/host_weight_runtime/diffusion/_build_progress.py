"""How far a background publication got, so a worker that arrives meanwhile can take whichever is sooner.

    <root>/publishing-v1/<key>.json   canonical JSON: bytes streamed, bytes in all, seconds streaming so far,
                                      and the seconds the publishing worker's own canonical load took

The record is advisory and disposable: it is written by the thread that holds the key's build
lock, removed when that build ends, and read only while the build lock is held, so a record a
killed builder left behind is ignored (or overwritten by the next builder). The arriving
worker's rule (`arrival_choice`) is deterministic in what the record says.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import math
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from .._faults import fault_point
from ..canonical_json import decode_json, encode_canonical
from ..filesystem import DomainLayout, read_small_file, write_file_atomic
from ..filesystem.locks import lock_in_use

__all__ = ["ArrivalChoice", "BuildProgress", "ProgressRecorder", "arrival_choice", "read_progress"]

_LOG = logging.getLogger(__name__)

_RECORD_DIR = "publishing-v1"
_SCHEMA = "hwr-build-progress-v1"
_RECORD_LIMIT_BYTES = 4096
_STEPS = 8
"""The record is rewritten each time another eighth of the bytes is streamed (and at the start and the end)."""


class ArrivalChoice(str, enum.Enum):
    """What a worker whose lookup missed does about a build of the same key."""

    NO_BUILD = "no_build"  # nobody builds this key now: load canonically and publish behind, as a first worker
    WAIT = "wait"  # the build in flight will end sooner than a canonical load: wait for it and serve the artifact
    CANONICAL = "canonical"  # a canonical load is sooner: load canonically, leave the publication to its builder


@dataclass(frozen=True, slots=True)
class BuildProgress:
    """One record: `done_bytes` of `total_bytes` streamed in `streaming_s`; the builder's canonical load took
    `canonical_s` (None when unknown)."""

    done_bytes: int
    total_bytes: int
    streaming_s: float
    canonical_s: float | None

    @property
    def remaining_s(self) -> float:
        """The streaming still to do at the rate so far (infinite before the first byte); 0 once all is streamed."""
        if self.done_bytes >= self.total_bytes:
            return 0.0
        if self.done_bytes <= 0:
            return math.inf
        return self.streaming_s * (self.total_bytes - self.done_bytes) / self.done_bytes


def _record_path(root: Path, key: str) -> Path:
    return root / _RECORD_DIR / f"{key}.json"


def read_progress(root: Path, key: str) -> BuildProgress | None:
    """The record of `key`'s build, or None when there is none or it cannot be read (it is advisory)."""
    try:
        body = decode_json(read_small_file(_record_path(root, key), _RECORD_LIMIT_BYTES))
        if not isinstance(body, dict) or body.get("schema") != _SCHEMA:
            return None
        done, total, streaming, canonical = (
            body["done_bytes"],
            body["total_bytes"],
            body["streaming_s"],
            body["canonical_s"],
        )
        numbers = (int, float)
        if not (isinstance(done, int) and isinstance(total, int) and isinstance(streaming, numbers)):
            return None
        if canonical is not None and not isinstance(canonical, numbers):
            return None
        return BuildProgress(done, total, float(streaming), None if canonical is None else float(canonical))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def arrival_choice(root: Path, key: str) -> ArrivalChoice:
    """The arriving worker's rule: wait only for a build whose record says it ends before a canonical load would.

    No build lock held: NO_BUILD. Held: WAIT when the record's projected remaining streaming time
    is shorter than the canonical load its builder measured for the same checkpoint (all bytes
    streamed: always WAIT); CANONICAL otherwise, and when there is no readable record yet.
    """
    try:
        building = lock_in_use(DomainLayout(root).build_lock(key))
    except OSError as exc:
        _LOG.debug("cannot tell whether %s... is being built (%s); loading canonically", key[:16], exc)
        return ArrivalChoice.CANONICAL
    if not building:
        return ArrivalChoice.NO_BUILD
    progress = read_progress(root, key)
    if progress is None:
        return ArrivalChoice.CANONICAL
    if progress.remaining_s == 0.0:
        return ArrivalChoice.WAIT
    if progress.canonical_s is not None and progress.remaining_s < progress.canonical_s:
        return ArrivalChoice.WAIT
    return ArrivalChoice.CANONICAL


class ProgressRecorder:
    """The producer's progress callback that keeps `key`'s record current; `close()` removes the record."""

    __slots__ = ("_canonical_s", "_guard", "_next_step", "_path", "_started", "_wrote")

    def __init__(self, root: Path, key: str, canonical_s: float | None) -> None:
        self._path = _record_path(root, key)
        self._canonical_s = canonical_s
        self._guard = threading.Lock()
        self._started: float | None = None
        self._next_step = 0
        self._wrote = False

    def __call__(self, done: int, total: int) -> None:
        with self._guard:
            now = time.monotonic()
            if self._started is None:
                self._started = now
            if total > 0 and done < total and done * _STEPS < self._next_step * total:
                return
            self._next_step = (done * _STEPS) // max(total, 1) + 1
            body = {
                "schema": _SCHEMA,
                "done_bytes": done,
                "total_bytes": total,
                "streaming_s": now - self._started,
                "canonical_s": self._canonical_s,
            }
            try:
                self._path.parent.mkdir(mode=0o755, exist_ok=True)
                write_file_atomic(self._path, encode_canonical(body))
                self._wrote = True
            except OSError as exc:
                _LOG.debug("no build progress record (%s)", exc)
                return
        fault_point("build_progress.recorded")

    def close(self) -> None:
        """Remove the record this builder wrote (a build that found the artifact wrote none, and removes none)."""
        with self._guard:
            if self._wrote:
                with contextlib.suppress(OSError):
                    self._path.unlink()

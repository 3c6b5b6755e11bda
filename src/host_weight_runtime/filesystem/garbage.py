"""Garbage collection of a domain: plan what to free, then free exactly that plan.

`plan` only reads. It selects unleased artifacts (least recently used first until the
store fits `max_bytes`, and any unused for longer than `older_than_s`), deny markers
whose artifact is gone, quarantined copies older than their retention, and the
leftovers of builds whose process is dead (and whose build lock is free) or of
interrupted removals. Leased artifacts and live builds are listed as kept, never planned.

`execute` takes the domain's capacity lock (so it never races a build's reservation)
and removes each planned item only if it is still what was planned: an artifact must
still be the same directory and its exclusive lock must be free *now*; nothing waits
on a lease. Removal of an artifact is the evictor's crash-safe move-then-delete.
"""

from __future__ import annotations

import enum
import os
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..canonical_json import JsonValue
from ..failures import HostWeightError, HostWeightFailure, ResolutionStage
from ._eviction import Evictor
from ._fsutil import failure_from_os_error, fsync_dir, list_names, remove_tree, tree_bytes
from ._layout import EVICTING_PREFIX, DomainLayout, is_key
from ._usage import LockTable
from .capacity import CapacityGuard
from .locks import FileLock, acquire_lock, lock_in_use, try_lock

__all__ = [
    "DEFAULT_QUARANTINE_RETENTION_S",
    "GcItem",
    "GcItemKind",
    "GcItemResult",
    "GcItemStatus",
    "GcKept",
    "GcKeepReason",
    "GcPlan",
    "GcReason",
    "GcResult",
    "GarbageCollector",
]

DEFAULT_QUARANTINE_RETENTION_S = 24 * 3600.0
_REMOVING_MARKER = ".removing."


class GcItemKind(str, enum.Enum):
    ARTIFACT = "artifact"
    DENY_MARKER = "deny_marker"
    QUARANTINED = "quarantined"
    LEFTOVER = "leftover"


class GcReason(str, enum.Enum):
    """Why an item is in the plan."""

    LEAST_RECENTLY_USED = "least_recently_used"  # the store is above max_bytes
    UNUSED = "unused"  # not leased for longer than older_than
    STALE_DENY = "stale_deny"  # a deny marker whose artifact is gone
    OLD_QUARANTINE = "old_quarantine"
    DEAD_BUILDER = "dead_builder"  # a build whose process is gone
    INTERRUPTED_REMOVAL = "interrupted_removal"  # an eviction or cleanup that crashed after the move


class GcKeepReason(str, enum.Enum):
    LEASED = "leased"
    ACTIVE_BUILD = "active_build"


@dataclass(frozen=True, slots=True)
class GcItem:
    """One thing the plan removes; `inode` pins an artifact to the directory that was planned."""

    kind: GcItemKind
    reason: GcReason
    key: str
    path: str
    size_bytes: int
    last_used_ns: int | None = None
    inode: int = 0

    def to_dict(self) -> dict[str, JsonValue]:
        return {
            "kind": self.kind.value,
            "reason": self.reason.value,
            "key": self.key,
            "path": self.path,
            "size_bytes": self.size_bytes,
            "last_used_ns": self.last_used_ns,
        }


@dataclass(frozen=True, slots=True)
class GcKept:
    """An artifact or build the criteria would have removed, kept because it is in use."""

    key: str
    path: str
    size_bytes: int
    reason: GcKeepReason

    def to_dict(self) -> dict[str, JsonValue]:
        return {"key": self.key, "path": self.path, "size_bytes": self.size_bytes, "reason": self.reason.value}


@dataclass(frozen=True, slots=True)
class GcPlan:
    """What `execute` will remove, in order, and what it keeps because it is in use."""

    root: str
    store_bytes: int
    max_bytes: int | None
    older_than_s: float | None
    quarantine_older_than_s: float
    planned_at_ns: int
    items: tuple[GcItem, ...]
    kept: tuple[GcKept, ...] = ()

    @property
    def bytes_to_free(self) -> int:
        return sum(item.size_bytes for item in self.items)

    def to_dict(self) -> dict[str, JsonValue]:
        return {
            "root": self.root,
            "store_bytes": self.store_bytes,
            "max_bytes": self.max_bytes,
            "older_than_s": self.older_than_s,
            "quarantine_older_than_s": self.quarantine_older_than_s,
            "planned_at_ns": self.planned_at_ns,
            "bytes_to_free": self.bytes_to_free,
            "items": [item.to_dict() for item in self.items],
            "kept": [kept.to_dict() for kept in self.kept],
        }


class GcItemStatus(str, enum.Enum):
    REMOVED = "removed"
    LEASED = "leased"  # a lease appeared since planning; kept
    ACTIVE_BUILD = "active_build"  # a build holds the key now; kept
    CHANGED = "changed"  # gone, or replaced by a new copy since planning; not touched
    FAILED = "failed"


@dataclass(frozen=True, slots=True)
class GcItemResult:
    item: GcItem
    status: GcItemStatus
    freed_bytes: int = 0
    failure: HostWeightFailure | None = None

    def to_dict(self) -> dict[str, JsonValue]:
        return {
            **self.item.to_dict(),
            "status": self.status.value,
            "freed_bytes": self.freed_bytes,
            "failure": None if self.failure is None else self.failure.to_dict(),
        }


@dataclass(frozen=True, slots=True)
class GcResult:
    """What executing a plan did, item by item."""

    plan: GcPlan
    results: tuple[GcItemResult, ...] = field(default=())

    @property
    def freed_bytes(self) -> int:
        return sum(result.freed_bytes for result in self.results)

    @property
    def ok(self) -> bool:
        return all(result.status is not GcItemStatus.FAILED for result in self.results)

    def to_dict(self) -> dict[str, JsonValue]:
        return {
            "root": self.plan.root,
            "freed_bytes": self.freed_bytes,
            "planned_bytes": self.plan.bytes_to_free,
            "results": [result.to_dict() for result in self.results],
            "kept": [kept.to_dict() for kept in self.plan.kept],
        }


class GarbageCollector:
    """Plans and executes garbage collection of one domain."""

    __slots__ = ("_capacity", "_evictor", "_layout")

    def __init__(self, layout: DomainLayout, capacity: CapacityGuard, evictor: Evictor) -> None:
        self._layout = layout
        self._capacity = capacity
        self._evictor = evictor

    # ------------------------------------------------------------------ planning

    def plan(
        self,
        *,
        max_bytes: int | None = None,
        older_than_s: float | None = None,
        quarantine_older_than_s: float = DEFAULT_QUARANTINE_RETENTION_S,
    ) -> GcPlan:
        """Read the domain and decide what to remove; changes nothing."""
        if max_bytes is not None and (type(max_bytes) is not int or max_bytes < 0):
            raise ValueError(f"max_bytes must be a non-negative int or None, got {max_bytes!r}")
        for name, value in (("older_than_s", older_than_s), ("quarantine_older_than_s", quarantine_older_than_s)):
            if value is not None and (type(value) not in (int, float) or not value >= 0):
                raise ValueError(f"{name} must be a non-negative number of seconds, got {value!r}")
        now_ns = time.time_ns()
        store_bytes = self._capacity.store_bytes()
        items: list[GcItem] = []
        kept: list[GcKept] = []
        self._plan_leftovers(items, kept)
        self._plan_quarantine(items, now_ns, quarantine_older_than_s)
        self._plan_deny_markers(items)
        self._plan_artifacts(
            items, kept, store_bytes=store_bytes, now_ns=now_ns, max_bytes=max_bytes, older_than_s=older_than_s
        )
        return GcPlan(
            root=str(self._layout.root),
            store_bytes=store_bytes,
            max_bytes=max_bytes,
            older_than_s=older_than_s,
            quarantine_older_than_s=quarantine_older_than_s,
            planned_at_ns=now_ns,
            items=tuple(items),
            kept=tuple(kept),
        )

    def _plan_leftovers(self, items: list[GcItem], kept: list[GcKept]) -> None:
        for name in sorted(list_names(self._layout.tmp)):
            path = self._layout.tmp / name
            if name.startswith(EVICTING_PREFIX):
                key, reason = name[len(EVICTING_PREFIX) :].split(".", 1)[0], GcReason.INTERRUPTED_REMOVAL
            elif _REMOVING_MARKER in name:
                key, reason = name.split(".", 1)[0], GcReason.INTERRUPTED_REMOVAL
                if is_key(key) and lock_in_use(self._layout.build_lock(key)):
                    kept.append(GcKept(key, str(path), _size(path), GcKeepReason.ACTIVE_BUILD))
                    continue
            else:
                key, _, rest = name.partition(".")
                pid_text = rest.split(".", 1)[0]
                if not is_key(key) or not pid_text.isdigit():
                    continue  # not ours: leave it alone
                if _alive(int(pid_text)) or lock_in_use(self._layout.build_lock(key)):
                    kept.append(GcKept(key, str(path), _size(path), GcKeepReason.ACTIVE_BUILD))
                    continue
                reason = GcReason.DEAD_BUILDER
            items.append(GcItem(GcItemKind.LEFTOVER, reason, key, str(path), _size(path)))

    def _plan_quarantine(self, items: list[GcItem], now_ns: int, retention_s: float) -> None:
        for name in sorted(list_names(self._layout.quarantine)):
            path = self._layout.quarantine / name
            moved_ns = _quarantined_at_ns(name, path)
            if moved_ns is None or now_ns - moved_ns < retention_s * 1e9:
                continue
            items.append(
                GcItem(GcItemKind.QUARANTINED, GcReason.OLD_QUARANTINE, name.split(".", 1)[0], str(path), _size(path))
            )

    def _plan_deny_markers(self, items: list[GcItem]) -> None:
        for name in sorted(list_names(self._layout.deny)):
            key = name.removesuffix(".json")
            if not name.endswith(".json") or not is_key(key):
                continue
            if os.path.lexists(self._layout.artifact_dir(key)):
                continue
            path = self._layout.deny_marker(key)
            items.append(GcItem(GcItemKind.DENY_MARKER, GcReason.STALE_DENY, key, str(path), _size(path)))

    def _plan_artifacts(
        self,
        items: list[GcItem],
        kept: list[GcKept],
        *,
        store_bytes: int,
        now_ns: int,
        max_bytes: int | None,
        older_than_s: float | None,
    ) -> None:
        if max_bytes is None and older_than_s is None:
            return
        projected = store_bytes - sum(item.size_bytes for item in items if item.kind is not GcItemKind.DENY_MARKER)
        locks = LockTable.read()
        for candidate in self._evictor.candidates():
            over_limit = max_bytes is not None and projected > max_bytes
            unused = older_than_s is not None and now_ns - candidate.last_used_ns > older_than_s * 1e9
            if not (over_limit or unused):
                continue
            artifact_dir = self._layout.artifact_dir(candidate.key)
            try:
                inode = os.stat(artifact_dir, follow_symlinks=False).st_ino
                size = tree_bytes(artifact_dir)
            except FileNotFoundError:
                continue
            if locks.live_leases(self._layout.artifact_lock(candidate.key)):
                kept.append(GcKept(candidate.key, str(artifact_dir), size, GcKeepReason.LEASED))
                continue
            reason = GcReason.LEAST_RECENTLY_USED if over_limit else GcReason.UNUSED
            path = str(artifact_dir)
            items.append(GcItem(GcItemKind.ARTIFACT, reason, candidate.key, path, size, candidate.last_used_ns, inode))
            projected -= size

    # ------------------------------------------------------------------ execution

    def execute(self, plan: GcPlan, *, deadline: float | None = None) -> GcResult:
        """Remove every planned item that is still as planned; a lease or build that appeared keeps its item."""
        if plan.root != str(self._layout.root):
            raise ValueError(f"this plan is for the domain at {plan.root}, not {self._layout.root}")
        capacity_lock = acquire_lock(
            self._layout.capacity_lock,
            exclusive=True,
            deadline=deadline,
            stage=ResolutionStage.CLEANUP,
            what="the domain's capacity lock (a build is reserving space)",
        )
        try:
            return GcResult(plan, tuple(self._execute_item(item) for item in plan.items))
        finally:
            capacity_lock.release()

    def _execute_item(self, item: GcItem) -> GcItemResult:
        try:
            if item.kind is GcItemKind.ARTIFACT:
                return self._remove_artifact(item)
            if item.kind is GcItemKind.DENY_MARKER:
                return self._remove_deny_marker(item)
            if item.kind is GcItemKind.QUARANTINED:
                return self._remove_path(item)
            return self._remove_leftover(item)
        except HostWeightError as exc:
            return GcItemResult(item, GcItemStatus.FAILED, failure=exc.failure)
        except OSError as exc:
            problem = failure_from_os_error(exc, stage=ResolutionStage.CLEANUP, what=f"removing {item.path}")
            return GcItemResult(item, GcItemStatus.FAILED, failure=problem)

    def _remove_artifact(self, item: GcItem) -> GcItemResult:
        freed = self._evictor.evict(item.key, expected_inode=item.inode)
        if freed is not None:
            return GcItemResult(item, GcItemStatus.REMOVED, freed)
        try:
            inode = os.stat(item.path, follow_symlinks=False).st_ino
        except FileNotFoundError:
            return GcItemResult(item, GcItemStatus.CHANGED)
        if inode != item.inode:
            return GcItemResult(item, GcItemStatus.CHANGED)
        return GcItemResult(item, GcItemStatus.LEASED)

    def _remove_deny_marker(self, item: GcItem) -> GcItemResult:
        build_lock = try_lock(self._layout.build_lock(item.key), exclusive=True)
        if build_lock is None:
            return GcItemResult(item, GcItemStatus.ACTIVE_BUILD)
        try:
            if os.path.lexists(self._layout.artifact_dir(item.key)):
                return GcItemResult(item, GcItemStatus.CHANGED)
            try:
                os.unlink(item.path)
            except FileNotFoundError:
                return GcItemResult(item, GcItemStatus.CHANGED)
            fsync_dir(self._layout.deny)
            return GcItemResult(item, GcItemStatus.REMOVED, item.size_bytes)
        finally:
            build_lock.release()

    def _remove_leftover(self, item: GcItem) -> GcItemResult:
        if item.reason is GcReason.INTERRUPTED_REMOVAL and os.path.basename(item.path).startswith(EVICTING_PREFIX):
            return self._remove_path(item)  # evictors hold the capacity lock, which we hold
        build_lock: FileLock | None = None
        if is_key(item.key):
            build_lock = try_lock(self._layout.build_lock(item.key), exclusive=True)
            if build_lock is None:
                return GcItemResult(item, GcItemStatus.ACTIVE_BUILD)
        try:
            return self._remove_path(item)
        finally:
            if build_lock is not None:
                build_lock.release()

    @staticmethod
    def _remove_path(item: GcItem) -> GcItemResult:
        path = Path(item.path)
        if not os.path.lexists(path):
            return GcItemResult(item, GcItemStatus.CHANGED)
        size = _size(path)
        remove_tree(path)
        return GcItemResult(item, GcItemStatus.REMOVED, size)


def _size(path: Path) -> int:
    """Bytes of a file or a directory tree; 0 when it is gone."""
    try:
        info = path.lstat()
    except FileNotFoundError:
        return 0
    return tree_bytes(path) if stat.S_ISDIR(info.st_mode) else info.st_size


def _alive(pid: int) -> bool:
    """Whether a process with this pid exists (a reused pid counts as alive: we keep, never guess)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _quarantined_at_ns(name: str, path: Path) -> int | None:
    """When a copy was quarantined: the nanosecond stamp in its name (`<key>.<ns>.<rand>`), else its mtime."""
    parts = name.split(".")
    if len(parts) >= 2 and parts[1].isdigit():
        return int(parts[1])
    try:
        return path.lstat().st_mtime_ns
    except FileNotFoundError:
        return None

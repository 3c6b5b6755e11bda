"""Read-only snapshots of a domain and its artifacts, for `hwr inspect` and operators.

Inspection never writes: it does not deny, quarantine or remove anything.
"""

from __future__ import annotations

import datetime
import enum
from dataclasses import dataclass

from ..canonical_json import JsonValue
from ..failures import HostWeightFailure
from .capacity import CapacitySnapshot


class ArtifactState(str, enum.Enum):
    READY = "ready"
    UNVERIFIED = "unverified"
    DENIED = "denied"
    INVALID = "invalid"
    QUARANTINED = "quarantined"
    TEMPORARY = "temporary"
    EVICTING = "evicting"
    MISSING = "missing"


@dataclass(frozen=True, slots=True)
class LockActivity:
    """Whether someone holds a key's build lock or its artifact lock right now."""

    build_active: bool
    lease_active: bool

    def to_dict(self) -> dict[str, JsonValue]:
        return {"build_active": self.build_active, "lease_active": self.lease_active}


@dataclass(frozen=True, slots=True)
class ArtifactInspection:
    """One entry of a domain's inventory.

    `size_bytes` is what the entry occupies on disk; `tensor_bytes` is the tensor data alone, the
    figure `hwr prewarm` prints. The fields after `problem` come from a readable manifest (the
    model's `built_from` record and the identity) and are None when there is none.
    """

    key: str
    state: ArtifactState
    path: str
    size_bytes: int
    locks: LockActivity
    publication_id: str | None = None
    model_id: str | None = None
    tensor_count: int | None = None
    problem: HostWeightFailure | None = None
    last_used_ns: int | None = None
    live_leases: int = 0
    component: str | None = None
    revision: str | None = None
    dtype: str | None = None
    tensor_bytes: int | None = None
    created_at_ns: int | None = None
    source_paths: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, JsonValue]:
        return {
            "key": self.key,
            "state": self.state.value,
            "path": self.path,
            "size_bytes": self.size_bytes,
            "locks": self.locks.to_dict(),
            "publication_id": self.publication_id,
            "model_id": self.model_id,
            "tensor_count": self.tensor_count,
            "problem": None if self.problem is None else self.problem.to_dict(),
            "last_used_ns": self.last_used_ns,
            "live_leases": self.live_leases,
            "component": self.component,
            "revision": self.revision,
            "dtype": self.dtype,
            "tensor_bytes": self.tensor_bytes,
            "created_at_ns": self.created_at_ns,
            "created_at": _iso_time(self.created_at_ns),
            "source_paths": list(self.source_paths),
        }


@dataclass(frozen=True, slots=True)
class DomainUsage:
    """A cheap summary of a domain (no validation, no hashing): what metrics and dashboards show.

    `leased_artifacts` counts published artifacts with at least one live lease; `live_leases`
    counts the leases (shared locks) on them, across every process on the node.
    """

    storage_class: str
    artifacts: int
    leased_artifacts: int
    live_leases: int
    store_bytes: int
    free_bytes: int
    total_bytes: int
    max_store_bytes: int | None
    min_free_bytes: int

    def to_dict(self) -> dict[str, JsonValue]:
        return {
            "storage_class": self.storage_class,
            "artifacts": self.artifacts,
            "leased_artifacts": self.leased_artifacts,
            "live_leases": self.live_leases,
            "store_bytes": self.store_bytes,
            "free_bytes": self.free_bytes,
            "total_bytes": self.total_bytes,
            "max_store_bytes": self.max_store_bytes,
            "min_free_bytes": self.min_free_bytes,
        }


def _iso_time(ns: int | None) -> str | None:
    """UTC ISO 8601 to the second, for JSON readers that want a date rather than nanoseconds."""
    if ns is None:
        return None
    return datetime.datetime.fromtimestamp(ns / 1e9, tz=datetime.timezone.utc).isoformat(timespec="seconds")


@dataclass(frozen=True, slots=True)
class DomainInspection:
    """A domain's identity, filesystem, capacity and inventory."""

    root: str
    domain_id: str
    scope: str
    storage_class: str
    fs_type: str
    huge_pages: str | None
    mount_point: str
    capacity: CapacitySnapshot
    artifacts: tuple[ArtifactInspection, ...]

    def to_dict(self) -> dict[str, JsonValue]:
        policy = self.capacity.policy
        return {
            "root": self.root,
            "domain_id": self.domain_id,
            "scope": self.scope,
            "storage_class": self.storage_class,
            "fs_type": self.fs_type,
            "huge_pages": self.huge_pages,
            "mount_point": self.mount_point,
            "capacity": {
                "total_bytes": self.capacity.total_bytes,
                "free_bytes": self.capacity.free_bytes,
                "store_bytes": self.capacity.store_bytes,
                "is_memory": self.capacity.is_memory,
                "max_artifact_bytes": policy.max_artifact_bytes,
                "max_store_bytes": policy.max_store_bytes,
                "min_free_bytes": policy.min_free_bytes,
            },
            "artifacts": [artifact.to_dict() for artifact in self.artifacts],
        }

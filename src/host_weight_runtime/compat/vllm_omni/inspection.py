"""The reference's read-only inspection records, made from this runtime's inspections."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Protocol

from ...failures import HostWeightFailure
from ...filesystem import inspection as native
from ...identity import WeightArtifactIdentity
from ...outcomes import StoreStatus
from .config import ValidationLevel
from .manifest import WeightManifest

__all__ = [
    "ArtifactInspection",
    "ArtifactInventoryEntry",
    "ArtifactInventoryState",
    "DomainInspection",
    "HostWeightInspector",
    "inventory_entry_of",
]


class ArtifactInventoryState(str, enum.Enum):
    READY = "ready"
    DENIED = "denied"
    QUARANTINED = "quarantined"
    TEMPORARY = "temporary"


@dataclass(frozen=True)
class ArtifactInventoryEntry:
    artifact_key: str
    state: ArtifactInventoryState
    storage_name: str
    size_bytes: int
    reason: str | None = None


@dataclass(frozen=True)
class DomainInspection:
    domain_uuid: str
    scope: str
    domain_id: str
    storage_class: str
    filesystem_type: str
    policy_version: int
    store_bytes: int
    filesystem_free_bytes: int
    max_artifact_bytes: int | None
    max_store_bytes: int | None
    min_free_bytes: int
    inventory: tuple[ArtifactInventoryEntry, ...]


@dataclass(frozen=True)
class ArtifactInspection:
    artifact_key: str
    status: StoreStatus
    size_bytes: int
    manifest: WeightManifest | None
    publication_id: str | None
    backing_fingerprint: str | None
    failure: HostWeightFailure | None
    build_lock_active: bool
    artifact_lock_active: bool


class HostWeightInspector(Protocol):
    def inspect_domain(self) -> DomainInspection: ...

    def inspect_artifact(
        self, identity: WeightArtifactIdentity, *, validation: ValidationLevel
    ) -> ArtifactInspection: ...


# This runtime's finer states, in the reference's four (an unverified or evicting entry is still there, ready).
_STATES = {
    native.ArtifactState.READY: ArtifactInventoryState.READY,
    native.ArtifactState.UNVERIFIED: ArtifactInventoryState.READY,
    native.ArtifactState.EVICTING: ArtifactInventoryState.READY,
    native.ArtifactState.DENIED: ArtifactInventoryState.DENIED,
    native.ArtifactState.INVALID: ArtifactInventoryState.DENIED,
    native.ArtifactState.QUARANTINED: ArtifactInventoryState.QUARANTINED,
    native.ArtifactState.TEMPORARY: ArtifactInventoryState.TEMPORARY,
}


def inventory_entry_of(entry: native.ArtifactInspection) -> ArtifactInventoryEntry | None:
    state = _STATES.get(entry.state)
    if state is None:
        return None
    reason = None if entry.problem is None else entry.problem.code.value
    return ArtifactInventoryEntry(entry.key, state, entry.path.rsplit("/", 1)[-1], entry.size_bytes, reason)

"""Results as values: what a store returned, what the runtime decided, and why."""

from __future__ import annotations

import enum
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .canonical_json import JsonValue
from .failures import HostWeightFailure, ResolutionStage
from .identity import WeightArtifactIdentity

if TYPE_CHECKING:
    from .lease import HostWeightLease


def new_resolution_id() -> str:
    """A fresh id for one resolve or publication call (32 lowercase hex characters)."""
    return uuid.uuid4().hex


class StoreStatus(str, enum.Enum):
    """What one store call found or did."""

    HIT = "hit"
    MISS = "miss"
    BUILT = "built"
    JOINED = "joined"
    INVALID = "invalid"
    TIMEOUT = "timeout"  # a lock wait ran out; carries a (retryable) failure and is decided like FAILED
    FAILED = "failed"


@dataclass(frozen=True, slots=True)
class StoreResult:
    """A store call's outcome. HIT, BUILT and JOINED carry a lease the caller must close."""

    status: StoreStatus
    identity: WeightArtifactIdentity
    lease: HostWeightLease | None = None
    failure: HostWeightFailure | None = None
    publication_id: str | None = None
    elapsed_s: float = 0.0

    def __post_init__(self) -> None:
        has_lease = self.status in (StoreStatus.HIT, StoreStatus.BUILT, StoreStatus.JOINED)
        if has_lease != (self.lease is not None):
            raise ValueError(f"StoreResult {self.status.value} {'needs' if has_lease else 'cannot carry'} a lease")
        needs_failure = self.status in (StoreStatus.INVALID, StoreStatus.TIMEOUT, StoreStatus.FAILED)
        if needs_failure and self.failure is None:
            raise ValueError(f"StoreResult {self.status.value} needs a failure")

    @property
    def ok(self) -> bool:
        return self.lease is not None


class CleanupStatus(str, enum.Enum):
    """REMOVED (or PLANNED in a dry run), NOT_PRESENT, or why nothing was removed."""

    REMOVED = "removed"
    PLANNED = "planned"
    NOT_PRESENT = "not_present"
    ACTIVE_BUILD = "active_build"
    ACTIVE_LEASE = "active_lease"
    FAILED = "failed"


@dataclass(frozen=True, slots=True)
class CleanupResult:
    """What cleanup did for one key; it never waits for a lock."""

    key: str
    status: CleanupStatus
    removed_bytes: int = 0
    removed_paths: tuple[str, ...] = ()
    dry_run: bool = False
    failure: HostWeightFailure | None = None

    def to_dict(self) -> dict[str, JsonValue]:
        return {
            "key": self.key,
            "status": self.status.value,
            "removed_bytes": self.removed_bytes,
            "removed_paths": list(self.removed_paths),
            "dry_run": self.dry_run,
            "failure": None if self.failure is None else self.failure.to_dict(),
        }


class ResolutionOutcome(str, enum.Enum):
    """The single terminal outcome of one `HostWeightRuntime.resolve` call."""

    CANONICAL_DIRECT = "canonical_direct"
    LOCAL_HIT = "local_hit"
    REMOTE_IMPORT = "remote_import"
    LOCAL_PRODUCTION = "local_production"
    CANONICAL_FALLBACK = "canonical_fallback"
    FAILED = "failed"


class AttemptResult(str, enum.Enum):
    HIT = "hit"
    MISS = "miss"
    BUILT = "built"
    JOINED = "joined"
    INVALID = "invalid"
    FAILED = "failed"
    SKIPPED = "skipped"


class AttemptAction(str, enum.Enum):
    """What the runtime did after an attempt."""

    USE = "use"
    CONTINUE = "continue"
    FALL_BACK = "fall_back"
    FAIL = "fail"


@dataclass(frozen=True, slots=True)
class ResolutionAttempt:
    """One stage tried during a resolve."""

    stage: ResolutionStage
    result: AttemptResult
    action: AttemptAction
    elapsed_s: float
    failure: HostWeightFailure | None = None
    detail: str = ""

    @property
    def elapsed_seconds(self) -> float:
        return self.elapsed_s

    def to_dict(self) -> dict[str, JsonValue]:
        return {
            "stage": self.stage.value,
            "result": self.result.value,
            "action": self.action.value,
            "elapsed_s": self.elapsed_s,
            "failure": None if self.failure is None else self.failure.to_dict(),
            "detail": self.detail,
        }


@dataclass(frozen=True, slots=True)
class ResolutionReport:
    """Exactly one per resolve: the outcome, every attempt, and the failure if any."""

    identity_key: str
    mode: str
    outcome: ResolutionOutcome
    attempts: tuple[ResolutionAttempt, ...]
    elapsed_s: float
    failure: HostWeightFailure | None = None
    publication_id: str | None = None
    resolution_id: str = field(default_factory=new_resolution_id)
    """Unique per resolve: joins this report to logs, metrics and the lease it handed out."""

    @property
    def elapsed_seconds(self) -> float:
        return self.elapsed_s

    def to_dict(self) -> dict[str, JsonValue]:
        return {
            "resolution_id": self.resolution_id,
            "identity_key": self.identity_key,
            "mode": self.mode,
            "outcome": self.outcome.value,
            "attempts": [attempt.to_dict() for attempt in self.attempts],
            "elapsed_s": self.elapsed_s,
            "failure": None if self.failure is None else self.failure.to_dict(),
            "publication_id": self.publication_id,
        }


@dataclass(frozen=True, slots=True)
class HostWeightResolution:
    """A resolve's report, and the lease when the outcome provides one."""

    report: ResolutionReport
    lease: HostWeightLease | None = None

    @property
    def outcome(self) -> ResolutionOutcome:
        return self.report.outcome


class PostLoadPublicationStatus(str, enum.Enum):
    PUBLISHED = "published"
    ALREADY_PRESENT = "already_present"
    JOINED = "joined"
    FAILED = "failed"
    POLICY_DISABLED = "policy_disabled"
    RUNTIME_DISABLED = "runtime_disabled"


@dataclass(frozen=True, slots=True)
class PostLoadPublicationReport:
    """What publishing a loaded model's weights did; never raised, always reported."""

    identity_key: str
    status: PostLoadPublicationStatus
    elapsed_s: float
    failure: HostWeightFailure | None = None
    publication_id: str | None = None
    resolution_id: str = field(default_factory=new_resolution_id)
    """Unique per publication call (vLLM-Omni's reference calls it `operation_id`)."""

    @property
    def elapsed_seconds(self) -> float:
        return self.elapsed_s

    def to_dict(self) -> dict[str, JsonValue]:
        return {
            "resolution_id": self.resolution_id,
            "identity_key": self.identity_key,
            "status": self.status.value,
            "elapsed_s": self.elapsed_s,
            "failure": None if self.failure is None else self.failure.to_dict(),
            "publication_id": self.publication_id,
        }

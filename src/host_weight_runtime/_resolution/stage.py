"""What every resolve stage receives (`StageContext`) and returns (`StageOutcome`).

A stage is any callable `ResolveStage`; it never decides policy. It reports what it
found as a verdict (see `decisions`), and the pipeline turns that into an action,
an attempt record and, at the end, the one report.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..config import HostWeightRuntimeConfig
from ..failures import HostWeightFailure, ResolutionStage
from ..identity import WeightArtifactIdentity
from ..lease import HostWeightLease
from ..outcomes import AttemptResult, ResolutionOutcome
from ..protocols import HostWeightStore, RemoteArtifactProvider, WeightProducer
from .decisions import StageVerdict

__all__ = ["ResolveStage", "StageContext", "StageOutcome"]


@dataclass(frozen=True, slots=True)
class StageContext:
    """One resolve's inputs, shared read-only by its stages; the store is already open."""

    identity: WeightArtifactIdentity
    producer: WeightProducer | None
    deadline: float
    config: HostWeightRuntimeConfig
    store: HostWeightStore
    remote_providers: tuple[RemoteArtifactProvider, ...] = ()  # probed in order by the remote stage


@dataclass(frozen=True, slots=True)
class StageOutcome:
    """One stage's typed result: its verdict, what its attempt records, and the lease when it found one.

    Build it with the constructors; `result` is None only for NOT_TRIED (no attempt is
    recorded). `outcome` and `publication_id` come with a lease (verdict USE).
    """

    stage: ResolutionStage
    verdict: StageVerdict
    result: AttemptResult | None
    detail: str
    failure: HostWeightFailure | None = None
    lease: HostWeightLease | None = None
    outcome: ResolutionOutcome | None = None
    publication_id: str | None = None

    @classmethod
    def used(
        cls,
        stage: ResolutionStage,
        result: AttemptResult,
        detail: str,
        *,
        lease: HostWeightLease,
        outcome: ResolutionOutcome,
        publication_id: str,
    ) -> StageOutcome:
        """A validated lease: the resolve ends with it."""
        return cls(stage, StageVerdict.USE, result, detail, None, lease, outcome, publication_id)

    @classmethod
    def found(
        cls,
        stage: ResolutionStage,
        verdict: StageVerdict,
        result: AttemptResult,
        detail: str,
        fail: HostWeightFailure | None = None,
    ) -> StageOutcome:
        """Anything short of a lease: a miss, a skip, a denial, a failure or a rejection."""
        if verdict in (StageVerdict.USE, StageVerdict.NOT_TRIED):
            raise ValueError(f"StageOutcome.found cannot carry verdict {verdict.value}; use used() or not_tried()")
        return cls(stage, verdict, result, detail, fail)

    @classmethod
    def not_tried(cls, stage: ResolutionStage, detail: str) -> StageOutcome:
        """The stage does not apply here; the report lists no attempt for it."""
        return cls(stage, StageVerdict.NOT_TRIED, None, detail)


ResolveStage = Callable[[StageContext], StageOutcome]

"""What a component load reports besides the model: where its weights came from, and what a build produced."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from ..config import RuntimeMode
from ..outcomes import ResolutionAttempt, ResolutionOutcome, ResolutionReport

__all__ = ["ComponentLoadPath", "PrewarmResult", "report_without_lookup"]


class ComponentLoadPath(str, enum.Enum):
    """Where the returned model's weights came from."""

    ARTIFACT = "artifact"
    CANONICAL = "canonical"


@dataclass(frozen=True, slots=True)
class PrewarmResult:
    """What `prewarm_component` built (or found) for a model; a TP rank's result names the plan that split it."""

    identity_key: str
    resolution: ResolutionReport
    total_bytes: int
    tensor_count: int
    tensor_parallel_plan: str | None = None


def report_without_lookup(
    mode: RuntimeMode,
    outcome: ResolutionOutcome,
    attempt: ResolutionAttempt | None = None,
) -> ResolutionReport:
    """The report of a load that did not ask the runtime: no identity key, at most one attempt saying why."""
    return ResolutionReport(
        identity_key="",
        mode=mode.value,
        outcome=outcome,
        attempts=() if attempt is None else (attempt,),
        elapsed_s=0.0 if attempt is None else attempt.elapsed_s,
        failure=None if attempt is None else attempt.failure,
    )

"""Stage 2, remote import: an exact artifact from a remote provider (DESIGN "Next capabilities").

No provider can be configured in this version (the runtime refuses them, S24), so the
stage is never tried and the report lists no attempt for it.
"""

from __future__ import annotations

from ..failures import ResolutionStage
from .stage import StageContext, StageOutcome

__all__ = ["remote_import"]


def remote_import(context: StageContext) -> StageOutcome:
    """Not tried: no remote provider can be configured yet."""
    return StageOutcome.not_tried(ResolutionStage.REMOTE, "no remote provider is configured")

"""One WARNING for every component that loads canonically, naming it and saying why.

A canonical load costs a worker its own copy of the weights (and a cold start's time), so it
must never pass unnoticed: `load_component` and `load_pipeline` call these after deciding.
The logger is `host_weight_runtime.canonical`, so an operator can route or silence it alone.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path

from ..outcomes import AttemptResult, PostLoadPublicationStatus, ResolutionOutcome
from .component_source import ComponentLocation
from .load_reports import ComponentLoadPath
from .loaded import LoadedComponent

__all__ = ["CANONICAL_LOGGER", "canonical_reason", "warn_canonical_records", "warn_if_canonical"]

CANONICAL_LOGGER = "host_weight_runtime.canonical"
_LOG = logging.getLogger(CANONICAL_LOGGER)


def _publication(loaded: LoadedComponent) -> str:
    """What happens to the artifact the next worker needs."""
    if loaded.background_publication is not None:
        return "; its artifact is being built in the background for the next worker"
    publication = loaded.publication
    if publication is None:
        return ""
    if publication.status is PostLoadPublicationStatus.PUBLISHED:
        return "; its artifact is now published for the next worker"
    if publication.status is PostLoadPublicationStatus.POLICY_DISABLED:
        return "; this worker does not publish (HWR_ALLOW_POST_LOAD_PUBLISH=false): a prewarm must build it"
    if publication.failure is not None:
        return f"; publishing its artifact failed too: {publication.failure.message}"
    return f"; publication: {publication.status.value}"


def canonical_reason(loaded: LoadedComponent) -> str:
    """Why this component was loaded canonically, in one sentence an operator can act on."""
    report = loaded.resolution
    if report.outcome is ResolutionOutcome.CANONICAL_DIRECT:
        return "the runtime is DISABLED (HWR_MODE=disabled): no artifact is looked up or published"
    if loaded.identity_failure is not None:
        return f"no final-layout identity could be built: {loaded.identity_failure.message}"
    if loaded.restore_failure is not None:
        return f"its artifact could not be restored: {loaded.restore_failure.message}" + _publication(loaded)
    if report.failure is not None:
        return f"{report.failure.stage.value} failed: {report.failure.message}" + _publication(loaded)
    skipped = [attempt.detail for attempt in report.attempts if attempt.result is AttemptResult.SKIPPED]
    if skipped and skipped[0] and not loaded.identity_key:
        if loaded.background_publication is not None:
            never_identified = "no worker of this node has identified these checkpoint files"
            return f"{never_identified}, so it holds no artifact for them yet" + _publication(loaded)
        return skipped[0]
    return "this node holds no artifact for it yet (a first load)" + _publication(loaded)


def _name(location: ComponentLocation) -> str:
    where = location.name_or_path
    return f"{where} subfolder {location.subfolder}" if location.subfolder else where


def warn_if_canonical(location: ComponentLocation, loaded: LoadedComponent) -> LoadedComponent:
    """Log the WARNING when `loaded` came from the checkpoint rather than an artifact; returns `loaded`."""
    if loaded.load_path is ComponentLoadPath.CANONICAL:
        _LOG.warning("%s loads canonically (%s): %s", _name(location), loaded.outcome.value, canonical_reason(loaded))
    return loaded


def warn_canonical_records(root: Path, records: Iterable[tuple[str, str | None]]) -> None:
    """Log the WARNING for each pipeline component load_pipeline leaves to diffusers: (name, reason)."""
    for name, reason in records:
        _LOG.warning("%s component %s loads canonically (diffusers loads it): %s", root, name, reason)

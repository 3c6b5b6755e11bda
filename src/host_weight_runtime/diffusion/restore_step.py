"""The restore step: fill a component's skeleton from a lease, in place, and let the model keep the lease."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from ..failures import HostWeightError, HostWeightFailure
from ..lease import HostWeightLease
from ..metrics import record_restore
from .dtype_policies import ModelFamilyName
from .family_transformers import restore_from_lease
from .fp8 import FinalLayoutFP8Restorer
from .identity_adapter import FinalLayoutIdentityContext
from .lease_anchor import anchor_lease
from .restorer import FinalLayoutTensorRestorer
from .skeleton import ComponentSkeleton, IdentifiedComponent

__all__ = ["RestoreAttempt", "restore_into_skeleton", "restore_or_fall_back"]

_LOG = logging.getLogger(__name__)


def restore_into_skeleton(
    skeleton: ComponentSkeleton, context: FinalLayoutIdentityContext, lease: HostWeightLease, *, fp8: bool
) -> torch.nn.Module:
    """Plan (mutating nothing), commit once, and anchor the lease on the model; raises HostWeightError.

    A transformers component is validated the same way and then finished by transformers itself from
    the lease's tensors, in place on the same skeleton (checked to hold them without a copy).
    """
    if skeleton.family.family_name is ModelFamilyName.TRANSFORMERS:
        model = restore_from_lease(
            context, skeleton.holder, skeleton.model, lease, source=skeleton.source, dtype=skeleton.options.dtype
        )
        anchor_lease(model, lease)
        return model
    restorer = FinalLayoutFP8Restorer(context) if fp8 else FinalLayoutTensorRestorer(context)
    restorer._plan_on_identity_skeleton(skeleton.holder, lease).commit()
    anchor_lease(skeleton.model, lease)
    return skeleton.model


@dataclass(frozen=True, slots=True)
class RestoreAttempt:
    """A restored model, or why the restore failed (the lease is then closed and the load falls back)."""

    model: torch.nn.Module | None
    failure: HostWeightFailure | None


def restore_or_fall_back(
    identified: IdentifiedComponent, lease: HostWeightLease, *, fp8: bool, required: bool
) -> RestoreAttempt:
    """Restore from the lease, timed for the metrics; a failure raises when `required`, else it is reported."""
    started = time.monotonic()
    try:
        model = restore_into_skeleton(identified.skeleton, identified.context, lease, fp8=fp8)
    except HostWeightError as exc:
        record_restore(time.monotonic() - started, ok=False)
        lease.close()
        if required:
            raise
        _LOG.warning(
            "restoring %s from artifact %s failed (%s); loading canonically",
            identified.skeleton.location.name_or_path,
            identified.context.identity.key,
            exc.failure.message,
        )
        return RestoreAttempt(None, exc.failure)
    record_restore(time.monotonic() - started, ok=True)
    return RestoreAttempt(model, None)

"""Tensor ownership found once per process for each kind of skeleton `prepare_skeleton` builds.

A second load of the same component in one process builds a fresh `meta` skeleton from the same
class and config; walking it again would find the same tensors, dtypes and contracts. The plan is
kept under everything that shapes that skeleton and its final layout: the model class object, the
loader identity (config and weight-transform fingerprints), the parallel layout, the policy (its
type and document), the component name, the declared ties, and the class of every module of the
skeleton in order (so an FP8-quantized or otherwise altered skeleton never matches a plain one).
What is kept is immutable. A restore still checks every lease tensor against it, and the post-restore
validator refuses a model left with any `meta` tensor, so even a plan that did not fit could only
fail typed, never bind wrong tensors.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping

import torch

from ..canonical_json import encode_canonical
from ._kept_plans import KeptPlans
from .contracts import FinalLayoutModelContract, FinalLayoutRequest, FinalLayoutTensorPolicy
from .tensor_layout import TensorOwnership

__all__ = ["OWNERSHIP_PLANS", "OwnershipPlans", "ownership_plan_key"]

OwnershipPlan = tuple[TensorOwnership, tuple[FinalLayoutModelContract, ...]]


def ownership_plan_key(
    model: torch.nn.Module,
    component_name: str,
    request: FinalLayoutRequest,
    policy: FinalLayoutTensorPolicy,
    aliases: Mapping[str, str],
) -> Hashable:
    """Everything that shapes a skeleton's tensor ownership, cheap to compute (no tensor is looked at)."""
    return (
        type(model),
        tuple(type(module) for module in model.modules()),
        component_name,
        request.loader,
        request.parallel,
        type(policy),
        encode_canonical(policy.to_dict()),
        tuple(sorted(aliases.items())),
    )


class OwnershipPlans(KeptPlans[OwnershipPlan]):
    """A small per-process map from `ownership_plan_key` to the ownership and contracts discovered for it."""

    __slots__ = ()

    @property
    def discoveries(self) -> int:
        """How many plans this process discovered (the rest were kept)."""
        return self.misses


OWNERSHIP_PLANS = OwnershipPlans()
"""This process's ownership plans (what a second load of a component skips)."""

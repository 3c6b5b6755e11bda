"""A transformers skeleton's checkpoint bindings, found once per process for each kind of skeleton and checkpoint.

Binding a checkpoint's keys to a transformers model's names needs transformers' conversion mapping,
which it builds for every model type (hundreds of compiled patterns) the first time a process asks:
the largest fixed cost of a warm transformers component. A second load of the same component builds
the same skeleton over the same checkpoint keys, so the bindings are kept under everything they depend
on: the model class, its config (every field), the class of every module in order, the checkpoint's
keys in order, the declared ties, and the conversion mappings registered in this process. What is kept
is immutable; a restore still checks that every owned tensor is the lease's very tensor.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

import torch

__all__ = ["BINDING_PLANS", "BindingPlan", "BindingPlans", "binding_plan_key"]

BindingPlan = tuple[Mapping[str, str], Mapping[str, str]]
"""(model name -> checkpoint key, alias -> owner), both read-only."""

_KEPT = 32


def _registered_mappings() -> tuple[str, ...]:
    from transformers.conversion_mapping import USER_REGISTERED_MAPPINGS

    return tuple(sorted(USER_REGISTERED_MAPPINGS))


def binding_plan_key(model: torch.nn.Module, checkpoint_keys: Sequence[str], ties: Mapping[str, str]) -> Hashable:
    """Everything a skeleton's bindings depend on, cheap to compute (no tensor is looked at)."""
    config: Any = getattr(model, "config", None)
    return (
        type(model),
        None if config is None else config.to_json_string(use_diff=False),
        tuple(type(module) for module in model.modules()),
        tuple(checkpoint_keys),
        tuple(sorted(ties.items())),
        _registered_mappings(),
    )


class BindingPlans:
    """A small per-process map from `binding_plan_key` to the bindings found for it (`computations` counts misses)."""

    __slots__ = ("_guard", "_kept", "_limit", "computations", "hits")

    def __init__(self, limit: int = _KEPT) -> None:
        self._limit = limit
        self._kept: OrderedDict[Hashable, BindingPlan] = OrderedDict()
        self._guard = threading.Lock()
        self.hits = 0
        self.computations = 0

    def plan(self, key: Hashable, compute: Callable[[], tuple[dict[str, str], dict[str, str]]]) -> BindingPlan:
        """The kept bindings for `key`, or `compute()`'s (kept only when it succeeds)."""
        with self._guard:
            found = self._kept.get(key)
            if found is not None:
                self._kept.move_to_end(key)
                self.hits += 1
                return found
        keys, aliases = compute()
        computed: BindingPlan = (MappingProxyType(dict(keys)), MappingProxyType(dict(aliases)))
        with self._guard:
            self.computations += 1
            self._kept[key] = computed
            while len(self._kept) > self._limit:
                self._kept.popitem(last=False)
        return computed

    def clear(self) -> None:
        with self._guard:
            self._kept.clear()


BINDING_PLANS = BindingPlans()
"""This process's transformers checkpoint bindings (what a second load of a component skips)."""

"""A transformers skeleton's checkpoint bindings, found once per process for each kind of skeleton and checkpoint.

Binding a checkpoint's keys to a transformers model's names needs transformers' conversion mapping,
which it builds for every model type (hundreds of compiled patterns) the first time a process asks:
the largest fixed cost of a warm transformers component. A second load of the same component builds
the same skeleton over the same checkpoint keys, so the bindings are kept under everything they depend
on: the model class, its config (every field), the class of every module in order, the checkpoint's
keys in order, the declared ties, and the conversion mappings registered in this process. What is kept
is immutable; a restore still checks that every owned tensor is the lease's very tensor.

The node's workers share them too: `node_binding_key` digests the same facts (with transformers'
version instead of the class object) into the key of a record in the node's source-digest cache,
which the first worker writes and later workers read in place of transformers' mapping. A record is
believed only when it binds exactly the skeleton's tensors to keys the checkpoint holds.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

import torch

from ..canonical_json import JsonValue, canonical_sha256
from ._kept_plans import KeptPlans

__all__ = [
    "BINDING_PLANS",
    "BindingPlan",
    "BindingPlans",
    "binding_plan_key",
    "bindings_from_record",
    "bindings_record",
    "node_binding_key",
]

_RECORD_SCHEMA = "hwr-transformers-bindings-v1"

BindingPlan = tuple[Mapping[str, str], Mapping[str, str]]
"""(model name -> checkpoint key, alias -> owner), both read-only."""


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


def _qualname(cls: type[Any]) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def node_binding_key(model: torch.nn.Module, checkpoint_keys: Sequence[str], ties: Mapping[str, str]) -> str:
    """The SHA-256 hex of everything the bindings depend on, as the key of the node's record of them."""
    import transformers

    config: Any = getattr(model, "config", None)
    document: dict[str, JsonValue] = {
        "schema": _RECORD_SCHEMA,
        "transformers": str(transformers.__version__),
        "class": _qualname(type(model)),
        "config": None if config is None else config.to_json_string(use_diff=False),
        "modules": [_qualname(type(module)) for module in model.modules()],
        "checkpoint_keys": list(checkpoint_keys),
        "ties": [[alias, owner] for alias, owner in sorted(ties.items())],
        "registered": list(_registered_mappings()),
    }
    return canonical_sha256(document)


def bindings_record(keys: Mapping[str, str], aliases: Mapping[str, str]) -> JsonValue:
    return {"keys": dict(keys), "aliases": dict(aliases)}


def _string_map(value: JsonValue) -> dict[str, str] | None:
    if not isinstance(value, dict) or not all(isinstance(item, str) for item in value.values()):
        return None
    return {name: item for name, item in value.items() if isinstance(item, str)}


def bindings_from_record(
    value: JsonValue, model_names: set[str], checkpoint_keys: Sequence[str]
) -> tuple[dict[str, str], dict[str, str]] | None:
    """The recorded bindings when they bind exactly `model_names`, each to a key the checkpoint holds; else None."""
    if not isinstance(value, dict) or set(value) != {"keys", "aliases"}:
        return None
    keys, aliases = _string_map(value["keys"]), _string_map(value["aliases"])
    if keys is None or aliases is None or set(keys) & set(aliases) or set(keys) | set(aliases) != model_names:
        return None
    if not set(keys.values()) <= set(checkpoint_keys) or not set(aliases.values()) <= set(keys):
        return None
    return keys, aliases


class BindingPlans(KeptPlans[BindingPlan]):
    """A small per-process map from `binding_plan_key` to the bindings found for it (`computations` counts misses)."""

    __slots__ = ("renamings",)

    def __init__(self) -> None:
        super().__init__()
        self.renamings = 0
        """How many bindings this process asked transformers' conversion mapping for (the rest: kept or recorded)."""

    @property
    def computations(self) -> int:
        return self.misses

    def count_renaming(self) -> None:
        with self._guard:
            self.renamings += 1

    def bindings(self, key: Hashable, compute: Callable[[], tuple[dict[str, str], dict[str, str]]]) -> BindingPlan:
        """The kept bindings for `key`, or `compute()`'s, read-only (kept only when it succeeds)."""

        def frozen() -> BindingPlan:
            keys, aliases = compute()
            return MappingProxyType(dict(keys)), MappingProxyType(dict(aliases))

        return self.plan(key, frozen)


BINDING_PLANS = BindingPlans()
"""This process's transformers checkpoint bindings (what a second load of a component skips)."""

"""A restored model keeps its lease: the anchor it holds, which also makes `copy.deepcopy` give an owning copy."""

from __future__ import annotations

import copy
import weakref
from collections.abc import Callable
from typing import Any, cast

import torch

from ..lease import HostWeightLease

__all__ = ["LeaseAnchor", "anchor_lease"]

_ANCHOR_ATTRIBUTES = ("__deepcopy__", "_host_weight_lease")


def _no_anchor() -> None:
    """What a pickled anchor becomes: nothing, since an unpickled model owns its tensors."""
    return None


class LeaseAnchor:
    """What a restored model holds, as `_host_weight_lease` and as its own `__deepcopy__`.

    It keeps the lease (and so its shared lock) alive as long as the model lives. `copy.deepcopy`
    looks `__deepcopy__` up on the instance, finds the anchor, and gets a model that owns plain
    tensors and no lease, so closing the lease or removing the artifact never reaches the copy.
    """

    __slots__ = ("_model", "lease")

    def __init__(self, model: torch.nn.Module, lease: HostWeightLease) -> None:
        self.lease = lease
        self._model = weakref.ref(model)  # the model holds the anchor; no cycle keeps either alive

    def __call__(self, memo: dict[int, Any] | None = None) -> torch.nn.Module:
        model = self._model()
        if model is None:
            raise RuntimeError("the model of this lease anchor is gone")
        memo = {} if memo is None else memo
        # Tensor.__deepcopy__ copies a view's whole storage, which for a leased buffer is a whole
        # payload file; compact copies go into the memo first (parameters copy compactly anyway).
        for buffer in model.buffers():
            if id(buffer) not in memo:
                memo[id(buffer)] = buffer.detach().clone().requires_grad_(buffer.requires_grad)
        duplicate: Any = type(model).__new__(type(model))
        memo[id(model)] = duplicate
        state = {name: value for name, value in vars(model).items() if name not in _ANCHOR_ATTRIBUTES}
        duplicate.__setstate__(copy.deepcopy(state, memo))  # nn.Module's: restores __dict__ and hook defaults
        return cast(torch.nn.Module, duplicate)

    def __reduce__(self) -> tuple[Callable[[], None], tuple[()]]:
        return (_no_anchor, ())


def anchor_lease(model: torch.nn.Module, lease: HostWeightLease) -> None:
    """Let the model keep its lease (and lock) alive, and deep-copy into a model of its own."""
    anchor = LeaseAnchor(model, lease)
    for name in _ANCHOR_ATTRIBUTES:
        object.__setattr__(model, name, anchor)

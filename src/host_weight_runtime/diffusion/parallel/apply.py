"""Turn a rank's localized model into a tensor-parallel one with `parallelize_module` (DTensor).

The split parameters already hold this rank's slice (from the artifact or a localized
canonical load), so they are wrapped as `Shard(dim)` DTensors in place and
`parallelize_module` only installs the input/output hooks: nothing is copied or sent.
Split attention modules then run on their rank's heads (attention_heads.py).
"""

from __future__ import annotations

from typing import Any

import torch

from .attention_heads import adapt_attention_heads
from .plan import ShardStyle, TensorParallelPlan

__all__ = ["parallelize_localized"]


def parallelize_localized(model: torch.nn.Module, plan: TensorParallelPlan, mesh: Any) -> None:
    """Wrap every planned Linear's local weight/bias as DTensors on `mesh` and register the TP hooks."""
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    class _Colwise(ColwiseParallel):
        def _partition_linear_fn(self, name: str, module: torch.nn.Module, device_mesh: Any) -> None:
            return None  # weights are already this rank's Shard(0)

    class _Rowwise(RowwiseParallel):
        def _partition_linear_fn(self, name: str, module: torch.nn.Module, device_mesh: Any) -> None:
            return None  # weights are already this rank's Shard(1)

    styles: dict[str, Any] = {}
    for name, module in model.named_modules():
        rule = plan.rule_for(name) if name else None
        if rule is None:
            continue
        colwise = rule.style is ShardStyle.COLWISE
        for attribute, placement in (("weight", Shard(0 if colwise else 1)), ("bias", Shard(0) if colwise else None)):
            local = module._parameters.get(attribute)
            if local is None:
                continue
            placed = DTensor.from_local(
                local.detach(), mesh, [placement if placement is not None else Replicate()], run_check=False
            )
            module._parameters[attribute] = torch.nn.Parameter(placed, requires_grad=False)
        styles[name] = _Colwise() if colwise else _Rowwise()
    parallelize_module(model, mesh, styles)
    adapt_attention_heads(model, plan, mesh)

"""Tensor parallelism for final-layout artifacts: plans, per-rank artifacts, bundles and group cohorts.

Everything that needs `torch.distributed` lives in this package (and is imported lazily);
the core never imports it (C08).
"""

from __future__ import annotations

from .plan import (
    FIRST_CLASS_TENSOR_PARALLEL_PLANS,
    ShardStyle,
    TensorParallelPlan,
    TensorParallelRule,
    TensorShard,
    localize_module,
    plan_for_model,
    register_tensor_parallel_plan,
    resolve_tensor_shards,
)

__all__ = [
    "FIRST_CLASS_TENSOR_PARALLEL_PLANS",
    "ShardStyle",
    "TensorParallelPlan",
    "TensorParallelRule",
    "TensorShard",
    "localize_module",
    "plan_for_model",
    "register_tensor_parallel_plan",
    "resolve_tensor_shards",
]

"""Per-rank final-layout identities: localize the skeleton to one rank's shapes, then key it.

Every rank of a plan has the same local shapes (splits are even), so the identities of all
ranks differ only in the layout's rank and in which slice each split tensor holds (D05).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from ..contracts import FinalLayoutParallelIdentity, FinalLayoutRequest, FinalLayoutTensorPolicy
from ..identity_adapter import FinalLayoutIdentityContext, build_final_layout_identity
from ..source_identity import NodeSourceDigestCache, PreparedWeightSource
from .attention_heads import check_attention_split
from .plan import TensorParallelPlan, localize_module, plan_error, plan_for_model, resolve_tensor_shards

__all__ = ["identify_ranks", "localize_for_rank"]


def localize_for_rank(
    model: torch.nn.Module, parallel: FinalLayoutParallelIdentity, plan: TensorParallelPlan | None = None
) -> TensorParallelPlan:
    """Resolve the model's plan for this rank (typed refusals first) and cut its split parameters in place.

    Without `plan`, the default for the model and this TP size (`plan_for_model`); a given plan is used as it is.
    """
    chosen = plan if plan is not None else plan_for_model(model, parallel.tensor_parallel_size)
    _check_parallel(parallel)
    shards = resolve_tensor_shards(model, chosen, parallel.tensor_parallel_size, parallel.tensor_parallel_rank)
    check_attention_split(model, chosen)
    localize_module(model, shards)
    return chosen


def _check_parallel(parallel: FinalLayoutParallelIdentity) -> None:
    if parallel.sequence_parallel_size > 1:
        raise plan_error("tensor-parallel artifacts do not combine with sequence parallelism yet")


def identify_ranks(
    holder: torch.nn.Module,
    *,
    dit_name: str,
    skeleton: torch.nn.Module,
    prepared_sources: Sequence[PreparedWeightSource],
    request: FinalLayoutRequest,
    policy: FinalLayoutTensorPolicy,
    ranks: Sequence[int],
    source_digest_cache: NodeSourceDigestCache | None = None,
    plan: TensorParallelPlan | None = None,
) -> tuple[FinalLayoutIdentityContext, ...]:
    """The identity context of each listed rank; `skeleton` (full-shaped, on meta) is localized in place.

    The skeleton ends up shaped for any rank (shapes are equal across ranks), ready for restore.
    """
    parallel = request.parallel
    size = parallel.tensor_parallel_size
    if size < 2:
        raise ValueError("identify_ranks needs tensor_parallel_size >= 2")
    _check_parallel(parallel)
    chosen = plan if plan is not None else plan_for_model(skeleton, size)
    shards_by_rank = {rank: resolve_tensor_shards(skeleton, chosen, size, rank) for rank in ranks}
    check_attention_split(skeleton, chosen)
    localize_module(skeleton, shards_by_rank[ranks[0]])
    contexts: list[FinalLayoutIdentityContext] = []
    for rank in ranks:
        rank_request = replace(request, parallel=replace(parallel, tensor_parallel_rank=rank))
        contexts.append(
            build_final_layout_identity(
                holder,
                dit_modules=[(dit_name, skeleton)],
                prepared_sources=prepared_sources,
                request=rank_request,
                policy=policy,
                source_digest_cache=source_digest_cache,
                tensor_parallel_plan=chosen,
                tensor_shards={f"{dit_name}.{name}": shard for name, shard in shards_by_rank[rank].items()},
            )
        )
    return tuple(contexts)

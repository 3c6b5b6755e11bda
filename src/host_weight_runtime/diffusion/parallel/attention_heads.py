"""Per-rank attention: an attention module whose projections a plan splits runs on its rank's heads.

Colwise q/k/v projections give each rank whole heads (`heads // size` of them, in order).
diffusers' SD3, Wan and MiniMax-H3 processors reshape by `attn.heads`, so each split
attention module's `heads` becomes the local count (processors that reshape by `head_dim`,
as Flux's do, are indifferent to it). Wan normalizes queries and keys across all heads at
once; those norms become `HeadShardedRMSNorm`, which all-reduces the sum of squares over the
group and scales by its slice of the (replicated, whole) weight. Per-head norms are unchanged.

`check_attention_split` runs on the `meta` skeleton, before anything is read or written;
`adapt_attention_heads` runs once the model holds its rank's weights.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from .plan import TensorParallelPlan, plan_error

__all__ = ["HeadShardedRMSNorm", "adapt_attention_heads", "check_attention_split"]

_QK_NORMS = ("norm_q", "norm_k", "norm_added_q", "norm_added_k")


class HeadShardedRMSNorm(torch.nn.Module):
    """`torch.nn.RMSNorm` over all heads, computed by ranks that each hold `width // size` of the channels.

    Keeps the original `weight` Parameter (same state-dict name, no copy) and reads the
    rank's slice of it. Inference only: the all-reduce is not differentiated.
    """

    def __init__(self, norm: torch.nn.RMSNorm, *, rank: int, size: int, group: Any) -> None:
        super().__init__()
        (width,) = norm.normalized_shape
        self.normalized_shape = norm.normalized_shape
        self.eps = norm.eps
        self.weight = norm.weight
        self.width = width
        self.local_width = width // size
        self.start = rank * self.local_width
        self._group = group

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        if hidden_states.shape[-1] != self.local_width:
            raise ValueError(
                f"this rank normalizes {self.local_width} of {self.width} channels; got {hidden_states.shape[-1]}"
            )
        upcast = hidden_states.float()
        squares = upcast.pow(2).sum(-1, keepdim=True)
        dist.all_reduce(squares, group=self._group)
        eps = self.eps if self.eps is not None else torch.finfo(hidden_states.dtype).eps
        normalized = upcast * torch.rsqrt(squares / self.width + eps)
        if self.weight is not None:
            normalized = normalized * self.weight.narrow(0, self.start, self.local_width)
        return normalized.to(hidden_states.dtype)


def _projections(attention: torch.nn.Module) -> Iterator[str]:
    """Relative names of the attention module's matrix-weight submodules (its projections)."""
    for name, module in attention.named_modules():
        weight = getattr(module, "weight", None)
        if name and isinstance(weight, torch.Tensor) and weight.dim() == 2:
            yield name


def _split_attentions(model: torch.nn.Module, plan: TensorParallelPlan) -> Iterator[tuple[str, torch.nn.Module]]:
    """(name, module) of every attention module (one with an int `heads`) whose projections the plan splits.

    A plan that splits some projections of an attention module but not all of them would
    give its heads two different layouts: a typed refusal.
    """
    for name, module in model.named_modules():
        if type(getattr(module, "heads", None)) is not int:
            continue
        projections = list(_projections(module))
        split = [relative for relative in projections if plan.rule_for(f"{name}.{relative}" if name else relative)]
        if not split:
            continue
        if len(split) != len(projections):
            whole = sorted(set(projections) - set(split))
            raise plan_error(
                f"plan {plan.name!r} splits {sorted(split)} of attention module {name} but not {whole}; an "
                "attention module's projections are split together (whole heads per rank) or not at all",
                module=name,
                plan=plan.name,
            )
        yield name, module


def _heads(attention: torch.nn.Module) -> int:
    heads = getattr(attention, "heads", None)
    assert type(heads) is int
    return heads


def _norm_width(norm: torch.nn.Module) -> int | None:
    shape = getattr(norm, "normalized_shape", None) or getattr(norm, "dim", None)
    if isinstance(shape, (tuple, torch.Size)) and len(shape) == 1:
        return int(shape[0])
    return None


def _across_head_norms(name: str, attention: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module]]:
    """The q/k norms that normalize across all heads; a norm of any other width than one head is refused."""
    heads = _heads(attention)
    inner = getattr(attention, "inner_dim", None)
    if type(inner) is not int or inner % heads:
        raise plan_error(f"attention module {name} has no inner_dim that its {heads} heads divide", module=name)
    for norm_name in _QK_NORMS:
        norm = getattr(attention, norm_name, None)
        if not isinstance(norm, torch.nn.Module) or isinstance(norm, HeadShardedRMSNorm):
            continue
        width = _norm_width(norm)
        if width == inner // heads:
            continue  # one head's channels: the same norm on every rank
        if width == inner and type(norm) is torch.nn.RMSNorm:
            yield norm_name, norm
            continue
        raise plan_error(
            f"{name}.{norm_name} ({type(norm).__name__}, width {width}) normalizes neither one head "
            f"({inner // heads}) nor all heads with torch.nn.RMSNorm ({inner}); its attention cannot be split",
            module=f"{name}.{norm_name}",
        )


def check_attention_split(model: torch.nn.Module, plan: TensorParallelPlan) -> None:
    """Typed refusals for attention modules the plan cannot split; reads only module structure (works on meta)."""
    for name, attention in _split_attentions(model, plan):
        for _ in _across_head_norms(name, attention):
            pass


def adapt_attention_heads(model: torch.nn.Module, plan: TensorParallelPlan, mesh: Any) -> int:
    """Give every split attention module its rank's head count and group-wide across-head norms.

    Returns how many attention modules were adapted. Idempotent: a module already adapted
    (marked by `_hwr_full_heads`) is left as it is.
    """
    rank, size, group = int(mesh.get_local_rank()), int(mesh.size()), mesh.get_group()
    adapted = 0
    for name, attention in list(_split_attentions(model, plan)):
        if hasattr(attention, "_hwr_full_heads"):
            continue
        norms = list(_across_head_norms(name, attention))
        heads = _heads(attention)
        setattr(attention, "_hwr_full_heads", heads)  # noqa: B010 - Module.__setattr__ is typed for tensors and modules
        setattr(attention, "heads", heads // size)  # noqa: B010
        for norm_name, norm in norms:
            assert isinstance(norm, torch.nn.RMSNorm)
            setattr(attention, norm_name, HeadShardedRMSNorm(norm, rank=rank, size=size, group=group))
        adapted += 1
    return adapted

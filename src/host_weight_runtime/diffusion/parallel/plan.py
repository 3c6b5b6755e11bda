"""Tensor-parallel sharding plans: which Linear of a DiT is split along which dimension.

A plan is a value: rules `(module pattern, colwise|rowwise, blocks)`, where a pattern may
hold one `*` standing for a `ModuleList` index. Colwise splits a Linear's weight and bias
along dim 0 (output features); rowwise splits the weight along dim 1 (input features) and
keeps the bias whole (it is added after the all-reduce). Packed blocks split each fused
block separately, so rank r holds the r-th slice of every block. Every tensor no rule
names is replicated. The plan's `to_dict()` enters the layout identity, so a different
plan or TP size is a different key (D05). Nothing here imports `torch.distributed`.
Unless a plan is named (passed, or registered for the class), `plan_for_model` picks one per
(model structure, TP size): the first-class plan where the size divides it, else the model's
MLP-only plan, so a head count the size does not divide still loads with attention replicated.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from ...canonical_json import CanonicalJson, JsonValue
from ...failures import FailureCode, HostWeightError, HostWeightFailure, ResolutionStage
from .attention_plans import ATTENTION_SPLIT_PLANS, MLP_ONLY_PLANS

__all__ = [
    "FIRST_CLASS_TENSOR_PARALLEL_PLANS",
    "MLP_ONLY_TENSOR_PARALLEL_PLANS",
    "ShardStyle",
    "TensorParallelPlan",
    "TensorParallelRule",
    "TensorShard",
    "localize_module",
    "plan_for_model",
    "register_tensor_parallel_plan",
    "resolve_tensor_shards",
    "splits_evenly",
]


class ShardStyle(str, enum.Enum):
    """How one Linear is split: `parallelize_module`'s ColwiseParallel or RowwiseParallel."""

    COLWISE = "colwise"
    ROWWISE = "rowwise"


def plan_error(message: str, **details: JsonValue) -> HostWeightError:
    """A typed UNSUPPORTED refusal raised before anything is read or written."""
    return HostWeightError(
        HostWeightFailure(
            ResolutionStage.CONFIGURATION, FailureCode.UNSUPPORTED, False, message, CanonicalJson.from_value(details)
        )
    )


@dataclass(frozen=True, slots=True)
class TensorParallelRule:
    """One planned Linear (or family of Linears, with one `*` for a block index).

    `blocks` are proportional sizes of fused projections along the split dimension (empty:
    one block). `packed_attribute=True` reads absolute block sizes from the module's
    `_tp_packed_col_blocks` / `_tp_packed_row_blocks`, as diffusers' models declare them.
    """

    pattern: str
    style: ShardStyle
    blocks: tuple[int, ...] = ()
    packed_attribute: bool = False

    def __post_init__(self) -> None:
        if type(self.pattern) is not str or not self.pattern or self.pattern.count("*") > 1:
            raise ValueError(f"rule pattern {self.pattern!r} must be a non-empty module path with at most one '*'")
        if not isinstance(self.style, ShardStyle):
            raise ValueError("TensorParallelRule.style must be a ShardStyle")
        if type(self.blocks) is not tuple or any(type(b) is not int or b <= 0 for b in self.blocks):
            raise ValueError("TensorParallelRule.blocks must be a tuple of positive ints")

    def matches(self, module_name: str) -> bool:
        regex = "^" + r"[0-9]+".join(re.escape(part) for part in self.pattern.split("*")) + "$"
        return re.match(regex, module_name) is not None

    def to_dict(self) -> dict[str, JsonValue]:
        return {
            "pattern": self.pattern,
            "style": self.style.value,
            "blocks": list(self.blocks),
            "packed_attribute": self.packed_attribute,
        }


@dataclass(frozen=True, slots=True)
class TensorParallelPlan:
    """A named set of rules; part of the layout identity of every TP artifact."""

    name: str
    rules: tuple[TensorParallelRule, ...]

    def __post_init__(self) -> None:
        if type(self.name) is not str or not self.name:
            raise ValueError("TensorParallelPlan.name must be a non-empty str")
        if (
            type(self.rules) is not tuple
            or not self.rules
            or any(not isinstance(rule, TensorParallelRule) for rule in self.rules)
        ):
            raise ValueError("TensorParallelPlan.rules must be a non-empty tuple of TensorParallelRule")

    def to_dict(self) -> dict[str, JsonValue]:
        return {"name": self.name, "rules": [rule.to_dict() for rule in self.rules]}

    def rule_for(self, module_name: str) -> TensorParallelRule | None:
        return next((rule for rule in self.rules if rule.matches(module_name)), None)

    @classmethod
    def from_diffusers(cls, name: str, tp_plan: Mapping[str, object]) -> TensorParallelPlan:
        """A plan from a diffusers model class's `_tp_plan` (strings or Packed*Parallel markers)."""
        rules: list[TensorParallelRule] = []
        for pattern, style in tp_plan.items():
            if isinstance(style, str):
                rules.append(TensorParallelRule(pattern, ShardStyle(style)))
                continue
            kind = type(style).__name__
            if kind not in ("PackedColwiseParallel", "PackedRowwiseParallel"):
                raise ValueError(f"_tp_plan entry {pattern!r} has an unknown style {kind}")
            blocks = getattr(style, "blocks", None)
            rules.append(
                TensorParallelRule(
                    pattern,
                    ShardStyle.COLWISE if kind == "PackedColwiseParallel" else ShardStyle.ROWWISE,
                    blocks=tuple(int(b) for b in blocks) if blocks else (),
                    packed_attribute=not blocks,
                )
            )
        return cls(name, tuple(rules))


@dataclass(frozen=True, slots=True)
class TensorShard:
    """Rank `rank`'s part of one tensor: along `dim`, the r-th 1/size of every block in `block_sizes`."""

    dim: int
    block_sizes: tuple[int, ...]
    size: int
    rank: int

    def ranges(self) -> tuple[tuple[int, int], ...]:
        """The [start, stop) index ranges along `dim` of the full tensor that this rank holds, in order."""
        found: list[tuple[int, int]] = []
        offset = 0
        for block in self.block_sizes:
            chunk = block // self.size
            found.append((offset + self.rank * chunk, offset + (self.rank + 1) * chunk))
            offset += block
        return tuple(found)

    def local_shape(self, full_shape: Sequence[int]) -> tuple[int, ...]:
        shape = list(full_shape)
        shape[self.dim] = sum(block // self.size for block in self.block_sizes)
        return tuple(shape)

    def take(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's contiguous slice of a full tensor (a copy)."""
        parts = [full.narrow(self.dim, start, stop - start) for start, stop in self.ranges()]
        if len(parts) == 1:
            return parts[0].clone(memory_format=torch.contiguous_format)
        return torch.cat(parts, dim=self.dim)

    def for_rank(self, rank: int) -> TensorShard:
        return TensorShard(self.dim, self.block_sizes, self.size, rank)


@dataclass(frozen=True, slots=True)
class _PlannedSplit:
    """One split Linear before any TP size is applied: the dimension, its blocks, and whether the bias splits too."""

    dim: int
    blocks: tuple[int, ...]
    bias: bool


def _planned_split(name: str, module: torch.nn.Module, rule: TensorParallelRule) -> _PlannedSplit:
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise plan_error(f"plan rule {rule.pattern!r} names {name}, which has no 2-D weight", module=name)
    dim = 0 if rule.style is ShardStyle.COLWISE else 1
    total = int(weight.shape[dim])
    if rule.packed_attribute:
        attribute = "_tp_packed_col_blocks" if rule.style is ShardStyle.COLWISE else "_tp_packed_row_blocks"
        declared = getattr(module, attribute, None)
        if not declared:
            raise plan_error(f"{name} has no {attribute}, which its packed plan rule needs", module=name)
        blocks = tuple(int(b) for b in declared)
    elif rule.blocks:
        unit, remainder = divmod(total, sum(rule.blocks))
        if remainder:
            raise plan_error(f"{name}: blocks {list(rule.blocks)} do not divide dim {dim} of size {total}", module=name)
        blocks = tuple(b * unit for b in rule.blocks)
    else:
        blocks = (total,)
    if sum(blocks) != total:
        raise plan_error(f"{name}: blocks {list(blocks)} do not add up to dim {dim} of size {total}", module=name)
    bias = isinstance(getattr(module, "bias", None), torch.Tensor) and rule.style is ShardStyle.COLWISE
    return _PlannedSplit(dim, blocks, bias)


def _planned_splits(model: torch.nn.Module, plan: TensorParallelPlan) -> dict[str, _PlannedSplit]:
    """Module name -> its split, for every Linear the plan names; structural refusals (any TP size) are raised."""
    splits: dict[str, _PlannedSplit] = {}
    for name, module in model.named_modules():
        matching = [rule for rule in plan.rules if rule.matches(name)] if name else []
        if len(matching) > 1:
            raise plan_error(
                f"tensor-parallel plan {plan.name!r} names {name} in {len(matching)} rules "
                f"({[rule.pattern for rule in matching]}); each Linear is split one way or replicated, never both: "
                "keep one rule for it",
                module=name,
            )
        if matching:
            splits[name] = _planned_split(name, module, matching[0])
    if not splits:
        raise plan_error(
            f"tensor-parallel plan {plan.name!r} matches no module of {type(model).__name__}; it splits nothing",
            plan=plan.name,
        )
    return splits


def _uneven_split(model: torch.nn.Module, splits: Mapping[str, _PlannedSplit], size: int) -> HostWeightError | None:
    """The refusal for the first block or attention head count that `size` ranks cannot split evenly, if any."""
    for name, split in splits.items():
        for block in split.blocks:
            if block % size:
                return plan_error(
                    f"cannot split {name}.weight across {size} tensor-parallel ranks: a block of {block} along dim "
                    f"{split.dim} is not divisible by {size}; choose a TP size that divides it",
                    tensor=f"{name}.weight",
                    block=block,
                    tensor_parallel_size=size,
                )
    split_parents = {name.rsplit(".", index)[0] for name in splits for index in range(1, name.count(".") + 1)}
    for name, module in model.named_modules():
        heads = getattr(module, "heads", None)
        if name in split_parents and type(heads) is int and heads % size:
            return plan_error(
                f"{name} has {heads} attention heads, which {size} tensor-parallel ranks cannot split evenly",
                module=name,
                heads=heads,
                tensor_parallel_size=size,
            )
    return None


def splits_evenly(model: torch.nn.Module, plan: TensorParallelPlan, size: int) -> bool:
    """Whether `size` ranks divide every block and every split attention's heads under `plan` (reads only shapes).

    A plan that cannot apply to the model at any size still raises its typed refusal.
    """
    return _uneven_split(model, _planned_splits(model, plan), size) is None


def resolve_tensor_shards(
    model: torch.nn.Module, plan: TensorParallelPlan, size: int, rank: int
) -> dict[str, TensorShard]:
    """State-dict name -> shard for every split tensor of `model`; refusals are typed and come first (D05).

    Works on a `meta` skeleton: only shapes and declared block attributes are read. A module
    with a `heads` count whose projections are split must have heads divisible by `size`.
    """
    if type(size) is not int or size < 1 or type(rank) is not int or not 0 <= rank < size:
        raise ValueError(f"tensor-parallel rank {rank!r} of size {size!r} is not a valid rank")
    splits = _planned_splits(model, plan)
    refusal = _uneven_split(model, splits, size)
    if refusal is not None:
        raise refusal
    shards: dict[str, TensorShard] = {}
    for name, split in splits.items():
        shards[f"{name}.weight"] = TensorShard(split.dim, split.blocks, size, rank)
        if split.bias:
            shards[f"{name}.bias"] = TensorShard(0, split.blocks, size, rank)
    return shards


def localize_module(model: torch.nn.Module, shards: Mapping[str, TensorShard]) -> None:
    """Replace every split parameter of `model` by this rank's slice, in place.

    On a `meta` skeleton the slices are `meta` tensors of the local shape; on a loaded model
    they are contiguous copies of the rank's rows or columns. The result is the rank's final
    layout: discovery, identity, publication and restore then see local shapes only.
    """
    for name, shard in shards.items():
        module_name, _, attribute = name.rpartition(".")
        module = model.get_submodule(module_name)
        current = module._parameters.get(attribute)
        if current is None:
            raise ValueError(f"{name} is not a parameter of the model")
        if current.device.type == "meta":
            local = torch.empty(shard.local_shape(current.shape), dtype=current.dtype, device="meta")
        else:
            local = shard.take(current.detach())
        module._parameters[attribute] = torch.nn.Parameter(local, requires_grad=current.requires_grad)


def _entries_plan(name: str, entries: Sequence[tuple[str, str, tuple[int, ...]]]) -> TensorParallelPlan:
    return TensorParallelPlan(
        name, tuple(TensorParallelRule(pattern, ShardStyle(style), blocks=blocks) for pattern, style, blocks in entries)
    )


_REGISTERED: dict[str, TensorParallelPlan] = {}

FIRST_CLASS_TENSOR_PARALLEL_PLANS: Mapping[str, TensorParallelPlan] = {
    # Flux and Flux.2 plans come from diffusers' own `_tp_plan` (see plan_for_model). SD3, Wan and
    # MiniMax-H3 split attention heads and MLPs; attention_plans.py says what stays replicated and why.
    class_name: _entries_plan(name, entries)
    for class_name, (name, entries) in ATTENTION_SPLIT_PLANS.items()
}

MLP_ONLY_TENSOR_PARALLEL_PLANS: Mapping[str, TensorParallelPlan] = {
    # The default in place of the first-class plan at a TP size that does not divide the heads.
    class_name: _entries_plan(name, entries)
    for class_name, (name, entries) in MLP_ONLY_PLANS.items()
}

_DIFFUSERS_PLANS = {
    "FluxTransformer2DModel": "flux-diffusers-tp-v1",
    "Flux2Transformer2DModel": "flux2-diffusers-tp-v1",
}


def register_tensor_parallel_plan(model_class_name: str, plan: TensorParallelPlan) -> None:
    """Declare (or replace) the plan for a model class name; a different plan is a different key.

    A registered plan is used at every TP size as it is: one that a TP size cannot divide is refused.
    """
    if type(model_class_name) is not str or not model_class_name:
        raise ValueError("model_class_name must be a non-empty str")
    if not isinstance(plan, TensorParallelPlan):
        raise ValueError("plan must be a TensorParallelPlan")
    _REGISTERED[model_class_name] = plan


def plan_for_model(model: torch.nn.Module, tensor_parallel_size: int | None = None) -> TensorParallelPlan:
    """The registered plan, else a first-class one, else the class's diffusers `_tp_plan`; typed refusal otherwise.

    With `tensor_parallel_size`, a first-class plan that the size cannot divide (its attention
    heads, say) gives way to the model's MLP-only plan. The choice reads only the model's
    structure (its config) and the size, so every rank of a group makes the same one.
    """
    if tensor_parallel_size is not None and (type(tensor_parallel_size) is not int or tensor_parallel_size < 1):
        raise ValueError(f"tensor_parallel_size must be an int >= 1, got {tensor_parallel_size!r}")
    class_name = type(model).__name__
    registered = _REGISTERED.get(class_name)
    if registered is not None:
        return registered
    first_class = FIRST_CLASS_TENSOR_PARALLEL_PLANS.get(class_name)
    if first_class is not None:
        fallback = MLP_ONLY_TENSOR_PARALLEL_PLANS.get(class_name)
        if tensor_parallel_size is None or fallback is None or splits_evenly(model, first_class, tensor_parallel_size):
            return first_class
        return fallback
    tp_plan = getattr(type(model), "_tp_plan", None)
    if isinstance(tp_plan, dict) and tp_plan:
        return TensorParallelPlan.from_diffusers(
            _DIFFUSERS_PLANS.get(class_name, f"{class_name}-diffusers-tp"), tp_plan
        )
    raise plan_error(
        f"{class_name} has no tensor-parallel plan; declare one with register_tensor_parallel_plan()",
        model_class=class_name,
    )

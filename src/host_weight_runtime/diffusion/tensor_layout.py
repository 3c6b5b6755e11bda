"""Representation-neutral ownership discovery for final-layout tensors.

The artifact owns every parameter and persistent buffer of the DiT modules, named
`<dit>.<state-dict name>`. Discovery reads only metadata (shape, dtype, stride), so a
`meta` skeleton and a materialized CPU model yield the same contract.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch

from ..canonical_json import CanonicalJson, JsonValue, canonical_sha256_trusted
from ..failures import FailureCode, HostWeightError, HostWeightFailure, ResolutionStage
from ..protocols import TensorWriteSpec
from ..tensors import TensorKind, dtype_code

__all__ = [
    "FinalLayoutTensor",
    "TensorAlias",
    "TensorOwnership",
    "discover_tensor_ownership",
    "owned_tensors",
    "tensor_contract_digest",
]


FinalDtype = Callable[[str, str, torch.dtype], torch.dtype]
"""(dit name, local tensor name, current dtype) -> final dtype under the policy."""


def ownership_error(message: str, **details: JsonValue) -> HostWeightError:
    return HostWeightError(
        HostWeightFailure(
            ResolutionStage.CONFIGURATION, FailureCode.UNSUPPORTED, False, message, CanonicalJson.from_value(details)
        )
    )


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides: list[int] = []
    running = 1
    for size in reversed(shape):
        strides.append(running)
        running *= max(size, 1)
    return tuple(reversed(strides))


@dataclass(frozen=True, slots=True)
class FinalLayoutTensor:
    """One owned tensor as the artifact stores it: final dtype, contiguous layout."""

    name: str
    dit_name: str
    local_name: str
    kind: TensorKind
    role: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    stride: tuple[int, ...]

    def to_dict(self) -> dict[str, JsonValue]:
        return {
            "name": self.name,
            "kind": self.kind.value,
            "role": self.role,
            "shape": list(self.shape),
            "dtype": dtype_code(self.dtype),
            "stride": list(self.stride),
        }

    def write_spec(self) -> TensorWriteSpec:
        return TensorWriteSpec(self.name, self.shape, self.dtype, self.kind, self.role)

    @property
    def nbytes(self) -> int:
        numel = 1
        for size in self.shape:
            numel *= size
        return numel * self.dtype.itemsize


@dataclass(frozen=True, slots=True)
class TensorAlias:
    """A name the model's tied-weights mechanism declares to be the very tensor stored under `owner`.

    The artifact stores the owner once; a restore binds both names to that one tensor. Any alias
    the model does not declare is still refused.
    """

    name: str
    owner: str

    def to_dict(self) -> dict[str, JsonValue]:
        return {"alias": self.name, "owner": self.owner}


@dataclass(frozen=True, slots=True)
class TensorOwnership:
    """The complete tensor set of the DiT modules, its declared aliases, and its contract digest."""

    tensors: tuple[FinalLayoutTensor, ...]
    contract_digest: str
    aliases: tuple[TensorAlias, ...] = ()

    @property
    def names(self) -> frozenset[str]:
        return frozenset(tensor.name for tensor in self.tensors)

    def by_name(self) -> dict[str, FinalLayoutTensor]:
        return {tensor.name: tensor for tensor in self.tensors}

    @property
    def total_bytes(self) -> int:
        return sum(tensor.nbytes for tensor in self.tensors)


def tensor_contract_digest(tensors: Sequence[FinalLayoutTensor], aliases: Sequence[TensorAlias] = ()) -> str:
    """SHA-256 over the sorted (name, kind, role, shape, dtype, stride) rows, and the aliases when there are any."""
    rows: list[JsonValue] = [tensor.to_dict() for tensor in sorted(tensors, key=lambda tensor: tensor.name)]
    if not aliases:  # the original contract document, so models without ties keep their keys
        return canonical_sha256_trusted(rows)  # rows of validated, typed fields
    tied: list[JsonValue] = [alias.to_dict() for alias in sorted(aliases, key=lambda alias: alias.name)]
    return canonical_sha256_trusted({"tensors": rows, "aliases": tied})


def _check_dit_names(dit_modules: Sequence[tuple[str, torch.nn.Module]]) -> None:
    if not dit_modules:
        raise ValueError("dit_modules is empty: pass at least one (name, module) pair")
    seen: set[str] = set()
    for name, module in dit_modules:
        if type(name) is not str or not name or "." in name:
            raise ValueError(f"DiT module name {name!r} must be a non-empty str without dots")
        if name in seen:
            raise ValueError(f"DiT module name {name!r} appears twice in dit_modules")
        if not isinstance(module, torch.nn.Module):
            raise ValueError(f"DiT module {name!r} is a {type(module).__name__}, not a torch.nn.Module")
        seen.add(name)


def owned_tensors(
    dit_modules: Sequence[tuple[str, torch.nn.Module]],
) -> Iterator[tuple[str, str, str, TensorKind, torch.Tensor]]:
    """Yield (dit name, local name, attribute, kind, tensor) for every parameter and persistent buffer.

    Modules are walked without de-duplication so a shared submodule or tied parameter
    shows up twice and can be rejected as an alias.
    """
    _check_dit_names(dit_modules)
    for dit_name, dit in dit_modules:
        for module_name, module in dit.named_modules(remove_duplicate=False):
            prefix = f"{module_name}." if module_name else ""
            for attribute, parameter in module._parameters.items():
                if parameter is not None:
                    yield dit_name, prefix + attribute, attribute, TensorKind.PARAMETER, parameter
            non_persistent = module._non_persistent_buffers_set
            for attribute, buffer in module._buffers.items():
                if buffer is not None and attribute not in non_persistent:
                    yield dit_name, prefix + attribute, attribute, TensorKind.BUFFER, buffer


def _byte_range(tensor: torch.Tensor) -> tuple[int, int, int]:
    """(address space, first byte, end) of a tensor's bytes; meta tensors have no addresses, only storages."""
    length = tensor.numel() * tensor.element_size()
    if tensor.is_meta:
        storage = tensor.untyped_storage()
        space = int(getattr(storage, "_cdata", id(storage)))  # the storage's identity: views share it
        start = int(tensor.storage_offset()) * tensor.element_size()
        return space, start, start + length
    start = tensor.data_ptr()
    return 0, start, start + length


def _reject_overlaps(byte_ranges: list[tuple[int, int, int, str]]) -> None:
    """Distinct tensor objects that view the same bytes are aliases too."""
    byte_ranges.sort()
    reach_space, reach, reach_name = -1, -1, ""
    for space, start, end, name in byte_ranges:
        if space != reach_space:
            reach_space, reach, reach_name = space, end, name
            continue
        if start < reach:
            raise ownership_error(
                f"{name} shares memory with {reach_name}; aliased tensors cannot be published",
                tensor=name,
                alias_of=reach_name,
            )
        if end > reach:
            reach, reach_name = end, name


def discover_tensor_ownership(
    dit_modules: Sequence[tuple[str, torch.nn.Module]],
    final_dtype: FinalDtype,
    aliases: Mapping[str, str] | None = None,
) -> TensorOwnership:
    """Every owned tensor with its final dtype; undeclared aliases, non-contiguous, foreign-device tensors are refused.

    `aliases` maps a final-layout name to the owned name it is tied to (the model's tied-weights mechanism).
    """
    declared = dict(aliases or {})
    found = discover_owned_tensors(dit_modules, final_dtype, declared)
    tied = tuple(TensorAlias(name, owner) for name, owner in sorted(declared.items()))
    return TensorOwnership(found, tensor_contract_digest(found, tied), tied)


def _check_alias(name: str, owner: str, tensor: torch.Tensor, owners: Mapping[str, torch.Tensor]) -> None:
    """A declared alias is its owner's very tensor, or (a `meta` skeleton not tied yet) a twin of the same shape."""
    owned = owners.get(owner)
    if owned is None:
        raise ownership_error(f"{name} is declared tied to {owner}, which the model does not own", tensor=name)
    if tensor is owned:
        return
    if tensor.device.type != "meta" or tuple(tensor.shape) != tuple(owned.shape) or tensor.dtype != owned.dtype:
        raise ownership_error(
            f"{name} is declared tied to {owner} but is a separate {tensor.device.type} tensor; a loaded model "
            "must hold one tensor under both names",
            tensor=name,
            alias_of=owner,
        )


def _final_layout_tensor(
    name: str,
    tensor: torch.Tensor,
    *,
    dit_name: str,
    local_name: str,
    attribute: str,
    kind: TensorKind,
    final: FinalDtype,
) -> FinalLayoutTensor:
    if not (tensor.is_meta or tensor.is_cpu):  # the flags, not `device.type`: one call less per tensor
        raise ownership_error(
            f"{name} lives on {tensor.device}; final-layout tensors are host tensors, so discover ownership on a "
            "CPU or meta model before moving it to an accelerator",
            tensor=name,
            device=str(tensor.device),
        )
    shape = tuple(tensor.shape)  # torch.Size holds ints
    if not tensor.is_contiguous():
        raise ownership_error(
            f"{name} is not contiguous (stride {tensor.stride()} for shape {shape}); make it contiguous before "
            "publishing",
            tensor=name,
        )
    return FinalLayoutTensor(
        name=name,
        dit_name=dit_name,
        local_name=local_name,
        kind=kind,
        role=attribute,
        shape=shape,
        dtype=final(dit_name, local_name, tensor.dtype),
        stride=_contiguous_strides(shape),
    )


def discover_owned_tensors(
    dit_modules: Sequence[tuple[str, torch.nn.Module]],
    final_dtype: FinalDtype,
    aliases: Mapping[str, str] | None = None,
) -> tuple[FinalLayoutTensor, ...]:
    """The tensors of `discover_tensor_ownership`, sorted by name, without digesting them into a contract."""
    declared = aliases or {}
    found: list[FinalLayoutTensor] = []
    seen_objects: dict[int, str] = {}
    owners: dict[str, torch.Tensor] = {}
    tied: list[tuple[str, torch.Tensor]] = []
    byte_ranges: list[tuple[int, int, int, str]] = []
    for dit_name, local_name, attribute, kind, tensor in owned_tensors(dit_modules):
        name = f"{dit_name}.{local_name}"
        if name in declared:
            tied.append((name, tensor))
            continue
        earlier = seen_objects.get(id(tensor))
        if earlier is not None:
            raise ownership_error(
                f"{name} is the same tensor as {earlier}; aliased (tied or shared) tensors cannot be "
                "published as final-layout tensors unless the model declares the tie",
                tensor=name,
                alias_of=earlier,
            )
        seen_objects[id(tensor)] = name
        owners[name] = tensor
        described = _final_layout_tensor(
            name, tensor, dit_name=dit_name, local_name=local_name, attribute=attribute, kind=kind, final=final_dtype
        )
        found.append(described)
        if tensor.numel() > 0:
            byte_ranges.append((*_byte_range(tensor), name))
    for name, tensor in tied:
        _check_alias(name, declared[name], tensor, owners)
    missing = sorted(set(declared) - {name for name, _tensor in tied})
    if missing:
        raise ownership_error(
            f"the declared tied tensor(s) {missing[:5]} are not in the model", missing=list[JsonValue](missing[:5])
        )
    _reject_overlaps(byte_ranges)
    found.sort(key=lambda tensor: tensor.name)
    if not found:
        raise ownership_error("the DiT modules own no parameters or persistent buffers; there is nothing to publish")
    return tuple(found)


def tensors_by_name(dit_modules: Sequence[tuple[str, torch.nn.Module]]) -> Mapping[str, torch.Tensor]:
    """The live tensors of the DiT modules, keyed by their final-layout names."""
    return {f"{dit}.{local}": tensor for dit, local, _attribute, _kind, tensor in owned_tensors(dit_modules)}

"""Generic validation-first restorer for exact final-layout tensor artifacts.

`plan_restore` checks identity, coverage, shapes, dtypes and roles and touches nothing;
the plan's one-shot `commit` binds every parameter and persistent buffer to the lease's
tensors without copying, keeping each parameter's `requires_grad`. A model whose commit
failed must be discarded.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

from ..canonical_json import CanonicalJson, JsonValue
from ..failures import FailureCode, HostWeightError, HostWeightFailure, ResolutionStage
from ..lease import HostWeightLease
from ..manifest import WeightManifest
from ..tensors import TensorKind, dtype_code
from .contracts import FINAL_LAYOUT_TENSOR_RESTORER_SCHEMA
from .identity_adapter import FinalLayoutIdentityContext, discover_final_layout_tensors

__all__ = [
    "CHECKED_LAYOUTS",
    "CheckedLayouts",
    "FinalLayoutTensorRestorePlan",
    "FinalLayoutTensorRestorer",
    "dit_modules_of",
]

_CHECKED_LAYOUTS_KEPT = 32


def restore_error(message: str, **details: JsonValue) -> HostWeightError:
    return HostWeightError(
        HostWeightFailure(
            ResolutionStage.RESTORE, FailureCode.RESTORE_FAILED, False, message, CanonicalJson.from_value(details)
        )
    )


def dit_modules_of(model: torch.nn.Module, context: FinalLayoutIdentityContext) -> list[tuple[str, torch.nn.Module]]:
    """The context's DiT modules inside `model`, found by name, and of the types the identity was built for."""
    if not isinstance(model, context.pipeline_type):
        raise restore_error(
            f"the model is a {type(model).__name__}, but the identity was built for a {context.pipeline_type.__name__}",
            model_type=type(model).__name__,
        )
    found: list[tuple[str, torch.nn.Module]] = []
    for name, expected_type in zip(context.dit_names, context.dit_types, strict=True):
        try:
            module = model.get_submodule(name)
        except AttributeError as exc:
            raise restore_error(f"the model has no DiT module {name!r}", dit=name) from exc
        if type(module) is not expected_type:
            raise restore_error(
                f"DiT module {name!r} is a {type(module).__name__}, not the {expected_type.__name__} of the identity",
                dit=name,
            )
        found.append((name, module))
    return found


@dataclass(frozen=True, slots=True)
class _Binding:
    module: torch.nn.Module
    attribute: str
    kind: TensorKind
    tensor: torch.Tensor
    name: str = ""


@dataclass(frozen=True, slots=True)
class _Tie:
    """A declared alias: after the owned tensors are bound, `module.attribute` becomes the owner's very tensor."""

    module: torch.nn.Module
    attribute: str
    owner: str


class FinalLayoutTensorRestorePlan:
    """A validated, one-shot binding of a model's tensors to a lease's mapped tensors."""

    def __init__(
        self,
        context: FinalLayoutIdentityContext,
        model: torch.nn.Module,
        dit_modules: Sequence[tuple[str, torch.nn.Module]],
        lease: HostWeightLease,
        bindings: tuple[_Binding, ...],
        *,
        ties: tuple[_Tie, ...] = (),
    ) -> None:
        self._context = context
        self._ties = ties
        self._model = model
        self._dit_modules = tuple(dit_modules)
        self._lease = lease
        self._bindings = bindings
        self._guard = threading.Lock()
        self._committed = False

    @property
    def committed(self) -> bool:
        return self._committed

    @property
    def tensor_count(self) -> int:
        return len(self._bindings)

    def commit(self) -> None:
        """Bind every tensor once; marked committed before the first mutation, so a second call raises."""
        with self._guard:
            if self._committed:
                raise restore_error("this restore plan was already committed; plan a new restore on a fresh model")
            self._committed = True
        if self._lease.closed:
            raise restore_error("the lease was closed before commit; nothing was changed")
        self._context.ensure_sources_unchanged()
        bound: dict[str, torch.Tensor] = {}
        for binding in self._bindings:
            if binding.kind is TensorKind.PARAMETER:
                # Each parameter keeps the model's requires_grad (diffusers gives True), so a restored model
                # behaves as a canonical one; a lease maps private copy-on-write, so even a write (an optimizer
                # step) changes only this process's pages, never the artifact.
                previous = binding.module._parameters.get(binding.attribute)
                requires_grad = (True if previous is None else previous.requires_grad) and (
                    binding.tensor.is_floating_point() or binding.tensor.is_complex()
                )
                parameter = torch.nn.Parameter(binding.tensor, requires_grad=requires_grad)
                binding.module._parameters[binding.attribute] = parameter
                bound[binding.name] = parameter
            else:
                binding.module._buffers[binding.attribute] = binding.tensor
                bound[binding.name] = binding.tensor
        for tie in self._ties:
            owner = bound[tie.owner]
            if isinstance(owner, torch.nn.Parameter):
                tie.module._parameters[tie.attribute] = owner
            else:
                tie.module._buffers[tie.attribute] = owner
        for (_name, module), contract in zip(self._dit_modules, self._context.model_contracts, strict=True):
            try:
                contract.validator(module)
            except Exception as exc:
                raise restore_error(
                    f"{contract.model_class_name} failed its contract validator after restore: {exc}; "
                    "discard this model",
                    model_class=contract.model_class_name,
                ) from exc


class FinalLayoutTensorRestorer:
    """Validate and plan restoration for one exact policy-defined lease."""

    def __init__(self, context: FinalLayoutIdentityContext) -> None:
        self._context = context

    @property
    def schema(self) -> str:
        return FINAL_LAYOUT_TENSOR_RESTORER_SCHEMA

    def plan_restore(self, model: object, lease: HostWeightLease) -> FinalLayoutTensorRestorePlan:
        """Check everything a commit depends on; mutates neither the model nor the lease (D12)."""
        return self._plan(model, lease, rediscover=True)

    def _plan_on_identity_skeleton(self, model: object, lease: HostWeightLease) -> FinalLayoutTensorRestorePlan:
        """`plan_restore` for the very skeleton the identity was just built on, which no other code has seen.

        Only `load_component` calls it: it built that skeleton, discovered its tensors for the
        identity and handed it to nobody since, so discovering them again could find nothing new.
        Every lease-side check (key, schema, coverage, shapes, dtypes, kinds, roles) still runs.
        """
        return self._plan(model, lease, rediscover=False)

    def _plan(self, model: object, lease: HostWeightLease, *, rediscover: bool) -> FinalLayoutTensorRestorePlan:
        context = self._context
        if not isinstance(model, torch.nn.Module):
            raise restore_error(f"the model must be a torch.nn.Module, got {type(model).__name__}")
        if not isinstance(lease, HostWeightLease):
            raise restore_error(f"the lease must be a HostWeightLease, got {type(lease).__name__}")
        if lease.closed:
            raise restore_error("the lease is closed")
        if lease.identity.key != context.identity.key:
            raise restore_error(
                f"the lease is for artifact {lease.identity.key}, not {context.identity.key}",
                lease_key=lease.identity.key,
                expected_key=context.identity.key,
            )
        manifest = lease.manifest
        if manifest.restorer_schema != self.schema:
            raise restore_error(
                f"the artifact needs restorer schema {manifest.restorer_schema!r}; this restorer is {self.schema!r}"
            )
        dit_modules = dit_modules_of(model, context)
        if rediscover and (
            discover_final_layout_tensors(dit_modules, context.policy, context.aliases) != context.tensors
        ):
            raise restore_error(
                "the model's tensors do not match the identity's tensor contract; build the identity on this model",
            )
        leased = lease.tensors
        submodules = {name: dict(module.named_modules()) for name, module in dit_modules}
        bindings: list[_Binding] = []
        for row in CHECKED_LAYOUTS.rows(self.schema, context, manifest):
            value = leased[row.name]
            if value.shape != row.shape or value.dtype != row.dtype:
                raise restore_error(
                    f"{row.name}: the lease maps {value.dtype} {list(value.shape)}, the model needs "
                    f"{row.dtype} {list(row.shape)}",
                    tensor=row.name,
                )
            owner = submodules[row.dit_name].get(row.module_path)
            if owner is None:
                raise restore_error(f"{row.name}: the model has no submodule {row.module_path!r}", tensor=row.name)
            bindings.append(_Binding(owner, row.attribute, row.kind, value, row.name))
        ties = tuple(_tie(name, owner, submodules) for name, owner in sorted(context.aliases.items()))
        return FinalLayoutTensorRestorePlan(context, model, dit_modules, lease, tuple(bindings), ties=ties)


def _tie(name: str, owner: str, submodules: dict[str, dict[str, torch.nn.Module]]) -> _Tie:
    """Where a declared alias lives in the model, checked before anything is bound."""
    dit_name, _, local_name = name.partition(".")
    module_path, _, attribute = local_name.rpartition(".")
    module = submodules.get(dit_name, {}).get(module_path)
    if module is None:
        raise restore_error(f"{name}: the model has no submodule {module_path!r} for this tied tensor", tensor=name)
    return _Tie(module, attribute, owner)


@dataclass(frozen=True, slots=True)
class _CheckedRow:
    """One tensor of a manifest checked against the tensor contract: where it binds and what the lease must map."""

    name: str
    dit_name: str
    module_path: str
    attribute: str
    kind: TensorKind
    shape: tuple[int, ...]
    dtype: torch.dtype


def _check_manifest(context: FinalLayoutIdentityContext, manifest: WeightManifest) -> tuple[_CheckedRow, ...]:
    """Coverage, shapes, dtypes, kinds and roles of `manifest` against the identity's tensor contract."""
    manifest_names = {entry.name for entry in manifest.tensors}
    missing = sorted(context.tensor_names - manifest_names)
    extra = sorted(manifest_names - context.tensor_names)
    if missing or extra:
        raise restore_error(
            f"the artifact covers the model incompletely: {len(missing)} missing (e.g. {missing[:5]}), "
            f"{len(extra)} unexpected (e.g. {extra[:5]})",
            missing=len(missing),
            unexpected=len(extra),
        )
    rows: list[_CheckedRow] = []
    for tensor in context.tensors:
        entry = manifest.tensor(tensor.name)
        if (
            entry.shape != tensor.shape
            or entry.dtype != dtype_code(tensor.dtype)
            or entry.kind is not tensor.kind
            or entry.role != tensor.role
        ):
            raise restore_error(
                f"{tensor.name}: the artifact holds {entry.kind.value} {entry.role} {entry.dtype} "
                f"{list(entry.shape)}, the model needs {tensor.kind.value} {tensor.role} "
                f"{dtype_code(tensor.dtype)} {list(tensor.shape)}",
                tensor=tensor.name,
            )
        module_path, _, attribute = tensor.local_name.rpartition(".")
        rows.append(
            _CheckedRow(tensor.name, tensor.dit_name, module_path, attribute, tensor.kind, tensor.shape, tensor.dtype)
        )
    return tuple(rows)


class CheckedLayouts:
    """Per process: a manifest checked once against the tensor contract of an identity key, for every later restore.

    The manifest object is the one `PARSED_MANIFESTS` hands every lookup of the same exact bytes,
    and each entry keeps it, so an entry answers only for that very object (other bytes, another
    publication or a re-sealed manifest is another object and is checked afresh). The identity key
    covers the tensor contract, so the same key means the same contract. What a lease maps is still
    compared tensor by tensor on every restore.
    """

    __slots__ = ("_guard", "_kept", "_limit", "checks", "hits")

    def __init__(self, limit: int = _CHECKED_LAYOUTS_KEPT) -> None:
        self._limit = limit
        self._kept: OrderedDict[Hashable, tuple[WeightManifest, tuple[_CheckedRow, ...]]] = OrderedDict()
        self._guard = threading.Lock()
        self.hits = 0
        self.checks = 0

    def rows(
        self, schema: str, context: FinalLayoutIdentityContext, manifest: WeightManifest
    ) -> tuple[_CheckedRow, ...]:
        """The checked rows of `manifest` for `context`; raises the restore error a failed check gives."""
        key = (schema, context.identity.key, id(manifest))
        with self._guard:
            found = self._kept.get(key)
            if found is not None and found[0] is manifest:
                self._kept.move_to_end(key)
                self.hits += 1
                return found[1]
        rows = _check_manifest(context, manifest)
        with self._guard:
            self.checks += 1
            self._kept[key] = (manifest, rows)
            while len(self._kept) > self._limit:
                self._kept.popitem(last=False)
        return rows

    def clear(self) -> None:
        with self._guard:
            self._kept.clear()


CHECKED_LAYOUTS = CheckedLayouts()
"""This process's manifests checked against tensor contracts (what a restore of an artifact loaded before skips)."""

"""The skeleton and identity step: a `meta` model of the component, its request, then its artifact identity.

`prepare_skeleton` needs no hashing (files, class, skeleton, request); `identify_component`
hashes the sources once per node (through the digest cache) and builds the identity on the
skeleton, which a restore then fills in place.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from ..canonical_json import canonical_sha256
from ..runtime import HostWeightRuntime
from ._load_options import LoadOptions
from ._ownership_plans import OWNERSHIP_PLANS, ownership_plan_key
from .component_source import (
    ComponentLocation,
    checkpoint_source,
    component_model_class,
    model_id,
    node_digest_cache,
    usage_errors,
)
from .contracts import (
    FINAL_LAYOUT_BF16_POLICY,
    FinalLayoutLoaderIdentity,
    FinalLayoutModelContract,
    FinalLayoutParallelIdentity,
    FinalLayoutRequest,
    FinalLayoutTensorPolicy,
    ImplementationIdentity,
)
from .dtype_policies import ModelFamilyName, dtype_policy
from .identity_adapter import (
    FinalLayoutIdentityContext,
    build_final_layout_identity,
    discover_final_layout,
    model_contracts,
)
from .model_contracts import contract_for_model
from .model_family import ImportClock, ModelFamily
from .source_identity import NodeSourceDigestCache, PreparedWeightSource
from .tensor_layout import TensorOwnership

__all__ = [
    "LOADER_ID",
    "SKELETON_BUILDS",
    "ComponentHolder",
    "ComponentSkeleton",
    "IdentifiedComponent",
    "describe_model",
    "identify_component",
    "loader_identity",
    "prepare_skeleton",
    "with_ownership",
]

_KEY_MAPPING = {
    ModelFamilyName.DIFFUSERS: "identity",
    ModelFamilyName.TRANSFORMERS: "transformers-conversion-mapping",
}
"""How each family maps checkpoint keys to model tensors (it enters the weight transform, so the key)."""

LOADER_ID = "host_weight_runtime.diffusion.load_component"
"""The loader every artifact of a component load names (with `_LOADER_VERSION`) in its identity."""
_LOADER_VERSION = "1"


class SkeletonBuilds:
    """How many `meta` skeletons this process has built, by model class name: one per component load."""

    __slots__ = ("_guard", "by_class")

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self.by_class: dict[str, int] = {}

    def count(self, model_class: type[Any]) -> None:
        with self._guard:
            self.by_class[model_class.__name__] = self.by_class.get(model_class.__name__, 0) + 1

    def snapshot(self) -> dict[str, int]:
        with self._guard:
            return dict(self.by_class)


SKELETON_BUILDS = SkeletonBuilds()
"""Every skeleton `prepare_skeleton` builds, counted: a load builds each component's once, and nothing else does."""


class ComponentHolder(torch.nn.Module):
    """A one-component container, so a lone model has the `<component>.<name>` tensor names of a pipeline."""


@dataclass(frozen=True, slots=True)
class ComponentSkeleton:
    """Everything about a component that needs no hashing: its files, class, `meta` model and request."""

    location: ComponentLocation
    source: PreparedWeightSource
    model_class: type[Any]
    model: torch.nn.Module
    holder: torch.nn.Module
    request: FinalLayoutRequest
    options: LoadOptions
    family: ModelFamily
    policy: FinalLayoutTensorPolicy = FINAL_LAYOUT_BF16_POLICY
    """The family's policy at the requested dtype: the representation this load serves."""
    aliases: Mapping[str, str] = field(default_factory=dict)
    """Final-layout name -> owner of each tie the model declares (keyed, stored once)."""
    checkpoint_keys: Mapping[str, str] = field(default_factory=dict)
    """Final-layout name -> checkpoint key, where the family renames checkpoint keys."""
    discovered: tuple[TensorOwnership, tuple[FinalLayoutModelContract, ...]] | None = None
    """The tensor ownership and contracts under `policy`, where they were read while `model` was private
    (a canonically loaded model described for its background publication); None: discovered when identified."""

    @property
    def component_name(self) -> str:
        return self.location.component_name


@dataclass(frozen=True, slots=True)
class IdentifiedComponent:
    """A skeleton with its artifact identity: what the runtime resolves and a restore fills."""

    skeleton: ComponentSkeleton
    context: FinalLayoutIdentityContext


def _json_config(config: dict[str, Any]) -> dict[str, Any]:
    """The config facts that shape the model: public keys plus the class name, as plain JSON."""
    public = {key: value for key, value in config.items() if not key.startswith("_") or key == "_class_name"}
    loaded: dict[str, Any] = json.loads(json.dumps(public, sort_keys=True, default=str))
    return loaded


def _digest(value: object) -> str:
    return canonical_sha256(value)


def loader_identity(
    family: ModelFamily,
    model_class: type[Any],
    config: dict[str, Any],
    keep_fp32: tuple[str, ...],
    safetensors: bool,
    *,
    dtype: torch.dtype = torch.bfloat16,
) -> FinalLayoutLoaderIdentity:
    """Who loads the tensors and how: loader and library versions, the model's config, the dtype transform."""
    versions = family.library_versions()
    implementation = ImplementationIdentity(
        implementation_id=LOADER_ID,
        version=_LOADER_VERSION,
        fingerprint=_digest({"loader": LOADER_ID, "version": _LOADER_VERSION, **versions}),
    )
    return FinalLayoutLoaderIdentity(
        implementation=implementation,
        model_config_fingerprint=_digest(
            {"class": f"{model_class.__module__}.{model_class.__qualname__}", "config": _json_config(config)}
        ),
        weight_transform_fingerprint=_digest(
            {
                "torch_dtype": str(dtype),
                "keep_in_fp32_modules": list(keep_fp32),
                "key_mapping": _KEY_MAPPING[family.family_name],
                "checkpoint_format": "safetensors" if safetensors else "pickle",
            }
        ),
    )


def prepare_skeleton(
    location: ComponentLocation,
    options: LoadOptions,
    parallel: FinalLayoutParallelIdentity,
    *,
    family: ModelFamily | None = None,
    clock: ImportClock | None = None,
    source: PreparedWeightSource | None = None,
    records: NodeSourceDigestCache | None = None,
) -> ComponentSkeleton:
    """The source files, model class, `meta` skeleton and request: everything but the hashing.

    `source=None` reads the checkpoint where `location` says (a load by name passes the one the remote's
    index records). `family=None` takes the family the folder's config.json names. `records` is the node's
    cache, where what a family derives from the checkpoint (a transformers one's bindings) is shared. A
    transformers component whose checkpoint an artifact cannot reproduce (pickle only, a tensor it lacks,
    both names of a tie) raises UNSUPPORTED here, so the load falls back (PREFERRED) or fails typed (REQUIRED).
    """
    source = checkpoint_source(location, options) if source is None else source
    family, model_class = component_model_class(source, family, clock)
    with usage_errors():
        model = family.build_skeleton(model_class, source.resolved_root, location.name_or_path, options.dtype)
    SKELETON_BUILDS.count(model_class)
    return describe_model(
        location, options, parallel, model, family=family, model_class=model_class, source=source, records=records
    )


def describe_model(
    location: ComponentLocation,
    options: LoadOptions,
    parallel: FinalLayoutParallelIdentity,
    model: torch.nn.Module,
    *,
    family: ModelFamily,
    model_class: type[Any],
    source: PreparedWeightSource,
    records: NodeSourceDigestCache | None,
) -> ComponentSkeleton:
    """The request, contract and checkpoint bindings of `model`: a `meta` skeleton, or a canonically loaded model.

    The first worker on a node describes the model `from_pretrained` built instead of building a second one
    (`with_ownership` then reads its tensor ownership before the model is handed out).
    """
    holder = ComponentHolder()
    holder.add_module(location.component_name, model)
    contract = contract_for_model(model, options.dtype)
    config = family.model_config(model_class, source.resolved_root)
    request = FinalLayoutRequest(
        model_id=model_id(location.model_or_path, source),
        loader=loader_identity(
            family, model_class, config, contract.keep_in_fp32_modules, source.use_safetensors, dtype=options.dtype
        ),
        parallel=parallel,
    )
    keys, aliases = family.checkpoint_bindings(model, source, records)
    prefix = f"{location.component_name}."
    return ComponentSkeleton(
        location,
        source,
        model_class,
        model,
        holder,
        request,
        options,
        family,
        policy=dtype_policy(family.family_name, options.dtype),
        aliases={prefix + alias: prefix + owner for alias, owner in aliases.items()},
        checkpoint_keys={prefix + name: key for name, key in keys.items() if name != key},
    )


def identify_component(
    skeleton: ComponentSkeleton,
    runtime: HostWeightRuntime,
    policy: FinalLayoutTensorPolicy | None = None,
) -> IdentifiedComponent:
    """Hash the sources (once per node, through the digest cache) and build the identity on the skeleton.

    `policy=None` is the skeleton's own (its family's at the requested dtype); FP8 passes its own.
    The skeleton's tensor ownership is discovered once per process for each kind of skeleton
    (`_ownership_plans`): a later load of the same component builds the same skeleton.
    """
    chosen = skeleton.policy if policy is None else policy
    discovered = skeleton.discovered
    if discovered is None or chosen is not skeleton.policy:
        discovered = _discovered(skeleton, chosen)
    context = build_final_layout_identity(
        skeleton.holder,
        dit_modules=[(skeleton.component_name, skeleton.model)],
        prepared_sources=[skeleton.source],
        request=skeleton.request,
        policy=chosen,
        source_digest_cache=node_digest_cache(runtime),
        aliases=skeleton.aliases,
        checkpoint_keys=skeleton.checkpoint_keys,
        discovered=discovered,
    )
    return IdentifiedComponent(skeleton, context)


def _discovered(
    skeleton: ComponentSkeleton, policy: FinalLayoutTensorPolicy
) -> tuple[TensorOwnership, tuple[FinalLayoutModelContract, ...]]:
    """The skeleton's tensor ownership under `policy`, and each model's contract (kept per process, by kind)."""
    dit_modules = [(skeleton.component_name, skeleton.model)]
    # The contracts are looked up on every load, so a replaced validator is the one that checks the restore;
    # they are part of the plan's key because their FP32 modules shape the ownership.
    contracts = model_contracts(dit_modules, policy)
    key = (
        ownership_plan_key(skeleton.model, skeleton.component_name, skeleton.request, policy, skeleton.aliases),
        contracts,
    )
    ownership, _kept = OWNERSHIP_PLANS.plan(key, lambda: discover_final_layout(dit_modules, policy, skeleton.aliases))
    return ownership, contracts


def with_ownership(described: ComponentSkeleton) -> ComponentSkeleton:
    """The description with its tensor ownership discovered now, for a model about to be handed out.

    Ownership reads only names, shapes and dtypes, which a loaded model and a `meta` skeleton share, so
    the identity (and key) is the same; the background publication then reads nothing of the model but
    its type.
    """
    return replace(described, discovered=_discovered(described, described.policy))

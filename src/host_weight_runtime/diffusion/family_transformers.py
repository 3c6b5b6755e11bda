"""The transformers model family: `PreTrainedModel` components (text and vision encoders) served like DiTs.

Each step mirrors what `cls.from_pretrained(folder, dtype=...)` does, using transformers' own
code wherever it decides bytes: the class comes from `model_index.json` (as diffusers reads a
pipeline) or the config's `architectures`; the skeleton is built under `get_init_context` (on
`meta`, default dtype `dtype`, ties not applied); the checkpoint's keys are renamed with the
model's own conversion mapping; ties follow `tie_weights`' symmetric rule (the tensor the
checkpoint holds owns the tie, the other name is a keyed alias); and a hit finishes that same
skeleton with the steps `from_pretrained(state_dict=<the lease's tensors>, dtype=...)` runs after
it builds a model (transformers' state-dict load, which binds them without copying, then its
finalization: non-persistent buffers, ties, evaluation mode), so the model is built once. The
restored model is then checked: every owned tensor must be the lease's very tensor, every alias
its owner's.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch

from ..canonical_json import CanonicalJson, JsonValue, decode_json
from ..failures import FailureCode, HostWeightError, HostWeightFailure, ResolutionStage, usage_error
from ..lease import HostWeightLease
from ._binding_plans import (
    BINDING_PLANS,
    binding_plan_key,
    bindings_from_record,
    bindings_record,
    node_binding_key,
)
from ._initializers import repair_transformers_initializers
from ._load_options import LoadOptions
from .dtype_policies import TRANSFORMERS_RESTORER_SCHEMA, ModelFamilyName
from .identity_adapter import FinalLayoutIdentityContext
from .model_contracts import is_transformers_model
from .model_family import ImportClock, canonical_load_errors
from .producers._checkpoint import read_safetensors_header
from .restorer import FinalLayoutTensorRestorer, restore_error
from .source_identity import NodeSourceDigestCache, PreparedWeightSource

__all__ = [
    "TRANSFORMERS_FAMILY",
    "TransformersFamily",
    "TransformersLeaseRestorer",
    "checkpoint_bindings",
    "is_transformers_config",
]

_UP_FRONT_MODULES = ("transformers", "transformers.modeling_utils")
_INDEX_LIMIT_BYTES = 1 * 2**20
_CONFIG_LIMIT_BYTES = 16 * 2**20
_MAX_LISTED = 5
_BROKEN_CONFIG_ERRORS = (ValueError, TypeError, KeyError, AttributeError, IndexError, RuntimeError, RecursionError)
_UNKEYED_CONFIG = frozenset({"transformers_version", "_name_or_path", "dtype", "torch_dtype"})


def is_transformers_config(config: Mapping[str, Any]) -> bool:
    """A transformers config.json: `model_type` or `architectures`, and no diffusers `_class_name`."""
    return "_class_name" not in config and ("model_type" in config or "architectures" in config)


def _unsupported(message: str, **details: JsonValue) -> HostWeightError:
    return HostWeightError(
        HostWeightFailure(
            ResolutionStage.CONFIGURATION, FailureCode.UNSUPPORTED, False, message, CanonicalJson.from_value(details)
        )
    )


def _pipeline_class_name(resolved_root: Path) -> str | None:
    """The class a pipeline's `model_index.json` names for this component folder, when it names a transformers one."""
    index = resolved_root.parent / "model_index.json"
    try:
        with open(index, "rb") as stream:
            value = decode_json(stream.read(_INDEX_LIMIT_BYTES + 1), max_bytes=_INDEX_LIMIT_BYTES)
    except (OSError, ValueError):
        return None  # no pipeline around this folder (or a broken index): the config's architectures decide
    entry = value.get(resolved_root.name) if isinstance(value, dict) else None
    if isinstance(entry, list) and len(entry) == 2 and entry[0] == "transformers" and isinstance(entry[1], str):
        return entry[1]
    return None


def _class_name(config: Mapping[str, Any], config_path: Path) -> str:
    named = _pipeline_class_name(config_path.parent)
    if named is not None:
        return named
    architectures = config.get("architectures")
    if isinstance(architectures, list) and architectures and isinstance(architectures[0], str):
        return architectures[0]
    raise usage_error(
        f"{config_path} names no model class (no 'architectures', and no model_index.json entry next to it); "
        "save the model with save_pretrained, or point load_component at a pipeline folder"
    )


def _config_digest_document(config_path: Path) -> dict[str, Any]:
    """config.json as saved, less what records who saved it and in which dtype, as plain JSON for the key."""
    with open(config_path, "rb") as stream:
        raw = decode_json(stream.read(_CONFIG_LIMIT_BYTES + 1), max_bytes=_CONFIG_LIMIT_BYTES)
    public = {key: value for key, value in raw.items() if key not in _UNKEYED_CONFIG} if isinstance(raw, dict) else {}
    loaded: dict[str, Any] = json.loads(json.dumps(public, sort_keys=True, default=str))
    return loaded


class TransformersFamily:
    """transformers `PreTrainedModel` components: CLIP, T5/UMT5, Gemma2, Qwen2, Llama, Siglip, ..."""

    __slots__ = ()

    @property
    def family_name(self) -> ModelFamilyName:
        return ModelFamilyName.TRANSFORMERS

    def import_up_front(self, clock: ImportClock) -> None:
        clock.import_modules(_UP_FRONT_MODULES)
        repair_transformers_initializers(required=False)  # an earlier import may have recorded no-ops; loads insist

    def model_class(self, config: Mapping[str, Any], config_path: Path, clock: ImportClock | None) -> type[Any]:
        """The class `model_index.json` (or else `architectures`) names, looked up in transformers only.

        A class transformers does not ship (remote code) is refused: nothing here runs code from a model folder.
        """
        class_name = _class_name(config, config_path)
        if not class_name.isidentifier():
            raise usage_error(f"{config_path} names {class_name!r}, which is not a transformers model class")
        self.import_up_front(clock if clock is not None else ImportClock())
        import transformers

        try:
            model_class = getattr(transformers, class_name, None)
        except (ImportError, AttributeError, RuntimeError):  # a class whose optional dependency is missing
            model_class = None
        if not isinstance(model_class, type) or not is_transformers_model(model_class):
            remote = " (its config maps it to remote code, which is never run)" if "auto_map" in config else ""
            raise usage_error(
                f"{config_path} names {class_name!r}, which is not a transformers PreTrainedModel class{remote}; "
                "load it with its own library instead"
            )
        return model_class

    def model_config(self, model_class: type[Any], resolved_root: Path) -> dict[str, Any]:
        """config.json as saved, without the fields that only record who saved it or the dtype it was saved in."""
        return _config_digest_document(resolved_root / "config.json")

    def library_versions(self) -> dict[str, str]:
        import transformers

        return {"transformers": str(transformers.__version__), "torch": str(torch.__version__)}

    def load_config(self, model_class: type[Any], resolved_root: Path) -> Any:
        """The config object as `from_pretrained` reads it (local files only)."""
        try:
            return model_class.config_class.from_pretrained(str(resolved_root), local_files_only=True)
        except (OSError, *_BROKEN_CONFIG_ERRORS) as exc:
            raise usage_error(
                f"transformers cannot read {resolved_root / 'config.json'} ({type(exc).__name__}: {exc}); "
                "fix or re-download the model folder"
            ) from exc

    def build_skeleton(
        self, model_class: type[Any], resolved_root: Path, name_or_path: str, dtype: torch.dtype = torch.bfloat16
    ) -> torch.nn.Module:
        """The model as `from_pretrained(dtype=dtype)` constructs it: every tensor on `meta`, ties not applied yet."""
        from transformers.monkey_patching import patch_output_recorders

        config = self.load_config(model_class, resolved_root)
        config.dtype = dtype  # what from_pretrained's dtype resolution records, on the config and its sub-configs
        for key in getattr(config, "sub_configs", {}):
            sub_config = getattr(config, key, None)
            if sub_config is not None:
                sub_config.dtype = dtype
        config.name_or_path = name_or_path
        try:
            with ExitStack() as stack:
                for context in model_class.get_init_context(dtype, False, False, False):
                    stack.enter_context(context)
                model = model_class(config)
                patch_output_recorders(model)  # as from_pretrained does right after construction
        except _BROKEN_CONFIG_ERRORS as exc:
            raise usage_error(
                f"{resolved_root / 'config.json'} does not describe a buildable {model_class.__name__} "
                f"({type(exc).__name__}: {exc}); fix or re-download the model folder"
            ) from exc
        model.eval()
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"{model_class.__name__}(config) returned {type(model).__name__}")
        return model

    def load_canonical(
        self, model_class: type[Any], source: PreparedWeightSource, name_or_path: str, options: LoadOptions
    ) -> torch.nn.Module:
        """Exactly `model_class.from_pretrained(folder, dtype=...)` from local files; its errors leave typed."""
        extra: dict[str, Any] = {"variant": options.variant} if options.variant is not None else {}
        if options.disable_mmap:
            extra["disable_mmap"] = True
        repair_transformers_initializers()  # its non-persistent buffers are initialized through that table
        with canonical_load_errors("transformers", source.resolved_root, _BROKEN_CONFIG_ERRORS):
            model = model_class.from_pretrained(
                str(source.resolved_root),
                dtype=options.dtype,
                use_safetensors=source.use_safetensors,
                local_files_only=True,
                **extra,
            )
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"{model_class.__name__}.from_pretrained returned {type(model).__name__}")
        model.config.name_or_path = name_or_path  # type: ignore[union-attr]
        return model

    def checkpoint_bindings(
        self, model: torch.nn.Module, source: PreparedWeightSource, records: NodeSourceDigestCache | None = None
    ) -> tuple[dict[str, str], dict[str, str]]:
        return checkpoint_bindings(model, source, records)


TRANSFORMERS_FAMILY = TransformersFamily()
"""The one transformers family instance the loader uses."""


def _checkpoint_keys(source: PreparedWeightSource) -> list[str]:
    if source.recorded is not None:  # a load by name: the index lists each file's tensor names
        return [name for file in source.recorded.files for name in file.tensor_names]
    if not source.use_safetensors:
        raise _unsupported(
            f"{source.resolved_root} holds pickle (.bin) weights only; a transformers component is served from an "
            "artifact only when its checkpoint is safetensors (re-save it with save_pretrained to share it)",
            folder=str(source.resolved_root),
        )
    keys: list[str] = []
    for path in source.weight_files:
        keys.extend(read_safetensors_header(path))
    return keys


def _renamed_keys(model: Any, keys: Iterable[str]) -> dict[str, str]:
    """Model state-dict name -> checkpoint key, renamed exactly as transformers renames them while loading.

    A model tensor that a weight converter builds from several checkpoint tensors is left out: it
    is not one checkpoint tensor, so it cannot be bound (a streaming build then refuses, typed).
    """
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    transforms = get_model_conversion_mapping(model, None, None)
    renamings = [entry for entry in transforms if isinstance(entry, WeightRenaming)]
    converters = [entry for entry in transforms if isinstance(entry, WeightConverter)]
    meta_state = model.state_dict()
    prefix = getattr(model, "base_model_prefix", None)
    found: dict[str, str] = {}
    for key in keys:
        renamed, pattern = rename_source_key(key, renamings, converters, prefix, meta_state)
        if renamed not in meta_state and key in meta_state:
            renamed, pattern = rename_source_key(key, [], [], prefix, meta_state)
        if renamed not in meta_state or pattern is not None:
            continue
        if renamed in found:
            raise _unsupported(
                f"checkpoint keys {found[renamed]!r} and {key!r} both load into {renamed!r}; transformers keeps "
                "one of them, which an artifact cannot tell apart: this checkpoint is served canonically",
                tensor=renamed,
            )
        found[renamed] = key
    return found


def _effective_ties(ties: Mapping[str, str], present: set[str]) -> dict[str, str]:
    """Alias -> owner, as `tie_weights(missing_keys=...)` decides: the name the checkpoint holds owns the tie."""
    aliases: dict[str, str] = {}
    pairs = list(ties.items())
    for position, (target, source) in enumerate(pairs):
        source_there, target_there = source in present, target in present
        if source_there and target_there:
            raise _unsupported(
                f"the checkpoint holds both {source!r} and {target!r}, which the model ties; transformers ties them "
                "only when their values are equal, which only reading them can tell: this checkpoint is served "
                "canonically (re-save it with save_pretrained to store the tied tensor once)",
                tensor=target,
            )
        if target_there:
            aliases[source] = target
        elif source_there:
            aliases[target] = source
        else:
            backup = next((t for t, s in pairs[position + 1 :] if s == source and t in present), None)
            if backup is None:
                raise _unsupported(
                    f"the checkpoint holds neither {source!r} nor {target!r}, which the model ties; transformers "
                    "would initialize them at random, which no artifact reproduces: this checkpoint is served "
                    "canonically",
                    tensor=target,
                )
            aliases[target] = backup
    return aliases


def checkpoint_bindings(
    model: torch.nn.Module, source: PreparedWeightSource, records: NodeSourceDigestCache | None = None
) -> tuple[dict[str, str], dict[str, str]]:
    """(model name -> checkpoint key, alias -> owner) for a skeleton, both as transformers' loading decides them.

    Every other model tensor must come from the checkpoint: one transformers would initialize at
    random (a key the checkpoint lacks) makes the component UNSUPPORTED, so it is loaded canonically.
    Kept per process, and with the node's cache (`records`) recorded for the node's next worker.
    """
    checkpoint_keys = _checkpoint_keys(source)
    ties = dict(getattr(model, "all_tied_weights_keys", None) or {})
    key = binding_plan_key(model, checkpoint_keys, ties)
    keys, aliases = BINDING_PLANS.bindings(key, lambda: _bind_on_node(model, source, checkpoint_keys, ties, records))
    return dict(keys), dict(aliases)


def _bind_on_node(
    model: torch.nn.Module,
    source: PreparedWeightSource,
    checkpoint_keys: list[str],
    ties: dict[str, str],
    records: NodeSourceDigestCache | None,
) -> tuple[dict[str, str], dict[str, str]]:
    """The node's record of these bindings where one fits the skeleton exactly; else computed (and recorded)."""
    if records is None:
        return _bind(model, source, checkpoint_keys, ties)
    key = node_binding_key(model, checkpoint_keys, ties)
    recorded = records.derived_value(key)
    if recorded is not None:
        found = bindings_from_record(recorded, set(model.state_dict()), checkpoint_keys)
        if found is not None:
            return found
    keys, aliases = _bind(model, source, checkpoint_keys, ties)
    records.record_derived(key, bindings_record(keys, aliases))
    return keys, aliases


def _bind(
    model: torch.nn.Module, source: PreparedWeightSource, checkpoint_keys: list[str], ties: dict[str, str]
) -> tuple[dict[str, str], dict[str, str]]:
    """`checkpoint_bindings` computed: transformers' renaming of every key, the effective ties, the lacking check."""
    BINDING_PLANS.count_renaming()
    keys = _renamed_keys(model, checkpoint_keys)
    aliases = _effective_ties(ties, set(keys))
    lacking = sorted(set(model.state_dict()) - set(keys) - set(aliases))
    if lacking:
        raise _unsupported(
            f"the checkpoint in {source.resolved_root} lacks {len(lacking)} tensor(s) the model owns, e.g. "
            f"{lacking[:_MAX_LISTED]}; transformers would initialize them at random (or build them with a weight "
            "conversion), which an artifact cannot reproduce: this component is served canonically",
            lacking=len(lacking),
        )
    return keys, aliases


class TransformersLeaseRestorer(FinalLayoutTensorRestorer):
    """Checks a transformers lease against the identity (key, schema, coverage, shapes, dtypes), binding nothing."""

    @property
    def schema(self) -> str:
        return TRANSFORMERS_RESTORER_SCHEMA


def _live_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return dict([*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)])


def _check_bound(model: torch.nn.Module, context: FinalLayoutIdentityContext, lease: HostWeightLease) -> None:
    """Every owned tensor is the lease's (same bytes, dtype, shape: no copy, no cast); every alias its owner's."""
    live = _live_tensors(model)
    leased = lease.tensors
    for tensor in context.tensors:
        value = live.get(tensor.local_name)
        expected = leased[tensor.name]
        if value is None or value.data_ptr() != expected.data_ptr() or value.dtype != expected.dtype:
            raise restore_error(
                f"{tensor.local_name} is not the artifact's tensor after transformers restored the model "
                "(copied, cast or missing); discard this model",
                tensor=tensor.name,
            )
    for alias, owner in context.aliases.items():
        dit, _, local_alias = alias.partition(".")
        local_owner = owner.partition(".")[2]
        if live.get(local_alias) is not live.get(local_owner):
            raise restore_error(f"{local_alias} is not tied to {local_owner} after restore", tensor=alias, dit=dit)


def _finish_from_state(model: torch.nn.Module, state: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
    """What `from_pretrained(state_dict=...)` does after it built the model, done on the skeleton built once.

    The state is keyed by the model's own names in their final dtypes (the artifact holds them so), so
    transformers' renaming, casting and loader threads have nothing to do: each tensor is placed with
    its own `set_param_for_module` (a view, no copy, flagged initialized), then its finalization runs
    (non-persistent buffers off `meta`, initialization of anything still missing, ties), evaluation mode
    and no kernels. The names are the model's own, so no conversion rule applied and none is kept for saving.
    """
    from transformers.core_model_loading import dot_natural_key, set_param_for_module
    from transformers.modeling_utils import LoadStateDictConfig
    from transformers.utils.loading_report import LoadStateDictInfo

    model_class: Any = type(model)
    pretrained: Any = model
    load_config = LoadStateDictConfig(dtype=dtype, dtype_plan=pretrained._get_dtype_plan(dtype), weight_mapping=[])
    loading_info = LoadStateDictInfo(
        missing_keys=set(model.state_dict()),
        unexpected_keys=set(),
        mismatched_keys=set(),
        conversion_errors={},
        error_msgs=[],
        skipped_pp_keys=set(),
    )
    place: Any = set_param_for_module  # its quantizer argument is typed non-optional; None is "no quantizer"
    for name in sorted(state, key=dot_natural_key):
        place(pretrained, name, state[name][...], loading_info, None)
    pretrained._weight_conversions = []
    model_class._finalize_model_loading(pretrained, load_config, loading_info)
    model.eval()
    pretrained.set_use_kernels(False, None)


def restore_from_lease(
    context: FinalLayoutIdentityContext,
    holder: torch.nn.Module,
    model: torch.nn.Module,
    lease: HostWeightLease,
    *,
    source: PreparedWeightSource,
    dtype: torch.dtype,
) -> torch.nn.Module:
    """The identity's own skeleton finished by transformers from the lease's tensors, checked to hold them uncopied.

    The skeleton is the model `from_pretrained` would build (`build_skeleton`), so it is finished in
    place rather than built a second time; a model whose restore failed must be discarded.
    """
    TransformersLeaseRestorer(context)._plan_on_identity_skeleton(holder, lease)  # validation only: binds nothing
    context.ensure_sources_unchanged()
    leased = lease.tensors
    state = {tensor.local_name: leased[tensor.name] for tensor in context.tensors}
    repair_transformers_initializers()  # the finalization initializes the non-persistent buffers through it
    try:
        _finish_from_state(model, state, dtype)
    except (OSError, *_BROKEN_CONFIG_ERRORS) as exc:
        raise restore_error(f"transformers could not finish the model from the artifact's tensors: {exc}") from exc
    pretrained: Any = model
    if hasattr(pretrained, "adjust_generation_fn") and pretrained.can_generate():  # generation_config.json
        pretrained.adjust_generation_fn(
            None, False, None, str(source.resolved_root), None, False, None, True, None, None, "", None
        )
    _check_bound(model, context, lease)
    for contract in context.model_contracts:
        try:
            contract.validator(model)
        except Exception as exc:
            raise restore_error(
                f"{contract.model_class_name} failed its contract validator after restore: {exc}"
            ) from exc
    return model

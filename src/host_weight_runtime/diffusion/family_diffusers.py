"""The diffusers model family: `ModelMixin` classes, named by `_class_name` in a folder's config.json."""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch

from ..failures import FailureCode, usage_error
from ._initializers import repair_transformers_initializers
from ._load_options import LoadOptions
from .dtype_policies import ModelFamilyName
from .model_contracts import is_diffusers_model
from .model_family import ImportClock, canonical_load_errors, default_dtype
from .source_identity import NodeSourceDigestCache, PreparedWeightSource

__all__ = ["BROKEN_CONFIG_ERRORS", "DIFFUSERS_FAMILY", "DiffusersFamily", "build_skeleton"]

BROKEN_CONFIG_ERRORS = (ValueError, TypeError, KeyError, AttributeError, IndexError, RuntimeError, RecursionError)
"""What a library raises, deep inside from_config or from_pretrained, about a config or checkpoint it cannot use."""

_UP_FRONT_MODULES = ("accelerate", "diffusers", "diffusers.models.modeling_utils")
_MAX_LISTED = 5


def build_skeleton(
    model_class: type[Any], resolved_root: Path, name_or_path: str, dtype: torch.dtype = torch.bfloat16
) -> torch.nn.Module:
    """The model built the way diffusers' from_pretrained builds it, with parameters left on `meta`.

    Non-persistent buffers are computed for real (they are not in the artifact), under the
    same default dtype as a canonical load, so a restored model equals a canonical one.
    """
    import accelerate
    from diffusers.models.modeling_utils import no_init_weights

    try:
        config = model_class.load_config(str(resolved_root))
        with default_dtype(dtype), no_init_weights(), accelerate.init_empty_weights():
            model = model_class.from_config(config)
    except BROKEN_CONFIG_ERRORS as exc:
        raise usage_error(
            f"{resolved_root / 'config.json'} does not describe a buildable {model_class.__name__} "
            f"({type(exc).__name__}: {exc}); fix or re-download the model folder"
        ) from exc
    repair_transformers_initializers(required=False)  # in case the build first imported transformers in its window
    model.eval()
    model.register_to_config(_name_or_path=name_or_path)
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"{model_class.__name__}.from_config returned {type(model).__name__}")
    return model


def _check_complete(model: torch.nn.Module, source: PreparedWeightSource) -> None:
    """diffusers only warns about model tensors the checkpoint lacks and leaves them on `meta`: no usable model."""
    missing = [name for name, tensor in (*model.named_parameters(), *model.named_buffers()) if tensor.is_meta]
    if missing:
        raise usage_error(
            f"the checkpoint in {source.resolved_root} lacks {len(missing)} tensor(s) the model needs, e.g. "
            f"{missing[:_MAX_LISTED]}; diffusers left them uninitialised, so the weights do not match config.json: "
            "complete the checkpoint (a missing or partial weight index?) or re-download the model folder",
            code=FailureCode.CANONICAL_SOURCE_FAILED,
            missing=len(missing),
        )


class DiffusersFamily:
    """diffusers `ModelMixin` components: transformers (DiTs), VAEs, UNets."""

    __slots__ = ()

    @property
    def family_name(self) -> ModelFamilyName:
        return ModelFamilyName.DIFFUSERS

    def import_up_front(self, clock: ImportClock) -> None:
        clock.import_modules(_UP_FRONT_MODULES)

    def model_class(self, config: Mapping[str, Any], config_path: Path, clock: ImportClock | None) -> type[Any]:
        """The diffusers class named by `_class_name`, as diffusers resolves it (its module imports on `clock`)."""
        class_name = config.get("_class_name")
        if not isinstance(class_name, str) or not class_name:
            raise usage_error(
                f"{config_path} has no _class_name (diffusers) and no model_type or architectures (transformers); "
                "it is not a model config"
            )
        if not class_name.isidentifier():
            raise usage_error(f"{config_path} names {class_name!r}, which is not a diffusers model class")
        import diffusers

        model_class = vars(diffusers).get(class_name)  # diffusers keeps a class here once its module is imported
        if model_class is None:
            with clock.measure() if clock is not None else nullcontext():
                model_class = getattr(diffusers, class_name, None)
        if not isinstance(model_class, type) or not is_diffusers_model(model_class):
            raise usage_error(f"{config_path} names {class_name!r}, which is not a diffusers model class")
        return model_class

    def model_config(self, model_class: type[Any], resolved_root: Path) -> dict[str, Any]:
        return dict(model_class.load_config(str(resolved_root)))

    def build_skeleton(
        self, model_class: type[Any], resolved_root: Path, name_or_path: str, dtype: torch.dtype = torch.bfloat16
    ) -> torch.nn.Module:
        return build_skeleton(model_class, resolved_root, name_or_path, dtype)

    def checkpoint_bindings(
        self, model: torch.nn.Module, source: PreparedWeightSource, records: NodeSourceDigestCache | None = None
    ) -> tuple[dict[str, str], dict[str, str]]:
        """diffusers reads every tensor under its own name and declares no ties."""
        return {}, {}

    def library_versions(self) -> dict[str, str]:
        import diffusers

        return {"diffusers": str(diffusers.__version__), "torch": str(torch.__version__)}

    def load_canonical(
        self, model_class: type[Any], source: PreparedWeightSource, name_or_path: str, options: LoadOptions
    ) -> torch.nn.Module:
        """from_pretrained(torch_dtype=options.dtype), from local files only.

        What diffusers raises about the folder (a checkpoint that does not match config.json, an unreadable
        file) leaves typed: a HostWeightUsageError, or CANONICAL_SOURCE_FAILED for an OS error.
        """
        with canonical_load_errors("diffusers", source.resolved_root, BROKEN_CONFIG_ERRORS):
            model = model_class.from_pretrained(
                str(source.resolved_root),
                torch_dtype=options.dtype,
                use_safetensors=source.use_safetensors,
                variant=options.variant,
                disable_mmap=options.disable_mmap,
            )
        repair_transformers_initializers(required=False)  # diffusers builds it inside no_init_weights, too
        model.register_to_config(_name_or_path=name_or_path)
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"{model_class.__name__}.from_pretrained returned {type(model).__name__}")
        _check_complete(model, source)
        return model


DIFFUSERS_FAMILY = DiffusersFamily()
"""The family `load_component` serves."""

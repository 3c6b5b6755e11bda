"""Model contracts for diffusers transformer classes.

A contract names the implementation whose tensors an artifact holds, the modules it
keeps in FP32, and a validator that refuses a restored model that is not ready to serve.
Classes are recognised by name and MRO, so this module never imports diffusers.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from ..canonical_json import CanonicalJson, canonical_sha256
from ..failures import FailureCode, HostWeightError, HostWeightFailure, ResolutionStage
from .contracts import FinalLayoutModelContract, ImplementationIdentity, keeps_fp32

__all__ = [
    "FIRST_CLASS_CONTRACTS",
    "ModelNotReadyError",
    "contract_for_model",
    "is_diffusers_model",
    "is_transformers_model",
]

_CONTRACT_VERSION = "1"
_LABELS = {torch.bfloat16: "BF16", torch.float16: "FP16", torch.float32: "FP32"}


class ModelNotReadyError(ValueError):
    """A restored model failed its contract's validator."""


def is_transformers_model(model_type: type[object]) -> bool:
    """True for subclasses of transformers' `PreTrainedModel`, without importing transformers."""
    return any(
        klass.__name__ == "PreTrainedModel" and klass.__module__.startswith("transformers.")
        for klass in model_type.__mro__
    )


def is_diffusers_model(model_type: type[object]) -> bool:
    """True for subclasses of diffusers' `ModelMixin`, without importing diffusers."""
    return any(
        klass.__name__ == "ModelMixin" and klass.__module__.startswith("diffusers.") for klass in model_type.__mro__
    )


def _weight_scale(module: torch.nn.Module) -> object:
    """`getattr(module, "weight_scale", None)` without the AttributeError that nn.Module raises for
    every module lacking it (a thousand exceptions per Flux restore): look only where getattr would."""
    name = "weight_scale"
    if (
        name in module.__dict__
        or name in module._parameters
        or name in module._buffers
        or name in module._modules
        or hasattr(type(module), name)
    ):
        return getattr(module, name, None)
    return None


def _tensor_name(prefix: str, attribute: str) -> str:
    return f"{prefix}.{attribute}" if prefix else attribute


def _require_served(model: torch.nn.Module) -> None:
    """Eval mode and every tensor materialized (not on `meta`): what any family's restored model must be."""
    _require_ready(model, (), None)


def _require_ready(
    model: torch.nn.Module, keep_in_fp32_modules: tuple[str, ...], dtype: torch.dtype | None = torch.bfloat16
) -> None:
    """Every tensor is materialized on the host; floating parameters follow the dtype policy (None: any dtype);
    eval mode.

    One walk over the modules (the tensors `named_parameters`/`named_buffers(remove_duplicate=False)` give),
    reading each module's own tensor dicts, so the check costs one pass per tensor. `requires_grad` is left as
    diffusers gives it: a lease maps private copy-on-write, so not even a write to a parameter can reach the
    artifact.
    """
    if model.training:
        raise ModelNotReadyError(f"{type(model).__name__} is in training mode; a restored model serves in eval mode")
    mismatch: str | None = None
    for prefix, module in model.named_modules(remove_duplicate=False):
        for attribute, buffer in module._buffers.items():
            if buffer is not None and buffer.is_meta:
                raise ModelNotReadyError(
                    f"{_tensor_name(prefix, attribute)} is still on the meta device; the model was not fully restored"
                )
        # FP8 representation: an FP8Linear's weight is float8_e4m3fn next to its FP32 weight_scale.
        quantized = dtype is not None and isinstance(_weight_scale(module), torch.Tensor)
        for attribute, parameter in module._parameters.items():
            if parameter is None:
                continue
            if parameter.is_meta:
                raise ModelNotReadyError(
                    f"{_tensor_name(prefix, attribute)} is still on the meta device; the model was not fully restored"
                )
            if dtype is None or mismatch is not None or not parameter.dtype.is_floating_point:
                continue
            if quantized and attribute == "weight" and parameter.dtype == torch.float8_e4m3fn:
                continue
            name = _tensor_name(prefix, attribute)
            expected = torch.float32 if keep_in_fp32_modules and keeps_fp32(name, keep_in_fp32_modules) else dtype
            if parameter.dtype != expected:
                # Reported after the walk, so a tensor still on meta anywhere is named first.
                mismatch = f"{name} is {parameter.dtype}; the {_LABELS[dtype]} policy requires {expected}"
    if mismatch is not None:
        raise ModelNotReadyError(mismatch)


def _require_modules(*names: str) -> Callable[[torch.nn.Module], None]:
    def check(model: torch.nn.Module) -> None:
        missing = [name for name in names if not hasattr(model, name)]
        if missing:
            raise ModelNotReadyError(f"{type(model).__name__} lacks the modules {missing} its contract requires")

    return check


def _contract(
    class_name: str,
    keep_in_fp32_modules: tuple[str, ...],
    required_modules: tuple[str, ...],
    *,
    first_class: bool = True,
    dtype: torch.dtype = torch.bfloat16,
) -> FinalLayoutModelContract:
    structure = _require_modules(*required_modules)

    def validate(model: torch.nn.Module) -> None:
        structure(model)
        _require_ready(model, keep_in_fp32_modules, dtype)

    document = {
        "class": class_name,
        "version": _CONTRACT_VERSION,
        "keep_in_fp32_modules": list(keep_in_fp32_modules),
        "required_modules": list(required_modules),
        "validator": f"host tensors, {_LABELS[dtype]} policy dtypes, no grad, eval mode",
    }
    return FinalLayoutModelContract(
        implementation=ImplementationIdentity(
            implementation_id=f"diffusers.{class_name}",
            version=_CONTRACT_VERSION,
            fingerprint=canonical_sha256(document),
        ),
        model_class_name=class_name,
        keep_in_fp32_modules=keep_in_fp32_modules,
        validator=validate,
        first_class=first_class,
    )


_FIRST_CLASS: Mapping[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "FluxTransformer2DModel": (
        (),
        ("x_embedder", "context_embedder", "transformer_blocks", "single_transformer_blocks", "proj_out"),
    ),
    "Flux2Transformer2DModel": (
        (),
        ("x_embedder", "context_embedder", "transformer_blocks", "single_transformer_blocks", "proj_out"),
    ),
    "MiniMaxH3Transformer3DModel": (
        ("proj_in", "audio_proj_in", "time_embedder", "proj_out", "audio_proj_out", "rope"),
        ("proj_in", "proj_out", "rope"),
    ),
    "SD3Transformer2DModel": ((), ("pos_embed", "context_embedder", "transformer_blocks", "proj_out")),
    "WanTransformer3DModel": (
        ("rope", "time_embedder", "scale_shift_table", "norm1", "norm2", "norm3"),
        ("patch_embedding", "condition_embedder", "blocks", "proj_out", "rope"),
    ),
}
"""Class name -> (modules kept in FP32, modules the validator requires) of the first-class diffusers models."""

FIRST_CLASS_CONTRACTS: Mapping[str, FinalLayoutModelContract] = {
    name: _contract(name, keep, required) for name, (keep, required) in _FIRST_CLASS.items()
}
"""The BF16 contracts of the first-class models (FP16 and FP32 contracts differ only in their validator's dtype)."""


def _declared_fp32_modules(model_type: type[object]) -> tuple[str, ...]:
    declared = getattr(model_type, "_keep_in_fp32_modules", None)
    if declared is None:
        return ()
    if isinstance(declared, str):
        return (declared,)
    return tuple(str(name) for name in declared)


def _unsupported(message: str, **details: str) -> HostWeightError:
    return HostWeightError(
        HostWeightFailure(
            ResolutionStage.CONFIGURATION, FailureCode.UNSUPPORTED, False, message, CanonicalJson.from_value(details)
        )
    )


def _transformers_contract(model: torch.nn.Module, dtype: torch.dtype) -> FinalLayoutModelContract:
    """A transformers model's contract: its dtype plan at `dtype`, read from the instance as from_pretrained does."""
    plan_of = getattr(model, "_get_dtype_plan", None)
    plan = plan_of(dtype) if callable(plan_of) else {}
    keep = tuple(sorted(str(pattern) for pattern in plan))
    class_name = type(model).__name__
    document = {
        "class": class_name,
        "family": "transformers",
        "version": _CONTRACT_VERSION,
        "dtype_plan": list(keep),
        "validator": "host tensors, eval mode; dtypes and zero-copy binding checked against the lease on restore",
    }

    def validate(restored: torch.nn.Module) -> None:
        _require_served(restored)

    return FinalLayoutModelContract(
        implementation=ImplementationIdentity(
            implementation_id=f"transformers.{class_name}",
            version=_CONTRACT_VERSION,
            fingerprint=canonical_sha256(document),
        ),
        model_class_name=class_name,
        keep_in_fp32_modules=keep,
        validator=validate,
        first_class=False,
    )


def contract_for_model(model: torch.nn.Module, dtype: torch.dtype = torch.bfloat16) -> FinalLayoutModelContract:
    """The model's contract at `dtype`: first-class, generic diffusers, transformers, else refused (D08)."""
    model_type = type(model)
    if dtype not in _LABELS:
        raise _unsupported(f"no final-layout contract serves {dtype}", model_class=model_type.__qualname__)
    if is_transformers_model(model_type):
        return _transformers_contract(model, dtype)
    if not is_diffusers_model(model_type):
        raise _unsupported(
            f"{model_type.__module__}.{model_type.__qualname__} has no final-layout restore contract; only diffusers "
            "ModelMixin and transformers PreTrainedModel subclasses can build a final-layout identity",
            model_class=model_type.__qualname__,
        )
    declared = _declared_fp32_modules(model_type)
    contract = FIRST_CLASS_CONTRACTS.get(model_type.__name__)
    if contract is not None:
        if declared != contract.keep_in_fp32_modules:
            raise _unsupported(
                f"{model_type.__name__} keeps {list(declared)} in FP32 but its contract expects "
                f"{list(contract.keep_in_fp32_modules)}; this diffusers version changed the class, so the contract "
                "must be reviewed before its artifacts can be trusted",
                model_class=model_type.__name__,
            )
        if dtype == torch.bfloat16:
            return contract
        required = _FIRST_CLASS.get(model_type.__name__, ((), ()))[1]
        return _contract(model_type.__name__, contract.keep_in_fp32_modules, required, dtype=dtype)
    return _contract(model_type.__name__, declared, (), first_class=False, dtype=dtype)

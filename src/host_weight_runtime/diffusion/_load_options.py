"""The `from_pretrained` arguments `load_component` accepts, checked before anything is touched.

A diffusers user pastes an existing `from_pretrained(...)` call. Every argument that call
may carry is either honoured, accepted because it cannot change the result here (nothing
is downloaded; the model is built on `meta` and lands on the CPU), or refused with one
error type, `HostWeightUsageError`, that names the argument and says what to do instead.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from ..failures import FailureCode, HostWeightUsageError, usage_error
from .contracts import FinalLayoutParallelIdentity

__all__ = ["LOAD_ARGUMENTS", "LoadOptions", "check_dtype", "check_load_arguments", "check_parallel", "check_variant"]

_VARIANT = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]*")
_CPU_NAMES = frozenset({"cpu"})

# from_pretrained arguments that only a default value leaves harmless here: (accepted values, what to do instead).
_DEFAULT_ONLY: dict[str, tuple[tuple[object, ...], str]] = {
    "force_download": ((False, None), "nothing is downloaded; refresh the local copy with `hf download` first"),
    "ignore_mismatched_sizes": (
        (False, None),
        "an artifact holds exactly the checkpoint's shapes; load with diffusers directly to resize",
    ),
    "max_memory": ((None,), "load_component returns a CPU model and never dispatches it; drop the argument"),
    "offload_folder": ((None,), "load_component never offloads; drop the argument"),
    "offload_state_dict": ((None, False), "load_component never offloads; drop the argument"),
    "quantization_config": (
        (None,),
        "the artifact holds BF16 weights; quantize the loaded model, or load with diffusers directly",
    ),
    "parallel_config": ((None,), "configure parallelism on the loaded model; load_component loads one full copy"),
    "use_flashpack": ((False, None), "load_component reads safetensors (or .bin) checkpoints only"),
    "flashpack_kwargs": ((None,), "load_component reads safetensors (or .bin) checkpoints only"),
}
# Accepted whatever their value: they only say how to reach the network, and nothing is downloaded.
_NETWORK_ONLY = frozenset({"proxies"})

# Every argument name `load_component` takes, for the "did you mean" of a misspelling.
LOAD_ARGUMENTS: tuple[str, ...] = (
    "subfolder",
    "revision",
    "variant",
    "torch_dtype",
    "dtype",
    "cache_dir",
    "use_safetensors",
    "low_cpu_mem_usage",
    "local_files_only",
    "device_map",
    "token",
    "output_loading_info",
    "disable_mmap",
    "runtime",
    "parallel",
    "stream_on_miss",
    "publish_in_background",
    "process_group",
    "representation",
    *_DEFAULT_ONLY,
    *_NETWORK_ONLY,
)


@dataclass(frozen=True, slots=True)
class LoadOptions:
    """The arguments that change which files are read or how the canonical load reads them."""

    variant: str | None = None
    use_safetensors: bool | None = None
    disable_mmap: bool = False
    dtype: torch.dtype = torch.bfloat16
    """The `torch_dtype` served: each of BF16, FP16 and FP32 is its own representation and key."""


def _unsupported(argument: str, message: str) -> HostWeightUsageError:
    return usage_error(message, code=FailureCode.UNSUPPORTED, argument=argument)


def _invalid(argument: str, message: str) -> HostWeightUsageError:
    return usage_error(message, argument=argument)


def check_variant(variant: object) -> str | None:
    """None, or a variant name as diffusers spells it in file names (`fp16` in `*.fp16.safetensors`)."""
    if variant is None:
        return None
    if not isinstance(variant, str) or not _VARIANT.fullmatch(variant):
        raise _invalid(
            "variant", f"variant must be None or a name such as 'fp16' (letters, digits, '_' or '-'), got {variant!r}"
        )
    return variant


_DTYPE_NAMES: dict[str, torch.dtype] = {
    name: dtype
    for dtype in (torch.bfloat16, torch.float16, torch.float32)
    for name in (str(dtype).removeprefix("torch."), str(dtype))
}


def _served_dtype(argument: str, value: object) -> torch.dtype:
    if isinstance(value, torch.dtype) and value in _DTYPE_NAMES.values():
        return value
    if isinstance(value, str) and value in _DTYPE_NAMES:
        return _DTYPE_NAMES[value]
    shown = f"{value!r}" if isinstance(value, str) else str(value)
    raise _unsupported(
        argument,
        f"load_component serves BF16, FP16 and FP32 final layouts; {argument}={shown} is not one of them: pass "
        f"{argument}=torch.bfloat16, torch.float16 or torch.float32 (or their names), or load with diffusers directly",
    )


def check_dtype(torch_dtype: object, dtype: object = None) -> torch.dtype:
    """BF16, FP16 or FP32, given as a torch dtype or its name; `dtype` (the newer spelling) wins when given."""
    chosen = _served_dtype("torch_dtype", torch_dtype)
    if dtype is not None:
        chosen = _served_dtype("dtype", dtype)
    return chosen


def _is_cpu(device: object) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cpu" and device.index in (None, 0)
    return isinstance(device, str) and device in _CPU_NAMES


def _check_device_map(device_map: object) -> None:
    """None, or everything on the CPU: "cpu", torch.device("cpu") or {"": "cpu"}."""
    if device_map is None or _is_cpu(device_map):
        return
    if isinstance(device_map, Mapping) and set(device_map) == {""} and _is_cpu(device_map[""]):
        return
    raise _unsupported(
        "device_map",
        f"load_component returns a CPU model (on a hit its weights are the node's shared host pages), so "
        f"device_map={device_map!r} is not supported: drop it (or pass 'cpu') and move the model after loading, "
        f"e.g. loaded.model.to('cuda')",
    )


def _check_flag(argument: str, value: object) -> bool | None:
    if value is None or isinstance(value, bool):
        return value
    raise _invalid(argument, f"{argument} must be True, False or None, got {value!r}")


def check_load_arguments(
    *,
    torch_dtype: object,
    dtype: object,
    variant: object,
    use_safetensors: object,
    low_cpu_mem_usage: object,
    local_files_only: object,
    device_map: object,
    output_loading_info: object,
    disable_mmap: object,
    parallel: object,
    extra: Mapping[str, object],
) -> LoadOptions:
    """Check every argument; HostWeightUsageError naming the first that load_component cannot honour.

    `low_cpu_mem_usage` and `local_files_only` are accepted and change nothing: the skeleton is
    always built on `meta` (the canonical load keeps diffusers' memory-frugal default), and
    nothing is ever downloaded. A `token` never reaches this function.
    """
    for argument, value in extra.items():
        if argument in _NETWORK_ONLY:
            continue
        if argument in _DEFAULT_ONLY:
            accepted, instead = _DEFAULT_ONLY[argument]
            if any(value is default or (type(value) is type(default) and value == default) for default in accepted):
                continue
            raise _unsupported(argument, f"load_component does not support {argument}={value!r}: {instead}")
        close = difflib.get_close_matches(argument, LOAD_ARGUMENTS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise _invalid(
            argument,
            f"load_component takes no argument {argument!r}{hint}. It accepts what from_pretrained takes for a "
            f"local model (subfolder, revision, variant, torch_dtype, cache_dir, use_safetensors, device_map='cpu', "
            f"...) plus runtime, parallel, stream_on_miss and publish_in_background",
        )
    served = check_dtype(torch_dtype, dtype)
    checked_variant = check_variant(variant)
    safetensors = _check_flag("use_safetensors", use_safetensors)
    _check_flag("low_cpu_mem_usage", low_cpu_mem_usage)
    _check_flag("local_files_only", local_files_only)
    _check_device_map(device_map)
    if _check_flag("output_loading_info", output_loading_info):
        raise _unsupported(
            "output_loading_info",
            "load_component returns a LoadedComponent whose reports say how the model was loaded; a restore "
            "binds every tensor of the checkpoint or falls back, so there are no missing or unexpected keys to "
            "list: drop output_loading_info",
        )
    mmap_off = _check_flag("disable_mmap", disable_mmap)
    check_parallel(parallel)
    return LoadOptions(variant=checked_variant, use_safetensors=safetensors, disable_mmap=bool(mmap_off), dtype=served)


def check_parallel(parallel: object) -> None:
    """None, or a one-rank FinalLayoutParallelIdentity: load_component does not shard models."""
    if parallel is not None and not isinstance(parallel, FinalLayoutParallelIdentity):
        raise _invalid("parallel", "parallel must be a FinalLayoutParallelIdentity")
    if parallel is not None and parallel.tensor_parallel_size > 1:
        raise _unsupported(
            "parallel", "load_component does not shard models; tensor_parallel_size > 1 needs a tensor-parallel loader"
        )

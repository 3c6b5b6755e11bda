"""Tensor vocabulary shared by writers, manifests and leases."""

from __future__ import annotations

import enum
import functools
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


class TensorKind(str, enum.Enum):
    """What a tensor is to the model that owns it."""

    PARAMETER = "parameter"
    BUFFER = "buffer"


class ValidationLevel(str, enum.Enum):
    """How much a lookup checks before it hands out a lease."""

    MANIFEST_AND_METADATA = "manifest_and_metadata"
    FULL_CHECKSUM = "full_checksum"


# The dtype codes of the safetensors format with their item sizes. Validating a manifest or a
# header needs only these, so `hwr inspect`/`verify`/`cleanup` never import torch; mapping a
# code to a torch dtype (which needs torch) is `dtype_from_code`.
SAFETENSORS_ITEMSIZES: dict[str, int] = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "I16": 2,
    "I32": 4,
    "I64": 8,
    "F16": 2,
    "BF16": 2,
    "F32": 4,
    "F64": 8,
    "C64": 8,
    "F8_E4M3": 1,
    "F8_E4M3FNUZ": 1,
    "F8_E5M2": 1,
    "F8_E5M2FNUZ": 1,
    "U16": 2,
    "U32": 4,
    "U64": 8,
}

_TORCH_NAMES: dict[str, str] = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "I16": "int16",
    "I32": "int32",
    "I64": "int64",
    "F16": "float16",
    "BF16": "bfloat16",
    "F32": "float32",
    "F64": "float64",
    "C64": "complex64",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E4M3FNUZ": "float8_e4m3fnuz",
    "F8_E5M2": "float8_e5m2",
    "F8_E5M2FNUZ": "float8_e5m2fnuz",
    "U16": "uint16",
    "U32": "uint32",
    "U64": "uint64",
}


@functools.cache
def safetensors_dtypes() -> dict[str, torch.dtype]:
    """The codes this torch build can map to a dtype (the optional ones need a recent torch); imports torch."""
    import torch

    found: dict[str, torch.dtype] = {}
    for code, attribute in _TORCH_NAMES.items():
        dtype = getattr(torch, attribute, None)
        if isinstance(dtype, torch.dtype):
            found[code] = dtype
    return found


@functools.cache
def _code_by_dtype() -> dict[torch.dtype, str]:
    return {dtype: code for code, dtype in safetensors_dtypes().items()}


if TYPE_CHECKING:
    SAFETENSORS_DTYPES: dict[str, torch.dtype]
else:

    def __getattr__(name: str) -> object:
        """`SAFETENSORS_DTYPES` (code to torch dtype) is built on first use, so importing this module needs no torch."""
        if name == "SAFETENSORS_DTYPES":
            return safetensors_dtypes()
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def dtype_code(dtype: torch.dtype) -> str:
    """The safetensors code for a torch dtype, or ValueError when the format has none."""
    try:
        return _code_by_dtype()[dtype]
    except KeyError:
        raise ValueError(
            f"dtype {dtype} has no safetensors encoding; supported: {sorted(safetensors_dtypes())}"
        ) from None


def dtype_from_code(code: str) -> torch.dtype:
    try:
        return safetensors_dtypes()[code]
    except KeyError:
        raise ValueError(f"unknown safetensors dtype code {code!r}") from None


def itemsize_of_code(code: str) -> int:
    """The item size of a safetensors dtype code without importing torch; ValueError for an unknown code."""
    try:
        return SAFETENSORS_ITEMSIZES[code]
    except KeyError:
        raise ValueError(f"unknown safetensors dtype code {code!r}") from None


def dtype_itemsize(dtype: torch.dtype) -> int:
    return int(dtype.itemsize)


def numel_of(shape: tuple[int, ...]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides: list[int] = []
    step = 1
    for dim in reversed(shape):
        strides.append(step)
        step *= max(dim, 1)
    return tuple(reversed(strides))

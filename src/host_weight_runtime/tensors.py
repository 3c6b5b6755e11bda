"""Tensor vocabulary shared by writers, manifests and leases."""

from __future__ import annotations

import enum

import torch


class TensorKind(str, enum.Enum):
    """What a tensor is to the model that owns it."""

    PARAMETER = "parameter"
    BUFFER = "buffer"


class ValidationLevel(str, enum.Enum):
    """How much a lookup checks before it hands out a lease."""

    MANIFEST_AND_METADATA = "manifest_and_metadata"
    FULL_CHECKSUM = "full_checksum"


def _optional_dtypes() -> dict[str, torch.dtype]:
    found: dict[str, torch.dtype] = {}
    for code, attribute in (
        ("F8_E4M3", "float8_e4m3fn"),
        ("F8_E4M3FNUZ", "float8_e4m3fnuz"),
        ("F8_E5M2", "float8_e5m2"),
        ("F8_E5M2FNUZ", "float8_e5m2fnuz"),
        ("U16", "uint16"),
        ("U32", "uint32"),
        ("U64", "uint64"),
    ):
        dtype = getattr(torch, attribute, None)
        if isinstance(dtype, torch.dtype):
            found[code] = dtype
    return found


# The dtype codes of the safetensors format, restricted to what stock safetensors reads.
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
    "C64": torch.complex64,
    **_optional_dtypes(),
}
_CODE_BY_DTYPE: dict[torch.dtype, str] = {dtype: code for code, dtype in SAFETENSORS_DTYPES.items()}


def dtype_code(dtype: torch.dtype) -> str:
    """The safetensors code for a torch dtype, or ValueError when the format has none."""
    try:
        return _CODE_BY_DTYPE[dtype]
    except KeyError:
        raise ValueError(
            f"dtype {dtype} has no safetensors encoding; supported: {sorted(SAFETENSORS_DTYPES)}"
        ) from None


def dtype_from_code(code: str) -> torch.dtype:
    try:
        return SAFETENSORS_DTYPES[code]
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

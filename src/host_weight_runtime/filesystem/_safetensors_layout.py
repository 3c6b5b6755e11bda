"""The safetensors layout of one payload file, fixed before any byte is written.

Which tensors a file may declare, where each one lives, and the exact header bytes.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..canonical_json import JsonValue, encode_canonical_trusted
from ..protocols import TensorWriteSpec
from ..tensors import dtype_code, dtype_itemsize
from ._write_failures import producer_failed

if TYPE_CHECKING:
    import torch

__all__ = ["HEADER_ALIGNMENT", "METADATA_KEY", "FileLayout", "Placement", "check_specs", "plan_layout", "tensor_bytes"]

# File layout (standard safetensors, readable by stock ``safetensors.safe_open``):
#
#     [u64 little-endian N][N bytes: canonical JSON header, space padded][tensor data]
#      `-- 8 + N is a multiple of 8, so the data section starts 8-byte aligned
#
# Tensors are placed in declared order, stable-sorted by element size (largest first),
# contiguously and without holes, so each tensor's offset is a multiple of its element
# size and a reader can view it zero-copy.

HEADER_ALIGNMENT = 8
METADATA_KEY = "__metadata__"
_HEADER_METADATA: dict[str, JsonValue] = {"format": "pt"}


@dataclass(frozen=True, slots=True)
class Placement:
    """Where one tensor lives; offsets are relative to the data section, as in the header."""

    spec: TensorWriteSpec
    code: str
    begin: int
    end: int
    rows: int
    row_bytes: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True, slots=True)
class FileLayout:
    """The complete plan of one payload file, fixed before any byte is written."""

    header: bytes  # the whole prefix: length word, JSON and padding
    placements: tuple[Placement, ...]  # offset order
    size: int


def check_specs(name: str, specs: Iterable[TensorWriteSpec]) -> tuple[TensorWriteSpec, ...]:
    """The declared tensors of file `name`, or a producer failure saying why they cannot be laid out."""
    try:
        declared = tuple(specs)
    except TypeError:
        raise producer_failed(f"{name}: specs must be a tuple of TensorWriteSpec", file=name) from None
    if not declared:
        raise producer_failed(f"{name}: a payload file must declare at least one tensor", file=name)
    seen: set[str] = set()
    for spec in declared:
        if not isinstance(spec, TensorWriteSpec):
            raise producer_failed(f"{name}: specs must be TensorWriteSpec, got {type(spec).__name__}", file=name)
        if spec.name in seen:
            raise producer_failed(f"{name}: tensor {spec.name} is declared twice", file=name, tensor=spec.name)
        if spec.name == METADATA_KEY:
            raise producer_failed(
                f"{name}: {METADATA_KEY} is reserved by safetensors; rename the tensor",
                file=name,
                tensor=spec.name,
            )
        try:
            dtype_code(spec.dtype)
        except ValueError as exc:
            raise producer_failed(f"{name}: tensor {spec.name}: {exc}", file=name, tensor=spec.name) from None
        seen.add(spec.name)
    return declared


def plan_layout(specs: tuple[TensorWriteSpec, ...]) -> FileLayout:
    """Place tensors by element size (largest first, stable) and build the padded header."""
    itemsizes = {spec.name: dtype_itemsize(spec.dtype) for spec in specs}
    ordered = sorted(specs, key=lambda spec: -itemsizes[spec.name])
    placements: list[Placement] = []
    position = 0
    header_value: dict[str, JsonValue] = {METADATA_KEY: dict(_HEADER_METADATA)}
    for spec in ordered:
        code = dtype_code(spec.dtype)
        nbytes = spec.nbytes
        if spec.shape:
            rows = spec.shape[0]
            row_bytes = nbytes // rows if rows else 0
        else:
            rows, row_bytes = 1, nbytes
        placements.append(Placement(spec, code, position, position + nbytes, rows, row_bytes))
        header_value[spec.name] = {
            "dtype": code,
            "shape": list(spec.shape),
            "data_offsets": [position, position + nbytes],
        }
        position += nbytes
    text = encode_canonical_trusted(header_value)  # names, codes and ints of validated TensorWriteSpecs
    padding = -(8 + len(text)) % HEADER_ALIGNMENT
    body = text + b" " * padding
    header = len(body).to_bytes(8, "little") + body
    return FileLayout(header=header, placements=tuple(placements), size=len(header) + position)


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """A flat uint8 view of the tensor's bytes; copies only when the input is not contiguous."""
    import torch  # the caller holds a tensor, so this is a lookup; the module itself stays torch-free

    source = tensor.detach()
    if source.is_conj():
        source = source.resolve_conj()
    if source.is_neg():
        source = source.resolve_neg()
    return source.contiguous().reshape(-1).view(torch.uint8).numpy().data

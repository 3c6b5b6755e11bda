"""FP8 per tensor from the checkpoint: the full tensor's scale first, then each chunk cast with it.

The FP8 representation's bytes (`diffusion/fp8.py`) are q = (W_bf16.float() / scale) as
float8_e4m3fn with scale = amax(|W_bf16|) / 448 over the whole weight. Rounding to BF16 is
monotonic, so the amax of the BF16 chunks is the amax of the BF16 tensor; the quantization is
elementwise, so any rows or columns of the weight (one chunk, one TP rank's part) quantize to
the matching slice of the post-load bytes. `FP8StreamCast` does both for the single-artifact
producer and for a bundle that cuts every chunk into rank parts, at any TP size.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable

import torch

from ..fp8 import FP8_DTYPE, fp8_scale
from ..tensor_layout import FinalLayoutTensor
from ._checkpoint import CheckpointTensor, ScratchBuffer, mapped_rows, row_chunks

__all__ = ["FP8Scratch", "FP8StreamCast", "FP8TensorRole", "full_tensor_scale", "quantize_rows", "scale_weight_name"]

CANONICAL_DTYPE = torch.bfloat16
"""The dtype the representation quantizes from: the weight as the canonical BF16 load holds it."""
_SCALE_SUFFIX = "_scale"
_AMINMAX_DTYPES = frozenset({torch.float64, torch.float32, torch.float16, torch.bfloat16})
"""Checkpoint dtypes whose amax is taken as stored (then rounded); others (float8) are cast to BF16 first."""


class FP8TensorRole(enum.Enum):
    """What an owned tensor of an FP8 artifact is made from."""

    QUANTIZED = "quantized"
    """A quantized Linear weight: float8_e4m3fn rows cast with its full tensor's scale."""
    SCALE = "scale"
    """The FP32 scale of a quantized weight (`<module>.weight_scale`): computed, not read."""
    PLAIN = "plain"
    """Anything else: the BF16 representation's rule (BF16, FP32 where kept, non-floating unchanged)."""


def scale_weight_name(scale_name: str) -> str:
    """`<module>.weight_scale` -> `<module>.weight`: the weight whose checkpoint entry feeds a scale."""
    return scale_name.removesuffix(_SCALE_SUFFIX)


class FP8Scratch:
    """The three reused buffers of a chunk's cast (BF16, FP32, e4m3): no chunk-sized allocation per chunk.

    Freed-and-reallocated temporaries of a few MiB stay on the C heap, so a stream of them grows
    the process by tens of MiB; reusing one buffer per stage keeps it at one chunk each.
    """

    __slots__ = ("bf16", "fp8", "fp32")

    def __init__(self) -> None:
        self.bf16 = ScratchBuffer()
        self.fp32 = ScratchBuffer()
        self.fp8 = ScratchBuffer()


def full_tensor_scale(
    fd: int, entry: CheckpointTensor, chunk_bytes: int, scratch: FP8Scratch | None = None
) -> torch.Tensor:
    """The FP32 scale of a whole checkpoint weight, from one bounded pass (one chunk mapped at a time).

    Every row is read whatever part of the weight a caller writes, so a TP rank's shard gets the
    scale of the full tensor. Equals `fp8_scale` of the canonical BF16 weight bit for bit: a
    chunk's max(max, -min) is its amax(|x|) (NaN included), and rounding to BF16 is monotonic and
    symmetric, so rounding the checkpoint's amax gives the BF16 tensor's amax without casting it.
    """
    if not entry.shape or any(size == 0 for size in entry.shape):
        raise ValueError(f"{entry.key!r} has shape {list(entry.shape)}: an FP8 weight needs a non-empty matrix")
    buffers = scratch if scratch is not None else FP8Scratch()
    amaxes: list[torch.Tensor] = []
    for start, stop in row_chunks(entry, chunk_bytes):
        rows = mapped_rows(fd, entry, start, stop)
        values = rows if rows.dtype in _AMINMAX_DTYPES else buffers.bf16.cast(rows, CANONICAL_DTYPE)
        low, high = torch.aminmax(values)
        amaxes.append(torch.maximum(high, low.neg()).to(CANONICAL_DTYPE))
        del rows  # unmaps the chunk
    return fp8_scale(torch.stack(amaxes))


def quantize_rows(rows: torch.Tensor, scale: torch.Tensor, scratch: FP8Scratch | None = None) -> torch.Tensor:
    """Any part of a checkpoint weight (its own dtype) as the FP8 bytes of that part of the post-load weight.

    The same operations as `quantize_to_fp8` (BF16, then FP32 divided by the scale, then e4m3).
    With `scratch` the result lives in its buffer: write it before the next call with the same scratch.
    """
    if scratch is None:
        return (rows.to(CANONICAL_DTYPE).to(torch.float32) / scale).to(FP8_DTYPE)
    canonical = scratch.bf16.cast(rows, CANONICAL_DTYPE)  # `rows` itself when the checkpoint is BF16
    work = scratch.fp32.cast(canonical, torch.float32)  # always the scratch's own buffer: `canonical` is BF16
    work.div_(scale)
    return scratch.fp8.cast(work, FP8_DTYPE)


class FP8StreamCast:
    """Per-tensor FP8 casting of checkpoint rows for one FP8 artifact (or every rank of a bundle).

    Built from the artifact's owned tensors; the roles do not depend on the TP rank, so one
    instance serves every rank of a bundle. A weight's scale is computed once (one extra pass
    over that weight) and kept, a 0-dim tensor per quantized Linear.

    A bundle reads, for each owned tensor, the checkpoint entry of `checkpoint_name(name)`; a
    SCALE tensor is `scale_value(name, fd, entry)` on every part that holds it; any other tensor
    is read in full-row chunks, each passed through `cast(name, rows, fd, entry, tensor.dtype)`
    and then cut into the ranks' rows or columns (quantizing commutes with cutting).
    """

    def __init__(self, tensors: Iterable[FinalLayoutTensor], *, chunk_bytes: int) -> None:
        if type(chunk_bytes) is not int or chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be a positive int, got {chunk_bytes!r}")
        owned = {tensor.name: tensor for tensor in tensors}
        self._chunk_bytes = chunk_bytes
        self._roles = {name: _role(tensor, owned) for name, tensor in owned.items()}
        self._scales: dict[str, torch.Tensor] = {}
        self._scratch = FP8Scratch()
        self._plain = ScratchBuffer()

    def role(self, name: str) -> FP8TensorRole:
        return self._roles[name]

    def checkpoint_name(self, name: str) -> str:
        """The owned tensor whose checkpoint entry `name` is made from (a scale: its weight's)."""
        return scale_weight_name(name) if self._roles[name] is FP8TensorRole.SCALE else name

    def quantized_names(self) -> tuple[str, ...]:
        return tuple(name for name, role in self._roles.items() if role is FP8TensorRole.QUANTIZED)

    def scale(self, weight_name: str, fd: int, entry: CheckpointTensor) -> torch.Tensor:
        """The full-tensor scale of a quantized weight (`entry` is its full checkpoint tensor)."""
        found = self._scales.get(weight_name)
        if found is None:
            found = full_tensor_scale(fd, entry, self._chunk_bytes, self._scratch)
            self._scales[weight_name] = found
        return found

    def scale_value(self, scale_name: str, fd: int, weight_entry: CheckpointTensor) -> torch.Tensor:
        """The bytes of a SCALE tensor: its weight's full-tensor scale, the same on every TP rank."""
        return self.scale(scale_weight_name(scale_name), fd, weight_entry)

    def cast(
        self, name: str, rows: torch.Tensor, fd: int, entry: CheckpointTensor, final_dtype: torch.dtype
    ) -> torch.Tensor:
        """Rows (or a rank's part of them) of `name`'s checkpoint tensor in the artifact's bytes.

        A QUANTIZED weight is quantized with its full tensor's scale (computed on first use from
        `entry`, the whole checkpoint weight); a PLAIN tensor is cast to `final_dtype`. The result
        lives in a reused buffer: write it (every rank's part) before the next `cast`.
        """
        role = self._roles[name]
        if role is FP8TensorRole.QUANTIZED:
            return quantize_rows(rows, self.scale(name, fd, entry), self._scratch)
        if role is FP8TensorRole.SCALE:
            raise ValueError(f"{name} is a scale: write scale_value(), it has no checkpoint rows")
        return self._plain.cast(rows, final_dtype)


def _role(tensor: FinalLayoutTensor, owned: dict[str, FinalLayoutTensor]) -> FP8TensorRole:
    if tensor.dtype == FP8_DTYPE:
        return FP8TensorRole.QUANTIZED
    weight = owned.get(scale_weight_name(tensor.name)) if tensor.name.endswith(_SCALE_SUFFIX) else None
    if weight is not None and weight.dtype == FP8_DTYPE and tensor.dtype == torch.float32 and not tensor.shape:
        return FP8TensorRole.SCALE
    return FP8TensorRole.PLAIN

"""Pre-load FP8 production: the post-load FP8 artifact's very bytes, streamed from the safetensors checkpoint.

No model is built or loaded. Each quantized Linear weight is read twice, in bounded chunks:
once for its full tensor's amax, once to cast (`fp8_stream.py`); scales are computed, every
other tensor is cast as the BF16 producer casts it. Same key, same tensor bytes, same content
digest as `FinalLayoutFP8Producer` after a canonical load.
"""

from __future__ import annotations

import functools

from ...failures import FailureCode
from ...protocols import ArtifactWriter, ProductionMetadata, TensorFileWriter
from ..contracts import FINAL_LAYOUT_BF16_POLICY, streamed_final_dtype
from ..fp8 import FINAL_LAYOUT_FP8_SPEC
from ..identity_adapter import FinalLayoutIdentityContext
from ..tensor_layout import FinalLayoutTensor
from ._checkpoint import CheckpointTensor, read_rows
from ._shards import ProgressCallback, producer_error
from ._stream import CheckpointStreamProducer
from .checkpoint_stream import FinalLayoutBF16CheckpointProducer, index_checkpoint
from .fp8_stream import FP8StreamCast, FP8TensorRole

__all__ = ["FinalLayoutFP8CheckpointProducer", "streaming_producer"]


def streaming_producer(
    context: FinalLayoutIdentityContext, *, progress: ProgressCallback | None = None
) -> FinalLayoutBF16CheckpointProducer | FinalLayoutFP8CheckpointProducer:
    """The checkpoint-streaming producer of the context's representation (FP8, or a dtype policy's)."""
    if context.spec == FINAL_LAYOUT_FP8_SPEC:
        return FinalLayoutFP8CheckpointProducer(context, progress=progress)
    return FinalLayoutBF16CheckpointProducer(context, progress=progress)


class FinalLayoutFP8CheckpointProducer(CheckpointStreamProducer):
    """Stream an FP8-representation artifact from the canonical checkpoint (PRE_LOAD_SAFE, CHECKPOINT_STREAM).

    The context is the FP8 identity of a `quantize_model_fp8` skeleton (one rank's, at TP > 1:
    split tensors hold the rank's part, quantized with the full tensor's scale).
    """

    def _require(self, context: FinalLayoutIdentityContext) -> None:
        if context.spec != FINAL_LAYOUT_FP8_SPEC:
            raise ValueError(
                f"{context.spec.representation.name} is not the FP8 representation; stream it with "
                "FinalLayoutBF16CheckpointProducer (or streaming_producer, which picks)"
            )

    @functools.cached_property
    def _cast(self) -> FP8StreamCast:
        """Roles and scales of this artifact's tensors; a scale is computed once, on first use."""
        return FP8StreamCast(self._context.tensors, chunk_bytes=self._chunk_bytes)

    def produce(self, writer: ArtifactWriter) -> ProductionMetadata:
        self._context.ensure_sources_unchanged()
        return self._stream(writer, self.checked_index(), self._write_tensor)

    def checked_index(self) -> dict[str, CheckpointTensor]:
        """Owned name -> the checkpoint tensor it is made from (a scale: its weight's), every one checked to make
        the owned tensor (typed PRODUCER_FAILED / PRODUCER_UNSUPPORTED) before anything is written."""
        index = self._checkpoint_index()
        for tensor in self._context.tensors:
            self._check(tensor, index[tensor.name])
        return index

    def _write_tensor(
        self, file_writer: TensorFileWriter, tensor: FinalLayoutTensor, entry: CheckpointTensor, fd: int
    ) -> None:
        """One owned tensor: a computed scale, or bounded chunks of (this rank's part of) its checkpoint rows."""
        cast = self._cast
        role = cast.role(tensor.name)
        if role is FP8TensorRole.SCALE:
            file_writer.write_tensor(tensor.name, cast.scale_value(tensor.name, fd, entry))
            return
        if not tensor.shape:
            file_writer.write_tensor(tensor.name, read_rows(fd, entry, 0, 0).to(tensor.dtype))
            return
        if role is FP8TensorRole.QUANTIZED:
            cast.scale(tensor.name, fd, entry)  # the first pass, over the full weight, before any rows are held
        for local_row, rows in self._local_rows(fd, entry, self._context.tensor_shards.get(tensor.name)):
            file_writer.write_rows(tensor.name, local_row, cast.cast(tensor.name, rows, fd, entry, tensor.dtype))
            del rows  # unmaps a mapped chunk before the next

    def _check(self, tensor: FinalLayoutTensor, entry: CheckpointTensor) -> None:
        """The checkpoint tensor can make this owned tensor: a floating matrix for FP8, the policy's dtype else."""
        role = self._cast.role(tensor.name)
        if role is FP8TensorRole.SCALE:
            return
        if role is FP8TensorRole.QUANTIZED and (not entry.dtype.is_floating_point or len(entry.shape) != 2):
            raise producer_error(
                FailureCode.PRODUCER_UNSUPPORTED,
                f"{tensor.name}: the checkpoint holds {entry.dtype} {list(entry.shape)}; the FP8 representation "
                "quantizes floating-point Linear weight matrices only (load it as BF16 instead)",
                tensor=tensor.name,
            )
        final = tensor.dtype
        if role is FP8TensorRole.PLAIN:
            final = streamed_final_dtype(
                FINAL_LAYOUT_BF16_POLICY, tensor.local_name, entry.dtype, tensor.dtype, self._keep_fp32(tensor)
            )
        self._check_makes(tensor, entry, final, "the FP8 representation")

    def _checkpoint_index(self) -> dict[str, CheckpointTensor]:
        """Owned name -> the checkpoint tensor it is made from (a scale: its weight's); all must be found."""
        return index_checkpoint(
            self._context,
            self._cast.checkpoint_name,
            no_safetensors="FP8 is streamed from safetensors only (load it with load_component(..., "
            "representation='fp8'), which publishes after the load)",
            missing_hint="load canonically instead",
        )

"""Pre-load FP8 production: the post-load FP8 artifact's very bytes, streamed from the safetensors checkpoint.

No model is built or loaded. Each quantized Linear weight is read twice, in bounded chunks:
once for its full tensor's amax, once to cast (`fp8_stream.py`); scales are computed, every
other tensor is cast as the BF16 producer casts it. Same key, same tensor bytes, same content
digest as `FinalLayoutFP8Producer` after a canonical load.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import torch

from ...failures import FailureCode
from ...protocols import (
    ArtifactWriter,
    LookupPhase,
    ProductionMetadata,
    ProductionSourceMode,
    TensorFileWriter,
    WeightProductionSpec,
)
from ..contracts import FINAL_LAYOUT_BF16_POLICY, streamed_final_dtype
from ..fp8 import FINAL_LAYOUT_FP8_SPEC
from ..identity_adapter import FinalLayoutIdentityContext
from ..parallel.plan import TensorShard
from ..tensor_layout import FinalLayoutTensor
from ._checkpoint import (
    CheckpointFormatError,
    CheckpointTensor,
    mapped_rows,
    read_column_ranges,
    read_rows,
    row_chunks,
)
from ._shards import DEFAULT_SHARD_BYTES, ProgressCallback, producer_error, production_metadata, write_all
from .checkpoint_stream import DEFAULT_CHUNK_BYTES, FinalLayoutBF16CheckpointProducer, index_checkpoint
from .fp8_stream import FP8StreamCast, FP8TensorRole

__all__ = ["FinalLayoutFP8CheckpointProducer", "streaming_producer"]


def streaming_producer(
    context: FinalLayoutIdentityContext, *, progress: ProgressCallback | None = None
) -> FinalLayoutBF16CheckpointProducer | FinalLayoutFP8CheckpointProducer:
    """The checkpoint-streaming producer of the context's representation (FP8, or a dtype policy's)."""
    if context.spec == FINAL_LAYOUT_FP8_SPEC:
        return FinalLayoutFP8CheckpointProducer(context, progress=progress)
    return FinalLayoutBF16CheckpointProducer(context, progress=progress)


class FinalLayoutFP8CheckpointProducer:
    """Stream an FP8-representation artifact from the canonical checkpoint (PRE_LOAD_SAFE, CHECKPOINT_STREAM).

    The context is the FP8 identity of a `quantize_model_fp8` skeleton (one rank's, at TP > 1:
    split tensors hold the rank's part, quantized with the full tensor's scale).
    """

    def __init__(
        self,
        context: FinalLayoutIdentityContext,
        *,
        shard_bytes: int = DEFAULT_SHARD_BYTES,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        progress: ProgressCallback | None = None,
    ) -> None:
        if context.spec != FINAL_LAYOUT_FP8_SPEC:
            raise ValueError(
                f"{context.spec.representation.name} is not the FP8 representation; stream it with "
                "FinalLayoutBF16CheckpointProducer (or streaming_producer, which picks)"
            )
        self._context = context
        self._shard_bytes = shard_bytes
        self._chunk_bytes = chunk_bytes
        self._progress = progress
        self._cast = FP8StreamCast(context.tensors, chunk_bytes=chunk_bytes)
        self._spec = WeightProductionSpec(
            producer_id=context.spec.producer.producer_id,
            outputs=(context.identity,),
            source_mode=ProductionSourceMode.CHECKPOINT_STREAM,
            lookup_phase=LookupPhase.PRE_LOAD_SAFE,
            digest_algorithm=context.spec.digest_algorithm,
        )
        self.largest_chunk_bytes = 0
        """The largest row chunk read so far (source bytes); tests use it to show memory stays bounded."""

    @property
    def spec(self) -> WeightProductionSpec:
        return self._spec

    def produce(self, writer: ArtifactWriter) -> ProductionMetadata:
        context = self._context
        context.ensure_sources_unchanged()
        index = self.checked_index()
        descriptors: dict[str, int] = {}

        def write_one(file_writer: TensorFileWriter, tensor: FinalLayoutTensor) -> None:
            if tensor.nbytes == 0:
                return  # nothing to write; the writer treats an empty tensor as complete
            entry = index[tensor.name]
            fd = descriptors.get(str(entry.path))
            if fd is None:
                fd = os.open(entry.path, os.O_RDONLY | os.O_CLOEXEC)
                descriptors[str(entry.path)] = fd
            self._write_tensor(file_writer, tensor, entry, fd)

        try:
            write_all(writer, context, self._shard_bytes, write_one, self._progress)
        except CheckpointFormatError as exc:
            raise producer_error(FailureCode.PRODUCER_FAILED, str(exc)) from exc
        finally:
            for fd in descriptors.values():
                os.close(fd)
        context.ensure_sources_unchanged()
        return production_metadata(context, ProductionSourceMode.CHECKPOINT_STREAM.value)

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

    def _local_rows(
        self, fd: int, entry: CheckpointTensor, shard: TensorShard | None
    ) -> Iterator[tuple[int, torch.Tensor]]:
        """(first local row, rows) chunks of the tensor, or of this rank's rows (dim 0) or columns (dim 1)."""
        per_chunk = max(1, self._chunk_bytes // max(entry.row_bytes, 1))
        if shard is None:
            for start, stop in row_chunks(entry, self._chunk_bytes):
                self._note(stop - start, entry.row_bytes)
                yield start, mapped_rows(fd, entry, start, stop)
            return
        if shard.dim == 0:
            local_row = 0
            for first, last in shard.ranges():
                for start in range(first, last, per_chunk):
                    stop = min(last, start + per_chunk)
                    self._note(stop - start, entry.row_bytes)
                    yield local_row, read_rows(fd, entry, start, stop)
                    local_row += stop - start
            return
        for start in range(0, entry.shape[0], per_chunk):
            stop = min(entry.shape[0], start + per_chunk)
            self._note(stop - start, entry.row_bytes)
            yield start, read_column_ranges(fd, entry, start, stop, shard.ranges())

    def _note(self, rows: int, row_bytes: int) -> None:
        self.largest_chunk_bytes = max(self.largest_chunk_bytes, rows * row_bytes)

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
        shard = self._context.tensor_shards.get(tensor.name)
        shape = entry.shape if shard is None else shard.local_shape(entry.shape)
        final = tensor.dtype
        if role is FP8TensorRole.PLAIN:
            final = streamed_final_dtype(
                FINAL_LAYOUT_BF16_POLICY, tensor.local_name, entry.dtype, tensor.dtype, self._keep_fp32(tensor)
            )
        if shape != tensor.shape or final != tensor.dtype:
            raise producer_error(
                FailureCode.PRODUCER_FAILED,
                f"{tensor.name}: the checkpoint holds {entry.dtype} {list(entry.shape)}, which the FP8 representation "
                f"turns into {final}, but the model expects {tensor.dtype} {list(tensor.shape)}",
                tensor=tensor.name,
            )

    def _keep_fp32(self, tensor: FinalLayoutTensor) -> tuple[str, ...]:
        context = self._context
        return context.model_contracts[context.dit_names.index(tensor.dit_name)].keep_in_fp32_modules

    def _checkpoint_index(self) -> dict[str, CheckpointTensor]:
        """Owned name -> the checkpoint tensor it is made from (a scale: its weight's); all must be found."""
        return index_checkpoint(
            self._context,
            self._cast.checkpoint_name,
            no_safetensors="FP8 is streamed from safetensors only (load it with load_component(..., "
            "representation='fp8'), which publishes after the load)",
            missing_hint="load canonically instead",
        )

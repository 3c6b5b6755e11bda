"""Pre-load production: the same final-layout bytes, streamed straight from the safetensors checkpoint.

No model is built. Rows are mapped from the checkpoint in chunks and handed to the writer's
`copy_rows`, which casts them with the policy's rule into a reused buffer, writes it and hashes it
behind the write while the chunk is still in cache: each byte is read once, converted once and never
read back; memory beyond the writer stays at about three chunks. A writer without `copy_rows` gets
the cast rows through one reused buffer and `write_rows`.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from ...failures import FailureCode
from ...protocols import (
    ArtifactWriter,
    LookupPhase,
    ProductionMetadata,
    ProductionSourceMode,
    RowCopyingTensorFileWriter,
    TensorFileWriter,
    WeightProductionSpec,
)
from ..contracts import streamed_final_dtype
from ..identity_adapter import FinalLayoutIdentityContext
from ..parallel.plan import TensorShard
from ..tensor_layout import FinalLayoutTensor
from ._checkpoint import (
    CheckpointFormatError,
    CheckpointTensor,
    ScratchBuffer,
    mapped_rows,
    read_column_ranges,
    read_rows,
    read_safetensors_header,
    row_chunks,
)
from ._shards import DEFAULT_SHARD_BYTES, ProgressCallback, producer_error, production_metadata, write_all

DEFAULT_CHUNK_BYTES = 32 * 2**20
"""Source bytes cast per step: small enough that the cast rows are still in cache when they are hashed."""


class FinalLayoutBF16CheckpointProducer:
    """Stream BF16-policy tensors from the canonical checkpoint (PRE_LOAD_SAFE, CHECKPOINT_STREAM)."""

    def __init__(
        self,
        context: FinalLayoutIdentityContext,
        *,
        shard_bytes: int = DEFAULT_SHARD_BYTES,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        progress: ProgressCallback | None = None,
    ) -> None:
        if type(chunk_bytes) is not int or chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be a positive int, got {chunk_bytes!r}")
        self._context = context
        self._shard_bytes = shard_bytes
        self._chunk_bytes = chunk_bytes
        self._progress = progress
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

    def checkpoint_index(self) -> dict[str, CheckpointTensor]:
        """DiT tensor name -> where its bytes are in the checkpoint; every owned tensor must be found."""
        return index_checkpoint(
            self._context,
            lambda name: name,
            no_safetensors="the streaming producer reads safetensors only (load canonically and publish after load "
            "instead)",
            missing_hint="its keys need a conversion the streaming producer does not do, so load canonically instead",
        )

    def _keep_fp32(self, tensor: FinalLayoutTensor) -> tuple[str, ...]:
        context = self._context
        return context.model_contracts[context.dit_names.index(tensor.dit_name)].keep_in_fp32_modules

    def produce(self, writer: ArtifactWriter) -> ProductionMetadata:
        context = self._context
        context.ensure_sources_unchanged()
        index = self.checkpoint_index()
        for tensor in context.tensors:
            entry = index[tensor.name]
            final = streamed_final_dtype(
                context.policy, tensor.local_name, entry.dtype, tensor.dtype, self._keep_fp32(tensor)
            )
            shard = context.tensor_shards.get(tensor.name)
            shape = entry.shape if shard is None else shard.local_shape(entry.shape)
            if shape != tensor.shape or final != tensor.dtype:
                raise producer_error(
                    FailureCode.PRODUCER_FAILED,
                    f"{tensor.name}: the checkpoint holds {entry.dtype} {list(entry.shape)}, which the policy turns "
                    f"into {final}, but the model expects {tensor.dtype} {list(tensor.shape)}",
                    tensor=tensor.name,
                )
        descriptors: dict[str, int] = {}
        # Without copy_rows, each chunk is cast into one reused buffer and written (pwrite returns)
        # before the next: no fresh allocation per chunk.
        cast_buffer = ScratchBuffer()
        try:

            def write_one(file_writer: TensorFileWriter, tensor: FinalLayoutTensor) -> None:
                if tensor.nbytes == 0:
                    return  # nothing to write; the writer treats an empty tensor as complete
                entry = index[tensor.name]
                fd = descriptors.get(str(entry.path))
                if fd is None:
                    fd = os.open(entry.path, os.O_RDONLY | os.O_CLOEXEC)
                    descriptors[str(entry.path)] = fd
                if not tensor.shape:
                    file_writer.write_tensor(tensor.name, read_rows(fd, entry, 0, 0).to(tensor.dtype))
                    return
                shard = context.tensor_shards.get(tensor.name)
                if shard is not None:
                    self._write_shard(file_writer, tensor, entry, fd, shard)
                    return
                copier = file_writer if isinstance(file_writer, RowCopyingTensorFileWriter) else None
                for start, stop in row_chunks(entry, self._chunk_bytes):
                    self.largest_chunk_bytes = max(self.largest_chunk_bytes, (stop - start) * entry.row_bytes)
                    rows = mapped_rows(fd, entry, start, stop)
                    if copier is not None:
                        copier.copy_rows(tensor.name, start, rows)
                    else:
                        file_writer.write_rows(tensor.name, start, cast_buffer.cast(rows, tensor.dtype))
                    del rows  # unmaps the chunk

            write_all(writer, context, self._shard_bytes, write_one, self._progress)
        except CheckpointFormatError as exc:
            raise producer_error(FailureCode.PRODUCER_FAILED, str(exc)) from exc
        finally:
            for fd in descriptors.values():
                os.close(fd)
        context.ensure_sources_unchanged()
        return production_metadata(context, ProductionSourceMode.CHECKPOINT_STREAM.value)

    def _write_shard(
        self,
        file_writer: TensorFileWriter,
        tensor: FinalLayoutTensor,
        entry: CheckpointTensor,
        fd: int,
        shard: TensorShard,
    ) -> None:
        """Read only this rank's rows (dim 0) or columns (dim 1) of a split tensor, in bounded chunks."""
        per_chunk = max(1, self._chunk_bytes // max(entry.row_bytes, 1))
        if shard.dim == 0:
            local_row = 0
            for first, last in shard.ranges():
                for start in range(first, last, per_chunk):
                    stop = min(last, start + per_chunk)
                    self.largest_chunk_bytes = max(self.largest_chunk_bytes, (stop - start) * entry.row_bytes)
                    rows = read_rows(fd, entry, start, stop)
                    file_writer.write_rows(tensor.name, local_row, rows.to(tensor.dtype))
                    local_row += stop - start
            return
        ranges = shard.ranges()
        for start in range(0, entry.shape[0], per_chunk):
            stop = min(entry.shape[0], start + per_chunk)
            rows = read_column_ranges(fd, entry, start, stop, ranges)
            self.largest_chunk_bytes = max(self.largest_chunk_bytes, rows.numel() * entry.dtype.itemsize)
            file_writer.write_rows(tensor.name, start, rows.to(tensor.dtype))


def index_checkpoint(
    context: FinalLayoutIdentityContext,
    checkpoint_name: Callable[[str], str],
    *,
    no_safetensors: str,
    missing_hint: str,
) -> dict[str, CheckpointTensor]:
    """Owned name -> the checkpoint tensor `checkpoint_name(name)` is read from; all must be found, else typed."""
    by_source: dict[int, dict[str, CheckpointTensor]] = {}
    for index, source in enumerate(context.source.sources):
        if not source.use_safetensors:
            raise producer_error(
                FailureCode.PRODUCER_UNSUPPORTED, f"{source.model_or_path} has no safetensors weights; {no_safetensors}"
            )
        keys: dict[str, CheckpointTensor] = {}
        for path in source.weight_files:
            try:
                keys.update(read_safetensors_header(path))
            except CheckpointFormatError as exc:
                raise producer_error(FailureCode.PRODUCER_FAILED, str(exc), file=str(path)) from exc
        by_source[index] = keys
    found: dict[str, CheckpointTensor] = {}
    missing: list[str] = []
    for tensor in context.tensors:
        source_index, key = context.tensor_sources[checkpoint_name(tensor.name)]
        entry = by_source[source_index].get(key)
        if entry is None:
            missing.append(f"{tensor.name} (checkpoint key {key!r})")
        else:
            found[tensor.name] = entry
    if missing:
        raise producer_error(
            FailureCode.PRODUCER_FAILED,
            f"the checkpoint lacks {len(missing)} tensors the model owns, e.g. {missing[:5]}; {missing_hint}",
            missing=len(missing),
        )
    return found

"""Pre-load production: the same final-layout bytes, streamed straight from the safetensors checkpoint.

No model is built. Rows are mapped from the checkpoint in chunks and handed to the writer's
`copy_rows`, which casts them with the policy's rule into a reused buffer, writes it and hashes it
behind the write while the chunk is still in cache: each byte is read once, converted once and never
read back; memory beyond the writer stays at about three chunks. A writer without `copy_rows` gets
the cast rows through one reused buffer and `write_rows`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

from ...failures import FailureCode
from ...protocols import ArtifactWriter, ProductionMetadata, RowCopyingTensorFileWriter, TensorFileWriter
from ..contracts import streamed_final_dtype
from ..identity_adapter import FinalLayoutIdentityContext
from ..tensor_layout import FinalLayoutTensor
from ._checkpoint import CheckpointFormatError, CheckpointTensor, ScratchBuffer, read_rows, read_safetensors_header
from ._shards import producer_error
from ._stream import CheckpointStreamProducer


class FinalLayoutBF16CheckpointProducer(CheckpointStreamProducer):
    """Stream BF16-policy tensors from the canonical checkpoint (PRE_LOAD_SAFE, CHECKPOINT_STREAM)."""

    def checkpoint_index(self) -> dict[str, CheckpointTensor]:
        """DiT tensor name -> where its bytes are in the checkpoint; every owned tensor must be found."""
        return index_checkpoint(
            self._context,
            lambda name: name,
            no_safetensors="the streaming producer reads safetensors only (load canonically and publish after load "
            "instead)",
            missing_hint="its keys need a conversion the streaming producer does not do, so load canonically instead",
        )

    def produce(self, writer: ArtifactWriter) -> ProductionMetadata:
        context = self._context
        context.ensure_sources_unchanged()
        index = self.checkpoint_index()
        for tensor in context.tensors:
            entry = index[tensor.name]
            final = streamed_final_dtype(
                context.policy, tensor.local_name, entry.dtype, tensor.dtype, self._keep_fp32(tensor)
            )
            self._check_makes(tensor, entry, final, "the policy")
        # Without copy_rows, each chunk is cast into one reused buffer and written (pwrite returns)
        # before the next: no fresh allocation per chunk.
        cast_buffer = ScratchBuffer()
        # A runtime-checkable Protocol's isinstance walks the protocol's members: asked once per writer class.
        copies_rows: dict[type, bool] = {}

        def write_tensor(
            file_writer: TensorFileWriter, tensor: FinalLayoutTensor, entry: CheckpointTensor, fd: int
        ) -> None:
            if not tensor.shape:
                file_writer.write_tensor(tensor.name, read_rows(fd, entry, 0, 0).to(tensor.dtype))
                return
            shard = context.tensor_shards.get(tensor.name)
            whole = shard is None  # copy_rows takes whole rows only; a rank's part is cast and written
            copying = copies_rows.get(type(file_writer))
            if copying is None:
                copying = copies_rows[type(file_writer)] = isinstance(file_writer, RowCopyingTensorFileWriter)
            copier = cast(RowCopyingTensorFileWriter, file_writer) if whole and copying else None
            for local_row, rows in self._local_rows(fd, entry, shard):
                if copier is not None:
                    copier.copy_rows(tensor.name, local_row, rows)
                else:
                    file_writer.write_rows(tensor.name, local_row, cast_buffer.cast(rows, tensor.dtype))
                del rows  # unmaps a mapped chunk before the next

        return self._stream(writer, index, write_tensor)


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

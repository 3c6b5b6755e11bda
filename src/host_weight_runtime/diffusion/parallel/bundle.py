"""ARTIFACT_BUNDLE production: every TP rank's artifact from one pass over the checkpoint.

Each owned tensor is read once, in row chunks, and each chunk is cut into every rank's
rows, columns or (for replicated tensors) copied whole into each rank's writer. The store
publishes each rank's artifact atomically (filesystem/_bundle.py).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from ...failures import FailureCode
from ...protocols import (
    ArtifactWriter,
    BundleWriter,
    CoordinationScope,
    LookupPhase,
    ProductionMetadata,
    ProductionSourceMode,
    TensorFileWriter,
    WeightProductionSpec,
)
from ..identity_adapter import FinalLayoutIdentityContext
from ..producers._checkpoint import CheckpointFormatError, CheckpointTensor, read_rows, row_chunks
from ..producers._shards import DEFAULT_SHARD_BYTES, plan_shards, producer_error, production_metadata
from ..producers.checkpoint_stream import DEFAULT_CHUNK_BYTES, FinalLayoutBF16CheckpointProducer
from ..tensor_layout import FinalLayoutTensor
from .plan import TensorShard

__all__ = ["FinalLayoutBF16BundleProducer"]


class FinalLayoutBF16BundleProducer:
    """All TP ranks' BF16 final-layout artifacts in one checkpoint pass (ARTIFACT_BUNDLE, PRE_LOAD_SAFE)."""

    def __init__(
        self,
        contexts: Sequence[FinalLayoutIdentityContext],
        *,
        shard_bytes: int = DEFAULT_SHARD_BYTES,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    ) -> None:
        if not contexts:
            raise ValueError("a bundle needs at least one rank's context")
        names = [tuple(tensor.name for tensor in context.tensors) for context in contexts]
        if any(tensors != names[0] for tensors in names):
            raise ValueError("every rank of a bundle must own the same tensors")
        self._contexts = tuple(contexts)
        self._shard_bytes = shard_bytes
        self._chunk_bytes = chunk_bytes
        self._spec = WeightProductionSpec(
            producer_id=contexts[0].spec.producer.producer_id,
            outputs=tuple(context.identity for context in contexts),
            source_mode=ProductionSourceMode.CHECKPOINT_STREAM,
            lookup_phase=LookupPhase.PRE_LOAD_SAFE,
            coordination_scope=CoordinationScope.ARTIFACT_BUNDLE,
            digest_algorithm=contexts[0].spec.digest_algorithm,
        )
        self.bytes_read = 0
        """Checkpoint bytes read by the last bundle; tests use it to show each tensor is read once."""

    @property
    def spec(self) -> WeightProductionSpec:
        return self._spec

    def produce(self, writer: ArtifactWriter) -> ProductionMetadata:
        raise producer_error(
            FailureCode.PRODUCER_UNSUPPORTED,
            "a bundle producer writes several artifacts at once; build it through a store with ARTIFACT_BUNDLE "
            "support (FilesystemHostWeightStore.get_or_build)",
        )

    def produce_bundle(self, writers: BundleWriter) -> dict[str, ProductionMetadata]:
        by_key = {context.identity.key: context for context in self._contexts}
        wanted = [by_key[output.key] for output in writers.outputs if output.key in by_key]
        if len(wanted) != len(writers.outputs):
            raise producer_error(FailureCode.PRODUCER_FAILED, "the store asked for an output this bundle does not make")
        first = wanted[0]
        checker = FinalLayoutBF16CheckpointProducer(first)
        first.ensure_sources_unchanged()
        index = checker._checkpoint_index()
        self.bytes_read = 0
        descriptors: dict[str, int] = {}
        try:
            for file_name, group in plan_shards(first.tensors, self._shard_bytes):
                files = [
                    writers.writer_for(context.identity).open_tensor_file(
                        file_name, tuple(t.write_spec() for t in group), ordered=True
                    )
                    for context in wanted
                ]
                by_name = {tensor.name: tensor for tensor in group}
                order = getattr(files[0], "layout", tuple(t.write_spec() for t in group))
                for spec in order:
                    tensor = by_name[spec.name]
                    entry = index[tensor.name]
                    fd = descriptors.get(str(entry.path))
                    if fd is None:
                        fd = os.open(entry.path, os.O_RDONLY | os.O_CLOEXEC)
                        descriptors[str(entry.path)] = fd
                    self._write_everywhere(tensor, entry, fd, wanted, files)
                for file_writer in files:
                    file_writer.close()
        except CheckpointFormatError as exc:
            raise producer_error(FailureCode.PRODUCER_FAILED, str(exc)) from exc
        finally:
            for fd in descriptors.values():
                os.close(fd)
        first.ensure_sources_unchanged()
        return {
            context.identity.key: production_metadata(context, ProductionSourceMode.CHECKPOINT_STREAM.value)
            for context in wanted
        }

    def _write_everywhere(
        self,
        tensor: FinalLayoutTensor,
        entry: CheckpointTensor,
        fd: int,
        contexts: Sequence[FinalLayoutIdentityContext],
        files: Sequence[TensorFileWriter],
    ) -> None:
        """Read `tensor` once and hand every rank its part of each chunk."""
        shards = [context.tensor_shards.get(tensor.name) for context in contexts]
        expected = entry.shape if shards[0] is None else shards[0].local_shape(entry.shape)
        if expected != tensor.shape:
            raise producer_error(
                FailureCode.PRODUCER_FAILED,
                f"{tensor.name}: the checkpoint holds {list(entry.shape)}; the rank layout expects "
                f"{list(tensor.shape)}",
                tensor=tensor.name,
            )
        if tensor.nbytes == 0:
            return
        if not tensor.shape:
            value = read_rows(fd, entry, 0, 0).to(tensor.dtype)
            self.bytes_read += entry.end - entry.begin
            for file_writer in files:
                file_writer.write_tensor(tensor.name, value)
            return
        for start, stop in row_chunks(entry, self._chunk_bytes):
            rows = read_rows(fd, entry, start, stop).to(tensor.dtype)
            self.bytes_read += (stop - start) * entry.row_bytes
            for shard, file_writer in zip(shards, files, strict=True):
                _write_part(file_writer, tensor.name, rows, (start, stop), shard)


def _write_part(
    file_writer: TensorFileWriter, name: str, rows: torch.Tensor, span: tuple[int, int], shard: TensorShard | None
) -> None:
    """Write the part of full rows span = [start, stop) that a rank holds."""
    start, stop = span
    if shard is None:
        file_writer.write_rows(name, start, rows)
        return
    if shard.dim == 1:
        parts = [rows[:, first:last] for first, last in shard.ranges()]
        local = parts[0].contiguous() if len(parts) == 1 else torch.cat(parts, dim=1)
        file_writer.write_rows(name, start, local)
        return
    local_offset = 0
    for first, last in shard.ranges():
        low, high = max(first, start), min(last, stop)
        if low < high:
            file_writer.write_rows(name, local_offset + low - first, rows[low - start : high - start])
        local_offset += last - first

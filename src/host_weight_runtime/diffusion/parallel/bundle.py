"""ARTIFACT_BUNDLE production: the replicated part and every TP rank's shard part from one checkpoint pass.

Each owned tensor is read once, in row chunks. A tensor the plan replicates is written once,
into the replicated part every rank shares (parts.py); a split tensor's chunks are cut into
every rank's rows or columns and written into that rank's shard part. The store publishes
each part atomically (filesystem/_bundle.py) and records, in every part's manifest, the
content digest of each part of the pass, so a rank's lease can prove its two parts belong
together. Only the parts the store reports missing are written (a rebuild of one part
reads only that part's tensors).
"""

from __future__ import annotations

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
from ..producers._checkpoint import (
    CheckpointFormatError,
    CheckpointTensor,
    ScratchBuffer,
    mapped_rows,
    read_rows,
    row_chunks,
)
from ..producers._shards import DEFAULT_SHARD_BYTES, producer_error, production_metadata
from ..producers._stream import DEFAULT_CHUNK_BYTES, CheckpointFiles
from ..producers.checkpoint_stream import FinalLayoutBF16CheckpointProducer
from ..tensor_layout import FinalLayoutTensor
from .parts import PartKind, RankParts, part_file_plan, split_rank
from .plan import TensorShard, plan_error

__all__ = ["FinalLayoutBF16BundleProducer", "bundle_parts"]


def bundle_parts(contexts: Sequence[FinalLayoutIdentityContext]) -> tuple[RankParts, ...]:
    """Every rank's parts; ranks that disagree on the replicated part (another plan, source or size) are refused."""
    if not contexts:
        raise ValueError("a bundle needs at least one rank's context")
    names = [tuple(tensor.name for tensor in context.tensors) for context in contexts]
    if any(tensors != names[0] for tensors in names):
        raise ValueError("every rank of a bundle must own the same tensors")
    parts = tuple(split_rank(context) for context in contexts)
    if len({part.replicated.identity.key for part in parts}) != 1:
        raise plan_error(
            "the ranks of this bundle disagree on their replicated part (another plan, checkpoint or TP size); "
            "identify every rank from one skeleton and one plan",
        )
    return parts


class FinalLayoutBF16BundleProducer:
    """The replicated part and every TP rank's shard part, BF16, in one checkpoint pass (ARTIFACT_BUNDLE)."""

    def __init__(
        self,
        contexts: Sequence[FinalLayoutIdentityContext],
        *,
        shard_bytes: int = DEFAULT_SHARD_BYTES,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    ) -> None:
        self._parts = bundle_parts(contexts)
        self._shard_bytes = shard_bytes
        self._chunk_bytes = chunk_bytes
        first = self._parts[0].rank
        self._spec = WeightProductionSpec(
            producer_id=first.spec.producer.producer_id,
            outputs=(self._parts[0].replicated.identity, *(part.shard.identity for part in self._parts)),
            source_mode=ProductionSourceMode.CHECKPOINT_STREAM,
            lookup_phase=LookupPhase.PRE_LOAD_SAFE,
            coordination_scope=CoordinationScope.ARTIFACT_BUNDLE,
            digest_algorithm=first.spec.digest_algorithm,
        )
        self.bytes_read = 0
        """Checkpoint bytes read by the last bundle; tests use it to show each tensor is read once."""
        self._scratch = ScratchBuffer()

    @property
    def spec(self) -> WeightProductionSpec:
        return self._spec

    @property
    def parts(self) -> tuple[RankParts, ...]:
        """Every rank's parts, in rank order."""
        return self._parts

    def produce(self, writer: ArtifactWriter) -> ProductionMetadata:
        raise producer_error(
            FailureCode.PRODUCER_UNSUPPORTED,
            "a bundle producer writes several artifacts at once; build it through a store with ARTIFACT_BUNDLE "
            "support (FilesystemHostWeightStore.get_or_build)",
        )

    def produce_bundle(self, writers: BundleWriter) -> dict[str, ProductionMetadata]:
        wanted = {output.key for output in writers.outputs}
        replicated = self._parts[0].replicated
        shards = [part.shard for part in self._parts if part.shard.identity.key in wanted]
        making_replicated = replicated.identity.key in wanted
        if len(wanted) != len(shards) + making_replicated:
            raise producer_error(FailureCode.PRODUCER_FAILED, "the store asked for an output this bundle does not make")
        rank = self._parts[0].rank
        rank.ensure_sources_unchanged()
        index = self._start_pass(rank)
        self.bytes_read = 0
        replicated_outputs = [replicated] if making_replicated else []
        made = replicated_outputs + shards
        with CheckpointFiles() as checkpoint_files:
            try:
                for kind, contexts in ((PartKind.REPLICATED, replicated_outputs), (PartKind.SHARD, shards)):
                    if contexts:
                        self._write_kind(writers, kind, contexts, index, checkpoint_files)
            except CheckpointFormatError as exc:
                raise producer_error(FailureCode.PRODUCER_FAILED, str(exc)) from exc
        rank.ensure_sources_unchanged()
        return {
            context.identity.key: production_metadata(context, ProductionSourceMode.CHECKPOINT_STREAM.value)
            for context in made
        }

    def _write_kind(
        self,
        writers: BundleWriter,
        kind: PartKind,
        contexts: Sequence[FinalLayoutIdentityContext],
        index: dict[str, CheckpointTensor],
        checkpoint_files: CheckpointFiles,
    ) -> None:
        """Every payload file of one part kind, written for all `contexts` at once from one read of each tensor."""
        for file_name, group in part_file_plan(contexts[0].tensors, self._shard_bytes, kind):
            files = [
                writers.writer_for(context.identity).open_tensor_file(
                    file_name, tuple(t.write_spec() for t in group), ordered=True
                )
                for context in contexts
            ]
            by_name = {tensor.name: tensor for tensor in group}
            for spec in getattr(files[0], "layout", tuple(t.write_spec() for t in group)):
                entry = index[spec.name]
                self._write_everywhere(by_name[spec.name], entry, checkpoint_files.fd(entry), contexts, files)
            for file_writer in files:
                file_writer.close()

    def _start_pass(self, rank: FinalLayoutIdentityContext) -> dict[str, CheckpointTensor]:
        """Owned name -> the checkpoint tensor it is read from, for one bundle pass over `rank`'s layout."""
        return FinalLayoutBF16CheckpointProducer(rank).checkpoint_index()

    def _final(self, rows: torch.Tensor, tensor: FinalLayoutTensor) -> torch.Tensor:
        """The one place a chunk of checkpoint rows becomes the representation's bytes (a cast for BF16).

        The result may live in a buffer reused by the next chunk: every writer is done with it first.
        """
        return self._scratch.cast(rows, tensor.dtype)

    def _final_rows(
        self, rows: torch.Tensor, tensor: FinalLayoutTensor, fd: int, entry: CheckpointTensor
    ) -> torch.Tensor:
        """Full checkpoint rows of `tensor` in the representation's bytes; the FP8 bundle reads the entry's scale."""
        return self._final(rows, tensor)

    def _write_everywhere(
        self,
        tensor: FinalLayoutTensor,
        entry: CheckpointTensor,
        fd: int,
        contexts: Sequence[FinalLayoutIdentityContext],
        files: Sequence[TensorFileWriter],
    ) -> None:
        """Read `tensor` once and hand every part being written its share of each chunk."""
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
            value = self._final_rows(read_rows(fd, entry, 0, 0), tensor, fd, entry)
            self.bytes_read += entry.end - entry.begin
            for file_writer in files:
                file_writer.write_tensor(tensor.name, value)
            return
        for start, stop in row_chunks(entry, self._chunk_bytes):
            mapped = mapped_rows(fd, entry, start, stop)  # cast straight from the page cache, no pread copy
            rows = self._final_rows(mapped, tensor, fd, entry)
            self.bytes_read += (stop - start) * entry.row_bytes
            for shard, file_writer in zip(shards, files, strict=True):
                _write_part(file_writer, tensor.name, rows, (start, stop), shard)
            del rows, mapped  # unmaps the chunk


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

"""What the BF16 and FP8 checkpoint-streaming producers (and the TP bundle) share, written once.

The checkpoint files a pass opens, the loop that writes every owned tensor from its entry, the
check that an entry makes its owned tensor, and this rank's rows of an entry in bounded chunks.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from types import TracebackType

import torch

from ...failures import FailureCode
from ...protocols import ArtifactWriter, ProductionMetadata, ProductionSourceMode, TensorFileWriter
from ..identity_adapter import FinalLayoutIdentityContext
from ..parallel.plan import TensorShard
from ..tensor_layout import FinalLayoutTensor
from ._checkpoint import CheckpointFormatError, CheckpointTensor, mapped_rows, read_column_ranges, read_rows, row_chunks
from ._shards import DEFAULT_SHARD_BYTES, ProgressCallback, SingleArtifactProducer, producer_error, write_all

_READ_BELOW_BYTES = 256 * 2**10
"""A tensor this small (a bias, a norm) is read with one `pread`: mapping, populating and unmapping it would
cost three system calls and a mapping's setup and teardown for a few pages."""

DEFAULT_CHUNK_BYTES = 32 * 2**20
"""Source bytes cast per step: small enough that the cast rows are still in cache when they are hashed."""

StreamedTensorWriter = Callable[[TensorFileWriter, FinalLayoutTensor, CheckpointTensor, int], None]
"""Writes one non-empty owned tensor from its checkpoint entry, read through the open descriptor."""


class CheckpointFiles:
    """Read-only descriptors of the checkpoint files one pass reads: each opened once, all closed on exit."""

    __slots__ = ("_descriptors",)

    def __init__(self) -> None:
        self._descriptors: dict[str, int] = {}

    def fd(self, entry: CheckpointTensor) -> int:
        fd = self._descriptors.get(str(entry.path))
        if fd is None:
            fd = os.open(entry.path, os.O_RDONLY | os.O_CLOEXEC)
            self._descriptors[str(entry.path)] = fd
        return fd

    def __enter__(self) -> CheckpointFiles:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        for fd in self._descriptors.values():
            os.close(fd)
        self._descriptors.clear()


class CheckpointStreamProducer(SingleArtifactProducer):
    """The common part of a producer that streams one artifact from the checkpoint (PRE_LOAD_SAFE,
    CHECKPOINT_STREAM); a subclass decides how each tensor's entry becomes its final bytes."""

    def __init__(
        self,
        context: FinalLayoutIdentityContext,
        *,
        shard_bytes: int = DEFAULT_SHARD_BYTES,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        progress: ProgressCallback | None = None,
    ) -> None:
        self._require(context)
        if type(chunk_bytes) is not int or chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be a positive int, got {chunk_bytes!r}")
        super().__init__(context, ProductionSourceMode.CHECKPOINT_STREAM, shard_bytes=shard_bytes, progress=progress)
        self._chunk_bytes = chunk_bytes
        self.largest_chunk_bytes = 0
        """The largest row chunk read so far (source bytes); tests use it to show memory stays bounded."""

    def _require(self, context: FinalLayoutIdentityContext) -> None:
        """Refuse, with a ValueError that names the right producer, a context this one cannot stream."""

    def _stream(
        self, writer: ArtifactWriter, index: dict[str, CheckpointTensor], write_tensor: StreamedTensorWriter
    ) -> ProductionMetadata:
        """Write every non-empty owned tensor from its entry in `index`, then check the sources held still."""
        context = self._context
        with CheckpointFiles() as files:

            def write_one(file_writer: TensorFileWriter, tensor: FinalLayoutTensor) -> None:
                if tensor.nbytes == 0:
                    return  # nothing to write; the writer treats an empty tensor as complete
                entry = index[tensor.name]
                write_tensor(file_writer, tensor, entry, files.fd(entry))

            try:
                with one_core_for_the_lane():
                    write_all(writer, context, self._shard_bytes, write_one, self._progress)
            except CheckpointFormatError as exc:
                raise producer_error(FailureCode.PRODUCER_FAILED, str(exc)) from exc
        return self._finish()

    def _keep_fp32(self, tensor: FinalLayoutTensor) -> tuple[str, ...]:
        context = self._context
        return context.model_contracts[context.dit_names.index(tensor.dit_name)].keep_in_fp32_modules

    def _check_makes(self, tensor: FinalLayoutTensor, entry: CheckpointTensor, final: torch.dtype, rule: str) -> None:
        """This rank's part of `entry`, turned into `final` by `rule`, is the owned tensor's shape and dtype."""
        shard = self._context.tensor_shards.get(tensor.name)
        shape = entry.shape if shard is None else shard.local_shape(entry.shape)
        if shape != tensor.shape or final != tensor.dtype:
            raise producer_error(
                FailureCode.PRODUCER_FAILED,
                f"{tensor.name}: the checkpoint holds {entry.dtype} {list(entry.shape)}, which {rule} turns "
                f"into {final}, but the model expects {tensor.dtype} {list(tensor.shape)}",
                tensor=tensor.name,
            )

    def _local_rows(
        self, fd: int, entry: CheckpointTensor, shard: TensorShard | None
    ) -> Iterator[tuple[int, torch.Tensor]]:
        """(first local row, rows) chunks of the whole tensor (mapped), or of this rank's rows (dim 0) or columns
        (dim 1); each chunk's source bytes are noted in `largest_chunk_bytes`."""
        for local_row, rows in _local_row_chunks(fd, entry, shard, self._chunk_bytes):
            self.largest_chunk_bytes = max(self.largest_chunk_bytes, rows.numel() * rows.element_size())
            yield local_row, rows
            del rows  # the caller is done with it: a mapped chunk is unmapped before the next is read


@contextlib.contextmanager
def one_core_for_the_lane() -> Iterator[None]:
    """Leave one core to the writer's lane while a stream runs, then restore the intra-op thread count.

    The lane's write thread stores each cast chunk while this thread hashes it; an intra-op worker on the
    write thread's core would split each cast and spin between casts, taking that core from the lane (on
    the 2-core VM, one cast thread halved the stream's CPU). torch keeps the count per thread once a thread
    has run a parallel op, so other such threads keep theirs; a thread that runs its first parallel op
    meanwhile starts with it.
    """
    previous = torch.get_num_threads()
    if previous == 1:
        yield
        return
    torch.set_num_threads(previous - 1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _local_row_chunks(
    fd: int, entry: CheckpointTensor, shard: TensorShard | None, chunk_bytes: int
) -> Iterator[tuple[int, torch.Tensor]]:
    if shard is None:
        small = entry.end - entry.begin <= _READ_BELOW_BYTES
        for start, stop in row_chunks(entry, chunk_bytes):
            yield start, (read_rows if small else mapped_rows)(fd, entry, start, stop)
        return
    per_chunk = max(1, chunk_bytes // max(entry.row_bytes, 1))
    if shard.dim == 0:
        local_row = 0
        for first, last in shard.ranges():
            for start in range(first, last, per_chunk):
                stop = min(last, start + per_chunk)
                yield local_row, read_rows(fd, entry, start, stop)
                local_row += stop - start
        return
    ranges = shard.ranges()
    for start in range(0, entry.shape[0], per_chunk):
        yield start, read_column_ranges(fd, entry, start, min(entry.shape[0], start + per_chunk), ranges)

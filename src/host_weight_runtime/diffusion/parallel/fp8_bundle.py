"""ARTIFACT_BUNDLE production of the FP8 representation: every rank's parts from one checkpoint pass.

The FP8 bytes of a rank are the slice of the full tensor's quantization (one scale per full
weight, the same on every rank), so the bundle quantizes full checkpoint rows with
`FP8StreamCast` and then cuts them exactly as the BF16 bundle cuts its cast rows. A scale is
computed, not read: a 0-dim tensor the plan never splits, so it lives in the replicated part.
Each quantized weight is read once more, whole, for its amax (`bytes_read` counts it).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ...protocols import TensorFileWriter
from ..fp8 import FINAL_LAYOUT_FP8_SPEC
from ..identity_adapter import FinalLayoutIdentityContext
from ..producers._checkpoint import CheckpointTensor
from ..producers._shards import DEFAULT_SHARD_BYTES
from ..producers._stream import DEFAULT_CHUNK_BYTES
from ..producers.fp8_checkpoint import FinalLayoutFP8CheckpointProducer
from ..producers.fp8_stream import FP8StreamCast, FP8TensorRole
from ..tensor_layout import FinalLayoutTensor
from .bundle import FinalLayoutBF16BundleProducer

__all__ = ["FinalLayoutFP8BundleProducer", "bundle_producer"]


def bundle_producer(contexts: Sequence[FinalLayoutIdentityContext]) -> FinalLayoutBF16BundleProducer:
    """The bundle producer of the ranks' representation: FP8, or the BF16 bundle for a dtype policy."""
    if contexts and contexts[0].spec == FINAL_LAYOUT_FP8_SPEC:
        return FinalLayoutFP8BundleProducer(contexts)
    return FinalLayoutBF16BundleProducer(contexts)


class FinalLayoutFP8BundleProducer(FinalLayoutBF16BundleProducer):
    """The replicated part and every TP rank's shard part of the FP8 representation, in one checkpoint pass.

    Every part equals, byte for byte, the part a rank publishes after a canonical FP8 load
    (quantize the full model, then cut it to the rank): same keys and content digests.
    """

    def __init__(
        self,
        contexts: Sequence[FinalLayoutIdentityContext],
        *,
        shard_bytes: int = DEFAULT_SHARD_BYTES,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    ) -> None:
        if any(context.spec != FINAL_LAYOUT_FP8_SPEC for context in contexts):
            raise ValueError(
                "every rank of an FP8 bundle needs the FP8 representation's identity (quantize_model_fp8 on the "
                "skeleton, FINAL_LAYOUT_FP8_POLICY); use FinalLayoutBF16BundleProducer (or bundle_producer) else"
            )
        super().__init__(contexts, shard_bytes=shard_bytes, chunk_bytes=chunk_bytes)
        self._cast = FP8StreamCast(self.parts[0].rank.tensors, chunk_bytes=chunk_bytes)
        self._scaled: set[str] = set()

    def _start_pass(self, rank: FinalLayoutIdentityContext) -> dict[str, CheckpointTensor]:
        # A fresh cast per pass: a scale is never kept from an earlier pass over a checkpoint since replaced.
        self._cast = FP8StreamCast(rank.tensors, chunk_bytes=self._chunk_bytes)
        self._scaled = set()
        return FinalLayoutFP8CheckpointProducer(rank, chunk_bytes=self._chunk_bytes).checked_index()

    def _scale(self, weight_name: str, fd: int, entry: CheckpointTensor) -> torch.Tensor:
        """The full weight's scale; its first use reads the whole weight once (counted in `bytes_read`)."""
        if weight_name not in self._scaled:
            self._scaled.add(weight_name)
            self.bytes_read += entry.end - entry.begin
        return self._cast.scale(weight_name, fd, entry)

    def _final_rows(
        self, rows: torch.Tensor, tensor: FinalLayoutTensor, fd: int, entry: CheckpointTensor
    ) -> torch.Tensor:
        # Lives in the cast's reused buffer: the caller writes every rank's part before the next chunk.
        return self._cast.cast(tensor.name, rows, fd, entry, tensor.dtype)

    def _write_everywhere(
        self,
        tensor: FinalLayoutTensor,
        entry: CheckpointTensor,
        fd: int,
        contexts: Sequence[FinalLayoutIdentityContext],
        files: Sequence[TensorFileWriter],
    ) -> None:
        role = self._cast.role(tensor.name)
        if role is FP8TensorRole.SCALE:
            weight = self._cast.checkpoint_name(tensor.name)
            value = self._scale(weight, fd, entry)
            for file_writer in files:
                file_writer.write_tensor(tensor.name, value)
            return
        if role is FP8TensorRole.QUANTIZED and tensor.nbytes:
            self._scale(tensor.name, fd, entry)  # the amax pass, over the full weight, before any rows are held
        super()._write_everywhere(tensor, entry, fd, contexts, files)

"""Writing a loaded model's tensors in one pass: each piece copied once into a private buffer, then
written from that buffer and hashed from it on a second thread at the same time (or, for a model
nobody else holds yet, hashed and written straight from its own memory, the hashing started before
the file is preallocated).

Nothing is read back from the payload file, and what is hashed is exactly what was written: both
read the same private buffer, which is reused only after its write returned and its hash finished.
So the manifest describes the file even if the live tensors were to change during publication.
The digests are the tree digests a read-back would give (docs/DIGEST.md), so the artifact and its
manifest are byte-identical to the ones the read-back path writes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol, runtime_checkable

import torch

from ..._digest import DigestAlgorithm, TreeHasher, tree_digest
from ...protocols import ArtifactWriter, TensorFileWriter, TensorWriteSpec
from ..tensor_layout import FinalLayoutTensor
from ._shards import ProgressCallback, TensorWriter, write_files

__all__ = ["LIVE_BATCH_BYTES", "LIVE_PIECE_BYTES", "write_live_files"]

LIVE_PIECE_BYTES = 4 * 2**20
"""How many bytes of a live tensor are copied, written and hashed at a time (whole rows, at least one)."""

LIVE_BATCH_BYTES = 64 * 2**20
"""A private model's consecutive tensors are written together, up to this many bytes per `pwritev` (whole tensors,
at least one): one system call and one coverage claim per batch instead of per tensor."""

_BUFFERS = 3
"""Private buffers in rotation: one being filled while the lane hashes the others."""


@runtime_checkable
class _CallerHashedFile(Protocol):
    """An ordered payload file whose caller hashes what it writes (the store's writer provides it)."""

    @property
    def layout(self) -> tuple[TensorWriteSpec, ...]: ...

    def write_tensor(self, name: str, tensor: torch.Tensor) -> None: ...

    def write_data(self, data: bytes | bytearray | memoryview) -> None: ...

    def close_hashed(self, tensor_digests: Sequence[str]) -> None: ...


@runtime_checkable
class _VectoredFile(Protocol):
    """A caller-hashed file that writes several consecutive buffers in one call (the store's writer provides it)."""

    def write_data_parts(self, parts: Sequence[memoryview]) -> None: ...


@runtime_checkable
class _HashingArtifactWriter(Protocol):
    """A writer that lets its producer hash: it names the digest format and opens caller-hashed files."""

    @property
    def chunk_bytes(self) -> int: ...

    @property
    def digest_algorithm(self) -> DigestAlgorithm: ...

    def open_tensor_file(
        self,
        relative_name: str,
        specs: tuple[TensorWriteSpec, ...],
        *,
        ordered: bool = False,
        caller_hashes: bool = False,
    ) -> TensorFileWriter: ...


LiveBytes = Callable[[FinalLayoutTensor], torch.Tensor]
"""The live tensor to publish for a planned one (checked: on the host, in its final dtype)."""


def write_live_files(
    writer: ArtifactWriter,
    files: Sequence[tuple[str, Sequence[FinalLayoutTensor]]],
    live_tensor: LiveBytes,
    fallback: TensorWriter,
    progress: ProgressCallback | None = None,
    *,
    model_is_private: bool = False,
    check: Callable[[], None] | None = None,
) -> None:
    """Write every planned file from the live tensors; a writer that cannot take caller digests gets `fallback`
    (tensor by tensor, hashed by the writer).

    `model_is_private`: the caller guarantees that nothing writes these tensors until the call returns (a load
    publishing a model it has not handed out yet). Then no private copy is needed: each file's tensors are
    hashed straight from their memory, starting before the file is preallocated, and written from it.
    `check`: a check of the model that fails the production by raising; it runs first on the hash lane while
    the files are written, and no file is closed before it passed (its error wins over any later one).
    """
    if not isinstance(writer, _HashingArtifactWriter):
        if check is not None:
            check()
        write_files(writer, files, fallback, progress)
        return
    total = sum(tensor.nbytes for _file_name, group in files for tensor in group)
    if progress is not None:
        progress(0, total)
    # Leaving the block waits for every hash, so no buffer is read after the call, even a failed one.
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="hwr-live-hash") as lane:
        pieces = _PieceWriter(lane, writer.chunk_bytes, writer.digest_algorithm, progress, total)
        checked = lane.submit(check) if check is not None else None
        for file_name, group in files:
            early: dict[str, Future[str]] = {}
            try:
                values = {tensor.name: live_tensor(tensor) for tensor in group}
                flats = {name: _flat_bytes(value) for name, value in values.items()} if model_is_private else {}
                early.update((name, pieces.hash_early(flat)) for name, flat in flats.items())
                _write_file(writer, pieces, file_name, group, values=values, flats=flats, early=early, checked=checked)
            except BaseException:
                for digest in early.values():
                    digest.cancel()  # a failed file hashes no further tensor before the failure is reported
                if checked is not None:
                    checked.result()  # a model that failed its check fails the production with that error
                raise


def _write_file(
    writer: _HashingArtifactWriter,
    pieces: _PieceWriter,
    file_name: str,
    group: Sequence[FinalLayoutTensor],
    *,
    values: Mapping[str, torch.Tensor],
    flats: Mapping[str, torch.Tensor],
    early: Mapping[str, Future[str]],
    checked: Future[None] | None = None,
) -> None:
    """Open one caller-hashed payload file, write its tensors in layout order, close it with their digests.

    `flats` and `early`: a private model's tensors as flat bytes and their digests, already being hashed
    (both empty: copy piece by piece). `checked`: the model's check, which must pass before the file is closed."""
    specs = tuple(tensor.write_spec() for tensor in group)
    file_writer = writer.open_tensor_file(file_name, specs, ordered=True, caller_hashes=True)
    if not isinstance(file_writer, _CallerHashedFile):  # pragma: no cover - the store's files are
        raise TypeError(f"{type(file_writer).__name__} cannot be closed with caller digests")
    if early:
        pieces.write_private(file_writer, values, flats)
        digests = [early[spec.name] for spec in file_writer.layout]
    else:
        digests = [pieces.write(file_writer, spec.name, values[spec.name]) for spec in file_writer.layout]
    if checked is not None:
        checked.result()
    file_writer.close_hashed([digest.result() for digest in digests])


def _flat_bytes(value: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 tensor (a copy only when it is not contiguous)."""
    return value.resolve_conj().resolve_neg().contiguous().reshape(-1).view(torch.uint8)


class _PieceWriter:
    """Copies live tensors piece by piece into rotating private buffers, writes each and hashes it on the lane."""

    __slots__ = ("_algorithm", "_buffers", "_chunk_bytes", "_done", "_lane", "_pending", "_progress", "_total", "_turn")

    def __init__(
        self,
        lane: ThreadPoolExecutor,
        chunk_bytes: int,
        algorithm: DigestAlgorithm,
        progress: ProgressCallback | None,
        total: int,
    ) -> None:
        self._lane = lane
        self._chunk_bytes = chunk_bytes
        self._algorithm = algorithm
        self._progress = progress
        self._total = total
        self._done = 0
        self._buffers: list[bytearray] = [bytearray() for _ in range(_BUFFERS)]
        self._pending: list[Future[None] | None] = [None] * _BUFFERS
        self._turn = 0

    def write(self, file_writer: _CallerHashedFile, name: str, value: torch.Tensor) -> Future[str]:
        """Write all of `value` as the file's next tensor; the future gives its digest once every piece is hashed."""
        hasher = TreeHasher(self._chunk_bytes, self._algorithm)
        flat = _flat_bytes(value)
        nbytes = flat.numel()
        pieces: list[Future[None]] = []
        if nbytes == 0:
            file_writer.write_tensor(name, value)  # no bytes: nothing to copy, only the rows to account for
        else:
            row_bytes = nbytes // (value.shape[0] if value.dim() else 1)
            step = max(1, LIVE_PIECE_BYTES // row_bytes) * row_bytes
            source = flat.numpy().data
            for begin in range(0, nbytes, step):
                end = min(nbytes, begin + step)
                index, piece = self._take(end - begin)
                piece[:] = source[begin:end]
                hashed = self._lane.submit(hasher.update, piece)
                self._pending[index] = hashed
                pieces.append(hashed)
                file_writer.write_data(piece)  # the lane hashes this buffer while it is written
                self._done += end - begin
                if self._progress is not None:
                    self._progress(self._done, self._total)
        return self._lane.submit(_digest_after, pieces, hasher)  # the lane runs in order: after the last piece

    def hash_early(self, flat: torch.Tensor) -> Future[str]:
        """The digest of a private tensor's flat bytes, hashed on the lane from its own memory."""
        return self._lane.submit(tree_digest, flat.numpy().data, self._chunk_bytes, self._algorithm)

    def write_private(
        self, file_writer: _CallerHashedFile, values: Mapping[str, torch.Tensor], flats: Mapping[str, torch.Tensor]
    ) -> None:
        """Write a private model's tensors (hashed by `hash_early`) in layout order straight from their memory,
        consecutive ones together, up to `LIVE_BATCH_BYTES` per call."""
        batch: list[memoryview] = []
        batch_bytes = 0
        for spec in file_writer.layout:
            flat = flats[spec.name]
            if flat.numel() == 0:
                self._write_batch(file_writer, batch, batch_bytes)
                batch, batch_bytes = [], 0
                file_writer.write_tensor(spec.name, values[spec.name])  # no bytes: only its rows to account for
                continue
            batch.append(flat.numpy().data)
            batch_bytes += flat.numel()
            if batch_bytes >= LIVE_BATCH_BYTES:
                self._write_batch(file_writer, batch, batch_bytes)
                batch, batch_bytes = [], 0
        self._write_batch(file_writer, batch, batch_bytes)

    def _write_batch(self, file_writer: _CallerHashedFile, batch: Sequence[memoryview], nbytes: int) -> None:
        if not batch:
            return
        if len(batch) > 1 and isinstance(file_writer, _VectoredFile):
            file_writer.write_data_parts(batch)
        else:
            for part in batch:
                file_writer.write_data(part)
        self._done += nbytes
        if self._progress is not None:
            self._progress(self._done, self._total)

    def _take(self, nbytes: int) -> tuple[int, memoryview]:
        """The next buffer in rotation, once its previous hash finished, as a view of `nbytes`."""
        index = self._turn
        self._turn = (index + 1) % _BUFFERS
        pending, self._pending[index] = self._pending[index], None
        if pending is not None:
            pending.result()
        if len(self._buffers[index]) < nbytes:
            self._buffers[index] = bytearray(max(nbytes, LIVE_PIECE_BYTES))
        return index, memoryview(self._buffers[index])[:nbytes]


def _digest_after(pieces: Sequence[Future[None]], hasher: TreeHasher) -> str:
    """The tensor's digest; a piece that failed to hash fails it."""
    for piece in pieces:
        piece.result()
    return hasher.hexdigest()

"""A payload file's record at close: proof that every declared row was written, and what the manifest records.

The staging file writer (`_tensor_file`) does the writing; this is the part of its close that only reads
its bookkeeping: the completeness check over its row coverage, the check of digests a caller hashed
itself, and the `WrittenFile` (per-tensor manifest entries and the file digest) built from them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ..manifest import FileManifestEntry, TensorManifestEntry
from ..tensors import contiguous_strides
from ._coverage import RowCoverage
from ._safetensors_layout import FileLayout, Placement
from ._write_failures import producer_failed

__all__ = ["WrittenFile", "check_caller_digests", "check_complete", "written_file"]


@dataclass(frozen=True, slots=True)
class WrittenFile:
    """One closed, complete, fsynced payload file and the digests the manifest records."""

    name: str
    size: int
    header_size: int
    digest: str
    tensors: tuple[TensorManifestEntry, ...]

    def manifest_entry(self) -> FileManifestEntry:
        """The manifest's view of this file (tensor names in offset order)."""
        return FileManifestEntry(
            name=self.name,
            size=self.size,
            header_size=self.header_size,
            digest=self.digest,
            tensors=tuple(entry.name for entry in self.tensors),
        )


def check_complete(name: str, layout: FileLayout, coverage: Mapping[str, RowCoverage]) -> None:
    """Every row of every declared tensor of file `name` written and none still in flight, or a producer failure."""
    for placement in layout.placements:
        rows = coverage[placement.spec.name]
        missing = rows.first_missing()
        if missing is not None or rows.pending:
            begin, end = missing if missing is not None else rows.pending[0]
            raise producer_failed(
                f"{name}: tensor {placement.spec.name} rows {begin}..{end} were never written; "
                "every byte of every declared tensor must be written before close()",
                file=name,
                tensor=placement.spec.name,
                start_row=begin,
                stop_row=end,
            )


def check_caller_digests(name: str, layout: FileLayout, caller_digests: Sequence[str]) -> list[str]:
    """The digests `close_hashed` was given: one non-empty string per tensor, in layout order."""
    if len(caller_digests) != len(layout.placements) or not all(
        type(digest) is str and digest for digest in caller_digests
    ):
        raise producer_failed(
            f"{name}: close_hashed needs one digest per tensor ({len(layout.placements)}), got {len(caller_digests)}",
            file=name,
        )
    return list(caller_digests)


def written_file(
    name: str,
    layout: FileLayout,
    digests: Sequence[str],
    file_digest: str,
    expected: Sequence[TensorManifestEntry] | None = None,
) -> WrittenFile:
    """The manifest's record of complete file `name`: each tensor's entry with its digest, and the file's.

    `expected`: entries a caller already holds (an import's remote manifest), one per tensor in layout order;
    each is kept where it is exactly the record of what was written, so no second record is built and checked.
    """
    kept: Sequence[TensorManifestEntry | None] = (
        expected if expected is not None and len(expected) == len(digests) else (None,) * len(digests)
    )
    entries = tuple(
        known
        if known is not None and _records(known, name, placement, digest)
        else TensorManifestEntry(
            name=placement.spec.name,
            file=name,
            dtype=placement.code,
            shape=placement.spec.shape,
            strides=contiguous_strides(placement.spec.shape),
            data_offsets=(placement.begin, placement.end),
            kind=placement.spec.kind,
            role=placement.spec.role,
            digest=digest,
        )
        for placement, digest, known in zip(layout.placements, digests, kept, strict=True)
    )
    return WrittenFile(name=name, size=layout.size, header_size=len(layout.header), digest=file_digest, tensors=entries)


def _records(entry: TensorManifestEntry, file: str, placement: Placement, digest: str) -> bool:
    """Whether `entry` (validated when it was made) is exactly the record of `placement` with `digest` in `file`."""
    return (
        entry.name == placement.spec.name
        and entry.file == file
        and entry.dtype == placement.code
        and entry.shape == placement.spec.shape
        and entry.data_offsets == (placement.begin, placement.end)
        and entry.kind is placement.spec.kind
        and entry.role == placement.spec.role
        and entry.digest == digest
    )

"""The first file of a `file://` import is read in ranges that grow from a small one (hashing starts early) and
the last file in ranges that shrink towards its end (little hashing left once the last byte was copied) (E12);
every byte of those edges is still hashed and compared before publication, so a flipped byte in any of them,
or a source cut short while its file is copied (the object is opened once per file), is a non-retryable
remote_failed with nothing visible (E03).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from host_weight_runtime import FailureCode, StoreStatus
from host_weight_runtime._faults import Fault, FaultAction, armed
from host_weight_runtime.manifest import MANIFEST_FILE_NAME, WeightManifest
from host_weight_runtime.remote import FsspecArtifactProvider, import_remote_artifact, push_artifact
from host_weight_runtime.remote._ranges import ReadRange, plan_ranges

from .remote_support import META, Node, soon
from .support import make_identity, make_tensors

CHUNK = 64 << 10
SCALE = 64  # rows of 64 to 16 KiB: the last file spans several 64 KiB ranges


def _pushed(tmp_path: Path) -> tuple[Node, Path, WeightManifest]:
    node_a = Node(tmp_path / "node-a")
    identity = node_a.build(tensors=make_tensors(scale=SCALE))
    folder = tmp_path / "remote"
    push_artifact(node_a.store, identity, f"file://{folder}")
    manifest = WeightManifest.from_bytes((folder / identity.key / MANIFEST_FILE_NAME).read_bytes())
    return node_a, folder, manifest


def _plan(
    manifest: WeightManifest, index: int, *, head_bytes: int | None = None, tail_bytes: int | None = None
) -> list[ReadRange]:
    file = manifest.files[index]
    tensors = tuple(sorted((t for t in manifest.tensors if t.file == file.name), key=lambda t: t.data_offsets))
    return plan_ranges(file, tensors, CHUNK, head_bytes=head_bytes, tail_bytes=tail_bytes)


def _covered(ranges: list[ReadRange]) -> list[tuple[str, int, int]]:
    """Every tensor's bytes as the plan writes them: (tensor, byte offset in the tensor, length), merged."""
    pieces: list[tuple[str, int, int]] = []
    for item in ranges:
        for write in item.writes:
            row_bytes = 0 if write.rows == 0 else write.nbytes // write.rows
            start = 0 if write.start_row is None else write.start_row * row_bytes
            if pieces and pieces[-1][0] == write.spec.name and sum(pieces[-1][1:]) == start:
                name, first, length = pieces.pop()
                pieces.append((name, first, length + write.nbytes))
            else:
                pieces.append((write.spec.name, start, write.nbytes))
    return pieces


@pytest.mark.parametrize("edge", ["head", "tail", "both"])
def test_the_edge_plans_taper_and_still_cover_every_byte_once(tmp_path: Path, edge: str) -> None:
    """E12: with a head and/or a tail, the ranges are contiguous from the header to the end of the file, none
    is longer than a range, the first is small (head) and the last is small (tail), down to the edge size or
    one row, and the tensors' bytes are written exactly as the plan without edges writes them."""
    _, _, manifest = _pushed(tmp_path)
    for index, file in enumerate(manifest.files):
        plain = _plan(manifest, index)
        edges = {
            "head_bytes": CHUNK // 16 if edge in ("head", "both") else None,
            "tail_bytes": CHUNK // 16 if edge in ("tail", "both") else None,
        }
        tapered = _plan(manifest, index, **edges)
        position = file.header_size
        for item in tapered:
            assert item.start == position and item.end > item.start
            assert item.end - item.start <= CHUNK
            assert sum(write.nbytes for write in item.writes) == item.end - item.start
            position = item.end
        assert position == file.size
        assert _covered(tapered) == _covered(plain)
        largest_row = max(t.nbytes // t.shape[0] for t in manifest.tensors if t.file == file.name and t.shape)
        sizes = [item.end - item.start for item in tapered]
        if file.size - file.header_size > 2 * CHUNK:
            assert len(tapered) > len(plain)  # the edges split the file further
        for wanted, size in (("head_bytes", sizes[0]), ("tail_bytes", sizes[-1])):
            if edges[wanted] is not None:
                assert size <= max(CHUNK // 16, largest_row) and size < CHUNK // 2


@pytest.mark.parametrize(
    "where",
    ["first_byte", "middle_head_range", "last_head_range", "first_tail_range", "middle_tail_range", "last_byte"],
)
def test_a_flipped_byte_in_an_edge_is_caught(tmp_path: Path, where: str) -> None:
    """E03, E12: a byte flipped inside any of the growing first ranges of the first file or of the shrinking
    last ranges of the last file fails the import (non-retryable remote_failed) and node B keeps nothing."""
    _, folder, manifest = _pushed(tmp_path)
    head = [item for item in _plan(manifest, 0, head_bytes=CHUNK // 16) if item.end - item.start < CHUNK]
    tail = [item for item in _plan(manifest, -1, tail_bytes=CHUNK // 16) if item.end - item.start < CHUNK]
    assert len(head) >= 3 and len(tail) >= 3
    index, offset = {
        "first_byte": (0, head[0].start),
        "middle_head_range": (0, (head[len(head) // 2].start + head[len(head) // 2].end) // 2),
        "last_head_range": (0, head[-1].end - 1),
        "first_tail_range": (-1, tail[0].start),
        "middle_tail_range": (-1, (tail[len(tail) // 2].start + tail[len(tail) // 2].end) // 2),
        "last_byte": (-1, tail[-1].end - 1),
    }[where]
    payload = folder / make_identity().key / manifest.files[index].name
    data = bytearray(payload.read_bytes())
    data[offset] ^= 0x10
    payload.write_bytes(bytes(data))
    node_b = Node(tmp_path / "node-b")
    provider = FsspecArtifactProvider(f"file://{folder}", chunk_bytes=CHUNK)
    result = import_remote_artifact(node_b.store, make_identity(), provider, validation=META, deadline=soon())
    assert result is not None and result.status is StoreStatus.FAILED and result.failure is not None
    assert result.failure.code is FailureCode.REMOTE_FAILED and not result.failure.retryable
    assert node_b.visible() == [] and node_b.temporaries() == []


def test_a_source_cut_short_while_its_file_is_copied_fails_typed(tmp_path: Path) -> None:
    """E03, E12: the source is opened once per file; truncated in place after its first range was copied, the
    next copy comes up short: a non-retryable remote_failed naming the object, nothing visible on node B."""
    _, folder, manifest = _pushed(tmp_path)
    payload = folder / make_identity().key / manifest.files[0].name
    assert len(_plan(manifest, 0)) >= 2
    calls: list[str] = []

    def cut(point: str) -> None:
        calls.append(point)
        if len(calls) == 2:  # the first range is stored: the file is open, cut it in place
            os.truncate(payload, manifest.files[0].header_size + 1)

    node_b = Node(tmp_path / "node-b")
    provider = FsspecArtifactProvider(f"file://{folder}", chunk_bytes=CHUNK)
    with armed("remote.fetch.chunk", Fault(FaultAction.PAUSE, hook=cut, times=10_000)):
        result = import_remote_artifact(node_b.store, make_identity(), provider, validation=META, deadline=soon())
    assert len(calls) >= 2
    assert result is not None and result.status is StoreStatus.FAILED and result.failure is not None
    assert result.failure.code is FailureCode.REMOTE_FAILED and not result.failure.retryable
    details = result.failure.details.to_value()
    assert isinstance(details, dict) and str(details["object"]).endswith(manifest.files[0].name)
    assert "truncated" in result.failure.message  # the short copy itself, not a later digest mismatch
    assert node_b.visible() == [] and node_b.temporaries() == []

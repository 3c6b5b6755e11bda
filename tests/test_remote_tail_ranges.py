"""The last file of a `file://` import is read in ranges that shrink towards its end, so that little hashing is
left once the last byte was copied (E12); every byte of that tail is still hashed and compared before
publication, so a flipped byte in any tail range, or a source cut short while its file is copied (the object
is opened once per file), is a non-retryable remote_failed with nothing visible (E03).
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


def _plan(manifest: WeightManifest, index: int, tail_bytes: int | None) -> list[ReadRange]:
    file = manifest.files[index]
    tensors = tuple(sorted((t for t in manifest.tensors if t.file == file.name), key=lambda t: t.data_offsets))
    return plan_ranges(file, tensors, CHUNK, tail_bytes=tail_bytes)


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


def test_the_tail_plan_shrinks_and_still_covers_every_byte_once(tmp_path: Path) -> None:
    """E12: with a tail, the ranges are contiguous from the header to the end of the file, none is longer
    than a range, they shrink towards the end down to the tail size (or one row), and the tensors' bytes
    are written exactly as the plan without a tail writes them."""
    _, _, manifest = _pushed(tmp_path)
    file = manifest.files[-1]
    plain = _plan(manifest, -1, None)
    tail = _plan(manifest, -1, CHUNK // 16)
    assert len(tail) > len(plain)  # the tail split the end of the file further
    position = file.header_size
    for item in tail:
        assert item.start == position and item.end > item.start
        assert item.end - item.start <= CHUNK
        assert sum(write.nbytes for write in item.writes) == item.end - item.start
        position = item.end
    assert position == file.size
    largest_row = max(t.nbytes // t.shape[0] for t in manifest.tensors if t.file == file.name and t.shape)
    sizes = [item.end - item.start for item in tail]
    assert sizes[-1] <= max(CHUNK // 16, largest_row)
    assert sizes[-1] < CHUNK // 2
    assert _covered(tail) == _covered(plain)


@pytest.mark.parametrize("where", ["first_tail_range", "middle_tail_range", "last_byte"])
def test_a_flipped_byte_in_the_tail_is_caught(tmp_path: Path, where: str) -> None:
    """E03, E12: a byte flipped inside any of the shrinking last ranges of the last file fails the import
    (non-retryable remote_failed) and node B keeps nothing."""
    _, folder, manifest = _pushed(tmp_path)
    tail = [item for item in _plan(manifest, -1, CHUNK // 16) if item.end - item.start < CHUNK]
    assert len(tail) >= 3
    offset = {
        "first_tail_range": tail[0].start,
        "middle_tail_range": (tail[len(tail) // 2].start + tail[len(tail) // 2].end) // 2,
        "last_byte": tail[-1].end - 1,
    }[where]
    payload = folder / make_identity().key / manifest.files[-1].name
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
    assert len(_plan(manifest, 0, None)) >= 2
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

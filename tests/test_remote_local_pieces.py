"""A `file://` import copies each payload file piece by piece and hashes each piece as stored: read into a reused
buffer, written and hashed from it on the copying thread, or (with a hash lane) copied in the kernel and read back
from the stored file by the lane behind the next piece (E12); a file system that refuses the kernel copy gets the
buffered one, and a failed copy is a typed failure (S18); every byte
of every piece is still hashed and compared before publication, so a flipped byte anywhere (the first byte, either
side of a piece boundary, the last byte), or a source cut short while its file is copied (the object is opened
once per file), is a non-retryable remote_failed with nothing visible (E03).
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import torch

from host_weight_runtime import FailureCode, StoreStatus, WeightArtifactIdentity
from host_weight_runtime._digest import DigestAlgorithm, tree_digest
from host_weight_runtime._faults import Fault, FaultAction, armed
from host_weight_runtime.manifest import MANIFEST_FILE_NAME, WeightManifest
from host_weight_runtime.remote import FsspecArtifactProvider, import_remote_artifact, push_artifact
from host_weight_runtime.remote import provider as provider_module
from host_weight_runtime.remote._piece_lane import FileHashes, PieceLane, lane_pays

from .remote_support import META, Node, soon
from .support import make_identity, make_tensors

CHUNK = 64 << 10  # the piece size (a provider's chunk_bytes under 1 MiB)
SCALE = 64  # rows of 64 to 16 KiB: each file spans several 64 KiB pieces


def _pushed(tmp_path: Path) -> tuple[Node, Path, WeightManifest]:
    node_a = Node(tmp_path / "node-a")
    identity = node_a.build(tensors=make_tensors(scale=SCALE))
    folder = tmp_path / "remote"
    push_artifact(node_a.store, identity, f"file://{folder}")
    manifest = WeightManifest.from_bytes((folder / identity.key / MANIFEST_FILE_NAME).read_bytes())
    return node_a, folder, manifest


def _two_files_pushed(
    tmp_path: Path,
) -> tuple[WeightArtifactIdentity, dict[str, torch.Tensor], Node, FsspecArtifactProvider]:
    """Two payload files of many pieces pushed by node A to a `file://` folder: what node B imports, the
    tensors it must hold, node B, and a provider of the folder in CHUNK-byte pieces."""
    node_a = Node(tmp_path / "node-a")
    tensors = make_tensors(scale=SCALE)
    identity = node_a.build(tensors=tensors, files=2)
    url = f"file://{tmp_path / 'remote'}"
    push_artifact(node_a.store, identity, url)
    return identity, tensors, Node(tmp_path / "node-b"), FsspecArtifactProvider(url, chunk_bytes=CHUNK)


@pytest.mark.parametrize("read_back", [False, True])
@pytest.mark.parametrize("threaded", [False, True])
def test_pieces_that_straddle_tensors_hash_to_each_tensors_tree_digest(
    tmp_path: Path, threaded: bool, read_back: bool
) -> None:
    """E12: pieces of odd sizes, each crossing tensor boundaries (empty tensors among them), fed in order to a
    file's hashers, from lent buffers or read back from the stored file, on the copying thread or on the lane,
    give every tensor its one-shot tree digest; two files in a row keep their bytes apart."""
    sizes = [[5000, 0, 123, 70001, 1], [0, 9, 4096 * 3]]
    chunk = 4096
    lane = PieceLane(777, threaded=threaded)
    opened: list[tuple[FileHashes, list[bytes]]] = []
    try:
        for index, file_sizes in enumerate(sizes):
            blobs = [os.urandom(size) for size in file_sizes]
            hashes = FileHashes([len(blob) for blob in blobs], chunk, DigestAlgorithm.BLAKE3_TREE_V1)
            data = b"".join(blobs)
            stored = tmp_path / f"stored-{index}"
            stored.write_bytes(b"header" + data)  # read back from offset 6 on, as a payload after its header
            lane.open_file(hashes, reader=os.open(stored, os.O_RDONLY) if read_back else -1)
            position = 0
            while position < len(data):
                if read_back:
                    count = min(lane.next_piece(), len(data) - position)
                    lane.sent(6 + position, count)
                else:
                    buffer = lane.take()
                    count = min(len(buffer), len(data) - position)
                    buffer[:count] = data[position : position + count]
                    lane.stored(buffer, count)
                position += count
            lane.end_file()
            opened.append((hashes, blobs))
        for hashes, blobs in opened:
            expected = tuple(tree_digest(blob, chunk, DigestAlgorithm.BLAKE3_TREE_V1) for blob in blobs)
            assert lane.finish(hashes) == expected
    finally:
        lane.close()


@pytest.mark.parametrize("threaded", [False, True])
@pytest.mark.parametrize("where", ["first_byte", "end_of_a_piece", "start_of_a_piece", "last_byte"])
def test_a_flipped_byte_anywhere_is_caught(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str, threaded: bool
) -> None:
    """E03, E12: a byte flipped at the first data byte of the first file, on either side of a piece boundary,
    or at the last byte of the last file fails the import (non-retryable remote_failed), whichever thread
    hashes; node B keeps nothing."""
    monkeypatch.setattr(provider_module, "hash_on_a_lane", lambda: threaded)
    _, folder, manifest = _pushed(tmp_path)
    first, last = manifest.files[0], manifest.files[-1]
    assert first.size - first.header_size > 2 * CHUNK
    index, offset = {
        "first_byte": (0, first.header_size),
        "end_of_a_piece": (0, first.header_size + CHUNK - 1),
        "start_of_a_piece": (0, first.header_size + CHUNK),
        "last_byte": (-1, last.size - 1),
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


@pytest.mark.parametrize("threaded", [False, True])
def test_an_import_publishes_every_byte_whichever_thread_hashes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, threaded: bool
) -> None:
    """E12: the same import hashed on the copying thread and on a hash lane publishes the pushed bytes."""
    monkeypatch.setattr(provider_module, "hash_on_a_lane", lambda: threaded)
    identity, tensors, node_b, provider = _two_files_pushed(tmp_path)
    result = import_remote_artifact(node_b.store, identity, provider, validation=META, deadline=soon())
    assert result is not None and result.status is StoreStatus.BUILT and result.lease is not None, result
    result.lease.close()
    node_b.assert_holds(identity, tensors)


def test_a_source_cut_short_while_its_file_is_copied_fails_typed(tmp_path: Path) -> None:
    """E03, E12: the source is opened once per file; truncated in place after its first piece was stored, the
    next read comes up short: a non-retryable remote_failed naming the object, nothing visible on node B."""
    _, folder, manifest = _pushed(tmp_path)
    payload = folder / make_identity().key / manifest.files[0].name
    assert manifest.files[0].size - manifest.files[0].header_size > 2 * CHUNK
    calls: list[str] = []

    def cut(point: str) -> None:
        calls.append(point)
        if len(calls) == 2:  # the first piece is stored: the file is open, cut it in place
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


@pytest.mark.parametrize("threaded", [False, True])
def test_only_a_hash_lane_copies_in_the_kernel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, threaded: bool) -> None:
    """E12: with a hash lane every piece is copied in the kernel (the `sendfile` seam passes once a piece) and
    read back by the lane; without one, no piece is, and both publish the pushed bytes."""
    monkeypatch.setattr(provider_module, "hash_on_a_lane", lambda: threaded)
    identity, tensors, node_b, provider = _two_files_pushed(tmp_path)
    sends: list[str] = []
    with armed("writer.sendfile", Fault(FaultAction.PAUSE, hook=sends.append, times=10_000)):
        result = import_remote_artifact(node_b.store, identity, provider, validation=META, deadline=soon())
    assert result is not None and result.status is StoreStatus.BUILT and result.lease is not None, result
    result.lease.close()
    node_b.assert_holds(identity, tensors)
    data_bytes = sum(tensor.numel() * tensor.element_size() for tensor in tensors.values())
    assert len(sends) >= (data_bytes // CHUNK if threaded else 0) and (len(sends) > 0) == threaded


@pytest.mark.parametrize(("error", "published"), [(errno.EINVAL, True), (errno.EOPNOTSUPP, True), (errno.EIO, False)])
def test_a_refused_kernel_copy_falls_back_to_buffers_and_a_failed_one_is_typed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, error: int, published: bool
) -> None:
    """E12, S18: where the file system refuses `sendfile` (EINVAL, EOPNOTSUPP) each piece goes through a buffer
    and the import publishes the pushed bytes; any other error of the copy (EIO) fails the import typed and
    retryable, with nothing visible on node B."""
    monkeypatch.setattr(provider_module, "hash_on_a_lane", lambda: True)
    identity, tensors, node_b, provider = _two_files_pushed(tmp_path)
    with armed("writer.sendfile", Fault(FaultAction.RAISE_OSERROR, errno=error, times=10_000)):
        result = import_remote_artifact(node_b.store, identity, provider, validation=META, deadline=soon())
    assert result is not None
    if published:
        assert result.status is StoreStatus.BUILT and result.lease is not None, result
        result.lease.close()
        node_b.assert_holds(identity, tensors)
        return
    assert result.status is StoreStatus.FAILED and result.failure is not None
    assert result.failure.code is FailureCode.IO_ERROR and result.failure.retryable, result.failure
    assert node_b.visible() == [] and node_b.temporaries() == []


def test_a_failed_read_back_is_typed_and_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """E12, S18: an I/O error while the hash lane reads a stored piece back fails the import typed and retryable
    (io_error), the same whether the copying thread meets it at its next piece or when it finishes the file;
    node B keeps nothing, and the next import publishes."""
    monkeypatch.setattr(provider_module, "hash_on_a_lane", lambda: True)
    identity, tensors, node_b, provider = _two_files_pushed(tmp_path)
    with armed("remote.read_back", Fault(FaultAction.RAISE_OSERROR, errno=errno.EIO, times=10_000)):
        failed = import_remote_artifact(node_b.store, identity, provider, validation=META, deadline=soon())
    assert failed is not None and failed.status is StoreStatus.FAILED and failed.failure is not None
    assert failed.failure.code is FailureCode.IO_ERROR and failed.failure.retryable, failed.failure
    assert node_b.visible() == [] and node_b.temporaries() == []
    again = import_remote_artifact(node_b.store, identity, provider, validation=META, deadline=soon())
    assert again is not None and again.status is StoreStatus.BUILT and again.lease is not None, again
    again.lease.close()
    node_b.assert_holds(identity, tensors)


def test_a_hash_thread_is_used_only_where_a_core_is_free_for_it() -> None:
    """E12: three cores or more always hash on a thread; two only while the load leaves one idle; one never."""
    assert lane_pays(3, 10.0) and lane_pays(64, 0.0)
    assert lane_pays(2, 0.9) and not lane_pays(2, 1.5) and not lane_pays(2, 2.7)
    assert not lane_pays(1, 0.0)

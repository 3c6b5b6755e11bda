"""Post-load publication in one pass: each piece of a live tensor copied once, written and hashed from that copy.

A real small diffusers model is published twice: through the store's writer with the producer hashing
what it writes (the default), and through a writer that offers only `open_tensor_file` (so each file is
hashed by the writer from the written file, the path every other writer takes). The two artifacts must
be the same bytes; the one-pass one must verify fully; a mid-write ENOSPC must stay typed and leave
nothing behind.
"""

from __future__ import annotations

import errno
import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from host_weight_runtime import FilesystemHostWeightStore, StoreStatus, ValidationLevel
from host_weight_runtime._faults import Fault, FaultAction, arm, disarm_all
from host_weight_runtime.diffusion import FinalLayoutBF16Producer, FinalLayoutIdentityContext
from host_weight_runtime.diffusion.producers import _live_write
from host_weight_runtime.diffusion.producers._shards import DEFAULT_SHARD_BYTES
from host_weight_runtime.failures import FailureCode
from host_weight_runtime.outcomes import PostLoadPublicationStatus
from host_weight_runtime.protocols import ArtifactWriter, ProductionMetadata, TensorFileWriter, TensorWriteSpec
from host_weight_runtime.runtime import HostWeightRuntime

from ._diffusion import (
    DIT,
    Folder,
    Pipeline,
    TensorSnapshot,
    identity_context,
    publish_canonical,
    runtime_at,
    save_folder,
)


@pytest.fixture(scope="module")
def wan(tmp_path_factory: pytest.TempPathFactory) -> Folder:
    return save_folder(tmp_path_factory.mktemp("wan"), "wan")


@pytest.fixture(autouse=True)
def _disarm() -> Iterator[None]:
    yield
    disarm_all()


class _OpenOnlyWriter:
    """The store's writer seen through `open_tensor_file` alone: no caller digests, so the writer hashes."""

    def __init__(self, writer: ArtifactWriter) -> None:
        self._writer = writer

    def open_tensor_file(
        self, relative_name: str, specs: tuple[TensorWriteSpec, ...], *, ordered: bool = False
    ) -> TensorFileWriter:
        return self._writer.open_tensor_file(relative_name, specs, ordered=ordered)


class _WriterHashedProducer(FinalLayoutBF16Producer):
    """The same producer, handed a writer that cannot take caller digests."""

    def produce(self, writer: ArtifactWriter) -> ProductionMetadata:
        return super().produce(_OpenOnlyWriter(writer))


def _published_files(runtime: HostWeightRuntime, context: FinalLayoutIdentityContext) -> dict[str, bytes]:
    """Every file of the published artifact (manifest, READY marker, payloads), by name."""
    store = FilesystemHostWeightStore(runtime.config.root)
    folder = store.layout.artifact_dir(context.identity.key)
    return {name: (folder / name).read_bytes() for name in sorted(os.listdir(folder))}


def _without_id_and_time(ready: bytes) -> dict[str, object]:
    marker = json.loads(ready)
    assert isinstance(marker, dict) and marker.pop("publication_id") and marker.pop("published_at_ns")
    return marker


def _piece_bytes_seam(monkeypatch: pytest.MonkeyPatch, nbytes: int) -> None:
    """Pieces of `nbytes` (whole rows), so most tensors of a small model are written in several pieces, and a
    private model's batches of about `nbytes`, so its file is written in several `pwritev` calls."""
    monkeypatch.setattr(_live_write, "LIVE_PIECE_BYTES", nbytes)
    monkeypatch.setattr(_live_write, "LIVE_BATCH_BYTES", nbytes)


# (piece bytes, payload-file bytes or None for one file, model_is_private)
CASES = [(4096, None, False), (1000, 64 * 1024, False), (2**22, 16 * 1024, False), (4096, None, True), (1000, 16 * 1024, True), (2**22, None, True)]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_one_pass_publication_is_byte_identical_to_the_writer_hashed_one(
    wan: Folder, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: tuple[int, int | None, bool]
) -> None:
    """D10 D09: publishing with the producer hashing what it writes (each piece from its private copy, or a
    private model's tensors straight from their memory) gives the very files (payloads, manifest, READY
    marker) the writer-hashed path gives, verifies under FULL_CHECKSUM, and leaves the serving model untouched."""
    piece_bytes, shard_bytes, private = case
    _piece_bytes_seam(monkeypatch, piece_bytes)
    holder = Pipeline(wan.canonical())
    context = identity_context(holder, wan.source())
    kwargs: dict[str, object] = {"model_is_private": private}
    if shard_bytes is not None:
        kwargs["shard_bytes"] = shard_bytes
    before = TensorSnapshot.of(holder)

    one_pass = runtime_at(tmp_path / "one-pass")
    report = publish_canonical(one_pass, context, holder.transformer, **kwargs)
    assert report.status is PostLoadPublicationStatus.PUBLISHED, report.failure
    before.assert_unchanged(holder)

    hashed = runtime_at(tmp_path / "writer-hashed")
    producer = _WriterHashedProducer(context, [(DIT, holder.transformer)], shard_bytes=shard_bytes or DEFAULT_SHARD_BYTES)
    assert hashed.publish_after_load(context.identity, producer).status is PostLoadPublicationStatus.PUBLISHED

    one_pass_files, hashed_files = _published_files(one_pass, context), _published_files(hashed, context)
    assert sorted(one_pass_files) == sorted(hashed_files)
    if shard_bytes is not None:
        assert sum(name.endswith(".safetensors") for name in one_pass_files) >= 2
    for name, data in one_pass_files.items():
        if name == "READY.json":  # each publication has its own id and time; the rest must match
            assert _without_id_and_time(data) == _without_id_and_time(hashed_files[name])
        else:
            assert data == hashed_files[name], name
    store = FilesystemHostWeightStore(one_pass.config.root)
    hit = store.lookup(context.identity, validation=ValidationLevel.FULL_CHECKSUM)
    assert hit.status is StoreStatus.HIT and hit.lease is not None, hit.failure
    with hit.lease as lease:
        live = dict(holder.transformer.state_dict())
        for tensor in context.tensors:
            served = lease.tensors[tensor.name]
            assert served.dtype == tensor.dtype and torch.equal(served, live[tensor.name.removeprefix(f"{DIT}.")])


@pytest.mark.parametrize("private", [False, True], ids=["copied", "private"])
@pytest.mark.parametrize("seam", [("writer.pwrite", 3), ("writer.after_pwrite", 5)], ids=str)
def test_one_pass_publication_mid_write_enospc_is_typed_and_leaves_nothing(
    wan: Folder, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, seam: tuple[str, int], private: bool
) -> None:
    """S18 S16: ENOSPC in the middle of a one-pass publication is a typed, retryable NO_SPACE report (never
    raised); no artifact, staging directory or deny marker is left; the next publication verifies fully."""
    point, skip = seam
    _piece_bytes_seam(monkeypatch, 4096)
    holder = Pipeline(wan.canonical())
    context = identity_context(holder, wan.source())
    runtime = runtime_at(tmp_path / "domain")
    arm(point, Fault(FaultAction.PAUSE, times=skip))  # a PAUSE without a hook only counts a pass
    arm(point, Fault(FaultAction.RAISE_OSERROR, errno=errno.ENOSPC))

    report = publish_canonical(runtime, context, holder.transformer, model_is_private=private)
    disarm_all()

    assert report.status is PostLoadPublicationStatus.FAILED and report.failure is not None
    assert report.failure.code is FailureCode.NO_SPACE and report.failure.retryable
    store = FilesystemHostWeightStore(runtime.config.root)
    for directory in (store.layout.artifacts, store.layout.tmp, store.layout.deny, store.layout.quarantine):
        assert os.listdir(directory) == [], directory
    again = publish_canonical(runtime, context, holder.transformer, model_is_private=private)
    assert again.status is PostLoadPublicationStatus.PUBLISHED, again.failure
    hit = store.lookup(context.identity, validation=ValidationLevel.FULL_CHECKSUM)
    assert hit.status is StoreStatus.HIT and hit.lease is not None, hit.failure
    hit.lease.close()


@pytest.mark.parametrize("private", [False, True], ids=["copied", "private"])
def test_s18_a_model_that_breaks_the_tensor_contract_fails_and_leaves_nothing(
    wan: Folder, tmp_path: Path, private: bool
) -> None:
    """S18 S04: a loaded model one of whose weights has another shape (the same bytes, transposed) than the identity
    records is a non-retryable PRODUCER_FAILED naming the contract, even where the check runs beside the writes
    (a private model); no artifact or staging directory is left, and nothing can be looked up under the key."""
    holder = Pipeline(wan.canonical())
    context = identity_context(holder, wan.source())
    owner, name, weight = next(
        (module, name, parameter)
        for module in holder.transformer.modules()
        for name, parameter in module.named_parameters(recurse=False)
        if parameter.dim() == 2 and parameter.shape[0] != parameter.shape[1]
    )
    setattr(owner, name, torch.nn.Parameter(weight.detach().t().contiguous(), requires_grad=False))
    runtime = runtime_at(tmp_path / "domain")

    report = publish_canonical(runtime, context, holder.transformer, model_is_private=private)

    assert report.status is PostLoadPublicationStatus.FAILED and report.failure is not None
    assert report.failure.code is FailureCode.PRODUCER_FAILED and not report.failure.retryable
    assert "tensor contract" in report.failure.message
    store = FilesystemHostWeightStore(runtime.config.root)
    for directory in (store.layout.artifacts, store.layout.tmp):
        assert os.listdir(directory) == [], directory
    assert store.lookup(context.identity, validation=ValidationLevel.FULL_CHECKSUM).status is StoreStatus.MISS

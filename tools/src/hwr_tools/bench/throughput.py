"""Publication and verification throughput, each next to the floor it cannot beat, on the same bytes.

Publication (`get_or_build` with a streaming producer: write, hash, manifest, READY,
fsyncs, rename) runs next to a raw `pwrite` + `fsync` of exactly the payload bytes to
the same filesystem, each file first preallocated (`posix_fallocate`) in one write and only
sized (`ftruncate`) in the other; the faster is the bound, since the store sizes payload files
on tmpfs without zeroing them and preallocates them elsewhere. FULL_CHECKSUM verification runs
next to single-thread SHA-256 of the same payload files. The artifact is digested as the BF16
final-layout artifacts are (`blake3-tree-v1`, docs/DIGEST.md). Raw and store runs alternate
which goes first.
"""

from __future__ import annotations

import gc
import hashlib
import mmap
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from host_weight_runtime import (
    IDENTITY_SCHEMA_VERSION,
    AdaptationIdentity,
    ArtifactWriter,
    BuildRequest,
    ComponentIdentity,
    DigestAlgorithm,
    FilesystemHostWeightStore,
    LookupPhase,
    ProducerIdentity,
    ProductionMetadata,
    ProductionSourceMode,
    RuntimeWeightLayout,
    StorageClass,
    StoreStatus,
    TensorWriteSpec,
    ValidationLevel,
    WeightArtifactIdentity,
    WeightProductionSpec,
    WeightRepresentation,
    WeightSourceIdentity,
)

from ..common import remove_tree

__all__ = ["ThroughputSamples", "measure_throughput"]

_TENSOR_BYTES = 16 << 20
_ROW_ELEMENTS = 4096  # BF16 elements per tensor row
_FILES = 2
_MANIFEST_SCHEMA = "bench-manifest"  # + the digest algorithm's name: each format has its own keys
_RESTORER_SCHEMA = "bench-restorer-v1"


@dataclass(frozen=True, slots=True)
class ThroughputSamples:
    """Seconds per run for each measurement, over the same `payload_bytes`."""

    payload_bytes: int
    raw_write_fsync_s: tuple[float, ...]  # per run, the faster of the two raw writes below
    raw_preallocated_s: tuple[float, ...]
    raw_sized_s: tuple[float, ...]
    publish_s: tuple[float, ...]
    single_thread_sha256_s: tuple[float, ...]
    full_checksum_s: tuple[float, ...]


def _identity(payload_bytes: int, run: int, algorithm: DigestAlgorithm) -> WeightArtifactIdentity:
    return WeightArtifactIdentity(
        schema_version=IDENTITY_SCHEMA_VERSION,
        source=WeightSourceIdentity(
            model_id=f"bench/throughput-{payload_bytes}", revision=str(run), fingerprint="0" * 64
        ),
        component=ComponentIdentity(name="transformer", ownership="complete"),
        representation=WeightRepresentation(name="bench", dtype="torch.bfloat16"),
        layout=RuntimeWeightLayout(name="bench"),
        adaptation=AdaptationIdentity(),
        producer=ProducerIdentity(
            producer_id="bench-throughput",
            version="1",
            implementation_fingerprint="1" * 64,
            manifest_schema=f"{_MANIFEST_SCHEMA}-{algorithm.value}",
            restorer_schema=_RESTORER_SCHEMA,
        ),
    )


def _tensors(payload_bytes: int) -> dict[str, torch.Tensor]:
    """Random BF16 bit patterns (incompressible, like trained weights): 16 MiB each, smaller for a payload
    under 32 MiB, so that each of the `_FILES` payload files gets at least one (a payload file may not be empty)."""
    generator = torch.Generator().manual_seed(0)
    row_bytes = _ROW_ELEMENTS * 2
    tensor_rows = max(1, min(_TENSOR_BYTES, payload_bytes // _FILES) // row_bytes)
    count = max(_FILES, payload_bytes // (tensor_rows * row_bytes))
    return {
        f"blocks.{index}.weight": torch.randint(
            -32768, 32767, (tensor_rows, _ROW_ELEMENTS), dtype=torch.int16, generator=generator
        ).view(torch.bfloat16)
        for index in range(count)
    }


class _Producer:
    """Writes pre-generated tensors through the store's writer, in the writer's layout order."""

    def __init__(
        self, identity: WeightArtifactIdentity, tensors: dict[str, torch.Tensor], algorithm: DigestAlgorithm
    ) -> None:
        self._tensors = tensors
        self._spec = WeightProductionSpec(
            producer_id="bench-throughput",
            outputs=(identity,),
            source_mode=ProductionSourceMode.CHECKPOINT_STREAM,
            lookup_phase=LookupPhase.PRE_LOAD_SAFE,
            digest_algorithm=algorithm,
        )

    @property
    def spec(self) -> WeightProductionSpec:
        return self._spec

    def produce(self, writer: ArtifactWriter) -> ProductionMetadata:
        names = list(self._tensors)
        for index in range(_FILES):
            group = names[index::_FILES]
            specs = tuple(TensorWriteSpec(n, tuple(self._tensors[n].shape), self._tensors[n].dtype) for n in group)
            file_writer = writer.open_tensor_file(f"model-{index:05d}.safetensors", specs, ordered=True)
            for spec in getattr(file_writer, "layout", specs):
                file_writer.write_tensor(spec.name, self._tensors[spec.name])
            file_writer.close()
        return ProductionMetadata(self._spec.outputs[0].producer.manifest_schema, _RESTORER_SCHEMA)


def _raw_write(directory: Path, tensors: dict[str, torch.Tensor], *, preallocate: bool) -> None:
    """`posix_fallocate` (or only `ftruncate`) + pwrite + fsync of exactly the payload bytes, in as many files
    as publication writes."""
    names = list(tensors)
    paths = [directory / f"raw-{index}.bin" for index in range(_FILES)]
    for index, path in enumerate(paths):
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        try:
            group = names[index::_FILES]
            group_bytes = sum(tensors[n].numel() * tensors[n].element_size() for n in group)
            if not preallocate:
                os.ftruncate(fd, group_bytes)
            elif group_bytes:  # a tiny model may leave a file empty, and fallocate refuses a zero length
                os.posix_fallocate(fd, 0, group_bytes)
            offset = 0
            for name in group:
                view = memoryview(tensors[name].reshape(-1).view(torch.uint8).numpy().data)
                while view:
                    written = os.pwrite(fd, view, offset)
                    offset += written
                    view = view[written:]
            os.fsync(fd)
        finally:
            os.close(fd)
    for path in paths:
        path.unlink()


def _raw_write_s(directory: Path, tensors: dict[str, torch.Tensor], *, preallocate: bool) -> float:
    gc.collect()  # off the clock, as `_timed`
    started = time.perf_counter()
    _raw_write(directory, tensors, preallocate=preallocate)
    return time.perf_counter() - started


def _timed(action: Callable[[], None]) -> float:
    gc.collect()  # garbage left by the run before (or the imports) is collected off the clock, before each side
    started = time.perf_counter()
    action()
    return time.perf_counter() - started


def measure_throughput(
    workdir: Path, payload_bytes: int, runs: int, algorithm: DigestAlgorithm = DigestAlgorithm.BLAKE3_TREE_V1
) -> ThroughputSamples:
    """Run each measurement `runs` times on a fresh domain under `workdir` (removed afterwards)."""
    tensors = _tensors(payload_bytes)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    domain_root = workdir / "throughput-domain"
    raw_dir = workdir / "throughput-raw"
    raw_dir.mkdir()
    try:
        store = FilesystemHostWeightStore(domain_root, storage_class=StorageClass.AUTO)
        raw_s: dict[bool, list[float]] = {True: [], False: []}
        publish_s: list[float] = []
        for run in range(runs):
            identity = _identity(total, run, algorithm)

            def publish(identity: WeightArtifactIdentity = identity) -> None:
                result = store.get_or_build(
                    BuildRequest(identity),
                    _Producer(identity, tensors, algorithm),
                    validation=ValidationLevel.MANIFEST_AND_METADATA,
                    deadline=time.monotonic() + 600,
                )
                if result.status is not StoreStatus.BUILT or result.lease is None:
                    raise RuntimeError(f"publication failed: {result.failure}")
                result.lease.close()

            if run % 2:  # alternate which goes first: publication, or the two raw writes (in either order)
                publish_s.append(_timed(publish))
            for preallocate in (True, False) if run % 2 == 0 else (False, True):
                raw_s[preallocate].append(_raw_write_s(raw_dir, tensors, preallocate=preallocate))
            if run % 2 == 0:
                publish_s.append(_timed(publish))
            if run:
                store.cleanup(identity.key)
        identity = _identity(total, 0, algorithm)
        payload_files = sorted(store.layout.artifact_dir(identity.key).glob("*.safetensors"))
        sha_s: list[float] = []
        full_s: list[float] = []
        for run in range(runs):

            def full_checksum() -> None:
                result = store.lookup(identity, validation=ValidationLevel.FULL_CHECKSUM)
                if result.lease is None:
                    raise RuntimeError(f"FULL_CHECKSUM lookup failed: {result.failure}")
                result.lease.close()

            def single_thread_sha256() -> None:
                for path in payload_files:
                    with path.open("rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
                        hashlib.sha256(mapped).digest()

            first, second = (
                (single_thread_sha256, full_checksum) if run % 2 == 0 else (full_checksum, single_thread_sha256)
            )
            first_s, second_s = _timed(first), _timed(second)
            sha_s.append(first_s if first is single_thread_sha256 else second_s)
            full_s.append(second_s if first is single_thread_sha256 else first_s)
        return ThroughputSamples(
            payload_bytes=total,
            raw_write_fsync_s=tuple(map(min, raw_s[True], raw_s[False])),
            raw_preallocated_s=tuple(raw_s[True]),
            raw_sized_s=tuple(raw_s[False]),
            publish_s=tuple(publish_s),
            single_thread_sha256_s=tuple(sha_s),
            full_checksum_s=tuple(full_s),
        )
    finally:
        remove_tree(domain_root)
        remove_tree(raw_dir)

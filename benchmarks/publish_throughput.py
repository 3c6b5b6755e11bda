"""Publication throughput, verification throughput and warm lookup time on one domain.

Measures side by side in one run, on the same filesystem and the same bytes:
  * raw write+fsync of the payload bytes (the floor any publisher pays),
  * `get_or_build` publication (write, hash, manifest, READY, fsyncs, rename),
  * FULL_CHECKSUM verification vs single-thread SHA-256 of the same bytes,
  * warm lookup (MANIFEST_AND_METADATA) in this process and in fresh processes.
Every figure is the median of --runs runs with min and max. Not a test: no thresholds.

    python benchmarks/publish_throughput.py [--size-mib 1024] [--runs 5] [--root /dev/shm/...]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import mmap
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from host_weight_runtime import (
    BuildRequest,
    FilesystemHostWeightStore,
    LookupPhase,
    ProductionMetadata,
    ProductionSourceMode,
    StoreStatus,
    TensorWriteSpec,
    ValidationLevel,
    WeightArtifactIdentity,
    WeightProductionSpec,
)
from host_weight_runtime.identity import (
    IDENTITY_SCHEMA_VERSION,
    AdaptationIdentity,
    ComponentIdentity,
    ProducerIdentity,
    RuntimeWeightLayout,
    WeightRepresentation,
    WeightSourceIdentity,
)
from host_weight_runtime.protocols import ArtifactWriter

TENSOR_MIB = 16


def bench_identity(size_mib: int, run: int) -> WeightArtifactIdentity:
    return WeightArtifactIdentity(
        schema_version=IDENTITY_SCHEMA_VERSION,
        source=WeightSourceIdentity(model_id=f"bench/synthetic-{size_mib}mib", revision=str(run), fingerprint="0" * 64),
        component=ComponentIdentity(name="transformer", ownership="complete"),
        representation=WeightRepresentation(name="bench", dtype="torch.bfloat16"),
        layout=RuntimeWeightLayout(name="bench"),
        adaptation=AdaptationIdentity(),
        producer=ProducerIdentity(
            producer_id="bench-producer",
            version="1",
            implementation_fingerprint="1" * 64,
            manifest_schema="bench-manifest-v1",
            restorer_schema="bench-restorer-v1",
        ),
    )


def make_tensors(size_mib: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    count = max(1, size_mib // TENSOR_MIB)
    elements = TENSOR_MIB * 1024 * 1024 // 2
    return {
        f"blocks.{index}.weight": torch.randint(
            -32768, 32767, (elements // 4096, 4096), dtype=torch.int16, generator=generator
        ).view(torch.bfloat16)
        for index in range(count)
    }


class BenchProducer:
    """Writes pre-generated tensors through the store writer in layout order."""

    def __init__(self, identity: WeightArtifactIdentity, tensors: dict[str, torch.Tensor], files: int) -> None:
        self.identity = identity
        self.tensors = tensors
        self.files = files
        self._spec = WeightProductionSpec(
            producer_id="bench-producer",
            outputs=(identity,),
            source_mode=ProductionSourceMode.CHECKPOINT_STREAM,
            lookup_phase=LookupPhase.PRE_LOAD_SAFE,
        )

    @property
    def spec(self) -> WeightProductionSpec:
        return self._spec

    def produce(self, writer: ArtifactWriter) -> ProductionMetadata:
        names = list(self.tensors)
        for index in range(self.files):
            group = names[index :: self.files]
            specs = tuple(TensorWriteSpec(n, tuple(self.tensors[n].shape), self.tensors[n].dtype) for n in group)
            file_writer = writer.open_tensor_file(f"model-{index:05d}.safetensors", specs, ordered=True)
            for spec in getattr(file_writer, "layout", specs):
                file_writer.write_tensor(spec.name, self.tensors[spec.name])
            file_writer.close()
        return ProductionMetadata("bench-manifest-v1", "bench-restorer-v1")


def raw_write(directory: Path, tensors: dict[str, torch.Tensor], files: int) -> None:
    names = list(tensors)
    for index in range(files):
        path = directory / f"raw-{index}.bin"
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        try:
            group = names[index::files]
            size = sum(tensors[n].numel() * tensors[n].element_size() for n in group)
            os.posix_fallocate(fd, 0, size)
            offset = 0
            for name in group:
                view = memoryview(tensors[name].reshape(-1).view(torch.uint8).numpy())
                while view:
                    written = os.pwrite(fd, view, offset)
                    offset += written
                    view = view[written:]
            os.fsync(fd)
        finally:
            os.close(fd)
    for index in range(files):
        os.unlink(directory / f"raw-{index}.bin")


def summarize(samples: list[float]) -> dict[str, float]:
    return {"median": statistics.median(samples), "min": min(samples), "max": max(samples)}


def timed(action: Callable[[], None]) -> float:
    start = time.perf_counter()
    action()
    return time.perf_counter() - start


WORKER_CODE = """
import json, sys, time
from pathlib import Path
start = time.perf_counter()
from host_weight_runtime import FilesystemHostWeightStore, ValidationLevel
sys.path.insert(0, sys.argv[3])
from publish_throughput import bench_identity
identity = bench_identity(int(sys.argv[2]), 0)
store = FilesystemHostWeightStore(Path(sys.argv[1]))
t0 = time.perf_counter()
result = store.lookup(identity, validation=ValidationLevel.MANIFEST_AND_METADATA)
t1 = time.perf_counter()
assert result.lease is not None, result
print(json.dumps({"lookup_s": t1 - t0, "status": result.status.value}))
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--files", type=int, default=2)
    parser.add_argument(
        "--root", type=Path, default=None, help="parent directory of the bench domain (default /dev/shm)"
    )
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()

    parent = args.root or Path("/dev/shm")
    workdir = Path(tempfile.mkdtemp(prefix="hwr-bench-", dir=parent))
    try:
        tensors = make_tensors(args.size_mib)
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        store = FilesystemHostWeightStore(workdir / "domain")
        raw_dir = workdir / "raw"
        raw_dir.mkdir()
        raw_s: list[float] = []
        publish_s: list[float] = []
        for run in range(args.runs):
            identity = bench_identity(args.size_mib, run)
            producer = BenchProducer(identity, tensors, args.files)

            def publish(identity: WeightArtifactIdentity = identity, producer: BenchProducer = producer) -> None:
                result = store.get_or_build(
                    BuildRequest(identity),
                    producer,
                    validation=ValidationLevel.MANIFEST_AND_METADATA,
                    deadline=time.monotonic() + 600,
                )
                assert result.status is StoreStatus.BUILT and result.lease is not None, result.failure
                result.lease.close()

            # Alternate which goes first so page-cache and allocator warm-up favour neither.
            if run % 2 == 0:
                raw_s.append(timed(lambda: raw_write(raw_dir, tensors, args.files)))
                publish_s.append(timed(publish))
            else:
                publish_s.append(timed(publish))
                raw_s.append(timed(lambda: raw_write(raw_dir, tensors, args.files)))
            if run:
                assert store.cleanup(identity.key).status.value == "removed"
        identity = bench_identity(args.size_mib, 0)

        warm_s: list[float] = []
        full_s: list[float] = []
        sha_s: list[float] = []
        for _ in range(args.runs):

            def lookup(level: ValidationLevel) -> None:
                result = store.lookup(identity, validation=level)
                assert result.lease is not None
                result.lease.close()

            warm_s.append(timed(lambda: lookup(ValidationLevel.MANIFEST_AND_METADATA)))
            full_s.append(timed(lambda: lookup(ValidationLevel.FULL_CHECKSUM)))
            payload_files = sorted(store.layout.artifact_dir(identity.key).glob("*.safetensors"))

            def single_thread_sha(payload_files: list[Path] = payload_files) -> None:
                for path in payload_files:
                    with path.open("rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
                        hashlib.sha256(mapped).digest()

            sha_s.append(timed(single_thread_sha))

        fresh_s: list[float] = []
        here = str(Path(__file__).resolve().parent)
        for _ in range(args.runs):
            out = subprocess.run(
                [sys.executable, "-c", WORKER_CODE, str(store.root), str(args.size_mib), here],
                check=True,
                capture_output=True,
                text=True,
            )
            fresh_s.append(json.loads(out.stdout)["lookup_s"])

        gib = total / 2**30
        results = {
            "machine": {
                "host": platform.node(),
                "cpus": os.cpu_count(),
                "python": platform.python_version(),
                "torch": torch.__version__,
                "fs": store.domain.fs_type,
                "root": str(parent),
            },
            "bytes": total,
            "runs": args.runs,
            "raw_write_fsync_s": summarize(raw_s),
            "publish_s": summarize(publish_s),
            "publish_vs_raw_throughput": statistics.median(raw_s) / statistics.median(publish_s),
            "publish_vs_raw_throughput_best": min(raw_s) / min(publish_s),
            "warm_lookup_metadata_s": summarize(warm_s),
            "warm_lookup_fresh_process_s": summarize(fresh_s),
            "full_checksum_lookup_s": summarize(full_s),
            "single_thread_sha256_s": summarize(sha_s),
            "full_checksum_vs_sha256_throughput": statistics.median(sha_s) / statistics.median(full_s),
        }
        print(f"artifact: {gib:.2f} GiB on {store.domain.fs_type} ({parent}), {args.runs} runs, median [min, max]")

        def row(label: str, key: str, per_gib: bool = True) -> None:
            stats = results[key]
            assert isinstance(stats, dict)
            rate = f"  {gib / stats['median']:.2f} GiB/s" if per_gib else ""
            print(
                f"  {label:<34} {stats['median'] * 1000:9.1f} ms [{stats['min'] * 1000:.1f}, {stats['max'] * 1000:.1f}]{rate}"
            )

        row("raw write+fsync", "raw_write_fsync_s")
        row("publication (get_or_build)", "publish_s")
        row("single-thread SHA-256", "single_thread_sha256_s")
        row("FULL_CHECKSUM lookup", "full_checksum_lookup_s")
        row("warm lookup (metadata), in process", "warm_lookup_metadata_s", per_gib=False)
        row("warm lookup, fresh process", "warm_lookup_fresh_process_s", per_gib=False)
        print(
            f"  publication throughput / raw write+fsync: {results['publish_vs_raw_throughput']:.2f} (medians), "
            f"{results['publish_vs_raw_throughput_best']:.2f} (best runs)"
        )
        print(
            f"  FULL_CHECKSUM throughput / single-thread SHA-256: {results['full_checksum_vs_sha256_throughput']:.2f}"
        )
        args.out.mkdir(parents=True, exist_ok=True)
        out_file = args.out / f"{time.strftime('%Y-%m-%d')}-{platform.node()}-publish.json"
        out_file.write_text(json.dumps(results, indent=2) + "\n")
        print(f"  wrote {out_file}")
        return 0
    finally:
        for directory, _dirs, _files in os.walk(workdir):
            os.chmod(directory, 0o700)
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())

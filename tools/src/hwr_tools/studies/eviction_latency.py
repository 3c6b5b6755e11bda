"""Resolve latency on a crowded domain: a warm hit, and a miss whose build must evict, with 200 artifacts vs none.

    PYTHONPATH=src python -m hwr_tools.studies.eviction_latency [--artifacts 200] [--runs 200] [--builds 30] [--json]

Two tmpfs domains under /dev/shm (removed afterwards): an empty one, and one holding
`--artifacts` small published artifacts and capped (`max_store_bytes`) so that every new
build must evict the least recently used one. Reported: the median of a warm
`HostWeightRuntime.resolve` hit plus lease close, and of a resolve that builds a new
artifact (evicting one on the crowded domain), with the crowded/empty ratio (goal
< 1.1x: nothing on the hot path may scan the whole domain). Also the median of a bare
store lookup plus close, for comparing the lease path across versions. It reports; it
asserts nothing.
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from host_weight_runtime.config import CapacityPolicy, HostWeightRuntimeConfig
from host_weight_runtime.filesystem._fsutil import tree_bytes
from host_weight_runtime.filesystem.store import FilesystemHostWeightStore
from host_weight_runtime.identity import WeightArtifactIdentity
from host_weight_runtime.protocols import BuildRequest
from host_weight_runtime.runtime import HostWeightRuntime
from host_weight_runtime.tensors import ValidationLevel
from host_weight_runtime.testing.store_conformance import TensorDictProducer, conformance_identity


def identity(index: int) -> WeightArtifactIdentity:
    return conformance_identity(f"eviction-{index}")


def producer(index: int) -> TensorDictProducer:
    """Four BF16 tensors of 64 KiB each: small, so the domain's size is the variable."""
    tensors = {f"w{n}": torch.full((128, 256), float(index + n), dtype=torch.bfloat16) for n in range(4)}
    return TensorDictProducer(identity(index), tensors, ordered=True)


def _median_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1000.0


def measure(artifacts: int, runs: int, builds: int) -> dict[str, float]:
    """Medians (ms) on an empty domain and on one with `artifacts` artifacts at its store limit."""
    base = Path(tempfile.mkdtemp(prefix="hwr-evict-bench-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    try:
        probe = FilesystemHostWeightStore(base / "probe")
        deadline = time.monotonic() + 600
        result = probe.get_or_build(
            BuildRequest(identity(0)), producer(0), validation=ValidationLevel.MANIFEST_AND_METADATA, deadline=deadline
        )
        assert result.lease is not None
        result.lease.close()
        size = tree_bytes(probe.layout.artifact_dir(identity(0).key))
        figures: dict[str, float] = {"artifact_bytes": float(size)}
        for name, count in (("empty", 0), ("crowded", artifacts)):
            root = base / name
            policy = CapacityPolicy(max_store_bytes=(count + 1) * size + size // 2) if count else None
            runtime = HostWeightRuntime(HostWeightRuntimeConfig(root=root, capacity=policy))
            for index in range(1, count + 2):  # the artifacts plus the one the hits read
                resolution = runtime.resolve(identity(index), producer(index))
                assert resolution.lease is not None, resolution.report
                resolution.lease.close()
            hit = identity(count + 1)
            store = FilesystemHostWeightStore(root)
            hits, lookups, misses = [], [], []
            gc.collect()  # the imports' and the setup's collector debt, paid before the timed runs
            for _ in range(runs):
                started = time.perf_counter()
                resolution = runtime.resolve(hit)
                assert resolution.lease is not None
                resolution.lease.close()
                hits.append(time.perf_counter() - started)
                started = time.perf_counter()
                found = store.lookup(hit, validation=ValidationLevel.MANIFEST_AND_METADATA)
                assert found.lease is not None
                found.lease.close()
                lookups.append(time.perf_counter() - started)
            for n in range(builds):
                index = 100_000 + n
                started = time.perf_counter()
                resolution = runtime.resolve(identity(index), producer(index))
                misses.append(time.perf_counter() - started)
                assert resolution.lease is not None, resolution.report
                resolution.lease.close()
            figures[f"{name}_hit_ms"] = _median_ms(hits)
            figures[f"{name}_lookup_ms"] = _median_ms(lookups)
            figures[f"{name}_miss_build_ms"] = _median_ms(misses)
        figures["hit_ratio"] = figures["crowded_hit_ms"] / figures["empty_hit_ms"]
        figures["miss_ratio"] = figures["crowded_miss_build_ms"] / figures["empty_miss_build_ms"]
        return figures
    finally:
        shutil.rmtree(base, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--artifacts", type=int, default=200)
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--builds", type=int, default=30)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    figures = measure(args.artifacts, args.runs, args.builds)
    if args.json:
        print(json.dumps(figures, indent=2))
        return
    print(f"artifact size {figures['artifact_bytes']:.0f} B; medians, empty vs {args.artifacts} artifacts:")
    print(
        f"  warm resolve hit + close  {figures['empty_hit_ms']:.3f} ms vs {figures['crowded_hit_ms']:.3f} ms "
        f"({figures['hit_ratio']:.2f}x)"
    )
    print(f"  store lookup + close      {figures['empty_lookup_ms']:.3f} ms vs {figures['crowded_lookup_ms']:.3f} ms")
    print(
        f"  miss that builds          {figures['empty_miss_build_ms']:.3f} ms vs {figures['crowded_miss_build_ms']:.3f} ms "
        f"(evicting one each; {figures['miss_ratio']:.2f}x)"
    )


if __name__ == "__main__":
    main()

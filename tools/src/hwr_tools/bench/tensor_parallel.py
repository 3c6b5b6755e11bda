"""Tensor-parallel rows: bundle build and bytes vs TP=1 publication, per-rank warm time to ready, weights' PSS.

Builds run in this process on fresh `/dev/shm` domains, alternating which goes first: the
TP=1 streaming publication (`prewarm_component`) and the TP=N bundle
(`prewarm_tensor_parallel`: the replicated part and every rank's shard part from one pass
over the checkpoint); the bytes written are the payload files each leaves in its domain.
The warm rows are real gloo groups: per run, 2 replicas x N fresh worker processes on one
prewarmed domain; replica 0's ranks load together (and are timed) and their weights' PSS is
read, then replica 1's, and the PSS of all 2 x N is read while every worker holds its model.
The node should hold one copy of the model whatever the TP size and the number of
replicas, so both PSS sums are compared with the TP=1 artifact's bytes.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from host_weight_runtime import (
    FailureCode,
    HostWeightError,
    HostWeightRuntime,
    HostWeightRuntimeConfig,
    RuntimeMode,
    StorageClass,
)
from host_weight_runtime.diffusion import PrewarmResult, prewarm_component, prewarm_tensor_parallel

from ..common import JsonValue, remove_tree
from ..memory import weights_pss
from .batch import WorkerBatch
from .goals import ratio
from .measure import LoadKind, RowSpec
from .stats import Stats

__all__ = ["REPLICAS", "TensorParallelSetup", "measure_tensor_parallel"]

REPLICAS = 2


@dataclass(frozen=True, slots=True)
class TensorParallelSetup:
    """Where the benchmark's model lives and where its scratch domains go."""

    pipeline: Path
    subfolder: str
    shm_dir: Path
    log: IO[bytes]
    timeout_s: float
    preimported_workers: bool = False  # ranks forked from a server that imported torch once (batch.py)


def _runtime(root: Path) -> HostWeightRuntime:
    config = HostWeightRuntimeConfig(mode=RuntimeMode.PREFERRED, root=root, storage_class=StorageClass.TMPFS)
    return HostWeightRuntime(config)


def _payload_bytes(root: Path) -> int:
    """Bytes of every payload file published under the domain `root` (what a build wrote for the node to keep)."""
    return sum(path.stat().st_size for path in (root / "artifacts").rglob("*.safetensors"))


def _build(setup: TensorParallelSetup, size: int, root: Path) -> tuple[float, int]:
    """(seconds, payload bytes written) to publish the TP=1 artifact (size 1) or the TP=`size` bundle on the
    empty domain `root`."""
    gc.collect()  # garbage left by the build before (or the imports) is collected off the clock
    started = time.perf_counter()
    try:
        if size == 1:
            prewarm_component(setup.pipeline, subfolder=setup.subfolder, runtime=_runtime(root))
        else:
            prewarm_tensor_parallel(
                setup.pipeline, tensor_parallel_size=size, subfolder=setup.subfolder, runtime=_runtime(root)
            )
        seconds = time.perf_counter() - started
        return seconds, _payload_bytes(root)
    finally:
        remove_tree(root)


def _bundle_builds(
    setup: TensorParallelSetup, sizes: Sequence[int], runs: int, say: Callable[[str], None]
) -> tuple[dict[str, JsonValue], dict[int, dict[str, Any]]]:
    """The TP=1 publication and each TP=N bundle, each run on fresh domains, rotating which goes first.

    A bundle writes the replicated tensors once and each rank's slices, so about the TP=1 artifact's
    bytes; `per_byte_vs_tp1` sets the time ratio against that byte ratio.
    """
    samples: dict[int, list[float]] = {size: [] for size in (1, *sizes)}
    written: dict[int, int] = {}
    order = [1, *sizes]
    for run in range(runs):
        say(f"tensor parallel: bundle builds vs TP=1 publication, run {run + 1}/{runs}")
        rotated = order[run % len(order) :] + order[: run % len(order)]
        for size in rotated:
            seconds, written[size] = _build(setup, size, setup.shm_dir / f"tp-build-{size}-{run}")
            samples[size].append(seconds)
    single = Stats.of(samples[1])
    found: dict[int, dict[str, Any]] = {}
    for size in sizes:
        bundle = Stats.of(samples[size])
        time_ratio = ratio(bundle.median, single.median)
        bytes_ratio = written[size] / written[1]
        found[size] = {
            "bundle_s": bundle.to_dict(),
            "bundle_vs_tp1": time_ratio,
            "bundle_bytes_vs_tp1": bytes_ratio,
            "per_byte_vs_tp1": None if time_ratio is None else time_ratio / bytes_ratio,
        }
    return {"seconds": single.to_dict(), "artifact_bytes": written[1]}, found


def _group_specs(setup: TensorParallelSetup, root: Path, size: int, run: int) -> list[RowSpec]:
    """REPLICAS x `size` worker specs: replica k's ranks share one rendezvous file."""
    specs: list[RowSpec] = []
    for replica in range(REPLICAS):
        rendezvous = setup.shm_dir / f"tp{size}-run{run}-replica{replica}.rendezvous"
        remove_tree(rendezvous)
        specs.extend(
            RowSpec(
                name=f"hwr warm: TP={size} rank {rank}",
                kind=LoadKind.HWR,
                pipeline=str(setup.pipeline),
                subfolder=setup.subfolder,
                root=str(root),
                tensor_parallel_size=size,
                tensor_parallel_rank=rank,
                rendezvous=f"file://{rendezvous}",
            )
            for rank in range(size)
        )
    return specs


def _measure_size(
    setup: TensorParallelSetup,
    size: int,
    results: Sequence[PrewarmResult],
    *,
    tp1_bytes: int,
    runs: int,
    say: Callable[[str], None],
) -> dict[str, Any]:
    root = _group_root(setup, size)
    per_rank: list[float] = []
    group_ready: list[float] = []
    one_replica: list[float] = []
    weights: list[float] = []
    outcomes: set[str] = set()
    try:
        for run in range(runs):
            say(f"tensor parallel: TP={size}, {REPLICAS} replicas x {size} ranks, run {run + 1}/{runs}")
            specs = _group_specs(setup, root, size, run)
            batch = WorkerBatch(
                specs, hold=True, log=setup.log, timeout_s=setup.timeout_s, preimported=setup.preimported_workers
            )
            try:
                rows: list[dict[str, Any]] = []
                for replica in range(REPLICAS):
                    indices = list(range(replica * size, (replica + 1) * size))
                    replica_rows, _wall_ms = batch.go(indices)
                    rows.extend(replica_rows)
                    group_ready.append(max(float(row["time_to_ready_ms"]) for row in replica_rows))
                    if replica == 0:
                        one_replica.append(float(sum(_weights_pss(row) for row in replica_rows)))
                everyone = list(range(len(specs)))
                # The PSS of the memory holding each rank's weights (its parts' mappings), read while every
                # replica holds them: the process's whole growth would count its torch.distributed set-up too.
                weights_now = [_weights_pss(row) for row in rows]
                batch.release(everyone)
            finally:
                batch.close()
            per_rank.extend(float(row["time_to_ready_ms"]) for row in rows)
            outcomes.update(str(row["outcome"]) for row in rows)
            weights.append(float(sum(weights_now)))
    finally:
        remove_tree(root)
    one_stats, weights_stats = Stats.of(one_replica), Stats.of(weights)
    return {
        "replicated_bytes": results[0].total_bytes,
        "shard_bytes": sum(result.total_bytes for result in results[1:]),
        "rank_shard_bytes": [result.total_bytes for result in results[1:]],
        "rank_time_to_ready_ms": Stats.of(per_rank).to_dict(),
        "group_time_to_ready_ms": Stats.of(group_ready).to_dict(),
        "replicas": REPLICAS,
        "one_replica_weights_pss_bytes": one_stats.to_dict(),
        "one_replica_pss_vs_tp1": ratio(one_stats.median, float(tp1_bytes)),
        "weights_pss_sum_bytes": weights_stats.to_dict(),
        "weights_pss_vs_tp1": ratio(weights_stats.median, float(tp1_bytes)),
        "outcomes": sorted(outcomes),
    }


def _weights_pss(row: dict[str, Any]) -> int:
    return weights_pss(row["weight_spans"], row["pid"])


def measure_tensor_parallel(
    setup: TensorParallelSetup,
    sizes: Sequence[int],
    *,
    runs: int,
    say: Callable[[str], None],
) -> dict[str, JsonValue]:
    """Per TP size: bundle build and bytes vs TP=1 publication, per-rank and whole-group warm time to ready,
    and the weights' PSS of N ranks of one replica and of 2 replicas x N ranks next to the TP=1 artifact."""
    started = time.perf_counter()
    published: dict[int, tuple[PrewarmResult, ...]] = {}
    unavailable: dict[str, JsonValue] = {}
    for size in sizes:
        say(f"tensor parallel: publishing every TP={size} rank's artifact for the warm groups")
        try:
            published[size] = prewarm_tensor_parallel(
                setup.pipeline,
                tensor_parallel_size=size,
                subfolder=setup.subfolder,
                runtime=_runtime(_group_root(setup, size)),
            )
        except HostWeightError as exc:  # the model does not split this way: say so instead of measuring nothing
            if exc.failure.code is not FailureCode.UNSUPPORTED:
                raise
            unavailable[str(size)] = exc.failure.message
    supported = sorted(published)
    if not supported:
        return {"replicas": REPLICAS, "tp1_publication": None, "sizes": {}, "unavailable": unavailable}
    single, builds = _bundle_builds(setup, supported, runs, say)
    tp1_bytes = single["artifact_bytes"]
    assert isinstance(tp1_bytes, int)
    measured: dict[str, JsonValue] = {
        str(size): {
            **builds[size],
            **_measure_size(setup, size, published[size], tp1_bytes=tp1_bytes, runs=runs, say=say),
        }
        for size in supported
    }
    return {
        "replicas": REPLICAS,
        "tp1_publication": single,
        "sizes": measured,
        "unavailable": unavailable,
        "elapsed_s": time.perf_counter() - started,
    }


def _group_root(setup: TensorParallelSetup, size: int) -> Path:
    return setup.shm_dir / f"tp{size}-domain"

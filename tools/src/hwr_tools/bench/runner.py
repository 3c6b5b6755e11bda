"""`hwr bench`: every row measured side by side in one run, on one real diffusers Flux transformer.

The setup (setup.py) is done once in this process; then every run is a fresh worker process
(imports done before it is told to go), measured one at a time, except the memory groups and
the concurrent cold starters, which start together (measurements.py). The rows are listed in
rows.py. Last come the figures measured in this process (throughput, CLI start-up, remote
import) and the tensor-parallel rows (tensor_parallel.py): bundle builds and gloo groups of ranks.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from host_weight_runtime._faults import fault_point

from ..common import JsonValue, remove_tree
from ..demo_store import _terminate_as_exit
from ..synthetic_models import TRANSFORMER_SUBFOLDER
from .bounds import cold_bounds, measure_source_sha256
from .goals import goals, ratio
from .machine import describe_machine
from .measurements import Measurements
from .options import BenchOptions
from .pipeline_rows import measure_pipeline_rows
from .remote import measure_remote_throughput
from .row_names import (
    CANONICAL,
    COLD,
    COLD_STREAM,
    HOT,
    HUB_REPO_ID,
    VIEWS_SHM,
    WARM_HUGE,
    WARM_SHM,
    WARM_VERIFY_OFF,
    WARM_VERIFY_ON,
)
from .rows import BenchRow, bench_rows
from .setup import SHM, BenchSetup, prepare_setup, published_identity, unavailable_peers
from .startup import measure_cli_startup
from .stats import Stats
from .tensor_parallel import TensorParallelSetup, measure_tensor_parallel
from .throughput import ThroughputSamples, measure_throughput

__all__ = ["BenchOptions", "BenchReport", "run_bench", "unavailable_peers"]

STARTUP_MIN_RUNS = 5  # a fresh interpreter takes a fraction of a second: a few more samples cost little
_GOAL_MEMORY_ROWS = frozenset({CANONICAL, WARM_SHM, WARM_HUGE, VIEWS_SHM})


@dataclass(frozen=True, slots=True)
class BenchReport:
    """Everything one `hwr bench` run measured, as the JSON written to benchmarks/results."""

    data: dict[str, JsonValue] = field(default_factory=dict)


def run_bench(options: BenchOptions, say: Callable[[str], None] = lambda _line: None) -> BenchReport:
    """Build, measure every row and figure, clean up; return the report (nothing is written here)."""
    started = time.perf_counter()
    if not SHM.is_dir() or not os.access(SHM, os.W_OK):
        raise ValueError(f"{SHM} is missing or not writable; the benchmark's domain lives on that tmpfs")
    disk_parent = options.workdir if options.workdir is not None else Path("/var/tmp")
    if not disk_parent.is_dir():
        raise ValueError(f"--workdir {disk_parent} is not a directory")
    # SIGTERM becomes SystemExit, so the folders, the huge-page mount and the workers go with it.
    with _terminate_as_exit(), contextlib.ExitStack() as cleanup:
        disk_dir = Path(tempfile.mkdtemp(prefix="hwr-bench-", dir=disk_parent))
        cleanup.callback(remove_tree, disk_dir)
        shm_dir = Path(tempfile.mkdtemp(prefix="hwr-bench-", dir=SHM))
        cleanup.callback(remove_tree, shm_dir)
        setup = prepare_setup(
            disk_dir, shm_dir, size_gib=options.size_gib, huge_pages=options.huge_pages, cleanup=cleanup, say=say
        )
        measured = bench_rows(setup, remote_s3_row=options.remote_s3_row)
        fault_point("bench.before_rows")
        results, concurrent = _measure_rows(options, setup, measured.rows, say)
        figures = _figures(options, setup, say)
        remote_throughput = figures.pop("remote_throughput")
        data: dict[str, Any] = {
            "date": time.strftime("%Y-%m-%d"),
            "machine": describe_machine(disk_dir, SHM),
            "options": _options_dict(options),
            "model": {
                "class": "FluxTransformer2DModel",
                "checkpoint_bytes": setup.checkpoint_bytes,
                "hub_repo_id": HUB_REPO_ID,
                "artifact_bytes": setup.prewarm.total_bytes,
                "tensors": setup.prewarm.tensor_count,
            },
            "huge_pages": {"status": setup.huge_status, "huge_page_backed_bytes": setup.huge_page_backed},
            "unavailable_peers": measured.unavailable_peers,
            "rows": results,
            "concurrent_cold_starters": concurrent,
            "background_verification": _verification_dict(results),
            **figures,
            "remote": {
                **setup.remotes.to_dict(),
                "throughput": remote_throughput,
                "rows_not_measured": measured.not_measured,
            },
            "elapsed_s": time.perf_counter() - started,
        }
        data["cold_bounds"] = cold_bounds(data)
        data["goals"] = goals(data)
        return BenchReport(data)


def _measure_rows(
    options: BenchOptions, setup: BenchSetup, rows: list[BenchRow], say: Callable[[str], None]
) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """Every row hot (and its memory group), then cold where asked, then the concurrent cold starters."""
    measurements = Measurements(options, setup.shm_dir, setup.worker_log, say)
    results: dict[str, dict[str, Any]] = {}
    for row in rows:
        entry: dict[str, Any] = {
            "description": row.description,
            "cold_start": row.fresh_domain,
            "baseline": row.baseline,
            HOT: measurements.solo(row, HOT),
        }
        if row.memory_group and (options.all_memory_groups or row.spec.name in _GOAL_MEMORY_ROWS):
            entry["memory_group"] = measurements.group(row)
        results[row.spec.name] = entry
    if options.cold_cache:
        for row in rows:
            if row.cold_cache:
                results[row.spec.name][COLD] = measurements.solo(row, COLD)
    stream_row = next(row for row in rows if row.spec.name == COLD_STREAM)
    return results, measurements.cold_starters(stream_row)


def _figures(options: BenchOptions, setup: BenchSetup, say: Callable[[str], None]) -> dict[str, Any]:
    """The figures measured in this process: throughput, CLI start-up, remote import, tensor parallel."""
    bf16_bytes = int(options.size_gib * (1 << 30))
    say("throughput: publication vs raw write+fsync, FULL_CHECKSUM vs single-thread SHA-256")
    throughput = measure_throughput(setup.shm_dir, min(bf16_bytes, setup.prewarm.total_bytes), options.runs)
    say("bound: single-thread SHA-256 of the checkpoint files (a local folder's content key)")
    source_hashing = measure_source_sha256(setup.checkpoint_files, options.runs)
    say("start-up: `hwr inspect` in a fresh process vs `python -c pass`")
    startup = measure_cli_startup(setup.warm_root, max(options.runs, STARTUP_MIN_RUNS))
    say("throughput: remote import vs a plain fsspec copy of the same objects")
    remote_throughput = measure_remote_throughput(
        setup.remotes,
        published_identity(setup.warm_store, setup.prewarm.identity_key),
        setup.shm_dir,
        options.remote_runs or options.runs,
    )
    tensor_parallel: dict[str, JsonValue] | None = None
    if options.tensor_parallel_sizes:
        tensor_parallel = measure_tensor_parallel(
            TensorParallelSetup(
                setup.pipeline,
                TRANSFORMER_SUBFOLDER,
                setup.shm_dir,
                setup.worker_log,
                options.timeout_s,
                options.preimported_workers,
            ),
            options.tensor_parallel_sizes,
            runs=min(options.runs, options.tensor_parallel_runs),
            say=say,
        )
    pipeline_report = None
    if options.pipeline_rows:
        pipeline_report = measure_pipeline_rows(
            transformer_mib=max(16, int(options.size_gib * 1024)),
            runs=options.runs,
            workers=options.workers,
            workdir=setup.disk_dir,
            timeout_s=options.timeout_s,
            say=say,
        )
    return {
        "throughput": _throughput_dict(throughput),
        "source_hashing": source_hashing,
        "cli_startup": startup.to_dict(),
        "remote_throughput": remote_throughput,
        "tensor_parallel": tensor_parallel,
        "pipeline": pipeline_report,
    }


def _options_dict(options: BenchOptions) -> dict[str, JsonValue]:
    return {
        "size_gib": options.size_gib,
        "runs": options.runs,
        "workers": options.workers,
        "cold_starters": options.cold_starters,
        "cold_starter_runs": options.cold_starter_runs or options.runs,
        "memory_runs": options.memory_runs or options.runs,
        "cold_cache": options.cold_cache,
        "remote_runs": options.remote_runs or options.runs,
        "tensor_parallel_sizes": list(options.tensor_parallel_sizes),
        "tensor_parallel_runs": min(options.runs, options.tensor_parallel_runs),
        "preimported_workers": options.preimported_workers,
    }


def _verification_dict(results: dict[str, dict[str, Any]]) -> dict[str, JsonValue]:
    """What the background full verification costs: its time next to a warm load, and the warm time to
    ready with it on (the first lease of a publication on a node) and off, measured side by side."""
    on, off = results[WARM_VERIFY_ON][HOT], results[WARM_VERIFY_OFF][HOT]
    verification = on["verification_s"]
    ready_on, ready_off = on["time_to_ready_ms"]["median"], off["time_to_ready_ms"]["median"]
    load_off = off["load_ms"]["median"]
    return {
        "verification_s": verification,
        "verifications": on["verifications"],
        "warm_load_off_ms": off["load_ms"],
        "time_to_ready_on_ms": on["time_to_ready_ms"],
        "time_to_ready_off_ms": off["time_to_ready_ms"],
        "ready_on_vs_off": ratio(ready_on, ready_off),
        "verification_vs_warm_load": None
        if verification is None
        else ratio(verification["median"] * 1000.0, load_off),
    }


def _throughput_dict(samples: ThroughputSamples) -> dict[str, JsonValue]:
    raw = Stats.of(samples.raw_write_fsync_s)
    publish = Stats.of(samples.publish_s)
    sha = Stats.of(samples.single_thread_sha256_s)
    full = Stats.of(samples.full_checksum_s)
    return {
        "payload_bytes": samples.payload_bytes,
        "raw_write_fsync_s": raw.to_dict(),
        "raw_preallocated_s": Stats.of(samples.raw_preallocated_s).to_dict(),
        "raw_sized_s": Stats.of(samples.raw_sized_s).to_dict(),
        "publish_s": publish.to_dict(),
        "single_thread_sha256_s": sha.to_dict(),
        "full_checksum_s": full.to_dict(),
        "publication_vs_raw": ratio(raw.median, publish.median),
        "publication_vs_raw_best": ratio(raw.minimum, publish.minimum),
        "full_checksum_vs_sha256": ratio(sha.median, full.median),
    }

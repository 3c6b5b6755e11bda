"""`hwr bench`: every row measured side by side in one run, on one real diffusers Flux transformer.

Setup (in this process): an FP32 Flux checkpoint on disk (a folder, and the same files hard-linked
into a Hugging Face cache snapshot, so the cold rows run from both), an artifact published into a
`/dev/shm` domain and, where a huge-page tmpfs can be mounted, into a domain there; the
artifact's final-layout BF16 tensors written in each peer's format on disk, plus a
safetensors copy on each tmpfs for the bare-mmap-views reference. Then every run is a
fresh worker process (imports done before it is told to go), measured one at a time,
except the 4-worker memory groups and the concurrent cold starters, which start together.
Last come the tensor-parallel rows (tensor_parallel.py): bundle builds and gloo groups of ranks.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import torch

from host_weight_runtime import (
    FilesystemHostWeightStore,
    HostWeightRuntime,
    HostWeightRuntimeConfig,
    RuntimeMode,
    StorageClass,
    WeightArtifactIdentity,
    WeightManifest,
)
from host_weight_runtime._faults import fault_point
from host_weight_runtime.diffusion import load_component, prewarm_component

from ..common import JsonValue, remove_tree
from ..demo_store import _terminate_as_exit
from ..memory import memory_rollup, weights_pss
from ..synthetic_models import TRANSFORMER_SUBFOLDER, save_flux_pipeline_folder, save_hub_snapshot
from .batch import WorkerBatch, evict_from_page_cache
from .goals import goals, ratio
from .machine import describe_machine, filesystem_type
from .measure import LoadKind, RowSpec
from .names import (
    CANONICAL,
    CANONICAL_HUB,
    COLD,
    COLD_BACKGROUND,
    COLD_BACKGROUND_HUB,
    COLD_PUBLISH,
    COLD_PUBLISH_HUB,
    COLD_STREAM,
    COLD_STREAM_HUB,
    HOT,
    HUB_REPO_ID,
    VIEWS_HUGE,
    VIEWS_SHM,
    WARM_HUGE,
    WARM_SHM,
    WARM_VERIFY_OFF,
    WARM_VERIFY_ON,
)
from .peers import PEERS, Peer, PeerFormat, peer_file_name, peer_unavailable_reason, write_peer_files
from .remote import measure_remote_throughput, remote_targets
from .startup import measure_cli_startup
from .stats import Stats
from .tensor_parallel import TensorParallelSetup, measure_tensor_parallel
from .throughput import ThroughputSamples, measure_throughput

__all__ = ["BenchOptions", "BenchReport", "run_bench", "unavailable_peers"]

GIB = 1 << 30
MIB = 1 << 20
SHM = Path("/dev/shm")
_GOAL_MEMORY_ROWS = frozenset({CANONICAL, WARM_SHM, WARM_HUGE, VIEWS_SHM})
STARTUP_MIN_RUNS = 5  # a fresh interpreter takes a fraction of a second: a few more samples cost little


@dataclass(frozen=True, slots=True)
class BenchOptions:
    """What to measure and how often; `quick` is a smaller model, the same rows."""

    size_gib: float = 1.0
    runs: int = 5
    workers: int = 4
    cold_starters: int = 8
    cold_cache: bool = True
    huge_pages: bool = True
    workdir: Path | None = None
    timeout_s: float = 600.0
    all_memory_groups: bool = True  # False: the 4-worker PSS groups only for canonical, warm and bare views
    cold_starter_runs: int | None = None  # None: `runs`
    memory_runs: int | None = None  # None: `runs`
    remote_runs: int | None = None  # remote import vs plain copy runs; None: `runs`
    remote_s3_row: bool = True  # False: node B's time to ready over file:// only (S3 throughput still measured)
    tensor_parallel_sizes: tuple[int, ...] = (2, 4)  # TP rows; () measures none
    tensor_parallel_runs: int = 3  # per TP size: bundle builds and groups of 2 replicas x N fresh ranks

    def __post_init__(self) -> None:
        if not 0 < self.size_gib <= 64:
            raise ValueError(f"--size must be between 0 and 64 GiB of BF16 weights, got {self.size_gib}")
        if self.runs < 1:
            raise ValueError(f"--runs must be at least 1, got {self.runs}")
        if self.workers < 1 or self.cold_starters < 1:
            raise ValueError("--workers and --cold-starters must be at least 1")
        if self.tensor_parallel_runs < 1:
            raise ValueError(f"tensor_parallel_runs must be at least 1, got {self.tensor_parallel_runs}")
        if any(type(size) is not int or size < 2 for size in self.tensor_parallel_sizes):
            raise ValueError(f"--tp sizes must be integers of at least 2, got {list(self.tensor_parallel_sizes)}")

    @classmethod
    def quick(cls) -> BenchOptions:
        """About 4 minutes: 0.25 GiB, 3 runs per time, one run per memory group (goal rows only) and per TP
        group, hot cache."""
        return cls(
            size_gib=0.25,
            runs=3,
            cold_cache=False,
            all_memory_groups=False,
            cold_starter_runs=1,
            memory_runs=1,
            remote_runs=2,
            remote_s3_row=False,
            tensor_parallel_runs=1,
        )


@dataclass(frozen=True, slots=True)
class BenchReport:
    """Everything one `hwr bench` run measured, as the JSON written to benchmarks/results."""

    data: dict[str, JsonValue] = field(default_factory=dict)


# --------------------------------------------------------------------------- setup


def _files_under(folder: Path) -> list[Path]:
    return sorted(path for path in folder.rglob("*") if path.is_file())


def _read_through(paths: Sequence[Path]) -> None:
    """Read every byte once so the page cache is hot."""
    for path in paths:
        with path.open("rb") as handle:
            while handle.read(64 * MIB):
                pass


@contextlib.contextmanager
def _huge_tmpfs(parent: Path, size_bytes: int, wanted: bool) -> Iterator[tuple[Path | None, str]]:
    """Mount a tmpfs with huge=always for the run where this process may; yield (mountpoint, what happened)."""
    if not wanted:
        yield None, "not asked for (--no-huge-pages)"
        return
    if os.geteuid() != 0:
        yield None, "not mounted: mounting a tmpfs needs root (CAP_SYS_ADMIN); see the README's huge-page section"
        return
    mountpoint = parent / "huge-tmpfs"
    mountpoint.mkdir()
    options = f"size={size_bytes},huge=always,mode=0700"
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "hwr-bench-huge", str(mountpoint)],
        check=False,
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        yield None, f"not mounted: mount -o {options} failed: {done.stderr.strip() or done.returncode}"
        return
    try:
        yield mountpoint, f"mounted tmpfs -o {options} at {mountpoint}"
    finally:
        subprocess.run(["umount", str(mountpoint)], check=False, capture_output=True)


def unavailable_peers(peers: Sequence[Peer]) -> dict[str, str]:
    """Each peer that cannot be imported here, with the reason: listed in the report, never dropped silently."""
    return {peer.name: reason for peer in peers if (reason := peer_unavailable_reason(peer)) is not None}


def _runtime(root: Path) -> HostWeightRuntime:
    config = HostWeightRuntimeConfig(mode=RuntimeMode.PREFERRED, root=root, storage_class=StorageClass.TMPFS)
    return HostWeightRuntime(config)


def _final_layout_state_dict(pipeline: Path, root: Path) -> dict[str, torch.Tensor]:
    """The published artifact's tensors under the model's own state-dict names (a copy, so the lease can close)."""
    with load_component(pipeline, subfolder=TRANSFORMER_SUBFOLDER, runtime=_runtime(root)) as loaded:
        if loaded.outcome.value != "local_hit":
            raise RuntimeError(f"setup expected a local hit on {root}, got {loaded.summary()}")
        return {name: tensor.detach().clone() for name, tensor in loaded.model.state_dict().items()}


def _published_identity(store: FilesystemHostWeightStore, key: str) -> WeightArtifactIdentity:
    """The identity of a published artifact, read from its manifest."""
    return WeightManifest.from_bytes((store.layout.artifact_dir(key) / "manifest.json").read_bytes()).identity


def _huge_page_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("ShmemHugePages:"):
            return int(line.split()[1]) * 1024
    return 0


# --------------------------------------------------------------------------- the rows


@dataclass(frozen=True, slots=True)
class _Row:
    spec: RowSpec
    description: str
    disk_files: tuple[Path, ...]  # what a cold-cache run evicts first
    fresh_domain: bool = False  # a cold row: every run gets a new, empty domain
    memory_group: bool = True  # measured as 4 concurrent held workers too
    cold_cache: bool = True  # measured with the page cache cold too
    before_run: Callable[[], None] | None = None  # run before each measured run (untimed)
    baseline: str = CANONICAL  # the row its "vs canonical" ratio and goals compare with


class _Measurements:
    """Runs rows in fresh worker processes and keeps every sample."""

    def __init__(self, options: BenchOptions, shm_dir: Path, log: IO[bytes], say: Callable[[str], None]) -> None:
        self._options = options
        self._shm_dir = shm_dir
        self._log = log
        self._say = say
        self._fresh = 0

    def _spec_for_run(self, row: _Row) -> RowSpec:
        """The row's spec, with a new empty domain for a cold row."""
        if not row.fresh_domain:
            return row.spec
        self._fresh += 1
        return RowSpec(**{**_spec_fields(row.spec), "root": str(self._shm_dir / f"cold-domain-{self._fresh}")})

    def _batch(self, specs: Sequence[RowSpec], *, hold: bool) -> WorkerBatch:
        return WorkerBatch(specs, hold=hold, log=self._log, timeout_s=self._options.timeout_s)

    def solo(self, row: _Row, cache: str) -> dict[str, Any]:
        """`runs` fresh processes, measured one at a time (the others wait, imported and idle)."""
        self._say(f"{cache} cache: {row.spec.name}: starting {self._options.runs} workers")
        specs = [self._spec_for_run(row) for _ in range(self._options.runs)]
        rows: list[dict[str, Any]] = []
        batch = self._batch(specs, hold=False)
        try:
            for index, spec in enumerate(specs):
                self._say(f"{cache} cache: {row.spec.name}: run {index + 1}/{len(specs)}")
                if cache == COLD:
                    evict_from_page_cache(row.disk_files)
                if row.before_run is not None:
                    row.before_run()
                rows.extend(batch.go([index])[0])
                batch.finish([index])
                if spec.root is not None and row.fresh_domain:
                    remove_tree(Path(spec.root))
        finally:
            batch.close()
            for spec in specs:
                if row.fresh_domain and spec.root is not None:
                    remove_tree(Path(spec.root))
        return _summarize_solo(rows)

    def group(self, row: _Row) -> dict[str, JsonValue]:
        """`workers` fresh processes loading together and holding their models while their PSS is read: the
        whole processes' and that of the memory holding their weights (for a hit, the artifact's mappings)."""
        sums: list[float] = []
        weights: list[float] = []
        workers = self._options.workers
        runs = self._options.memory_runs or self._options.runs
        for run in range(runs):
            self._say(f"memory: {row.spec.name}: {workers} workers together, run {run + 1}/{runs}")
            batch = self._batch([row.spec] * workers, hold=True)
            try:
                indices = list(range(workers))
                rows, _ = batch.go(indices)
                pss_now = [memory_rollup(batch.pid(index))[1] for index in indices]
                weights_now = [weights_pss(row["weight_spans"], row["pid"]) for row in rows]
                batch.release(indices)
            finally:
                batch.close()
            sums.append(float(sum(pss_now)))
            weights.append(float(sum(weights_now)))
        return {"pss_sum_bytes": Stats.of(sums).to_dict(), "weights_pss_sum_bytes": Stats.of(weights).to_dict()}

    def cold_starters(self, row: _Row) -> dict[str, Any]:
        """`cold_starters` fresh processes starting together on one empty domain: the producer must run once."""
        walls: list[float] = []
        producers: list[float] = []
        outcomes: set[str] = set()
        starters = self._options.cold_starters
        runs = self._options.cold_starter_runs or self._options.runs
        for run in range(runs):
            self._say(f"{starters} concurrent cold starters, run {run + 1}/{runs}")
            spec = self._spec_for_run(row)
            batch = self._batch([spec] * starters, hold=False)
            try:
                rows, wall_ms = batch.go(list(range(starters)))
            finally:
                batch.close()
                if spec.root is not None:
                    remove_tree(Path(spec.root))
            walls.append(wall_ms)
            producers.append(float(sum(1 for item in rows if "built" in item["attempts"])))
            outcomes.update(f"{item['outcome']} ({'+'.join(item['attempts'])})" for item in rows)
        return {
            "starters": starters,
            "wall_ms": Stats.of(walls).to_dict(),
            "producer_runs": Stats.of(producers).to_dict(),
            "outcomes": sorted(outcomes),
        }


def _spec_fields(spec: RowSpec) -> dict[str, Any]:
    return {name: getattr(spec, name) for name in RowSpec.__slots__}


def _summarize_solo(rows: list[dict[str, Any]]) -> dict[str, Any]:
    def stats(key: str) -> dict[str, JsonValue]:
        return Stats.of([float(row[key]) for row in rows]).to_dict()

    return {
        "time_to_ready_ms": stats("time_to_ready_ms"),
        "load_ms": stats("load_ms"),
        "touch_ms": stats("touch_ms"),
        "peak_rss_bytes": stats("peak_rss_bytes"),
        "peak_rss_rise_bytes": Stats.of([float(r["peak_rss_bytes"] - r["baseline_rss_bytes"]) for r in rows]).to_dict(),
        "pages": sorted({int(row["pages"]) for row in rows}),
        "checksums": sorted({int(row["checksum"]) for row in rows}),
        "outcomes": sorted({str(row["outcome"]) for row in rows}),
        "identity_keys": sorted({str(row["identity_key"]) for row in rows if row["identity_key"] is not None}),
        "publications": sorted({str(row["publication"]) for row in rows}),
        "failures": sorted({str(row["failure"]) for row in rows if row["failure"] is not None}),
        "published_ms": None
        if any(row["published_ms"] is None for row in rows)
        else Stats.of([float(row["published_ms"]) for row in rows]).to_dict(),
        "publication_ms": None
        if any(row["publication_ms"] is None for row in rows)
        else Stats.of([float(row["publication_ms"]) for row in rows]).to_dict(),
        "verification_s": None
        if any(row.get("verification_s") is None for row in rows)
        else Stats.of([float(row["verification_s"]) for row in rows]).to_dict(),
        "verifications": sorted({str(row.get("verification")) for row in rows}),
    }


# --------------------------------------------------------------------------- the whole run


def run_bench(options: BenchOptions, say: Callable[[str], None] = lambda _line: None) -> BenchReport:
    """Build, measure every row and figure, clean up; return the report (nothing is written here)."""
    started = time.perf_counter()
    if not SHM.is_dir() or not os.access(SHM, os.W_OK):
        raise ValueError(f"{SHM} is missing or not writable; the benchmark's domain lives on that tmpfs")
    disk_parent = options.workdir if options.workdir is not None else Path("/var/tmp")
    if not disk_parent.is_dir():
        raise ValueError(f"--workdir {disk_parent} is not a directory")
    bf16_bytes = int(options.size_gib * GIB)
    # SIGTERM becomes SystemExit, so the folders, the huge-page mount and the workers go with it.
    with _terminate_as_exit(), contextlib.ExitStack() as cleanup:
        disk_dir = Path(tempfile.mkdtemp(prefix="hwr-bench-", dir=disk_parent))
        cleanup.callback(remove_tree, disk_dir)
        shm_dir = Path(tempfile.mkdtemp(prefix="hwr-bench-", dir=SHM))
        cleanup.callback(remove_tree, shm_dir)

        pipeline = disk_dir / "pipeline"
        say(f"setup: writing a {2 * bf16_bytes / GIB:.2f} GiB FP32 Flux checkpoint to {pipeline}")
        save_flux_pipeline_folder(pipeline, target_bytes=2 * bf16_bytes, seed=0)
        checkpoint_files = _files_under(pipeline / TRANSFORMER_SUBFOLDER)
        for path in checkpoint_files:
            with path.open("rb") as handle:
                os.fsync(handle.fileno())
        checkpoint_bytes = sum(path.stat().st_size for path in checkpoint_files)
        hub_cache = disk_dir / "hub-cache"
        say(f"setup: hard-linking the checkpoint into a Hugging Face cache snapshot of {HUB_REPO_ID} in {hub_cache}")
        # Each file is hashed once, here, for its blob name; the hard links share the folder's bytes and pages.
        hub_snapshot = save_hub_snapshot(hub_cache, HUB_REPO_ID, pipeline, hard_link=True)
        hub_blobs = tuple(sorted(path.resolve() for path in (hub_snapshot / TRANSFORMER_SUBFOLDER).iterdir()))

        warm_root = shm_dir / "domain"
        say(f"setup: publishing the artifact into {warm_root}")
        prewarm = prewarm_component(pipeline, subfolder=TRANSFORMER_SUBFOLDER, runtime=_runtime(warm_root))
        huge_mount, huge_status = cleanup.enter_context(
            _huge_tmpfs(disk_dir, 2 * prewarm.total_bytes + 256 * MIB, options.huge_pages)
        )
        say(f"setup: huge-page tmpfs {huge_status}")
        huge_root = None if huge_mount is None else huge_mount / "domain"
        huge_bytes_before = _huge_page_bytes()
        if huge_root is not None:
            prewarm_component(pipeline, subfolder=TRANSFORMER_SUBFOLDER, runtime=_runtime(huge_root))
        huge_page_backed = _huge_page_bytes() - huge_bytes_before

        say("setup: writing the final-layout BF16 tensors in each peer's format")
        state_dict = _final_layout_state_dict(pipeline, warm_root)
        peer_dir = disk_dir / "peers"
        peer_dir.mkdir()
        worker_log = cleanup.enter_context((disk_dir / "workers.log").open("wb"))
        unavailable_reasons = unavailable_peers(PEERS)
        formats = {peer.file_format for peer in PEERS if peer.name not in unavailable_reasons}
        peer_files = write_peer_files(state_dict, peer_dir, sorted(formats, key=lambda f: f.value))
        views_shm = shm_dir / "views"
        views_shm.mkdir()
        shutil.copyfile(peer_files[PeerFormat.SAFETENSORS], views_shm / peer_file_name(PeerFormat.SAFETENSORS))
        views_huge: Path | None = None
        if huge_mount is not None:
            views_huge = huge_mount / "views"
            views_huge.mkdir()
            shutil.copyfile(peer_files[PeerFormat.SAFETENSORS], views_huge / peer_file_name(PeerFormat.SAFETENSORS))
        del state_dict
        warm_store = FilesystemHostWeightStore(warm_root)
        remotes = cleanup.enter_context(remote_targets(warm_store, prewarm.identity_key, disk_dir, say))
        remote_files = _files_under(disk_dir / "remote")
        _read_through(checkpoint_files + list(peer_files.values()) + remote_files)

        def spec(name: str, kind: LoadKind, **extra: Any) -> RowSpec:
            return RowSpec(name=name, kind=kind, pipeline=str(pipeline), subfolder=TRANSFORMER_SUBFOLDER, **extra)

        def hub_spec(name: str, kind: LoadKind, **extra: Any) -> RowSpec:
            return RowSpec(
                name=name,
                kind=kind,
                pipeline=HUB_REPO_ID,
                subfolder=TRANSFORMER_SUBFOLDER,
                cache_dir=str(hub_cache),
                **extra,
            )

        checkpoint = tuple(checkpoint_files)
        rows: list[_Row] = [
            _Row(
                spec(CANONICAL, LoadKind.CANONICAL),
                "diffusers from_pretrained(torch_dtype=bfloat16), FP32 checkpoint",
                checkpoint,
            ),
            _Row(
                spec(COLD_PUBLISH, LoadKind.HWR, root=""),
                "load_component on an empty domain: canonical load, then publication (first worker on a node)",
                checkpoint,
                fresh_domain=True,
                memory_group=False,
            ),
            _Row(
                spec(COLD_BACKGROUND, LoadKind.HWR, root="", publish_in_background=True),
                "load_component(publish_in_background=True) on an empty domain: canonical load, artifact on a thread",
                checkpoint,
                fresh_domain=True,
                memory_group=False,
            ),
            _Row(
                spec(COLD_STREAM, LoadKind.HWR, root="", stream_on_miss=True),
                "load_component(stream_on_miss=True) on an empty domain: streaming producer, then restore",
                checkpoint,
                fresh_domain=True,
                memory_group=False,
            ),
            *_hub_rows(hub_spec, hub_blobs),
            _Row(
                spec(WARM_SHM, LoadKind.HWR, root=str(warm_root)), "load_component hit, zero-copy restore", checkpoint
            ),
            _Row(
                spec(WARM_VERIFY_OFF, LoadKind.HWR, root=str(warm_root), background_verify="off"),
                "load_component hit with HWR_BACKGROUND_VERIFY=off",
                checkpoint,
                memory_group=False,
                cold_cache=False,
            ),
            _Row(
                spec(WARM_VERIFY_ON, LoadKind.HWR, root=str(warm_root), background_verify="once"),
                "load_component hit that starts the background full verification (its record removed before "
                "each run); the verification runs on a thread while the worker touches its weights",
                checkpoint,
                memory_group=False,
                cold_cache=False,
                before_run=functools.partial(_forget_verification, warm_store, prewarm.identity_key),
            ),
        ]
        if huge_root is not None:
            rows.append(
                _Row(
                    spec(WARM_HUGE, LoadKind.HWR, root=str(huge_root)),
                    "load_component hit on a tmpfs mounted huge=always",
                    checkpoint,
                    cold_cache=False,
                )
            )
        views_file = str(views_shm / peer_file_name(PeerFormat.SAFETENSORS))
        rows.append(
            _Row(
                spec(VIEWS_SHM, LoadKind.PEER, peer="safetensors-mmap-views", peer_file=views_file),
                "bare zero-copy mmap views of the same bytes on the same tmpfs, assigned into the skeleton",
                (),
                cold_cache=False,
            )
        )
        if views_huge is not None:
            rows.append(
                _Row(
                    spec(
                        VIEWS_HUGE,
                        LoadKind.PEER,
                        peer="safetensors-mmap-views",
                        peer_file=str(views_huge / peer_file_name(PeerFormat.SAFETENSORS)),
                    ),
                    "bare zero-copy mmap views on the huge-page tmpfs",
                    (),
                    cold_cache=False,
                )
            )
        rows_not_measured: dict[str, JsonValue] = {}
        for target in remotes.targets:
            if target.kind == "s3" and not options.remote_s3_row:
                rows_not_measured[target.row] = (
                    "--quick times node B over file:// only; S3 import throughput is measured"
                )
                continue
            rows.append(
                _Row(
                    spec(
                        target.row,
                        LoadKind.HWR,
                        root="",
                        remote_url=target.url,
                        remote_options=target.storage_options,
                    ),
                    f"load_component on an empty domain (node B) with the remote {target.url}: import the exact "
                    "artifact node A pushed (every byte re-hashed, published atomically), then restore from it",
                    tuple(remote_files) if target.kind == "file" else (),
                    fresh_domain=True,
                    memory_group=False,
                    cold_cache=target.kind == "file",
                )
            )
        unavailable: dict[str, JsonValue] = {}
        for peer in PEERS:
            if peer.name in unavailable_reasons:
                unavailable[peer.name] = unavailable_reasons[peer.name]
                continue
            path = peer_files[peer.file_format]
            rows.append(
                _Row(
                    spec(peer.name, LoadKind.PEER, peer=peer.name, peer_file=str(path)),
                    f"{peer.description} (file on {filesystem_type(path)}), assigned into the skeleton",
                    (path, *checkpoint),
                )
            )

        fault_point("bench.before_rows")
        measurements = _Measurements(options, shm_dir, worker_log, say)
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
        concurrent = measurements.cold_starters(stream_row)

        say("throughput: publication vs raw write+fsync, FULL_CHECKSUM vs single-thread SHA-256")
        throughput = measure_throughput(shm_dir, min(bf16_bytes, prewarm.total_bytes), options.runs)
        say("start-up: `hwr inspect` in a fresh process vs `python -c pass`")
        startup = measure_cli_startup(warm_root, max(options.runs, STARTUP_MIN_RUNS))
        say("throughput: remote import vs a plain fsspec copy of the same objects")
        remote_throughput = measure_remote_throughput(
            remotes, _published_identity(warm_store, prewarm.identity_key), shm_dir, options.remote_runs or options.runs
        )
        tensor_parallel: dict[str, JsonValue] | None = None
        if options.tensor_parallel_sizes:
            tensor_parallel = measure_tensor_parallel(
                TensorParallelSetup(pipeline, TRANSFORMER_SUBFOLDER, shm_dir, worker_log, options.timeout_s),
                options.tensor_parallel_sizes,
                runs=min(options.runs, options.tensor_parallel_runs),
                say=say,
            )
        elapsed = time.perf_counter() - started
        data: dict[str, Any] = {
            "date": time.strftime("%Y-%m-%d"),
            "machine": describe_machine(disk_dir, SHM),
            "options": {
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
            },
            "model": {
                "class": "FluxTransformer2DModel",
                "checkpoint_bytes": checkpoint_bytes,
                "hub_repo_id": HUB_REPO_ID,
                "artifact_bytes": prewarm.total_bytes,
                "tensors": prewarm.tensor_count,
            },
            "huge_pages": {"status": huge_status, "huge_page_backed_bytes": huge_page_backed},
            "unavailable_peers": unavailable,
            "rows": results,
            "concurrent_cold_starters": concurrent,
            "throughput": _throughput_dict(throughput),
            "cli_startup": startup.to_dict(),
            "background_verification": _verification_dict(results),
            "remote": {**remotes.to_dict(), "throughput": remote_throughput, "rows_not_measured": rows_not_measured},
            "tensor_parallel": tensor_parallel,
            "elapsed_s": elapsed,
        }
        data["goals"] = goals(data)
        return BenchReport(data)


def _hub_rows(hub_spec: Callable[..., RowSpec], blobs: tuple[Path, ...]) -> list[_Row]:
    """The cold rows again, loaded by repo id from the hub-cache snapshot, each against canonical from there.

    A validated snapshot's blob names are the files' SHA-256, so the first worker on a node
    hashes nothing: the difference to the folder rows is the checkpoint hashing.
    """
    hub = "from the Hugging Face cache snapshot by repo id (content ids from blob names, nothing hashed)"
    return [
        _Row(
            hub_spec(CANONICAL_HUB, LoadKind.CANONICAL),
            f"diffusers from_pretrained(repo id, cache_dir=..., torch_dtype=bfloat16) {hub}",
            blobs,
            memory_group=False,
            baseline=CANONICAL_HUB,
        ),
        _Row(
            hub_spec(COLD_PUBLISH_HUB, LoadKind.HWR, root=""),
            f"load_component on an empty domain {hub}: canonical load, then publication",
            blobs,
            fresh_domain=True,
            memory_group=False,
            baseline=CANONICAL_HUB,
        ),
        _Row(
            hub_spec(COLD_BACKGROUND_HUB, LoadKind.HWR, root="", publish_in_background=True),
            f"load_component(publish_in_background=True) on an empty domain {hub}: canonical load, artifact "
            "on a thread",
            blobs,
            fresh_domain=True,
            memory_group=False,
            baseline=CANONICAL_HUB,
        ),
        _Row(
            hub_spec(COLD_STREAM_HUB, LoadKind.HWR, root="", stream_on_miss=True),
            f"load_component(stream_on_miss=True) on an empty domain {hub}: streaming producer, then restore",
            blobs,
            fresh_domain=True,
            memory_group=False,
            baseline=CANONICAL_HUB,
        ),
    ]


def _forget_verification(store: FilesystemHostWeightStore, key: str) -> None:
    """Remove the artifact's background-verification record, so the next hit verifies it again."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(store.layout.verified_marker(key))


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
        "publish_s": publish.to_dict(),
        "single_thread_sha256_s": sha.to_dict(),
        "full_checksum_s": full.to_dict(),
        "publication_vs_raw": ratio(raw.median, publish.median),
        "publication_vs_raw_best": ratio(raw.minimum, publish.minimum),
        "full_checksum_vs_sha256": ratio(sha.median, full.median),
    }

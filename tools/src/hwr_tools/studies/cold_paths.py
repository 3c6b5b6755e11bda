"""Cold time to ready of `load_component` next to canonical `from_pretrained`, each run a fresh process.

    PYTHONPATH=src .venv/bin/python -m hwr_tools.studies.cold_paths --size-gib 0.25 --rounds 3 [--hub] [--src OTHER/src ...]

A targeted stand-in for the cold rows of `hwr bench` (about a minute instead of twenty):
an FP32 Flux checkpoint is written once; then, round after round and in rotating order,
a fresh interpreter per run imports everything, and its time to ready is timed as
`hwr bench` times it (the load call, then one byte read in every 4 KiB page of every
weight): canonical, the streaming producer (`stream_on_miss=True`), canonical + synchronous
publication and canonical + background publication (`publish_in_background=True`; it also
reports when the artifact was published), each HWR run on a fresh tmpfs domain (so it
hashes the checkpoint, as the first worker on a node does). `--modes` picks some. With several `--src` trees (e.g. a checkout of the base
commit) every tree's rows run in the same rounds, so their ratios share the same noise.
With `--hub` the same rows run in the same rounds from a Hugging Face cache snapshot too
(the checkpoint's files hard-linked as blobs, loaded offline by repo id), each against
canonical from that cache: blob names are the content ids, so nothing is hashed; `--hub-only`
runs those rows alone. Each round also measures the bounds the cold paths are judged against:
the faster of a raw `posix_fallocate` or `ftruncate`, then `pwrite` + `fsync`, of the artifact's bytes on the same tmpfs, and
single-thread SHA-256 of the checkpoint files divided by the cores available.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import mmap
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from hwr_tools.bench.steal import Attempts, StealSample, run_undisturbed, steal_summary
from hwr_tools.common import pythonpath_with_tools

_CHILD = r"""
import gc, json, sys, time, torch
from pathlib import Path
from diffusers import FluxTransformer2DModel
from host_weight_runtime import HostWeightRuntime, HostWeightRuntimeConfig, RuntimeMode, StorageClass
from host_weight_runtime.diffusion import load_component
from hwr_tools.bench.measure import touch_model
mode, source, root, cache_dir = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
hub = {"cache_dir": cache_dir, "local_files_only": True} if cache_dir else {}
gc.collect()  # the imports' collector debt, paid off the clock by every row alike
stat_before = open("/proc/stat").readline()
started, cpu_started = time.perf_counter(), time.process_time()
if mode == "canonical":
    model = FluxTransformer2DModel.from_pretrained(source, subfolder="transformer", torch_dtype=torch.bfloat16, **hub)
    outcome = "canonical"
else:
    config = HostWeightRuntimeConfig(mode=RuntimeMode.PREFERRED, root=Path(root), storage_class=StorageClass.TMPFS)
    loaded = load_component(source, subfolder="transformer", runtime=HostWeightRuntime(config),
                            stream_on_miss=(mode == "stream"), publish_in_background=(mode == "background"), **hub)
    model, outcome = loaded.model, str(loaded.outcome)
loaded_at = time.perf_counter()
touch_model(model)
ready, cpu = time.perf_counter() - started, time.process_time() - cpu_started
stat_after = open("/proc/stat").readline()
published = None
if mode == "background":
    assert loaded.background_publication.wait(600) and loaded.background_publication.failure is None
    published = time.perf_counter() - started
print(json.dumps({"s": ready, "cpu_s": cpu, "load_s": loaded_at - started, "published_s": published,
                  "outcome": outcome, "stat_before": stat_before, "stat_after": stat_after}))
"""


_HUB_REPO_ID = "hwr-bench/flux"


@dataclass(frozen=True, slots=True)
class _Row:
    """One measured way: a source tree, a load mode, and where the checkpoint comes from."""

    src: str
    mode: str  # canonical, stream, publish or background
    hub: bool  # from the hub-cache snapshot by repo id (else the local folder)

    @property
    def label(self) -> str:
        return f"{self.mode} (hub cache)" if self.hub else self.mode


def _run(row: _Row, pipeline: Path, hub_cache: Path, shm: Path) -> tuple[dict[str, float], StealSample]:
    source, cache_dir = (_HUB_REPO_ID, str(hub_cache)) if row.hub else (str(pipeline), "")
    with tempfile.TemporaryDirectory(dir=shm, prefix="hwr-cold-") as root:
        env = {**os.environ, "PYTHONPATH": pythonpath_with_tools(row.src), **({"HF_HUB_OFFLINE": "1"} if row.hub else {})}
        done = subprocess.run(
            [sys.executable, "-c", _CHILD, row.mode, source, str(Path(root) / "domain"), cache_dir],
            env=env,
            check=True,
            capture_output=True,
            text=True,
        )
    result = json.loads(done.stdout.strip().splitlines()[-1])
    figures = {
        name: float(result[name]) for name in ("s", "cpu_s", "load_s", "published_s") if result[name] is not None
    }
    return figures, StealSample.between(result["stat_before"], result["stat_after"], figures["s"])


def _undisturbed(row: _Row, pipeline: Path, hub_cache: Path, shm: Path) -> tuple[dict[str, float], Attempts]:
    """One sample of `row`, run again while the hypervisor's steal disturbed it (bounded)."""
    (figures, _), attempts = run_undisturbed(lambda: _run(row, pipeline, hub_cache, shm), lambda done: done[1])
    return figures, attempts


def _raw_write_s(shm: Path, nbytes: int, *, preallocate: bool) -> float:
    """`posix_fallocate` (or only `ftruncate`) + `pwrite` + `fsync` of `nbytes` (the artifact's size) on the
    domain's tmpfs; the bound is the faster of the two, since the store sizes tmpfs files without zeroing them."""
    block = os.urandom(8 << 20)
    with tempfile.TemporaryDirectory(dir=shm, prefix="hwr-raw-") as folder:
        fd = os.open(Path(folder) / "raw.bin", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        try:
            started = time.perf_counter()
            if preallocate:
                os.posix_fallocate(fd, 0, nbytes)
            else:
                os.ftruncate(fd, nbytes)
            for offset in range(0, nbytes, len(block)):
                os.pwrite(fd, block[: min(len(block), nbytes - offset)], offset)
            os.fsync(fd)
            return time.perf_counter() - started
        finally:
            os.close(fd)


def _sha256_s(files: list[Path]) -> float:
    """Single-thread SHA-256 of every checkpoint file (the page cache holds them)."""
    started = time.perf_counter()
    for path in files:
        with path.open("rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            hashlib.sha256(mapped).digest()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-gib", type=float, default=0.25, help="BF16 weights (the checkpoint is twice that)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--src", action="append", default=None, help="source trees to compare (default: ./src)")
    parser.add_argument("--workdir", type=Path, default=Path("/var/tmp"))
    parser.add_argument("--shm", type=Path, default=Path("/dev/shm"))
    parser.add_argument(
        "--hub", action="store_true", help="also run every row from a Hugging Face cache snapshot, by repo id"
    )
    parser.add_argument("--hub-only", action="store_true", help="run the hub-cache rows only (implies --hub)")
    parser.add_argument(
        "--modes", default="stream,publish,background", help="HWR rows to run (comma-separated; canonical always runs)"
    )
    args = parser.parse_args()
    modes = [mode for mode in args.modes.split(",") if mode]
    unknown = sorted(set(modes) - {"stream", "publish", "background"})
    if unknown:
        parser.error(f"unknown --modes {unknown}: choose from stream, publish, background")
    sources = [str(Path(src).resolve()) for src in (args.src or ["src"])]
    sys.path.insert(0, sources[-1])
    from hwr_tools.synthetic_models import save_flux_pipeline_folder, save_hub_snapshot

    rows: list[_Row] = []
    for hub in (True,) if args.hub_only else (False, True) if args.hub else (False,):
        rows.append(_Row(sources[-1], "canonical", hub))
        rows.extend(_Row(src, mode, hub) for src in sources for mode in modes)
    samples: dict[_Row, list[dict[str, float]]] = {row: [] for row in rows}
    with tempfile.TemporaryDirectory(dir=args.workdir, prefix="hwr-cold-paths-") as work:
        pipeline = Path(work) / "pipeline"
        save_flux_pipeline_folder(pipeline, target_bytes=int(2 * args.size_gib * 2**30), seed=0)
        hub_cache = Path(work) / "hub-cache"
        if args.hub or args.hub_only:  # hard links: the same bytes and page cache; each file hashed once here for its blob name
            save_hub_snapshot(hub_cache, _HUB_REPO_ID, pipeline, hard_link=True)
        for row in rows:  # warm the page cache and the imports
            if row.mode == "canonical":
                _run(row, pipeline, hub_cache, args.shm)
        weights = sorted((pipeline / "transformer").glob("*.safetensors"))
        raw_s: list[float] = []
        sha_s: list[float] = []
        steal: list[Attempts] = []
        for round_index in range(args.rounds):
            order = rows[round_index % len(rows) :] + rows[: round_index % len(rows)]
            for row in order:
                figures, attempts = _undisturbed(row, pipeline, hub_cache, args.shm)
                samples[row].append(figures)
                steal.append(attempts)
            nbytes = int(args.size_gib * 2**30)
            raw_s.append(min(_raw_write_s(args.shm, nbytes, preallocate=flag) for flag in (True, False)))
            sha_s.append(_sha256_s(weights))
    canonical = {
        row.hub: statistics.median(run["s"] for run in samples[row]) for row in rows if row.mode == "canonical"
    }
    raw, sha, cores = statistics.median(raw_s), statistics.median(sha_s), len(os.sched_getaffinity(0))
    print(
        f"bounds: raw write+fsync of {args.size_gib} GiB {raw * 1e3:.0f} ms; single-thread SHA-256 of the checkpoint "
        f"{sha * 1e3:.0f} ms / {cores} cores = {sha / cores * 1e3:.0f} ms"
    )
    print(f"load average {os.getloadavg()[0]:.1f} at the end; {steal_summary(steal)}")
    ready = {row: statistics.median(run["s"] for run in runs) for row, runs in samples.items()}
    for row, runs in samples.items():
        values = [run["s"] for run in runs]
        median = statistics.median(values)
        baseline = "canonical (hub cache)" if row.hub else "canonical"
        line = (
            f"{row.label:24s} {row.src}: ready {median * 1e3:7.0f} ms [{min(values) * 1e3:.0f}, {max(values) * 1e3:.0f}]"
            f"  {median / canonical[row.hub]:.2f}x {baseline}; load call {statistics.median(r['load_s'] for r in runs) * 1e3:.0f} ms"
            f"; CPU {statistics.median(r['cpu_s'] for r in runs) * 1e3:.0f} ms (all threads, until ready)"
        )
        if row.mode == "background":
            published = statistics.median(run["published_s"] for run in runs)
            line += f"; published at {published * 1e3:.0f} ms = {published / canonical[row.hub]:.2f}x {baseline}"
            if row.hub:
                line += f" = {published / (canonical[True] + raw):.2f}x (canonical + raw write)"
        if row.mode == "publish" and row.hub:
            line += f"; {median / (canonical[True] + raw):.2f}x (canonical + raw write)"
        hub_twin = _Row(row.src, row.mode, True)
        if row.mode != "canonical" and not row.hub and hub_twin in ready:
            extra = median - ready[hub_twin]
            line += f"; extra over the hub cache {extra * 1e3:.0f} ms = {extra / (sha / cores):.2f}x (SHA-256 / cores)"
        print(line)


if __name__ == "__main__":
    main()

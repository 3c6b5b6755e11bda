"""The cold rows of `cold_paths.py` (stream, publish, background) timed phase by phase, each run a fresh process.

    PYTHONPATH=src .venv/bin/python -m hwr_tools.studies.cold_phases --size-gib 0.25 --rounds 3 [--src OTHER/src ...]

The same FP32 Flux checkpoint as `cold_paths.py`, loaded offline by repo id from a Hugging
Face cache snapshot (nothing is hashed for the content key). Each run is one fresh interpreter
on a fresh tmpfs domain that imports everything off the clock and times one `load_component`
call, with the time spent in each named step of the loader and of the store under it (a step
nested in another counts in both), as wall time and as the CPU time of the thread that ran it
(`(cpu)`: the step's own Python and casting, not its hash threads; steadier than wall on a busy host). The background row's steps on the publication thread are
prefixed `bg.`, and `published` is when its artifact was published. With several `--src`
trees, every tree's rows run in the same rounds, alternating, and the report gives each
tree's medians, so the trees share the noise of one run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from hwr_tools.bench.steal import Attempts, StealSample, run_undisturbed, steal_summary
from hwr_tools.common import pythonpath_with_tools

_CHILD = r"""
import gc, importlib, json, sys, threading, time, torch
from pathlib import Path
from host_weight_runtime import HostWeightRuntime, HostWeightRuntimeConfig, RuntimeMode, StorageClass
from host_weight_runtime.diffusion import load_component
from diffusers import FluxTransformer2DModel  # imports off the clock, as cold_paths.py
from hwr_tools.bench.measure import touch_model
phases, cpu = {}, {}
def timed(name, function):
    def wrapper(*args, **kwargs):
        thread = threading.current_thread().name
        label = ("bg." if thread.startswith("hwr-background") else "") + name
        started, cpu_started = time.perf_counter(), time.thread_time()
        try:
            return function(*args, **kwargs)
        finally:
            phases[label] = phases.get(label, 0.0) + (time.perf_counter() - started) * 1000
            cpu[label] = cpu.get(label, 0.0) + (time.thread_time() - cpu_started) * 1000
    return wrapper
# (module, attribute or Class.method, label): what exists in a tree is timed, what does not is skipped
TARGETS = [
    ("host_weight_runtime.diffusion.family_diffusers", "DiffusersFamily.import_up_front", "imports"),
    ("host_weight_runtime.diffusion.loader", "runtime_for_load", "runtime"),
    ("host_weight_runtime.diffusion.loader", "_checkpoint_or_named_source", "source"),
    ("host_weight_runtime.diffusion.loader", "_start_prehash", "prehash"),
    ("host_weight_runtime.diffusion.loader", "prepare_skeleton", "skeleton"),
    ("host_weight_runtime.diffusion.loader", "identify_component", "identify"),
    ("host_weight_runtime.diffusion.publish_step", "identify_component", "identify"),
    ("host_weight_runtime.diffusion.loader", "resolve_component", "resolve"),
    ("host_weight_runtime.diffusion.loader", "restore_or_fall_back", "restore"),
    ("host_weight_runtime.diffusion.loader", "load_canonical_for", "canonical"),
    ("host_weight_runtime.diffusion.loader", "publish_after_canonical_load", "publish"),
    ("host_weight_runtime.diffusion.loader", "start_background_publication", "start_background"),
    ("host_weight_runtime.diffusion.loaded", "LoadStopwatch.finish", "report"),
    ("host_weight_runtime.filesystem._build", "ArtifactBuilder.get_or_build", "store.get_or_build"),
    ("host_weight_runtime.filesystem._lookup", "ArtifactLookup.lookup", "store.lookup"),
    ("host_weight_runtime.filesystem._build", "ArtifactBuilder._produce_into", "store.produce"),
    ("host_weight_runtime.filesystem.writer", "StagingArtifactWriter.finish", "store.produce.writer_finish"),
    ("host_weight_runtime.filesystem._build", "seal", "store.seal"),
    ("host_weight_runtime.filesystem._publication", "Publisher.publish", "store.publish"),
    ("host_weight_runtime.filesystem._publication", "open_artifact", "store.publish.open_artifact"),
    ("host_weight_runtime.filesystem._lookup", "ArtifactLookup.make_lease", "store.make_lease"),
]
for module_name, attribute, label in TARGETS:
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        continue
    owner, _, name = attribute.rpartition(".")
    holder = getattr(module, owner, None) if owner else module
    if holder is not None and hasattr(holder, name):
        setattr(holder, name, timed(label, getattr(holder, name)))
mode, repo_id, root, cache_dir = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
config = HostWeightRuntimeConfig(mode=RuntimeMode.PREFERRED, root=Path(root), storage_class=StorageClass.TMPFS)
gc.collect()  # the imports' collector debt, paid off the clock by every row alike
stat_before = open("/proc/stat").readline()
started = time.perf_counter()
loaded = load_component(repo_id, subfolder="transformer", runtime=HostWeightRuntime(config), cache_dir=cache_dir,
                        local_files_only=True, stream_on_miss=(mode == "stream"),
                        publish_in_background=(mode == "background"))
result = {"load_call": (time.perf_counter() - started) * 1000}
touch_model(loaded.model)
result["ready"] = (time.perf_counter() - started) * 1000
result["stat_before"], result["stat_after"] = stat_before, open("/proc/stat").readline()
if mode == "background":
    assert loaded.background_publication.wait(600) and loaded.background_publication.failure is None
    result["published"] = (time.perf_counter() - started) * 1000
result.update(phases)
result.update({label + " (cpu)": value for label, value in cpu.items()})
result["outcome"] = str(loaded.outcome)
print(json.dumps(result))
"""

_HUB_REPO_ID = "hwr-bench/flux"
_MODES = ("stream", "publish", "background")


def _run(src: str, mode: str, hub_cache: Path, shm: Path) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(dir=shm, prefix="hwr-cold-phases-") as root:
        env = {**os.environ, "PYTHONPATH": pythonpath_with_tools(src), "HF_HUB_OFFLINE": "1"}
        done = subprocess.run(
            [sys.executable, "-c", _CHILD, mode, _HUB_REPO_ID, str(Path(root) / "domain"), str(hub_cache)],
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-3000:])
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def _undisturbed(src: str, mode: str, hub_cache: Path, shm: Path) -> tuple[dict[str, Any], Attempts]:
    """One sample, run again while the hypervisor's steal during its timed load disturbed it (bounded)."""

    def steal_of(result: dict[str, Any]) -> StealSample:
        return StealSample.between(result["stat_before"], result["stat_after"], result["ready"] / 1000)

    result, attempts = run_undisturbed(lambda: _run(src, mode, hub_cache, shm), steal_of)
    for name in ("stat_before", "stat_after"):
        del result[name]
    return result, attempts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-gib", type=float, default=0.25, help="BF16 weights (the checkpoint is twice that)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--src", action="append", default=None, help="source trees to compare (default: ./src)")
    parser.add_argument("--modes", default=",".join(_MODES), help="rows to run (comma-separated)")
    parser.add_argument("--workdir", type=Path, default=Path("/var/tmp"))
    parser.add_argument("--shm", type=Path, default=Path("/dev/shm"))
    args = parser.parse_args()
    modes = [mode for mode in args.modes.split(",") if mode]
    if set(modes) - set(_MODES):
        parser.error(f"unknown --modes {sorted(set(modes) - set(_MODES))}: choose from {', '.join(_MODES)}")
    sources = [str(Path(src).resolve()) for src in (args.src or ["src"])]
    sys.path.insert(0, sources[-1])
    from hwr_tools.synthetic_models import save_flux_pipeline_folder, save_hub_snapshot

    rows = [(src, mode) for mode in modes for src in sources]
    samples: dict[tuple[str, str], list[dict[str, Any]]] = {row: [] for row in rows}
    with tempfile.TemporaryDirectory(dir=args.workdir, prefix="hwr-cold-phases-") as work:
        pipeline = Path(work) / "pipeline"
        save_flux_pipeline_folder(pipeline, target_bytes=int(2 * args.size_gib * 2**30), seed=0)
        hub_cache = Path(work) / "hub-cache"
        save_hub_snapshot(hub_cache, _HUB_REPO_ID, pipeline, hard_link=True)
        _run(sources[-1], modes[0], hub_cache, args.shm)  # warms the page cache and the imports
        steal: list[Attempts] = []
        for index in range(args.rounds):
            for row in rows if index % 2 == 0 else rows[::-1]:
                result, attempts = _undisturbed(row[0], row[1], hub_cache, args.shm)
                samples[row].append(result)
                steal.append(attempts)
    print(f"load average {os.getloadavg()[0]:.1f} at the end; medians of {args.rounds} runs, ms (hub cache)")
    print(steal_summary(steal))
    for mode in modes:
        names = sorted({key for src in sources for run in samples[(src, mode)] for key in run if key != "outcome"})
        print(f"\n{mode}:\n| phase | " + " | ".join(sources) + " |\n|---|" + "---:|" * len(sources))
        for name in names:
            cells = []
            for src in sources:
                values = [run[name] for run in samples[(src, mode)] if name in run]
                cells.append(f"{statistics.median(values):.0f}" if values else "-")
            print(f"| {name} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

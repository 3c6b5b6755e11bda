"""The first worker on a node next to plain diffusers: `load_pipeline` with default settings on an empty domain
against `DiffusionPipeline.from_pretrained(..., torch_dtype=torch.bfloat16)`, each run a fresh process.

    PYTHONPATH=src .venv/bin/python -m hwr_tools.studies.first_worker --transformer-mib 128 --rounds 5 [--hub] [--src OTHER/src]

A FLUX-proportioned pipeline (`save_proportional_flux_pipeline`: FP32 transformer of about
`--transformer-mib`, T5 about 40% of it, CLIP, VAE, tokenizers, scheduler) is written once to a
local folder and, with `--hub`, hard-linked into a Hugging Face cache snapshot loaded offline by
repo id. Round after round, in rotating order, a fresh interpreter imports torch, diffusers,
transformers and this package before the clock, then times the load and one byte read in every
4 KiB page of every weight of every component (time to ready). Each first-worker run gets a fresh,
empty domain (no artifact, no digest cache: what a new node sees), only HWR_ROOT set, so the
defaults decide; its process then exits, which waits for the background publication, and the
script checks that the artifacts were left (one per served component). Reported: each row's
median, and first worker / canonical per source. Figures on a shared machine are noisy.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hwr_tools.common import pythonpath_with_tools

_CHILD = r"""
import gc, json, sys, time, torch
import diffusers, transformers
from diffusers import DiffusionPipeline
from host_weight_runtime.diffusion import load_pipeline
from hwr_tools.bench.measure import touch_model
row, source, cache_dir = sys.argv[1], sys.argv[2], sys.argv[3]
hub = {"cache_dir": cache_dir} if cache_dir else {}
gc.collect()
started = time.perf_counter()
if row == "canonical":
    pipeline = DiffusionPipeline.from_pretrained(source, torch_dtype=torch.bfloat16, local_files_only=True, **hub)
    outcomes = {}
else:
    loaded = load_pipeline(source, **hub)
    pipeline, outcomes = loaded.pipeline, {name: value.value for name, value in loaded.outcomes.items()}
loaded_at = time.perf_counter()
checksum = 0
for value in pipeline.components.values():
    if isinstance(value, torch.nn.Module):
        checksum += touch_model(value)[1]
ready = time.perf_counter()
print(json.dumps({"load_s": loaded_at - started, "ready_s": ready - started, "checksum": checksum,
                  "outcomes": outcomes}))
"""

REPO_ID = "hwr-bench/first-worker"


def _run(row: str, source: str, cache_dir: str, root: Path | None, src: Path) -> dict[str, object]:
    """One fresh process; for a first worker also the wall time until it exited (publication included)."""
    environment = {name: value for name, value in os.environ.items() if not name.startswith("HWR_")}
    environment["PYTHONPATH"] = pythonpath_with_tools(str(src))
    environment["HF_HUB_OFFLINE"] = "1"
    if root is not None:
        environment["HWR_ROOT"] = str(root)
    started = time.perf_counter()
    completed = subprocess.run(
        [sys.executable, "-c", _CHILD, row, source, cache_dir],
        env=environment,
        capture_output=True,
        text=True,
        check=False,
        timeout=1800,
    )
    if completed.returncode != 0:
        raise RuntimeError(f"{row} {source} failed:\n{completed.stderr[-4000:]}")
    result: dict[str, object] = json.loads(completed.stdout.strip().splitlines()[-1])
    result["process_s"] = time.perf_counter() - started
    if root is not None:
        artifacts = root / "artifacts"
        result["artifacts"] = len(list(artifacts.iterdir())) if artifacts.is_dir() else 0
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--transformer-mib", type=int, default=128, help="FP32 transformer size (MiB)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--hub", action="store_true", help="also from a hub cache snapshot (loaded by repo id)")
    parser.add_argument("--work", type=Path, default=None, help="where the checkpoint is written (default: a tmp)")
    parser.add_argument("--domains", type=Path, default=None, help="where the empty domains go (default: /dev/shm)")
    parser.add_argument("--src", type=Path, default=None, help="the package tree the children import (default: ours)")
    arguments = parser.parse_args()

    from hwr_tools.synthetic_models import save_hub_snapshot
    from hwr_tools.synthetic_pipelines import save_proportional_flux_pipeline

    src = arguments.src or Path(__file__).resolve().parents[4] / "src"
    work = Path(tempfile.mkdtemp(prefix="hwr-first-worker-", dir=arguments.work))
    domains_base = arguments.domains or (Path("/dev/shm") if Path("/dev/shm").is_dir() else work)
    domains = Path(tempfile.mkdtemp(prefix="hwr-first-worker-domains-", dir=domains_base))
    try:
        folder = save_proportional_flux_pipeline(
            work / "flux", transformer_bytes=arguments.transformer_mib * 2**20, seed=0
        )
        sources = {"folder": (str(folder), "")}
        if arguments.hub:
            cache = work / "hub"
            save_hub_snapshot(cache, REPO_ID, folder, hard_link=True)
            sources["hub"] = (REPO_ID, str(cache))
        rows = [(where, kind) for where in sources for kind in ("canonical", "first")]
        samples: dict[tuple[str, str], list[dict[str, object]]] = {row: [] for row in rows}
        for round_index in range(arguments.rounds):
            shift = round_index % len(rows)
            for where, kind in rows[shift:] + rows[:shift]:
                source, cache_dir = sources[where]
                root = None
                if kind == "first":
                    root = domains / f"{where}-{round_index}"
                result = _run(kind, source, cache_dir, root, src)
                if root is not None:
                    shutil.rmtree(root, ignore_errors=True)
                samples[(where, kind)].append(result)
                print(json.dumps({"round": round_index, "source": where, "row": kind, **result}), flush=True)
        summary: dict[str, object] = {"transformer_mib": arguments.transformer_mib, "rounds": arguments.rounds}
        for where in sources:
            canonical = statistics.median(float(str(s["ready_s"])) for s in samples[(where, "canonical")])
            first = statistics.median(float(str(s["ready_s"])) for s in samples[(where, "first")])
            exited = statistics.median(float(str(s["process_s"])) for s in samples[(where, "first")])
            summary[where] = {
                "canonical_ready_s": canonical,
                "first_worker_ready_s": first,
                "first_over_canonical": first / canonical,
                "first_worker_process_s": exited,
                "artifacts_left": sorted({int(str(s["artifacts"])) for s in samples[(where, "first")]}),
            }
        print(json.dumps(summary, indent=2))
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(domains, ignore_errors=True)


if __name__ == "__main__":
    main()

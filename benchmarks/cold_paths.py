"""Cold time to ready of `load_component` next to canonical `from_pretrained`, each run a fresh process.

    PYTHONPATH=src .venv/bin/python benchmarks/cold_paths.py --size-gib 0.25 --rounds 3 [--src OTHER/src ...]

A targeted stand-in for the cold rows of `hwr bench` (about a minute instead of twenty):
an FP32 Flux checkpoint is written once; then, round after round and in rotating order,
a fresh interpreter per run imports everything, and only the load call is timed:
canonical, the streaming producer (`stream_on_miss=True`) and canonical + synchronous
publication, each HWR run on a fresh tmpfs domain (so it hashes the checkpoint, as the
first worker on a node does). With several `--src` trees (e.g. a checkout of the base
commit) every tree's rows run in the same rounds, so their ratios share the same noise.
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

_CHILD = r"""
import json, sys, time, torch
from pathlib import Path
from diffusers import FluxTransformer2DModel
from host_weight_runtime import HostWeightRuntime, HostWeightRuntimeConfig, RuntimeMode, StorageClass
from host_weight_runtime.diffusion import load_component
mode, pipeline, root = sys.argv[1], sys.argv[2], sys.argv[3]
started = time.perf_counter()
if mode == "canonical":
    model = FluxTransformer2DModel.from_pretrained(pipeline, subfolder="transformer", torch_dtype=torch.bfloat16)
    outcome = "canonical"
else:
    config = HostWeightRuntimeConfig(mode=RuntimeMode.PREFERRED, root=Path(root), storage_class=StorageClass.TMPFS)
    loaded = load_component(pipeline, subfolder="transformer", runtime=HostWeightRuntime(config),
                            stream_on_miss=(mode == "stream"))
    model, outcome = loaded.model, str(loaded.outcome)
elapsed = time.perf_counter() - started
print(json.dumps({"s": elapsed, "outcome": outcome}))
"""


def _run(src: str, mode: str, pipeline: Path, shm: Path) -> float:
    with tempfile.TemporaryDirectory(dir=shm, prefix="hwr-cold-") as root:
        env = {**os.environ, "PYTHONPATH": src}
        done = subprocess.run(
            [sys.executable, "-c", _CHILD, mode, str(pipeline), str(Path(root) / "domain")],
            env=env,
            check=True,
            capture_output=True,
            text=True,
        )
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return float(result["s"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-gib", type=float, default=0.25, help="BF16 weights (the checkpoint is twice that)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--src", action="append", default=None, help="source trees to compare (default: ./src)")
    parser.add_argument("--workdir", type=Path, default=Path("/var/tmp"))
    parser.add_argument("--shm", type=Path, default=Path("/dev/shm"))
    args = parser.parse_args()
    sources = [str(Path(src).resolve()) for src in (args.src or ["src"])]
    sys.path.insert(0, sources[-1])
    from host_weight_runtime.tools.synthetic_models import save_flux_pipeline_folder

    rows = [(sources[-1], "canonical")] + [(src, mode) for src in sources for mode in ("stream", "publish")]
    samples: dict[tuple[str, str], list[float]] = {row: [] for row in rows}
    with tempfile.TemporaryDirectory(dir=args.workdir, prefix="hwr-cold-paths-") as work:
        pipeline = Path(work) / "pipeline"
        save_flux_pipeline_folder(pipeline, target_bytes=int(2 * args.size_gib * 2**30), seed=0)
        _run(sources[-1], "canonical", pipeline, args.shm)  # warm the page cache and the imports
        for round_index in range(args.rounds):
            order = rows[round_index % len(rows) :] + rows[: round_index % len(rows)]
            for src, mode in order:
                samples[(src, mode)].append(_run(src, mode, pipeline, args.shm))
    canonical = statistics.median(samples[rows[0]])
    for (src, mode), values in samples.items():
        median = statistics.median(values)
        print(
            f"{mode:9s} {src}: {median * 1e3:7.0f} ms [{min(values) * 1e3:.0f}, {max(values) * 1e3:.0f}]"
            f"  {median / canonical:.2f}x canonical"
        )


if __name__ == "__main__":
    main()

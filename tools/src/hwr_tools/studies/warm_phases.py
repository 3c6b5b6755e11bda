"""A warm pipeline load (transformer, VAE and both text encoders), timed by phase, each run a fresh process.

    PYTHONPATH=src .venv/bin/python -m hwr_tools.studies.warm_phases --size-mib 256 --rounds 3 [--src OTHER/src ...]

A proportional Flux pipeline (`save_proportional_flux_pipeline`) is published once into a
`/dev/shm` domain; then, round after round, alternating the given source trees, a fresh
interpreter imports everything off the clock and times one `load_pipeline` hit, with the
time each component spends in the loader's steps (skeleton, identity, resolve, restore).
The report gives each tree's median per phase, so two trees share the noise of one run.
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

from hwr_tools.common import REPO_ROOT, pythonpath_with_tools

_CHILD = r"""
import gc, json, sys, time
from host_weight_runtime import HostWeightRuntime, HostWeightRuntimeConfig, RuntimeMode, StorageClass
from host_weight_runtime.diffusion import load_pipeline
import host_weight_runtime.diffusion.loader as loader
import diffusers, transformers, torch  # imports off the clock

phases = {}
def timed(name, function):
    def wrapper(*args, **kwargs):
        started = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            phases[name] = phases.get(name, 0.0) + (time.perf_counter() - started) * 1000
    return wrapper
for name in ("prepare_skeleton", "identify_component", "resolve_component", "restore_or_fall_back"):
    setattr(loader, name, timed(name, getattr(loader, name)))
folder, root, mode = sys.argv[1], sys.argv[2], sys.argv[3]
from pathlib import Path
config = HostWeightRuntimeConfig(mode=RuntimeMode[mode], root=Path(root), storage_class=StorageClass.TMPFS)
gc.collect()  # the imports' collector debt, paid off the clock by every tree alike
started = time.perf_counter()
loaded = load_pipeline(folder, runtime=HostWeightRuntime(config), torch_dtype=torch.bfloat16)
total = (time.perf_counter() - started) * 1000
paths = sorted({str(c.load_path.value) for c in loaded.components.values()})
print(json.dumps({"total_ms": total, **{k + "_ms": v for k, v in phases.items()}, "paths": paths}))
loaded.close()
"""


def _run(src: str, folder: Path, root: Path, mode: str) -> dict[str, Any]:
    # Every worker after a node's first hit finds the publication verified; a short-lived one would start
    # that once-per-node pass again every round and time its hash thread beside the load.
    env = {
        **os.environ,
        "PYTHONPATH": pythonpath_with_tools(src),
        "HF_HUB_OFFLINE": "1",
        "HWR_BACKGROUND_VERIFY": "off",
    }
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, str(folder), str(root), mode], env=env, capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-3000:])
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--src", action="append", default=[], help="a source tree to time (several: alternated)")
    parser.add_argument("--workdir", default="/var/tmp")
    options = parser.parse_args()
    sources = options.src or [str(REPO_ROOT / "src")]
    from hwr_tools.synthetic_pipelines import save_proportional_flux_pipeline

    with tempfile.TemporaryDirectory(dir=options.workdir, prefix="hwr-phases-") as disk, \
            tempfile.TemporaryDirectory(dir="/dev/shm", prefix="hwr-phases-") as shm:
        folder = save_proportional_flux_pipeline(Path(disk) / "pipeline", transformer_bytes=options.size_mib * 2**20)
        root = Path(shm) / "domain"
        print(json.dumps(_run(sources[0], folder, root, "PREFERRED")), file=sys.stderr)  # publishes every component
        rows: dict[str, list[dict[str, Any]]] = {src: [] for src in sources}
        for index in range(options.rounds):
            for src in sources if index % 2 == 0 else sources[::-1]:
                row = _run(src, folder, root, "REQUIRED")
                rows[src].append(row)
                print(f"# round {index + 1} {src}: {row}", file=sys.stderr)
        print(f"load average {os.getloadavg()[0]:.1f} at the end; medians of {options.rounds} runs, ms")
        names = sorted({key for samples in rows.values() for row in samples for key in row if key.endswith("_ms")})
        print("| tree | " + " | ".join(name.removesuffix("_ms") for name in names) + " |")
        print("|---|" + "---:|" * len(names))
        for src, samples in rows.items():
            medians = [statistics.median(row.get(name, 0.0) for row in samples) for name in names]
            print(f"| {src} | " + " | ".join(f"{value:.1f}" for value in medians) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

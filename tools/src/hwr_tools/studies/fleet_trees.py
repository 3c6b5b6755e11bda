"""`file://` import and node B against a plain fsspec copy, for several source trees side by side.

    .venv/bin/python -m hwr_tools.studies.fleet_trees --src /tmp/base/src --src src [--size-mib 256] [--rounds 4]
        [--children 2] [--disk /var/tmp] [--shm /dev/shm]

Publishes one BF16 `blake3-tree-v1` artifact with the first tree and pushes it to a `file://` folder on
disk, then runs child processes of each tree in turn (the order reversed every other pass). Each child
times `--rounds` x (import into an empty domain, plain copy, node B resolve in REQUIRED mode, plain
copy), alternating which goes first, with a `gc.collect()` before each timed side, and reports its
medians, its CPU per import and copy, the full collections that started inside an import or node B,
and the hypervisor's steal ticks (`/proc/stat`) while it ran.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from statistics import median

from hwr_tools.common import pythonpath_with_tools

_SETUP = """
import sys, time
from pathlib import Path
from host_weight_runtime import BuildRequest, DigestAlgorithm, FilesystemHostWeightStore, ValidationLevel, push_artifact
from hwr_tools.bench.throughput import _identity, _Producer, _tensors
shm, url, size = sys.argv[1], sys.argv[2], int(sys.argv[3])
algorithm = DigestAlgorithm.BLAKE3_TREE_V1
identity = _identity(size, 0, algorithm)
store = FilesystemHostWeightStore(Path(shm) / "node-a")
built = store.get_or_build(BuildRequest(identity), _Producer(identity, _tensors(size), algorithm),
                           validation=ValidationLevel.MANIFEST_AND_METADATA, deadline=time.monotonic() + 600)
assert built.lease is not None, built.failure
built.lease.close()
push_artifact(store, identity.key, url)
"""


def _steal_ticks() -> int:
    with open("/proc/stat") as stat:
        return int(stat.readline().split()[8])


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _child(url: str, shm: Path, rounds: int, size: int) -> dict[str, list[float]]:
    import fsspec.core
    import torch  # noqa: F401  (the bench process has torch imported, and so its garbage)

    from host_weight_runtime import (
        DigestAlgorithm,
        FilesystemHostWeightStore,
        FsspecArtifactProvider,
        HostWeightRuntime,
        HostWeightRuntimeConfig,
        ResolutionOutcome,
        RuntimeMode,
        ValidationLevel,
    )
    from host_weight_runtime.remote.importer import import_remote_artifact
    from hwr_tools.bench.throughput import _identity
    from hwr_tools.common import remove_tree

    identity = _identity(size, 0, DigestAlgorithm.BLAKE3_TREE_V1)
    fs, root = fsspec.core.url_to_fs(url, skip_instance_cache=True)
    sources = sorted(str(e).rstrip("/") for e in fs.ls(f"{str(root).rstrip('/')}/{identity.key}", detail=False))
    full: list[int] = []
    gc.callbacks.append(lambda phase, info: full.append(1) if phase == "start" and info["generation"] == 2 else None)
    out: dict[str, list[float]] = {
        key: [] for key in ("import", "copy", "node_b", "copy_b", "import_cpu", "copy_cpu", "full_gc")
    }

    def import_into(domain: Path) -> Callable[[], None]:
        def run() -> None:
            store = FilesystemHostWeightStore(domain)
            result = import_remote_artifact(
                store,
                identity,
                FsspecArtifactProvider(url),
                validation=ValidationLevel.MANIFEST_AND_METADATA,
                deadline=time.monotonic() + 600,
            )
            assert result is not None and result.lease is not None, result
            result.lease.close()

        return run

    def copy_into(folder: Path) -> Callable[[], None]:
        def run() -> None:
            folder.mkdir()
            fs.get(sources, [str(folder / source.rsplit("/", 1)[-1]) for source in sources])

        return run

    def node_b(domain: Path) -> Callable[[], None]:
        def run() -> None:
            config = HostWeightRuntimeConfig(root=domain, mode=RuntimeMode.REQUIRED)
            resolved = HostWeightRuntime(config, remote_providers=[FsspecArtifactProvider(url)]).resolve(identity)
            assert resolved.outcome is ResolutionOutcome.REMOTE_IMPORT and resolved.lease is not None
            resolved.lease.close()

        return run

    for run in range(rounds):
        paths = {name: shm / f"{name}-{os.getpid()}-{run}" for name in ("import", "copy", "node_b", "copy_b")}
        sides = [
            ("import", import_into(paths["import"])),
            ("copy", copy_into(paths["copy"])),
            ("node_b", node_b(paths["node_b"])),
            ("copy_b", copy_into(paths["copy_b"])),
        ]
        if run % 2:
            sides = [sides[1], sides[0], sides[3], sides[2]]
        for name, action in sides:
            gc.collect()
            full.clear()
            cpu, started = _cpu_s(), time.perf_counter()
            action()
            out[name].append(time.perf_counter() - started)
            if name in ("import", "copy"):
                out[f"{name}_cpu"].append(_cpu_s() - cpu)
            if name in ("import", "node_b"):
                out["full_gc"].append(len(full))
        for path in paths.values():
            remove_tree(path)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--src", action="append", default=[], help="a tree's src folder (repeat)")
    parser.add_argument("--size-mib", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--children", type=int, default=2, help="child processes per tree")
    parser.add_argument("--disk", type=Path, default=Path("/var/tmp"))
    parser.add_argument("--shm", type=Path, default=Path("/dev/shm"))
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    size = args.size_mib << 20
    if args.child:
        url, shm, rounds = args.child
        print("RESULT" + json.dumps(_child(url, Path(shm), int(rounds), size)))
        return
    if not args.src:
        parser.error("name at least one tree with --src")
    shm = Path(tempfile.mkdtemp(dir=args.shm, prefix="hwr-fleet-trees-"))
    disk = Path(tempfile.mkdtemp(dir=args.disk, prefix="hwr-fleet-trees-"))
    url = f"file://{disk / 'remote'}"
    trees = [str(Path(tree).resolve()) for tree in args.src]
    try:
        setup_env = {**os.environ, "PYTHONPATH": pythonpath_with_tools(trees[0])}
        subprocess.run([sys.executable, "-c", _SETUP, str(shm), url, str(size)], check=True, env=setup_env)
        for child in range(args.children):
            for tree in trees if child % 2 == 0 else trees[::-1]:
                load, steal = os.getloadavg()[0], _steal_ticks()
                command = [sys.executable, __file__, "--size-mib", str(args.size_mib), "--child", url, str(shm)]
                command.append(str(args.rounds))
                done = subprocess.run(
                    command, env={**os.environ, "PYTHONPATH": pythonpath_with_tools(tree)}, capture_output=True, text=True, check=False
                )
                if done.returncode:
                    raise SystemExit(f"{tree}: child failed\n{done.stderr[-3000:]}")
                got = json.loads(done.stdout.split("RESULT", 1)[1])
                imported, copied = median(got["import"]), median(got["copy"])
                ready, copied_b = median(got["node_b"]), median(got["copy_b"])
                print(
                    f"{tree}: load {load:.1f}, steal {_steal_ticks() - steal}; import {imported * 1e3:.0f} ms, copy "
                    f"{copied * 1e3:.0f} ms (import/copy {copied / imported:.2f}); node B {ready * 1e3:.0f} ms, copy "
                    f"{copied_b * 1e3:.0f} ms (node B/copy {ready / copied_b:.2f}); CPU import "
                    f"{median(got['import_cpu']) * 1e3:.0f} ms, copy {median(got['copy_cpu']) * 1e3:.0f} ms; full "
                    f"collections inside {int(sum(got['full_gc']))}",
                    flush=True,
                )
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(disk, ignore_errors=True)


if __name__ == "__main__":
    main()

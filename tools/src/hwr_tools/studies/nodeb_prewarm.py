"""Node B's `prewarm_component` (hub snapshot present, empty domain, `file://` remote) against a plain copy.

    .venv/bin/python -m hwr_tools.studies.nodeb_prewarm --src BASE/src --src src [--gib 0.6] [--rounds 4]
        [--disk /var/tmp] [--shm /dev/shm] [--keep-setup DIR] [--profile TREE_SRC]

Setup (with the first tree): a FLUX-shaped pipeline whose FP32 transformer holds `--gib` GiB (so its
BF16 artifact holds half), saved as a Hugging Face cache snapshot; its transformer prewarmed on a
node A domain and pushed to a `file://` folder on disk. Then, each round and for each tree (the order
reversed every other round), two fresh child processes, alternating which goes first: one times
`prewarm_component(repo_id, subfolder="transformer", revision=..., cache_dir=hub, runtime=<runtime
with the remote>)` on an empty domain (so node B imports the exact artifact), the other
`shutil.copyfile` of the artifact's files from the remote folder. Both children import torch,
diffusers, transformers and this package before the clock. Prints wall and CPU medians and the
ratio per tree, also against the copy's median over all trees (the same code in each). `--profile
TREE_SRC` instead runs one prewarm child of that tree under pyinstrument.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import median

from hwr_tools.common import pythonpath_with_tools

_REPO_ID = "hwr-study/nodeb"
_REVISION = hashlib.sha1(b"nodeb-prewarm").hexdigest()


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _setup(work: Path, shm: Path, gib: float) -> None:
    from host_weight_runtime import FilesystemHostWeightStore, HostWeightRuntime, HostWeightRuntimeConfig, RuntimeMode
    from host_weight_runtime.diffusion import prewarm_component
    from host_weight_runtime.remote import push_all_artifacts
    from hwr_tools.synthetic_hub import save_hub_snapshot
    from hwr_tools.synthetic_models import save_flux_pipeline_folder

    folder = save_flux_pipeline_folder(work / "pipe", target_bytes=int(gib * 2**30), seed=0)
    save_hub_snapshot(work / "hub", _REPO_ID, folder, revision=_REVISION, hard_link=True)
    root = shm / "node-a"
    runtime = HostWeightRuntime(HostWeightRuntimeConfig(root=root, mode=RuntimeMode.REQUIRED))
    result = prewarm_component(
        _REPO_ID, subfolder="transformer", revision=_REVISION, cache_dir=work / "hub", runtime=runtime
    )
    push_all_artifacts(FilesystemHostWeightStore(root), f"file://{work / 'remote'}")
    shutil.rmtree(root, ignore_errors=True)
    (work / "setup.json").write_text(json.dumps({"key": result.identity_key, "bytes": result.total_bytes}))


def _child(work: Path, shm: Path, action: str, profile: bool) -> dict[str, float]:
    import diffusers  # noqa: F401  (a serving process has these imported before it asks for weights)
    import torch  # noqa: F401
    import transformers  # noqa: F401
    from diffusers import FluxTransformer2DModel  # noqa: F401

    from host_weight_runtime import HostWeightRuntime, HostWeightRuntimeConfig, RuntimeMode, diffusion
    from host_weight_runtime.remote import FsspecArtifactProvider

    os.environ["HF_HUB_OFFLINE"] = "1"
    setup = json.loads((work / "setup.json").read_text())
    key = setup["key"]
    sources = sorted(path for path in (work / "remote" / key).rglob("*") if path.is_file())
    target = Path(tempfile.mkdtemp(dir=shm, prefix="child-"))

    def prewarm() -> None:
        config = HostWeightRuntimeConfig(root=target / "domain", mode=RuntimeMode.REQUIRED)
        runtime = HostWeightRuntime(config, remote_providers=[FsspecArtifactProvider(f"file://{work / 'remote'}")])
        result = diffusion.prewarm_component(
            _REPO_ID, subfolder="transformer", revision=_REVISION, cache_dir=work / "hub", runtime=runtime
        )
        assert result.identity_key == key, result
        assert result.resolution.outcome.value == "remote_import", result.resolution

    def copy() -> None:
        folder = target / "copy"
        folder.mkdir()
        for source in sources:
            shutil.copyfile(source, folder / "-".join(source.relative_to(work / "remote").parts))

    run = prewarm if action == "prewarm" else copy
    gc.collect()
    profiler = None
    if profile:
        import pyinstrument

        profiler = pyinstrument.Profiler(interval=0.0005)
        profiler.start()
    cpu, started = _cpu_s(), time.perf_counter()
    run()
    wall, cpu = time.perf_counter() - started, _cpu_s() - cpu
    if profiler is not None:
        profiler.stop()
        print(profiler.output_text(unicode=False, color=False, show_all=False), file=sys.stderr)
    shutil.rmtree(target, ignore_errors=True)
    return {"wall": wall, "cpu": cpu}


def _run_child(tree: str, work: Path, shm: Path, action: str, profile: bool = False) -> dict[str, float]:
    command = [sys.executable, "-m", "hwr_tools.studies.nodeb_prewarm", "--child", str(work), str(shm), action]
    if profile:
        command.append("profile")
    env = {**os.environ, "PYTHONPATH": pythonpath_with_tools(tree)}
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if done.returncode:
        raise SystemExit(f"{tree}: {action} child failed\n{done.stderr[-4000:]}")
    if profile:
        print(done.stderr)
    got: dict[str, float] = json.loads(done.stdout.split("RESULT", 1)[1])
    return got


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--src", action="append", default=[], help="a tree's src folder (repeat)")
    parser.add_argument("--gib", type=float, default=0.6, help="FP32 checkpoint size (the BF16 artifact is half)")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--disk", type=Path, default=Path("/var/tmp"))
    parser.add_argument("--shm", type=Path, default=Path("/dev/shm"))
    parser.add_argument("--keep-setup", type=Path, default=None, help="reuse (or make and keep) the setup here")
    parser.add_argument("--profile", default=None, help="profile one prewarm child of this tree's src")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        work, shm, action = Path(args.child[0]), Path(args.child[1]), args.child[2]
        print("RESULT" + json.dumps(_child(work, shm, action, profile=args.child[3:] == ["profile"])))
        return
    trees = [str(Path(tree).resolve()) for tree in args.src or ([args.profile] if args.profile else [])]
    if not trees:
        parser.error("name at least one tree with --src")
    work = args.keep_setup or Path(tempfile.mkdtemp(dir=args.disk, prefix="hwr-nodeb-"))
    shm = Path(tempfile.mkdtemp(dir=args.shm, prefix="hwr-nodeb-"))
    try:
        if not (work / "setup.json").exists():
            work.mkdir(parents=True, exist_ok=True)
            code = (
                f"import sys; sys.argv[0] = 'setup'; from hwr_tools.studies.nodeb_prewarm import _setup; "
                f"from pathlib import Path; _setup(Path({str(work)!r}), Path({str(shm)!r}), {args.gib!r})"
            )
            env = {**os.environ, "PYTHONPATH": pythonpath_with_tools(trees[0])}
            subprocess.run([sys.executable, "-c", code], check=True, env=env)
        setup = json.loads((work / "setup.json").read_text())
        print(f"artifact {setup['key'][:16]}: {setup['bytes'] / 2**20:.0f} MiB", flush=True)
        if args.profile:
            _run_child(str(Path(args.profile).resolve()), work, shm, "prewarm", profile=True)
            return
        got: dict[str, dict[str, list[float]]] = {
            tree: {"prewarm": [], "copy": [], "prewarm_cpu": [], "copy_cpu": []} for tree in trees
        }
        for round_ in range(args.rounds):
            for tree in trees if round_ % 2 == 0 else trees[::-1]:
                actions = ["prewarm", "copy"] if (round_ // 2) % 2 == 0 else ["copy", "prewarm"]
                for action in actions:
                    measured = _run_child(tree, work, shm, action)
                    got[tree][action].append(measured["wall"])
                    got[tree][f"{action}_cpu"].append(measured["cpu"])
        # The copy runs the same code in every tree: its median over all of them is the steadier reference.
        pooled = median(value for rows in got.values() for value in rows["copy"]) * 1e3
        pooled_cpu = median(value for rows in got.values() for value in rows["copy_cpu"]) * 1e3
        for tree, rows in got.items():
            m = {name: median(values) * 1e3 for name, values in rows.items()}
            print(
                f"{tree}: prewarm {m['prewarm']:.0f} ms (CPU {m['prewarm_cpu']:.0f}), copy {m['copy']:.0f} ms "
                f"(CPU {m['copy_cpu']:.0f}); prewarm/copy wall {m['prewarm'] / m['copy']:.2f}, CPU "
                f"{m['prewarm_cpu'] / m['copy_cpu']:.2f}; against the copy of all trees ({pooled:.0f} ms, CPU "
                f"{pooled_cpu:.0f}) wall {m['prewarm'] / pooled:.2f}, CPU {m['prewarm_cpu'] / pooled_cpu:.2f}; "
                f"n={len(rows['copy'])}",
                flush=True,
            )
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        if args.keep_setup is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

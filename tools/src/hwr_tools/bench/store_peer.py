"""The vLLM-Omni reference as a peer row: the same seeded BF16 tensors published and leased by its own store.

Side by side, in fresh processes and alternating rounds, on the same node-local folder (/dev/shm when
there is one): cold publish (get_or_build into an empty domain), warm hit (lookup plus a read of every
page) and N concurrent workers' PSS of the mapped weights. Both rows run the very same worker code: for
this runtime through its own public API (its `FilesystemHostWeightStore`), for the reference through the
installed `vllm_omni.host_weight_runtime` 0.30.0 (installed with --no-deps; its package `__init__`, which
needs vLLM, is not run).
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "STORE_PEERS",
    "StorePeerOptions",
    "reference_unavailable_reason",
    "run_store_peer_bench",
    "store_peer_markdown",
]

HWR = "host-weight-runtime"
REFERENCE = "vllm-omni-0.30.0-reference"
STORE_PEERS = (HWR, REFERENCE)
_TENSORS = 200
_PAGE = 4096


@dataclass(frozen=True, slots=True)
class StorePeerOptions:
    size_mib: int = 256
    rounds: int = 3
    workers: int = 4
    seed: int = 0
    workdir: Path | None = None  # default: /dev/shm when present, else the temp folder


def reference_unavailable_reason() -> str | None:
    """None when the reference's runtime files are installed; otherwise how to install them."""
    found = importlib.machinery.PathFinder.find_spec("vllm_omni")
    if found is None or not found.submodule_search_locations:
        return "vllm-omni is not installed (pip install --no-deps vllm-omni==0.30.0)"
    return None


# ----------------------------------------------------------------------------- the worker (a fresh process)


def _reference_api() -> Any:
    """`vllm_omni.host_weight_runtime` from the installed wheel, without running `vllm_omni/__init__` (needs vLLM)."""
    found = importlib.machinery.PathFinder.find_spec("vllm_omni")
    assert found is not None and found.submodule_search_locations is not None
    spec = importlib.machinery.ModuleSpec("vllm_omni", None, is_package=True)
    spec.submodule_search_locations = list(found.submodule_search_locations)
    sys.modules["vllm_omni"] = importlib.util.module_from_spec(spec)
    return importlib.import_module("vllm_omni.host_weight_runtime")


def _own_api() -> Any:
    """This runtime's own public names, under the reference's spelling where the worker needs one."""
    from host_weight_runtime import (
        AdaptationIdentity,
        BuildRequest,
        ComponentIdentity,
        FilesystemHostWeightStore,
        ProducerIdentity,
        ProductionMetadata,
        ProductionSourceMode,
        RuntimeWeightLayout,
        TensorWriteSpec,
        ValidationLevel,
        WeightArtifactIdentity,
        WeightProductionSpec,
        WeightRepresentation,
        WeightSourceIdentity,
    )

    return types.SimpleNamespace(
        AdaptationIdentity=AdaptationIdentity,
        BuildRequest=BuildRequest,
        ComponentIdentity=ComponentIdentity,
        ProducerIdentity=ProducerIdentity,
        ProductionMetadata=ProductionMetadata,
        ProductionSourceMode=ProductionSourceMode,
        RuntimeWeightLayout=RuntimeWeightLayout,
        TensorWriteSpec=TensorWriteSpec,
        ValidationLevel=ValidationLevel,
        WeightArtifactIdentity=WeightArtifactIdentity,
        WeightProductionSpec=WeightProductionSpec,
        WeightRepresentation=WeightRepresentation,
        WeightSourceIdentity=WeightSourceIdentity,
        open_store=FilesystemHostWeightStore,  # the default storage class: whatever node-local filesystem is there
    )


def _api(store: str) -> Any:
    """The names the worker uses: the reference's own module, or this runtime's front door."""
    if store != REFERENCE:
        return _own_api()
    api = _reference_api()
    filesystem = importlib.import_module("vllm_omni.host_weight_runtime.filesystem")

    def open_store(root: Path) -> Any:
        domain = api.StorageDomainPolicy(root=root, storage_class=filesystem.detect_storage_class(root.parent))
        return filesystem.FilesystemHostWeightStore(domain, api.CapacityPolicy(), api.IntegrityPolicy())

    return types.SimpleNamespace(**{name: getattr(api, name) for name in api.__all__}, open_store=open_store)


def _tensors(size_mib: int, seed: int) -> dict[str, Any]:
    """`_TENSORS` seeded BF16 matrices of size_mib MiB in all, identical in every process."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    cols = 1024
    rows = max(1, size_mib * 2**20 // (_TENSORS * cols * 2))
    return {
        f"layers.{index:03d}.weight": torch.randn(rows, cols, generator=generator).to(torch.bfloat16)
        for index in range(_TENSORS)
    }


def _identity(api: Any, size_mib: int, seed: int) -> Any:
    return api.WeightArtifactIdentity(
        schema_version=1,
        source=api.WeightSourceIdentity("bench/seeded", f"seed-{seed}", f"{size_mib}-mib"),
        component=api.ComponentIdentity("transformer", "diffusion.dit"),
        representation=api.WeightRepresentation("runtime-bf16", "torch.bfloat16"),
        layout=api.RuntimeWeightLayout("final-module-layout"),
        adaptation=api.AdaptationIdentity(),
        producer=api.ProducerIdentity("bench.seeded", "1", "bench-abi-1", "bench-producer-v1", "bench-restorer-v1"),
    )


class _Producer:
    def __init__(self, api: Any, identity: Any, tensors: dict[str, Any]) -> None:
        self._api, self._tensors = api, tensors
        self.spec = api.WeightProductionSpec(
            producer_id="bench.seeded", outputs=(identity,), source_mode=api.ProductionSourceMode.FINALIZED_MODEL
        )

    def produce(self, writer: Any) -> Any:
        specs = tuple(self._api.TensorWriteSpec(n, tuple(t.shape), t.dtype) for n, t in self._tensors.items())
        with writer.open_tensor_file("weights.safetensors", specs, ordered=True) as output:
            for name, tensor in self._tensors.items():
                output.write_tensor(name, tensor)
        return self._api.ProductionMetadata("bench-producer-v1", "bench-restorer-v1")


def _touch(lease: Any) -> int:
    """Read one byte of every page of every tensor: what a forward pass would fault in."""
    import torch

    total = 0
    for tensor in lease.tensors.values():
        flat = tensor.reshape(-1).view(torch.uint8)
        total += int(flat[::_PAGE].sum())
    return total


def _weights_pss_kib(root: Path) -> int:
    """PSS of this process's mappings of files under `root` (the weights), from /proc/self/smaps."""
    pss, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if fields and "-" in fields[0] and len(fields) >= 5:
            inside = len(fields) >= 6 and fields[5].startswith(str(root))
        elif inside and fields and fields[0] == "Pss:":
            pss += int(fields[1])
    return pss


def worker(argv: list[str]) -> dict[str, Any]:
    """One measurement in this process: `publish`, `lease` or `hold` (lease, touch, report PSS on request)."""
    import torch  # noqa: F401  (imported before any timer, as a serving process has it already)

    action, store_name, root_text, size_text, seed_text = argv
    root, size_mib, seed = Path(root_text), int(size_text), int(seed_text)
    api = _api(store_name)
    identity = _identity(api, size_mib, seed)
    validation = api.ValidationLevel.MANIFEST_AND_METADATA
    if action == "publish":
        producer = _Producer(api, identity, _tensors(size_mib, seed))
        started = time.perf_counter()
        store = api.open_store(root)
        result = store.get_or_build(
            api.BuildRequest(identity), producer, validation=validation, deadline=time.monotonic() + 600
        )
        elapsed = time.perf_counter() - started
        assert result.lease is not None, result
        result.lease.close()
        return {"status": result.status.value, "seconds": elapsed}
    started = time.perf_counter()
    store = api.open_store(root)
    result = store.lookup(identity, validation=validation, deadline=time.monotonic() + 600)
    assert result.lease is not None, result
    _touch(result.lease)
    elapsed = time.perf_counter() - started
    if action == "hold":
        print(json.dumps({"ready": True}), flush=True)
        sys.stdin.readline()  # every worker holds its lease now
        pss = _weights_pss_kib(root)
        print(json.dumps({"pss_kib": pss}), flush=True)
        sys.stdin.readline()
    result.lease.close()
    return {"status": result.status.value, "seconds": elapsed}


# ----------------------------------------------------------------------------- the parent


def _command(*argv: str) -> list[str]:
    return [sys.executable, "-m", __name__, *argv]


def _run_one(*argv: str) -> dict[str, Any]:
    done = subprocess.run(_command(*argv), check=True, capture_output=True, text=True, timeout=900)
    answer: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return answer


def _group_pss(store: str, root: Path, options: StorePeerOptions) -> float:
    """Sum of the weights' PSS over `workers` concurrent holders, in units of one copy of the weights."""
    argv = ("hold", store, str(root), str(options.size_mib), str(options.seed))
    workers = [
        subprocess.Popen(_command(*argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        for _ in range(options.workers)
    ]
    try:
        for process in workers:
            assert process.stdout is not None and json.loads(process.stdout.readline())["ready"]
        total_kib = 0
        for process in workers:
            assert process.stdin is not None and process.stdout is not None
            process.stdin.write("go\n")
            process.stdin.flush()
            total_kib += json.loads(process.stdout.readline())["pss_kib"]
    finally:
        for process in workers:
            if process.stdin is not None and not process.stdin.closed:
                process.stdin.close()
        for process in workers:
            if process.stdout is not None:  # read the worker's last line, so it never writes into a closed pipe
                process.stdout.read()
                process.stdout.close()
            process.wait(timeout=600)
    return total_kib * 1024 / (options.size_mib * 2**20)


def run_store_peer_bench(options: StorePeerOptions) -> dict[str, Any]:
    """Alternating rounds of cold publish, warm hit and group PSS for this runtime and the reference."""
    reason = reference_unavailable_reason()
    if reason is not None:
        raise RuntimeError(reason)
    base = options.workdir or (Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir()))
    samples: dict[str, dict[str, list[float]]] = {
        name: {"publish_s": [], "warm_s": [], "pss_copies": []} for name in STORE_PEERS
    }
    for _round in range(options.rounds):
        for store in STORE_PEERS:
            folder = Path(tempfile.mkdtemp(prefix="hwr-store-peer-", dir=base))
            try:
                root = folder / "domain"
                argv = (str(root), str(options.size_mib), str(options.seed))
                samples[store]["publish_s"].append(_run_one("publish", store, *argv)["seconds"])
                samples[store]["warm_s"].append(_run_one("lease", store, *argv)["seconds"])
                samples[store]["pss_copies"].append(_group_pss(store, root, options))
            finally:
                _remove(folder)
    return {
        "options": {
            "size_mib": options.size_mib,
            "rounds": options.rounds,
            "workers": options.workers,
            "dir": str(base),
        },
        "rows": {name: {key: _summary(values) for key, values in figures.items()} for name, figures in samples.items()},
    }


def _remove(folder: Path) -> None:
    for path in folder.rglob("*"):  # published artifacts are read-only (0555 folders): open them up first
        if path.is_dir() and not path.is_symlink():
            os.chmod(path, 0o700)
    shutil.rmtree(folder, ignore_errors=True)


def _summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def store_peer_markdown(data: dict[str, Any]) -> str:
    options = data["options"]
    lines = [
        f"## This runtime and the vLLM-Omni reference store ({options['size_mib']} MiB BF16, "
        f"{options['rounds']} alternating rounds, {options['dir']})",
        "",
        f"| store | cold publish (ms) | warm hit + touch (ms) | {options['workers']} workers' weights PSS (copies) |",
        "|---|---|---|---|",
    ]
    for name, row in data["rows"].items():
        publish, warm, pss = row["publish_s"], row["warm_s"], row["pss_copies"]
        lines.append(
            f"| {name} | {publish['median'] * 1e3:.0f} ({publish['min'] * 1e3:.0f}-{publish['max'] * 1e3:.0f}) "
            f"| {warm['median'] * 1e3:.0f} ({warm['min'] * 1e3:.0f}-{warm['max'] * 1e3:.0f}) | {pss['median']:.2f} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(json.dumps(worker(sys.argv[1:])), flush=True)

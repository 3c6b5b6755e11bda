"""4 TP ranks x 2 replicas on one node: the replicas of rank r share rank r's artifact pages (PSS).

One TP=4 bundle is built; then 8 spawned processes each lease one rank's artifact (two per
rank) and read every page of it. The kernel splits a shared page's PSS between the processes
mapping it, so the two replicas of a rank together account for one copy, not two.
"""

from __future__ import annotations

import multiprocessing
import time
from multiprocessing.connection import Connection
from pathlib import Path

import pytest
import torch

from host_weight_runtime.filesystem.store import FilesystemHostWeightStore
from host_weight_runtime.identity import WeightArtifactIdentity
from host_weight_runtime.protocols import BuildRequest
from host_weight_runtime.tensors import ValidationLevel

from ._diffusion import Folder, save_folder
from ._tp_children import rank_contexts

WORLD = 4
REPLICAS = 2
DEADLINE_S = 120.0
PAGE = 4096
FLUX_TP4 = {"num_attention_heads": 4, "attention_head_dim": 8, "axes_dims_rope": (2, 2, 4)}


def replica(domain: str, identity: WeightArtifactIdentity, conn: Connection) -> None:
    """Lease one rank's artifact, read every page, report the artifact dir, then hold it until told to go."""
    store = FilesystemHostWeightStore(Path(domain))
    found = store.lookup(identity, validation=ValidationLevel.MANIFEST_AND_METADATA)
    assert found.lease is not None
    with found.lease as lease:
        for tensor in lease.tensors.values():
            flat = tensor.reshape(-1).view(torch.uint8)
            if flat.numel():
                int(flat[::PAGE].sum(dtype=torch.int64)) + int(flat[-1])
        conn.send(lease.provenance.artifact_dir)
        conn.recv()  # hold the mapping while the parent reads /proc/<pid>/smaps


def mapped(pid: int, directory: str) -> tuple[int, int]:
    """(Rss, Pss) in bytes of this process's mappings of files under `directory`."""
    rss = pss = 0
    inside = False
    with open(f"/proc/{pid}/smaps") as smaps:
        for line in smaps:
            head = line.split(None, 1)[0]
            if not head.endswith(":") or "-" in head:  # a mapping header line: "start-end perms offset dev inode path"
                fields = line.split()
                inside = len(fields) >= 6 and fields[5].startswith(directory)
            elif inside and head == "Rss:":
                rss += int(line.split()[1]) * 1024
            elif inside and head == "Pss:":
                pss += int(line.split()[1]) * 1024
    return rss, pss


@pytest.fixture(scope="module")
def flux(tmp_path_factory: pytest.TempPathFactory) -> Folder:
    return save_folder(tmp_path_factory.mktemp("pss-flux"), "flux", seed=11, config_overrides=FLUX_TP4)


def test_two_replicas_of_each_rank_share_its_pages(tmp_path: Path, flux: Folder) -> None:
    """D13/M01: for every rank of a TP=4 bundle, two replica processes each have the whole artifact resident
    (Rss ~ its payload bytes) while their summed PSS of it is about one copy (<= 1.25x), not two; neither maps
    another rank's artifact."""
    domain = tmp_path / "hwr"
    _, contexts = rank_contexts(flux, WORLD)
    from host_weight_runtime.diffusion.parallel.bundle import FinalLayoutBF16BundleProducer

    store = FilesystemHostWeightStore(domain)
    built = store.get_or_build(
        BuildRequest(contexts[0].identity),
        FinalLayoutBF16BundleProducer(contexts),
        validation=ValidationLevel.MANIFEST_AND_METADATA,
        deadline=time.monotonic() + DEADLINE_S,
    )
    assert built.lease is not None
    built.lease.close()

    spawn = multiprocessing.get_context("spawn")
    children: list[tuple[int, multiprocessing.process.BaseProcess, Connection]] = []
    try:
        for rank, context in enumerate(contexts):
            for _ in range(REPLICAS):
                parent, child = spawn.Pipe()
                process = spawn.Process(target=replica, args=(str(domain), context.identity, child), daemon=True)
                process.start()
                child.close()
                children.append((rank, process, parent))
        directories: dict[int, str] = {}
        for rank, _process, conn in children:
            assert conn.poll(DEADLINE_S), "a replica never reported"
            directory = conn.recv()
            assert directories.setdefault(rank, directory) == directory
        assert len(set(directories.values())) == WORLD
        for rank, directory in directories.items():
            payload = sum(path.stat().st_size for path in Path(directory).rglob("*.safetensors"))
            tensor_bytes = contexts[rank].total_bytes
            assert payload >= tensor_bytes > 0
            replicas = [process for r, process, _conn in children if r == rank]
            measured = [mapped(process.pid or 0, directory) for process in replicas]
            for rss, _pss in measured:
                assert rss >= tensor_bytes, (rank, rss, tensor_bytes)  # every replica has all of it resident
            summed_pss = sum(pss for _rss, pss in measured)
            assert summed_pss <= 1.25 * payload, (rank, summed_pss, payload)
            for other, other_directory in directories.items():
                if other != rank:
                    assert all(mapped(process.pid or 0, other_directory) == (0, 0) for process in replicas)
        for _rank, _process, conn in children:
            conn.send("go")
    finally:
        for _rank, started, conn in children:
            started.join(DEADLINE_S)
            if started.is_alive():
                started.kill()
                started.join(DEADLINE_S)
            conn.close()
    assert [process.exitcode for _rank, process, _conn in children] == [0] * (WORLD * REPLICAS)

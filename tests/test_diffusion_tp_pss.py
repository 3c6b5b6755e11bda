"""4 TP ranks x 2 replicas on one node: one copy of the replicated part for all, one copy of each shard (PSS).

One TP=4 bundle is built; then 8 spawned processes each lease one rank's two parts (two
processes per rank) and read every page. The kernel splits a shared page's PSS between the
processes mapping it, so the 8 processes together account for one copy of the replicated
part, and the two replicas of a rank for one copy of its shard.
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
from hwr_tools.preimported import preimported_context

from ._diffusion import Folder, save_folder
from ._tp_children import rank_contexts

WORLD = 4
REPLICAS = 2
DEADLINE_S = 300.0
PAGE = 4096
FLUX_TP4 = {"num_attention_heads": 4, "attention_head_dim": 8, "axes_dims_rope": (2, 2, 4)}


def replica(domain: str, identities: list[WeightArtifactIdentity], conn: Connection) -> None:
    """Lease a rank's parts, read every page, report each part's artifact dir, then hold them until told to go."""
    store = FilesystemHostWeightStore(Path(domain))
    leases = []
    for identity in identities:
        found = store.lookup(identity, validation=ValidationLevel.MANIFEST_AND_METADATA)
        assert found.lease is not None
        leases.append(found.lease)
    for lease in leases:
        for tensor in lease.tensors.values():
            flat = tensor.reshape(-1).view(torch.uint8)
            if flat.numel():
                int(flat[::PAGE].sum(dtype=torch.int64)) + int(flat[-1])
    conn.send([lease.provenance.artifact_dir for lease in leases])
    conn.recv()  # hold the mappings while the parent reads /proc/<pid>/smaps
    for lease in leases:
        lease.close()


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


def _payload(directory: str) -> int:
    return sum(path.stat().st_size for path in Path(directory).rglob("*.safetensors"))


def test_every_rank_and_replica_shares_one_copy_of_each_part(tmp_path: Path, flux: Folder) -> None:
    """D13/M01/T01: for a TP=4 bundle, 8 processes (2 replicas x 4 ranks) each have their rank's two parts wholly
    resident (Rss ~ payload) while their summed PSS of the replicated part is about one copy (<= 1.25x), not
    eight, and each rank's two replicas account for about one copy of its shard; no process maps another
    rank's shard."""
    domain = tmp_path / "hwr"
    _, contexts = rank_contexts(flux, WORLD)
    from host_weight_runtime.diffusion.parallel.bundle import FinalLayoutBF16BundleProducer

    bundle = FinalLayoutBF16BundleProducer(contexts)
    store = FilesystemHostWeightStore(domain)
    built = store.get_or_build(
        BuildRequest(bundle.parts[0].shard.identity),
        bundle,
        validation=ValidationLevel.MANIFEST_AND_METADATA,
        deadline=time.monotonic() + DEADLINE_S,
    )
    assert built.lease is not None
    built.lease.close()

    spawn = preimported_context()
    children: list[tuple[int, multiprocessing.process.BaseProcess, Connection]] = []
    try:
        for rank, parts in enumerate(bundle.parts):
            for _ in range(REPLICAS):
                parent, child = spawn.Pipe()
                identities = [parts.replicated.identity, parts.shard.identity]
                process = spawn.Process(target=replica, args=(str(domain), identities, child), daemon=True)
                process.start()
                child.close()
                children.append((rank, process, parent))
        shards: dict[int, str] = {}
        replicated_dirs: set[str] = set()
        for rank, _process, conn in children:
            assert conn.poll(DEADLINE_S), "a replica never reported"
            replicated_dir, shard_dir = conn.recv()
            replicated_dirs.add(replicated_dir)
            assert shards.setdefault(rank, shard_dir) == shard_dir
        assert len(replicated_dirs) == 1 and len(set(shards.values())) == WORLD
        (replicated_dir,) = replicated_dirs
        everyone = [mapped(process.pid or 0, replicated_dir) for _rank, process, _conn in children]
        replicated_bytes = bundle.parts[0].replicated.total_bytes
        assert all(rss >= replicated_bytes for rss, _pss in everyone)
        assert sum(pss for _rss, pss in everyone) <= 1.25 * _payload(replicated_dir)
        for rank, directory in shards.items():
            payload = _payload(directory)
            tensor_bytes = bundle.parts[rank].shard.total_bytes
            assert payload >= tensor_bytes > 0
            replicas = [process for r, process, _conn in children if r == rank]
            measured = [mapped(process.pid or 0, directory) for process in replicas]
            for rss, _pss in measured:
                assert rss >= tensor_bytes, (rank, rss, tensor_bytes)  # every replica has all of it resident
            summed_pss = sum(pss for _rss, pss in measured)
            assert summed_pss <= 1.25 * payload, (rank, summed_pss, payload)
            for other, other_directory in shards.items():
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

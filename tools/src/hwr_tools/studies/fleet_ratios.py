"""The fleet figures of `hwr bench` on a synthetic artifact, in a few minutes instead of a full bench run.

    PYTHONPATH=src .venv/bin/python -m hwr_tools.studies.fleet_ratios --size-mib 512 --runs 3 [--disk /var/tmp] [--shm /dev/shm]
        [--only push]

Publishes one BF16 artifact (`blake3-tree-v1`, as diffusion artifacts are) on /dev/shm, pushes it
to a file:// remote on disk and to moto's S3 server on loopback, then measures side by side,
alternating which goes first (tools/bench/remote.py and tools/bench/fleet.py, the code `hwr
bench` runs): import vs a plain fsspec copy, `hwr push` vs a plain fsspec upload, node B's time
to ready vs the plain copy. Prints each pair's medians and the goals. `--only push` measures
only the push pairs (the setup's push, which hashes the fresh build in full, still runs first).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from host_weight_runtime import BuildRequest, DigestAlgorithm, FilesystemHostWeightStore, ValidationLevel
from hwr_tools.bench.fleet import measure_push
from hwr_tools.bench.remote import measure_remote_throughput, remote_targets
from hwr_tools.bench.throughput import _identity, _Producer, _tensors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mib", type=int, default=512)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--disk", type=Path, default=Path("/var/tmp"))
    parser.add_argument("--shm", type=Path, default=Path("/dev/shm"))
    parser.add_argument("--only", choices=["push"], default=None, help="measure only these pairs")
    args = parser.parse_args()
    algorithm = DigestAlgorithm.BLAKE3_TREE_V1
    with (
        tempfile.TemporaryDirectory(dir=args.shm, prefix="hwr-fleet-") as shm,
        tempfile.TemporaryDirectory(dir=args.disk, prefix="hwr-fleet-") as disk,
    ):
        tensors = _tensors(args.size_mib << 20)
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        identity = _identity(total, 0, algorithm)
        store = FilesystemHostWeightStore(Path(shm) / "node-a")
        built = store.get_or_build(
            BuildRequest(identity),
            _Producer(identity, tensors, algorithm),
            validation=ValidationLevel.MANIFEST_AND_METADATA,
            deadline=time.monotonic() + 600,
        )
        assert built.lease is not None, built.failure
        built.lease.close()
        del tensors
        with remote_targets(store, identity.key, Path(disk), lambda text: print(text, flush=True)) as setup:
            if args.only == "push":
                pushed = {
                    t.row: measure_push(store, identity.key, t.url, t.storage_options, runs=args.runs)
                    for t in setup.targets
                }
            else:
                measured = measure_remote_throughput(setup, identity, Path(shm), args.runs)
    if args.only == "push":
        print(json.dumps(pushed, indent=2))
        for row, pair in pushed.items():
            print(f"{row}: {total / 2**20:.0f} MiB; push/plain upload {pair['push_vs_plain_upload']:.2f} (goal >= 0.8)")
        return
    print(json.dumps(measured, indent=2))
    for row, entry in measured.items():
        assert isinstance(entry, dict)
        fleet = entry["fleet"]
        assert isinstance(fleet, dict)
        print(
            f"{row}: {total / 2**20:.0f} MiB; import/plain copy {entry['import_vs_plain_copy']:.2f} (goal >= 0.8); "
            f"push/plain upload {fleet['push_vs_plain_upload']:.2f} (goal >= 0.8); node B ready/plain copy "
            f"{fleet['node_b_vs_plain_copy']:.2f} (goal <= 1.3)"
        )


if __name__ == "__main__":
    main()

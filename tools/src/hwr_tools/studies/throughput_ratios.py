"""Publication and FULL_CHECKSUM ratios for both payload digest formats, side by side in one process.

    PYTHONPATH=src .venv/bin/python -m hwr_tools.studies.throughput_ratios --size-mib 1024 --runs 5 [--root /dev/shm]

The same measurement `hwr bench` reports under "Throughput" (tools/bench/throughput.py),
run for `sha256-tree-v1` and `blake3-tree-v1` alternately, so a shared machine's noise
hits both formats alike. Prints the medians and the two goal ratios (publication against the raw
write bound, the faster of a preallocated and an `ftruncate`-sized `pwrite` + `fsync`; FULL_CHECKSUM
against single-thread SHA-256), and each raw write's median.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from host_weight_runtime import DigestAlgorithm
from hwr_tools.bench.throughput import measure_throughput


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=1, help="alternate the two formats this many times")
    parser.add_argument("--root", type=Path, default=Path("/dev/shm"))
    args = parser.parse_args()
    results: dict[DigestAlgorithm, list[tuple[float, float, float, float]]] = {a: [] for a in DigestAlgorithm}
    for _ in range(args.rounds):
        for algorithm in DigestAlgorithm:
            with tempfile.TemporaryDirectory(dir=args.root, prefix="hwr-throughput-") as workdir:
                samples = measure_throughput(Path(workdir), args.size_mib << 20, args.runs, algorithm)
            gib = samples.payload_bytes / 2**30
            results[algorithm].append(
                (
                    statistics.median(samples.raw_write_fsync_s),
                    statistics.median(samples.publish_s),
                    statistics.median(samples.single_thread_sha256_s),
                    statistics.median(samples.full_checksum_s),
                )
            )
            raw, publish, sha, full = results[algorithm][-1]
            preallocated, sized = (statistics.median(s) for s in (samples.raw_preallocated_s, samples.raw_sized_s))
            print(
                f"{algorithm.value:15s} {gib:.2f} GiB: raw write+fsync {raw * 1e3:.0f} ms (preallocated "
                f"{preallocated * 1e3:.0f} ms, sized {sized * 1e3:.0f} ms), publication "
                f"{publish * 1e3:.0f} ms (ratio {raw / publish:.2f}, goal 0.8); single-thread SHA-256 "
                f"{sha * 1e3:.0f} ms, FULL_CHECKSUM {full * 1e3:.0f} ms (ratio {sha / full:.2f}, goal 2.0)",
                flush=True,
            )


if __name__ == "__main__":
    main()

"""The bounds the cold paths are judged against, each measured in the benchmark's own run.

- *Write bound*: canonical from the hub cache plus a raw `pwrite` + `fsync` of the artifact's
  bytes, the faster of a file preallocated with `posix_fallocate` and one only sized with
  `ftruncate` (the throughput figure, scaled to the artifact's size): what a publication after a
  canonical load cannot beat, whichever way the store sizes its payload files.
- *Source-hash bound*: single-thread SHA-256 of the checkpoint files (page cache hot), divided by
  the cores this process may run on: what the content key of a folder seen for the first time
  costs at best, the files being SHA-256'd whole (their digests are the key's content ids).
"""

from __future__ import annotations

import hashlib
import mmap
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..common import JsonValue
from .row_names import CANONICAL_HUB, COLD_BACKGROUND_HUB, COLD_PUBLISH, COLD_PUBLISH_HUB, COLD_STREAM, COLD_STREAM_HUB
from .stats import Stats

__all__ = ["cold_bounds", "cores_available", "measure_source_sha256"]


def cores_available() -> int:
    """The CPUs this process may run on (its affinity), the divisor of the source-hash bound."""
    return len(os.sched_getaffinity(0)) or 1


def measure_source_sha256(files: Sequence[Path], runs: int) -> dict[str, JsonValue]:
    """Single-thread SHA-256 of every checkpoint file, one after another, `runs` times (a run to warm first)."""

    def hash_all() -> float:
        started = time.perf_counter()
        for path in files:
            with path.open("rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
                hashlib.sha256(mapped).digest()
        return time.perf_counter() - started

    hash_all()  # the page cache holds the checkpoint (the rows read it hot); this makes sure
    samples = tuple(hash_all() for _ in range(max(1, runs)))
    return {
        "source_bytes": sum(path.stat().st_size for path in files),
        "single_thread_sha256_s": Stats.of(samples).to_dict(),
        "cores": cores_available(),
    }


def _ready_ms(rows: dict[str, Any], name: str, key: str = "time_to_ready_ms") -> float | None:
    measured = rows.get(name, {}).get("hot")
    value = measured.get(key) if isinstance(measured, dict) else None
    return float(value["median"]) if isinstance(value, dict) else None


def _over(numerator: float | None, denominator: float | None) -> float | None:
    return None if numerator is None or denominator is None or denominator <= 0 else numerator / denominator


def cold_bounds(data: dict[str, Any]) -> dict[str, JsonValue]:
    """Each bound in ms and each cold row's ratio to its bound (None where a figure was not measured)."""
    rows = data["rows"]
    throughput = data["throughput"]
    artifact_bytes = data["model"]["artifact_bytes"]
    raw_ms = throughput["raw_write_fsync_s"]["median"] * 1000.0 * artifact_bytes / throughput["payload_bytes"]
    canonical_hub = _ready_ms(rows, CANONICAL_HUB)
    write_bound = None if canonical_hub is None else canonical_hub + raw_ms
    source = data.get("source_hashing")
    hash_bound = None
    if isinstance(source, dict):
        hash_bound = source["single_thread_sha256_s"]["median"] * 1000.0 / source["cores"]
    publish_hub = _ready_ms(rows, COLD_PUBLISH_HUB)
    publish_extra = _minus(_ready_ms(rows, COLD_PUBLISH), publish_hub)
    stream_extra = _minus(_ready_ms(rows, COLD_STREAM), _ready_ms(rows, COLD_STREAM_HUB))
    return {
        "raw_write_fsync_artifact_ms": raw_ms,
        "write_bound_ms": write_bound,
        "source_hash_bound_ms": hash_bound,
        "stream_hub_vs_canonical_hub": _over(_ready_ms(rows, COLD_STREAM_HUB), canonical_hub),
        "publish_hub_vs_write_bound": _over(publish_hub, write_bound),
        "background_published_hub_vs_write_bound": _over(
            _ready_ms(rows, COLD_BACKGROUND_HUB, "published_ms"), write_bound
        ),
        "folder_publish_extra_ms": publish_extra,
        "folder_publish_extra_vs_source_hash_bound": _over(publish_extra, hash_bound),
        "folder_stream_extra_ms": stream_extra,
        "folder_stream_extra_vs_source_hash_bound": _over(stream_extra, hash_bound),
    }


def _minus(value: float | None, baseline: float | None) -> float | None:
    return None if value is None or baseline is None else value - baseline


def bounds_line(bounds: dict[str, Any], source: dict[str, Any] | None) -> str:
    """The bounds and ratios as one markdown paragraph."""

    def ms(value: float | None) -> str:
        return "n/a" if value is None else f"{value:.0f} ms"

    def times(value: float | None) -> str:
        return "n/a" if value is None else f"{value:.2f}x"

    hashing = ""
    if source is not None:
        sha = source["single_thread_sha256_s"]["median"] * 1000.0
        hashing = (
            f"single-thread SHA-256 of the {source['source_bytes'] / (1 << 30):.2f} GiB checkpoint {sha:.0f} ms / "
            f"{source['cores']} cores = {ms(bounds['source_hash_bound_ms'])}; "
        )
    return (
        f"**Cold-path bounds** (measured in this run): raw write+fsync of the artifact's bytes "
        f"{ms(bounds['raw_write_fsync_artifact_ms'])}, canonical (hub cache) + that = {ms(bounds['write_bound_ms'])}; "
        f"{hashing}streaming producer (hub cache) {times(bounds['stream_hub_vs_canonical_hub'])} canonical "
        "(hub cache); "
        f"canonical + publish (hub cache) {times(bounds['publish_hub_vs_write_bound'])} the write bound, background "
        f"published at {times(bounds['background_published_hub_vs_write_bound'])}; a local folder's extra over the hub "
        f"cache: canonical + publish {ms(bounds['folder_publish_extra_ms'])} "
        f"({times(bounds['folder_publish_extra_vs_source_hash_bound'])} the source-hash bound), streaming "
        f"{ms(bounds['folder_stream_extra_ms'])} ({times(bounds['folder_stream_extra_vs_source_hash_bound'])})."
    )

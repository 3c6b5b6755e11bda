"""The benchmark issue's goals, each with the measured ratio and whether it was met (reported, never asserted)."""

from __future__ import annotations

from collections.abc import Callable

from ..common import JsonValue
from .names import (
    CANONICAL,
    CANONICAL_HUB,
    COLD_BACKGROUND,
    COLD_BACKGROUND_HUB,
    COLD_PUBLISH,
    COLD_PUBLISH_HUB,
    COLD_STREAM,
    COLD_STREAM_HUB,
    HOT,
    REMOTE_FILE,
    REMOTE_S3,
    VIEWS_HUGE,
    VIEWS_SHM,
    WARM_HUGE,
    WARM_SHM,
)

__all__ = [
    "BACKGROUND_TARGET",
    "SOURCE_HASH_BOUND",
    "SOURCE_HASH_TARGET",
    "STARTUP_TARGET_S",
    "STREAM_TARGET",
    "WRITE_BOUND",
    "WRITE_BOUND_TARGET",
    "goals",
    "ratio",
]

STARTUP_TARGET_S = 1.0  # "well under a second" for the read-only commands
STREAM_TARGET = 1.5  # the streaming producer (hub cache) / canonical (hub cache)
WRITE_BOUND_TARGET = 1.25  # canonical + publish (hub cache), or its background publication, / the write bound
SOURCE_HASH_TARGET = 1.1  # a local folder's extra time over the hub cache / the source-hash bound
BACKGROUND_TARGET = 1.05  # canonical + background publication's time to ready / canonical
# Each checkpoint source's canonical load and its cold rows: a local folder (its files are hashed for the
# content key) and the same files as a Hugging Face cache snapshot (the blob names are the content ids).
_COLD_SOURCES = (
    ("local folder", CANONICAL, COLD_PUBLISH, COLD_BACKGROUND, COLD_STREAM),
    ("hub cache", CANONICAL_HUB, COLD_PUBLISH_HUB, COLD_BACKGROUND_HUB, COLD_STREAM_HUB),
)


def ratio(numerator: float, denominator: float) -> float | None:
    return None if denominator <= 0 else numerator / denominator


def _median(section: JsonValue, key: str) -> float:
    assert isinstance(section, dict)
    value = section[key]
    assert isinstance(value, dict)
    median = value["median"]
    assert isinstance(median, float)
    return median


WRITE_BOUND = "(canonical (hub cache) + raw write+fsync of the artifact)"
SOURCE_HASH_BOUND = "(single-thread SHA-256 of the checkpoint / cores)"


def _cold_bound_goals(bounds: JsonValue, goal: Callable[[str, float | None, float, bool], None]) -> None:
    """The cold paths against the bounds measured in the same run (tools/bench/bounds.py)."""
    found = bounds if isinstance(bounds, dict) else {}

    def value(key: str) -> float | None:
        measured = found.get(key)
        return measured if isinstance(measured, float) else None

    goal(
        "cold, hub cache (streaming producer): x canonical (hub cache)",
        value("stream_hub_vs_canonical_hub"),
        STREAM_TARGET,
        False,
    )
    goal(
        f"cold, hub cache (canonical + publish): x {WRITE_BOUND}",
        value("publish_hub_vs_write_bound"),
        WRITE_BOUND_TARGET,
        False,
    )
    goal(
        f"cold, hub cache (background publish): published at x {WRITE_BOUND}",
        value("background_published_hub_vs_write_bound"),
        WRITE_BOUND_TARGET,
        False,
    )
    goal(
        f"cold, local folder (canonical + publish): extra over the hub cache x {SOURCE_HASH_BOUND}",
        value("folder_publish_extra_vs_source_hash_bound"),
        SOURCE_HASH_TARGET,
        False,
    )


def goals(data: dict[str, JsonValue]) -> list[JsonValue]:
    """Each goal of the benchmark issue with the measured ratio and whether it was met (reported, never asserted)."""
    rows = data["rows"]
    assert isinstance(rows, dict)

    def ready(name: str, cache: str = HOT, key: str = "time_to_ready_ms") -> float | None:
        entry = rows.get(name)
        measured = entry.get(cache) if isinstance(entry, dict) else None
        if not isinstance(measured, dict) or measured.get(key) is None:
            return None  # not measured (a background publication's `published_ms` is None when it has none)
        return _median(measured, key)

    def times(name: str, baseline: float | None, key: str = "time_to_ready_ms") -> float | None:
        value = ready(name, key=key)
        return None if value is None or baseline is None else ratio(value, baseline)

    goals: list[JsonValue] = []

    def goal(text: str, value: float | None, target: float, higher_is_better: bool = True) -> None:
        met = None if value is None else (value >= target if higher_is_better else value <= target)
        goals.append({"goal": text, "value": value, "target": target, "met": met})

    canonical = ready(CANONICAL)
    warm = ready(WARM_SHM)
    huge = ready(WARM_HUGE)
    if canonical is not None:
        goal("warm on /dev/shm: x faster than canonical", None if warm is None else ratio(canonical, warm), 20.0)
        goal("warm on huge-page tmpfs: x faster than canonical", None if huge is None else ratio(canonical, huge), 50.0)
    for source, baseline_row, _publish, background, _stream in _COLD_SOURCES:
        goal(
            f"cold, {source} (canonical + background publish): x canonical ({source})",
            times(background, ready(baseline_row)),
            BACKGROUND_TARGET,
            False,
        )
    _cold_bound_goals(data.get("cold_bounds"), goal)
    if warm is not None:
        for peer in ("tensorizer", "runai-model-streamer", "fastsafetensors"):
            value = ready(peer)
            goal(f"warm x faster than {peer}", None if value is None else ratio(value, warm), 5.0)
        views = ready(VIEWS_SHM)
        goal(
            "warm / bare safetensors mmap views (same tmpfs)",
            None if views is None else ratio(warm, views),
            1.25,
            False,
        )
    if huge is not None:
        views_huge = ready(VIEWS_HUGE)
        goal(
            "warm / bare safetensors mmap views (huge-page tmpfs)",
            None if views_huge is None else ratio(huge, views_huge),
            1.25,
            False,
        )
    model = data["model"]
    assert isinstance(model, dict)
    artifact = model["artifact_bytes"]
    assert isinstance(artifact, int)
    for name in (WARM_SHM, WARM_HUGE):
        entry = rows.get(name)
        if isinstance(entry, dict) and "memory_group" in entry:
            weights = _median(entry["memory_group"], "weights_pss_sum_bytes")
            goal(f"{name}: 4 workers' weight PSS / one artifact", weights / artifact, 1.2, False)
    throughput = data["throughput"]
    assert isinstance(throughput, dict)
    publication = throughput["publication_vs_raw"]
    full = throughput["full_checksum_vs_sha256"]
    goal("publication throughput / raw write+fsync", publication if isinstance(publication, float) else None, 0.8)
    goal("FULL_CHECKSUM throughput / single-thread SHA-256", full if isinstance(full, float) else None, 2.0)
    startup = data.get("cli_startup")
    inspect = _median(startup, "inspect_s") if isinstance(startup, dict) else None
    goal("`hwr inspect` start-up in a fresh process, s", inspect, STARTUP_TARGET_S, False)
    remote = data.get("remote")
    measured = remote.get("throughput") if isinstance(remote, dict) else None
    for row, label in ((REMOTE_FILE, "file://"), (REMOTE_S3, "moto S3")):
        entry = measured.get(row) if isinstance(measured, dict) else None
        ratio_value = entry.get("import_vs_plain_copy") if isinstance(entry, dict) else None
        measured_ratio = ratio_value if isinstance(ratio_value, float) else None
        goal(f"remote import throughput / plain fsspec copy ({label})", measured_ratio, 0.8)
        fleet = entry.get("fleet") if isinstance(entry, dict) else None
        push = fleet.get("push_vs_plain_upload") if isinstance(fleet, dict) else None
        goal(f"hwr push throughput / plain fsspec upload ({label})", push if isinstance(push, float) else None, 0.8)
        node_b = fleet.get("node_b_vs_plain_copy") if isinstance(fleet, dict) else None
        goal(
            f"node B time to ready / plain fsspec copy ({label})",
            node_b if isinstance(node_b, float) else None,
            1.3,
            False,
        )
    tensor_parallel = data.get("tensor_parallel")
    sizes = tensor_parallel.get("sizes") if isinstance(tensor_parallel, dict) else None
    for size, entry in sizes.items() if isinstance(sizes, dict) else ():
        assert isinstance(entry, dict)
        build = entry.get("bundle_vs_tp1")
        goal(f"TP={size} bundle build / TP=1 publication", build if isinstance(build, float) else None, 1.2, False)
        pss = entry.get("weights_pss_vs_shards")
        goal(
            f"TP={size}: 2 replicas x {size} ranks' weight PSS / sum of shard artifacts",
            pss if isinstance(pss, float) else None,
            1.05,
            False,
        )
    return goals

"""The benchmark issue's goals, each with the measured ratio and whether it was met (reported, never asserted)."""

from __future__ import annotations

from collections.abc import Callable

from ..common import JsonValue
from .row_names import (
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
    VIEWS_POPULATE_HUGE,
    VIEWS_POPULATE_SHM,
    VIEWS_SHM,
    VIEWS_THREAD_HUGE,
    VIEWS_THREAD_SHM,
    WARM_HUGE,
    WARM_SHM,
)

__all__ = [
    "BACKGROUND_TARGET",
    "SOURCE_HASH_BOUND",
    "SOURCE_HASH_TARGET",
    "STARTUP_TARGET_S",
    "STREAM_TARGET",
    "WARM_VS_VIEWS_TARGET",
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
WARM_VS_VIEWS_TARGET = 1.25  # warm time to ready / the fastest bare mmap views of the same bytes on the same tmpfs
_VIEWS_SHM_ROWS = (
    ("page by page", VIEWS_SHM),
    ("MAP_POPULATE", VIEWS_POPULATE_SHM),
    ("prefault thread", VIEWS_THREAD_SHM),
)
_VIEWS_HUGE_ROWS = (
    ("page by page", VIEWS_HUGE),
    ("MAP_POPULATE", VIEWS_POPULATE_HUGE),
    ("prefault thread", VIEWS_THREAD_HUGE),
)
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
    for warm_row, label, variants in (
        (WARM_SHM, "same tmpfs", _VIEWS_SHM_ROWS),
        (WARM_HUGE, "huge-page tmpfs", _VIEWS_HUGE_ROWS),
    ):
        warm_time = ready(warm_row)
        if warm_time is None:
            continue
        bounds = {how: value for how, row in variants if (value := ready(row)) is not None}
        # The bound is the fastest bare mapping measured: page by page, MAP_POPULATE, or a prefault thread.
        best = min(bounds.values(), default=None)
        goal(
            f"warm / bare safetensors mmap views ({label})",
            None if best is None else ratio(warm_time, best),
            WARM_VS_VIEWS_TARGET,
            False,
        )
        for how, value in bounds.items():
            ratio_to_bound = ratio(warm_time, value)  # each bound on its own, reported without a verdict
            goals.append(
                {
                    "goal": f"warm / bare views, {how} ({label})",
                    "value": ratio_to_bound,
                    "target": "reported",
                    "met": None,
                }
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
        written = entry.get("bundle_bytes_vs_tp1")
        goal(
            f"TP={size} bundle bytes written / TP=1 artifact",
            written if isinstance(written, float) else None,
            1.02,
            False,
        )
        for field, label in (
            ("one_replica_pss_vs_tp1", f"{size} ranks"),
            ("weights_pss_vs_tp1", f"2 replicas x {size} ranks"),
        ):
            pss = entry.get(field)
            goal(
                f"TP={size}: {label}' weight PSS / TP=1 artifact",
                pss if isinstance(pss, float) else None,
                1.05,
                False,
            )
    return goals

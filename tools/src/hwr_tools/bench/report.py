"""What people read from a benchmark report: one markdown document (tables, machine, goals) and the output path."""

from __future__ import annotations

import platform
import time
from pathlib import Path
from typing import Any

from .bounds import bounds_line
from .pipeline_rows import render as render_pipeline_rows
from .row_names import CANONICAL, COLD, HOT
from .runner import BenchReport

__all__ = ["markdown", "result_path"]

MIB = 1 << 20


def result_path(out_dir: Path, suffix: str) -> Path:
    """`<out_dir>/<date>-<host><suffix>`, the name the benchmark issue asks for."""
    return out_dir / f"{time.strftime('%Y-%m-%d')}-{platform.node()}{suffix}"


def _ms(stats: dict[str, Any]) -> str:
    return f"{stats['median']:.1f} [{stats['min']:.1f}, {stats['max']:.1f}]"


def _mib(stats: dict[str, Any]) -> str:
    return f"{stats['median'] / MIB:.0f}"


def _speedup(canonical_ms: float | None, row_ms: float) -> str:
    if canonical_ms is None or row_ms <= 0:
        return "n/a"
    ratio = canonical_ms / row_ms
    return f"{ratio:.1f}x faster" if ratio >= 1 else f"{1 / ratio:.2f}x slower"


def _baseline_ms(rows: dict[str, Any], entry: dict[str, Any], cache: str) -> float | None:
    """The median time to ready of the canonical load this row is compared with (its own source's)."""
    baseline = rows.get(entry.get("baseline", CANONICAL), {}).get(cache)
    return None if baseline is None else float(baseline["time_to_ready_ms"]["median"])


def _rows_table(rows: dict[str, Any], cache: str, memory: bool) -> list[str]:
    header = (
        "| row | time to ready, ms: median [min, max] | vs canonical (same source) | load / touch ms "
        "| peak RSS rise MiB |"
    )
    rule = "|---|---:|---:|---:|---:|"
    if memory:
        header += " 4 workers: PSS sum / weights PSS MiB |"
        rule += "---:|"
    lines = [header, rule]
    for name, entry in rows.items():
        measured = entry.get(cache)
        if measured is None:
            continue
        ready = measured["time_to_ready_ms"]
        line = (
            f"| {name} | {_ms(ready)} | {_speedup(_baseline_ms(rows, entry, cache), ready['median'])} | "
            f"{measured['load_ms']['median']:.1f} / {measured['touch_ms']['median']:.1f} | "
            f"{_mib(measured['peak_rss_rise_bytes'])} |"
        )
        if memory:
            group = entry.get("memory_group")
            if group is not None:
                line += f" {_mib(group['pss_sum_bytes'])} / {_mib(group['weights_pss_sum_bytes'])} |"
            elif entry.get("cold_start"):
                line += " n/a (one cold starter per node) |"
            else:
                line += " not measured (--quick) |"
        lines.append(line)
    return lines


def _times_baseline(rows: dict[str, Any], entry: dict[str, Any]) -> str:
    """`(N.NNx <baseline>)`: when a background publication finished, next to its canonical load."""
    baseline_ms = _baseline_ms(rows, entry, HOT)
    if not baseline_ms:
        return ""
    return f" ({entry[HOT]['published_ms']['median'] / baseline_ms:.2f}x {entry.get('baseline', CANONICAL)})"


def _remote_lines(data: dict[str, Any]) -> list[str]:
    """Node B (an empty domain importing the artifact) next to canonical, and import vs a plain fsspec copy."""
    remote = data.get("remote")
    if not isinstance(remote, dict):
        return []
    rows = data["rows"]
    canonical = rows.get(CANONICAL, {}).get(HOT)
    canonical_ms = None if canonical is None else canonical["time_to_ready_ms"]["median"]
    parts: list[str] = []
    for name, measured in remote["throughput"].items():
        ready = rows.get(name, {}).get(HOT)
        skipped = remote.get("rows_not_measured", {}).get(name, "")
        ready_text = (
            f"not measured ({skipped or 'no row'})"
            if ready is None
            else f"{ready['time_to_ready_ms']['median']:.0f} ms to ready"
        )
        if ready is not None and canonical_ms:
            ready_text += f" ({_speedup(canonical_ms, ready['time_to_ready_ms']['median'])} than canonical)"
        object_gib = measured["object_bytes"] / (1 << 30)
        imported, copied = measured["import_s"], measured["plain_copy_s"]
        ratio = measured["import_vs_plain_copy"]
        parts.append(
            f"{remote['targets'][name]['url']} ({measured['kind']}): node B {ready_text}; import "
            f"{imported['median'] * 1000:.0f} ms ({object_gib / imported['median']:.2f} GiB/s) vs plain fsspec copy "
            f"{copied['median'] * 1000:.0f} ms ({object_gib / copied['median']:.2f} GiB/s), "
            f"{'n/a' if ratio is None else f'{ratio:.2f}x'}; push took {remote['targets'][name]['push_s']:.1f} s"
        )
    for name, why in remote["unavailable"].items():
        parts.append(f"{name}: not measured ({why})")
    return [
        "**Remote artifacts** (node A pushed the artifact; node B is an empty domain importing it; import "
        "throughput is the whole import, re-hashing included, next to a plain copy of the same objects): "
        + "; ".join(parts)
        + "."
    ]


def markdown(report: BenchReport) -> str:
    """The report as a markdown section: machine, model, rows (hot, cold), concurrency, throughput, goals."""
    data: dict[str, Any] = report.data
    machine, model, options = data["machine"], data["model"], data["options"]
    lines = [
        f"### Results: {data['date']}, {machine['host']}",
        "",
        f"{machine['cpus']} CPUs ({machine['cpu']}), {machine['memory_gib']} GiB RAM, Linux {machine['kernel']}, "
        f"Python {machine['python']}, torch {machine['torch']}, diffusers {machine['diffusers']}, "
        f"safetensors {machine['safetensors']}, tensorizer {machine['tensorizer']}, "
        f"runai-model-streamer {machine['runai-model-streamer']}, fastsafetensors {machine['fastsafetensors']}. "
        f"Checkpoint and peer files on {machine['checkpoint_filesystem']}, domain on "
        f"{machine['domain_filesystem']} (`/dev/shm`, shmem THP `{machine['shmem_thp']}`). "
        f"Huge-page tmpfs: {data['huge_pages']['status']} "
        f"({data['huge_pages']['huge_page_backed_bytes'] / MIB:.0f} MiB of the artifact backed by huge pages).",
        "",
        f"FluxTransformer2DModel: {model['checkpoint_bytes'] / MIB:.0f} MiB FP32 checkpoint, "
        f"{model['artifact_bytes'] / MIB:.0f} MiB final-layout artifact ({model['tensors']} tensors). "
        f"{options['runs']} runs per time figure, each in a fresh process; {options['workers']} concurrent "
        f"workers for PSS ({options.get('memory_runs', options['runs'])} runs; weights PSS: the PSS of the "
        "mappings holding each worker's weights, from /proc/<pid>/smaps, each counting at most the weights' "
        "bytes in it). "
        f"`hwr bench` took {data['elapsed_s']:.0f} s.",
        "",
        "**Page cache hot**",
        "",
        *_rows_table(data["rows"], HOT, memory=True),
    ]
    published = [
        f"{name}: the artifact was published {entry[HOT]['published_ms']['median']:.0f} ms after the load call began"
        f"{_times_baseline(data['rows'], entry)}"
        for name, entry in data["rows"].items()
        if entry.get(HOT, {}).get("published_ms") is not None
    ]
    if published:
        lines += ["", *published]
    lines += ["", _steal_line(data["rows"])]
    if any(COLD in entry for entry in data["rows"].values()):
        lines += [
            "",
            "**Page cache cold** (the row's checkpoint and peer files evicted with `POSIX_FADV_DONTNEED` "
            "before each run; a tmpfs domain is memory and stays)",
            "",
            *_rows_table(data["rows"], COLD, memory=False),
        ]
    unavailable = data["unavailable_peers"]
    if unavailable:
        lines += ["", "Peers not measured: " + "; ".join(f"{name}: {why}" for name, why in unavailable.items())]
    concurrent = data["concurrent_cold_starters"]
    lines += [
        "",
        f"**{concurrent['starters']} concurrent cold starters** (streaming producer, one empty domain): wall time "
        f"{_ms(concurrent['wall_ms'])} ms; producer runs per start: "
        f"{concurrent['producer_runs']['min']:.0f} to {concurrent['producer_runs']['max']:.0f}; "
        f"outcomes {', '.join(concurrent['outcomes'])}.",
    ]
    throughput = data["throughput"]
    payload_gib = throughput["payload_bytes"] / (1 << 30)

    def rate(key: str) -> str:
        stats = throughput[key]
        spread = f"[{stats['min'] * 1000:.0f}, {stats['max'] * 1000:.0f}]"
        return f"{stats['median'] * 1000:.0f} ms {spread}, {payload_gib / stats['median']:.2f} GiB/s"

    lines += ["", *_remote_lines(data)]
    lines += [
        "",
        f"**Throughput** ({payload_gib:.2f} GiB on the domain's filesystem): "
        f"raw write+fsync {rate('raw_write_fsync_s')}; "
        f"publication {rate('publish_s')}; single-thread SHA-256 {rate('single_thread_sha256_s')}; "
        f"FULL_CHECKSUM {rate('full_checksum_s')}.",
        *(["", bounds_line(data["cold_bounds"], data.get("source_hashing"))] if "cold_bounds" in data else []),
        *_startup_lines(data.get("cli_startup")),
        *_verification_lines(data.get("background_verification")),
        *_tensor_parallel_lines(data.get("tensor_parallel")),
        *([] if not data.get("pipeline") else ["", "**Whole pipeline**: " + render_pipeline_rows(data["pipeline"])]),
        "",
        "**Goals** (reported, not asserted)",
        "",
        "| goal | measured | target | met |",
        "|---|---:|---:|---|",
    ]
    for goal in data["goals"]:
        value = "n/a" if goal["value"] is None else f"{goal['value']:.2f}"
        met = {True: "yes", False: "**no**", None: "n/a"}[goal["met"]]
        lines.append(f"| {goal['goal']} | {value} | {goal['target']} | {met} |")
    return "\n".join(lines) + "\n"


def _steal_line(rows: dict[str, Any]) -> str:
    """How much the hypervisor's steal disturbed the timed solo runs (re-run, or kept after the attempts ran out)."""
    sections = [entry[cache] for entry in rows.values() for cache in (HOT, COLD) if cache in entry]
    ticks = [tick for section in sections for tick in section.get("steal_ticks", [])]
    reruns = sum(int(section.get("reruns", 0)) for section in sections)
    kept = sum(int(section.get("disturbed_runs", 0)) for section in sections)
    return (
        f"Hypervisor steal (/proc/stat) during the timed runs: at most {max(ticks, default=0)} ticks in a kept run; "
        f"{reruns} runs re-run because steal disturbed them, {kept} kept still disturbed."
    )


def _startup_lines(startup: dict[str, Any] | None) -> list[str]:
    """The CLI start-up row: `hwr inspect` vs `python -c pass`, each a fresh process, and what it imported."""
    if startup is None:
        return []
    inspect, python = startup["inspect_s"], startup["python_pass_s"]
    heavy = ", ".join(startup["heavy_imports"]) or "neither torch nor diffusers"

    def ms(stats: dict[str, Any]) -> str:
        return f"{stats['median'] * 1000:.0f} ms [{stats['min'] * 1000:.0f}, {stats['max'] * 1000:.0f}]"

    return [
        "",
        f"**CLI start-up** (`{startup['command']}`, {len(inspect['samples'])} fresh processes): {ms(inspect)}; "
        f"`python -c pass` {ms(python)}; overhead {startup['overhead_s'] * 1000:.0f} ms; imported {heavy}.",
    ]


def _verification_lines(section: dict[str, Any] | None) -> list[str]:
    """The cost of the background full verification (HWR_BACKGROUND_VERIFY=once) next to a warm load."""
    if section is None:
        return []
    verification = section["verification_s"]
    took = "not run" if verification is None else f"{verification['median'] * 1000:.0f} ms"
    times = "n/a" if section["verification_vs_warm_load"] is None else f"{section['verification_vs_warm_load']:.1f}x"
    ready = "n/a" if section["ready_on_vs_off"] is None else f"{section['ready_on_vs_off']:.2f}"
    return [
        "",
        f"**Background verification** (once per publication per node, on a thread): it took {took} "
        f"({times} the warm load with it off, {section['warm_load_off_ms']['median']:.0f} ms; outcomes "
        f"{', '.join(section['verifications'])}); warm time to ready on the first lease "
        f"{section['time_to_ready_on_ms']['median']:.0f} ms with it on vs "
        f"{section['time_to_ready_off_ms']['median']:.0f} ms off (ratio {ready}).",
    ]


def _times(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def _tensor_parallel_lines(tensor_parallel: dict[str, Any] | None) -> list[str]:
    """Per TP size: bundle build vs TP=1 publication, warm time to ready per rank and per group, replica PSS."""
    if not tensor_parallel:
        return []
    if not tensor_parallel["sizes"]:
        return ["", *(f"TP={size}: not measured ({why})" for size, why in tensor_parallel["unavailable"].items())]
    single = tensor_parallel["tp1_publication"]["seconds"]
    replicas = tensor_parallel["replicas"]
    lines = [
        "",
        f"**Tensor parallel** (gloo groups on CPU; TP=1 streaming publication {single['median'] * 1000:.0f} ms "
        f"[{single['min'] * 1000:.0f}, {single['max'] * 1000:.0f}]; warm: {replicas} replicas x N ranks per run, "
        f"each replica's ranks loading together, all held while PSS is read; {tensor_parallel['elapsed_s']:.0f} s "
        "in all)",
        "",
        "| TP | bundle build ms | x TP=1 publication | bytes written x TP=1 | per-rank warm time to ready ms "
        f"| group ready ms | N ranks: weights PSS x TP=1 | {replicas} replicas x N ranks: weights PSS x TP=1 |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for size, entry in tensor_parallel["sizes"].items():
        bundle = entry["bundle_s"]
        build_ratio = "n/a" if entry["bundle_vs_tp1"] is None else f"{entry['bundle_vs_tp1']:.2f}"
        lines.append(
            f"| {size} | {_ms({k: bundle[k] * 1000 for k in ('median', 'min', 'max')})} | {build_ratio} | "
            f"{entry['bundle_bytes_vs_tp1']:.3f} | {_ms(entry['rank_time_to_ready_ms'])} | "
            f"{_ms(entry['group_time_to_ready_ms'])} | {_times(entry['one_replica_pss_vs_tp1'])} | "
            f"{_times(entry['weights_pss_vs_tp1'])} |"
        )
    for size, why in tensor_parallel.get("unavailable", {}).items():
        lines += ["", f"TP={size}: not measured ({why})"]
    return lines

"""Charts of a `hwr bench` results JSON as SVG files, so a page or a review shows the figures, not only tables.

Drawn from the JSON alone (a fresh run or an old results file), with matplotlib's Agg backend; every bar and
series carries an SVG id (`ttr-<cache>-<row>`, `memory-<row>`) so a test or a page can find it.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

__all__ = ["CHART_FILES", "ChartError", "draw_charts", "series_id"]

MIB = 1 << 20
TIME_TO_READY_HOT = "time-to-ready.svg"
TIME_TO_READY_COLD = "time-to-ready-cold.svg"
MEMORY = "memory-per-workers.svg"
CHART_FILES = (TIME_TO_READY_HOT, TIME_TO_READY_COLD, MEMORY)

# One colour per kind of row, so canonical, our rows and the peers read apart at a glance.
_CANONICAL_COLOUR = "#7f7f7f"
_WARM_COLOUR = "#2ca02c"
_COLD_COLOUR = "#ff7f0e"
_PEER_COLOUR = "#1f77b4"
# A row whose workers together hold this many artifacts' worth of weights or more keeps private copies.
_PRIVATE_COPIES = 1.5


class ChartError(ValueError):
    """The JSON is not a `hwr bench` result this module can draw (says which field is missing)."""


def series_id(prefix: str, name: str) -> str:
    """An SVG id for one bar or line: the prefix and the row name with every other character as `-`."""
    return f"{prefix}-" + re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def draw_charts(data: Mapping[str, Any], out_dir: Path) -> tuple[Path, ...]:
    """Write every chart the result holds data for into `out_dir`; return the files written, in order.

    A main `hwr bench` result gives time to ready (page cache hot, and cold when measured) and node weight
    memory against the number of workers; a `hwr bench --serve` result gives node memory per worker count.
    """
    if not out_dir.is_dir():
        raise ChartError(f"{out_dir} is not a directory")
    rows = data.get("rows")
    if isinstance(rows, list):
        return (_serve_memory_chart(rows, out_dir / MEMORY),)
    if not isinstance(rows, dict) or not rows:
        raise ChartError("the results JSON has no `rows`: pass the .json file `hwr bench` wrote")
    written = [_time_to_ready_chart(rows, "hot", out_dir / TIME_TO_READY_HOT)]
    if any(isinstance(entry, dict) and entry.get("cold") for entry in rows.values()):
        written.append(_time_to_ready_chart(rows, "cold", out_dir / TIME_TO_READY_COLD))
    memory = _memory_chart(data, rows, out_dir / MEMORY)
    if memory is not None:
        written.append(memory)
    return tuple(written)


def _colour(name: str) -> str:
    if name.startswith("canonical"):
        return _CANONICAL_COLOUR
    if name.startswith("hwr warm"):
        return _WARM_COLOUR
    if name.startswith("hwr"):
        return _COLD_COLOUR
    return _PEER_COLOUR


def _median(entry: Mapping[str, Any], *path: str) -> float:
    value: Any = entry
    for key in path:
        if not isinstance(value, Mapping) or key not in value:
            raise ChartError(f"a row lacks {'.'.join(path)}")
        value = value[key]
    if not isinstance(value, Mapping) or not isinstance(value.get("median"), int | float):
        raise ChartError(f"a row's {'.'.join(path)} has no median")
    return float(value["median"])


@contextmanager
def _figure(width: float, height: float) -> Iterator[Any]:
    """A matplotlib figure on the Agg backend with stable SVG output (no date, fixed ids), closed afterwards."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    with matplotlib.rc_context({"svg.hashsalt": "hwr-bench", "svg.fonttype": "none", "font.size": 9}):
        figure, axes = plt.subplots(figsize=(width, height))
        try:
            yield figure, axes
        finally:
            plt.close(figure)


def _save(figure: Any, path: Path) -> Path:
    figure.tight_layout()
    figure.savefig(path, format="svg", metadata={"Date": None}, bbox_inches="tight")
    return path


def _time_to_ready_chart(rows: Mapping[str, Any], cache: str, path: Path) -> Path:
    """One horizontal bar per row measured in `cache` (median, whiskers min to max), log scale, each row's ratio
    to the canonical load from its own source, and canonical's time as a dotted line."""
    measured = [(name, entry) for name, entry in rows.items() if isinstance(entry, dict) and entry.get(cache)]
    names = [name for name, _ in measured]
    medians = [_median(entry[cache], "time_to_ready_ms") for _, entry in measured]
    spans = [entry[cache]["time_to_ready_ms"] for _, entry in measured]
    lows = [m - float(span.get("min", m)) for m, span in zip(medians, spans, strict=True)]
    highs = [float(span.get("max", m)) - m for m, span in zip(medians, spans, strict=True)]
    by_name = dict(zip(names, medians, strict=True))
    with _figure(8.5, 0.3 * len(names) + 1.3) as (figure, axes):
        positions = list(range(len(names)))[::-1]
        bars = axes.barh(
            positions,
            medians,
            xerr=[lows, highs],
            color=[_colour(name) for name in names],
            error_kw={"elinewidth": 0.6, "capsize": 2, "ecolor": "#555555"},
        )
        for bar, (name, entry), median, high in zip(bars, measured, medians, highs, strict=True):
            bar.set_gid(series_id(f"ttr-{cache}", name))
            label = f"{median:,.0f} ms"
            baseline = by_name.get(str(entry.get("baseline", "canonical")))
            if baseline and not name.startswith("canonical"):
                ratio = baseline / median
                label += f" ({ratio:.1f}x faster)" if ratio >= 1 else f" ({1 / ratio:.1f}x slower)"
            axes.text((median + high) * 1.1, bar.get_y() + bar.get_height() / 2, label, va="center", fontsize=7)
        if "canonical" in by_name:
            axes.axvline(by_name["canonical"], color=_CANONICAL_COLOUR, linestyle=":", linewidth=1)
        from matplotlib.patches import Patch

        kinds = (
            (_CANONICAL_COLOUR, "canonical from_pretrained"),
            (_WARM_COLOUR, "hwr warm: a later worker"),
            (_COLD_COLOUR, "hwr cold: the first worker, or an import"),
            (_PEER_COLOUR, "bare mmap views and other loaders"),
        )
        handles = [Patch(color=colour, label=label) for colour, label in kinds]
        axes.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
        axes.set_yticks(positions, names)
        axes.set_xscale("log")
        axes.set_xlim(min(medians) / 2, max(m + h for m, h in zip(medians, highs, strict=True)) * 12)
        axes.set_xlabel("ms, log scale: median of fresh runs, whiskers min to max; ratio to canonical, same source")
        state = "page cache hot" if cache == "hot" else "page cache cold: checkpoint evicted before each run"
        axes.set_title(f"Time to ready ({state})", loc="left")
        return _save(figure, path)


def _memory_chart(data: Mapping[str, Any], rows: Mapping[str, Any], path: Path) -> Path | None:
    """Node weight PSS against the number of workers, one series per row measured as a concurrent group.

    The benchmark measures each group at one worker count N (the dots). The line through 1..N follows from
    what the group held: rows whose N workers held about N copies grow by one copy per worker, rows that
    held about one copy stay at it (they share the artifact's or the page cache's pages).
    """
    groups = [
        (name, entry["memory_group"])
        for name, entry in rows.items()
        if isinstance(entry, dict) and isinstance(entry.get("memory_group"), Mapping)
    ]
    if not groups:
        return None
    workers = int(data.get("options", {}).get("workers", 4))
    artifact = float(data.get("model", {}).get("artifact_bytes", 0)) or None
    counts = list(range(1, workers + 1))
    # Peers first, then canonical, then ours, so the rows the page is about are drawn on top.
    order = sorted(groups, key=lambda item: (item[0].startswith("hwr"), item[0].startswith("canonical")))
    labelled: set[str] = set()
    with _figure(7.5, 4.2) as (figure, axes):
        for name, group in order:
            total = _median(group, "weights_pss_sum_bytes") / MIB
            private = artifact is not None and total * MIB >= _PRIVATE_COPIES * artifact
            line = [total * n / workers for n in counts] if private else [total for _ in counts]
            if name.startswith("canonical"):
                kind, width, style = "canonical from_pretrained", 2.5, "-"
            elif name.startswith("hwr"):
                kind, width, style = "hwr warm (one shared artifact)", 2.5, "-"
            else:
                kind, width, style = "peers" + (" (private copies)" if private else " (shared page cache)"), 1.0, "--"
            (drawn,) = axes.plot(
                counts, line, style, color=_colour(name), linewidth=width, label=kind if kind not in labelled else None
            )
            labelled.add(kind)
            drawn.set_gid(series_id("memory", name))
            axes.plot([workers], [total], "o", color=_colour(name), markersize=5)
            if name in ("canonical", "hwr warm: /dev/shm"):
                axes.annotate(
                    f"{total:,.0f} MiB",
                    (workers, total),
                    xytext=(-8, 6),
                    textcoords="offset points",
                    ha="right",
                    fontsize=8,
                )
        axes.set_xticks(counts)
        axes.set_xlabel("workers on the node")
        axes.set_ylabel("weights' PSS of all workers together, MiB")
        axes.set_ylim(bottom=0)
        axes.set_title(f"Node memory for the weights (dots: measured with {workers} workers)", loc="left")
        axes.legend(fontsize=8, loc="upper left")
        return _save(figure, path)


def _serve_memory_chart(rows: list[Any], path: Path) -> Path:
    """`hwr bench --serve`: the node's PSS at each measured worker count, canonical next to load_pipeline."""
    series: dict[str, list[tuple[int, float]]] = {}
    for row in rows:
        if not isinstance(row, Mapping) or not {"loader", "workers", "node_pss_bytes"} <= row.keys():
            raise ChartError("a serve row lacks loader, workers or node_pss_bytes")
        series.setdefault(str(row["loader"]), []).append((int(row["workers"]), float(row["node_pss_bytes"]) / MIB))
    with _figure(7.0, 4.2) as (figure, axes):
        for loader, points in series.items():
            points.sort()
            colour = _CANONICAL_COLOUR if loader == "canonical" else _WARM_COLOUR
            (drawn,) = axes.plot([w for w, _ in points], [m for _, m in points], "-o", color=colour, label=loader)
            drawn.set_gid(series_id("memory", loader))
        axes.set_xticks(sorted({w for points in series.values() for w, _ in points}))
        axes.set_xlabel("serving workers on the node")
        axes.set_ylabel("node PSS, all workers together, MiB")
        axes.set_ylim(bottom=0)
        axes.set_title("Node memory of the serving example", loc="left")
        axes.legend(fontsize=8, loc="upper left")
        return _save(figure, path)

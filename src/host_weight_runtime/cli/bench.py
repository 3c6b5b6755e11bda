"""`hwr bench`: canonical, cold, warm and peer loaders side by side; writes JSON and Markdown results."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

from rich.text import Text

from ._command import Subcommands, add_command, positive_float, positive_int
from ._output import EXIT_OK, UsageError, add_json_option, print_json, stderr_console, stdout_console
from ._tools import tools_needed

__all__ = ["register", "run"]


def register(commands: Subcommands) -> None:
    """Add `hwr bench [--quick] [--size GIB] [--runs N] ... [--out DIR] [--plots DIR [--from-json FILE]] [--json]`."""
    sub = add_command(
        commands,
        "bench",
        run,
        "time to ready, peak RSS and shared memory of canonical, cold, warm and peer loaders, side by side",
    )
    sub.add_argument(
        "--quick",
        action="store_true",
        help="about 4 minutes: 0.25 GiB, 3 runs, hot cache only, fewer memory and TP groups",
    )
    sub.add_argument("--size", type=positive_float, default=None, metavar="GIB", help="BF16 weights in GiB (default 1)")
    sub.add_argument(
        "--runs", type=positive_int, default=None, metavar="N", help="fresh processes per figure (default 5)"
    )
    sub.add_argument(
        "--workers", type=positive_int, default=4, metavar="N", help="concurrent workers for PSS (default 4)"
    )
    sub.add_argument(
        "--cold-starters", type=positive_int, default=8, metavar="N", help="concurrent cold starters (default 8)"
    )
    sub.add_argument(
        "--tp",
        type=positive_int,
        nargs="*",
        default=None,
        metavar="N",
        help="tensor-parallel sizes for the TP rows (default 2 4; --tp alone measures none)",
    )
    sub.add_argument(
        "--memory-groups",
        choices=("all", "goals"),
        default=None,
        help="which rows also run as concurrent workers for PSS: every row, or only the rows a goal reads "
        "(canonical, warm, bare views); default all (goals with --quick)",
    )
    sub.add_argument("--no-cold-cache", action="store_true", help="skip the page-cache-cold runs")
    sub.add_argument("--no-huge-pages", action="store_true", help="do not mount a huge-page tmpfs")
    sub.add_argument("--no-pipeline", action="store_true", help="skip the whole-pipeline rows")
    sub.add_argument(
        "--preimported-workers",
        action="store_true",
        help="fork workers from a server that imported torch once, not fresh interpreters: much faster to "
        "start; the processes' own PSS then shares the interpreter's pages (the weights' PSS does not change)",
    )
    sub.add_argument(
        "--workdir", type=Path, default=None, metavar="DIR", help="disk folder for the checkpoint (default /var/tmp)"
    )
    sub.add_argument(
        "--out", type=Path, default=None, metavar="DIR", help="results folder (default benchmarks/results, else .)"
    )
    sub.add_argument(
        "--serve",
        action="store_true",
        help="instead: the serving example with 1, 2, 4 LitServe workers, canonical vs load_pipeline (`serve` extra)",
    )
    sub.add_argument(
        "--serve-mib", type=positive_int, default=128, metavar="MIB", help="FP32 transformer MiB for --serve"
    )
    sub.add_argument(
        "--plots",
        type=Path,
        default=None,
        metavar="DIR",
        help="also draw SVG charts of the results into DIR (time to ready per row, memory per worker count)",
    )
    sub.add_argument(
        "--from-json",
        type=Path,
        default=None,
        metavar="FILE",
        help="with --plots: draw the charts of an existing results JSON instead of running the benchmark",
    )
    sub.add_argument(
        "--vllm-omni",
        action="store_true",
        help="instead: this runtime's store and vLLM-Omni's reference store (vllm-omni==0.30.0, installed "
        "--no-deps) on the same seeded BF16 tensors: cold publish, warm hit, --workers workers' PSS",
    )
    sub.add_argument("--vllm-omni-mib", type=positive_int, default=256, metavar="MIB", help="BF16 MiB for --vllm-omni")
    add_json_option(sub)


def run(args: argparse.Namespace) -> int:
    """Run the benchmark with the options given, write both result files, print the Markdown (or the JSON)."""
    _check_plot_options(args)
    if args.from_json is not None:
        return _plots_from_json(args)
    if args.serve:
        return _run_serve(args)
    if args.vllm_omni:
        return _run_store_peer(args)
    # The tools are their own package, imported only here (C08).
    with tools_needed("bench"):
        from hwr_tools.bench.report import markdown, result_path
        from hwr_tools.bench.runner import BenchOptions, run_bench

    defaults = BenchOptions.quick() if args.quick else BenchOptions()
    options = dataclasses.replace(
        defaults,
        size_gib=args.size if args.size is not None else defaults.size_gib,
        runs=args.runs if args.runs is not None else defaults.runs,
        workers=args.workers,
        cold_starters=args.cold_starters,
        cold_cache=defaults.cold_cache and not args.no_cold_cache,
        huge_pages=not args.no_huge_pages,
        workdir=args.workdir,
        tensor_parallel_sizes=tuple(args.tp) if args.tp is not None else defaults.tensor_parallel_sizes,
        pipeline_rows=not args.no_pipeline,
        preimported_workers=args.preimported_workers,
        all_memory_groups=defaults.all_memory_groups if args.memory_groups is None else args.memory_groups == "all",
    )
    out_dir: Path = args.out if args.out is not None else _default_results_dir()
    if not out_dir.is_dir():
        raise UsageError(f"--out {out_dir} is not a directory")
    console = stderr_console()
    if args.json:
        report = run_bench(options)
    else:
        with console.status("hwr bench: setting up") as status:
            report = run_bench(options, say=lambda line: status.update(f"hwr bench: {line}"))
    json_path = result_path(out_dir, ".json")
    markdown_path = result_path(out_dir, ".md")
    json_path.write_text(json.dumps(report.data, indent=2) + "\n")
    text = markdown(report)
    markdown_path.write_text(text)
    if args.json:
        print_json(report.data)
    else:
        from rich.markdown import Markdown

        stdout_console().print(Markdown(text))
        console.print(Text(f"wrote {json_path} and {markdown_path}"))
    _draw(report.data, args.plots)
    return EXIT_OK


def _check_plot_options(args: argparse.Namespace) -> None:
    """`--from-json` needs `--plots`; both name existing paths (checked before anything runs)."""
    if args.from_json is not None and args.plots is None:
        raise UsageError("--from-json FILE only draws charts: add --plots DIR")
    if args.plots is not None and not args.plots.is_dir():
        raise UsageError(f"--plots {args.plots} is not a directory")
    if args.from_json is not None and not args.from_json.is_file():
        raise UsageError(f"--from-json {args.from_json} is not a file")


def _plots_from_json(args: argparse.Namespace) -> int:
    """`hwr bench --plots DIR --from-json FILE`: redraw the charts of a result without running anything."""
    try:
        data = json.loads(args.from_json.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise UsageError(f"--from-json {args.from_json} is not a readable JSON file ({error})") from None
    if not isinstance(data, dict):
        raise UsageError(f"--from-json {args.from_json} holds no results object")
    written = _draw(data, args.plots)
    if args.json:
        print_json({"plots": [str(path) for path in written]})
    return EXIT_OK


def _draw(data: dict[str, Any], out_dir: Path | None) -> tuple[Path, ...]:
    """Draw the charts of `data` into `out_dir` when one was asked for; say which files were written."""
    if out_dir is None:
        return ()
    with tools_needed("bench"):
        from hwr_tools.bench.plots import ChartError, draw_charts

    try:
        written = draw_charts(data, out_dir)
    except ModuleNotFoundError as error:
        raise UsageError(f"--plots needs matplotlib ({error}): pip install 'host-weight-runtime[bench]'") from None
    except ChartError as error:
        raise UsageError(f"cannot draw the charts: {error}") from None
    stderr_console().print(Text("wrote " + ", ".join(str(path) for path in written)))
    return written


def _run_serve(args: argparse.Namespace) -> int:
    """`hwr bench --serve`: the serving benchmark's rows and goals, written next to the other results."""
    with tools_needed("bench"):
        from hwr_tools.bench.report import result_path
        from hwr_tools.bench.serve import ServeBenchOptions, run_serve_bench, serve_markdown

    out_dir: Path = args.out if args.out is not None else _default_results_dir()
    if not out_dir.is_dir():
        raise UsageError(f"--out {out_dir} is not a directory")
    options = ServeBenchOptions(transformer_bytes=args.serve_mib * 2**20, workdir=args.workdir)
    with stderr_console().status("hwr bench --serve: setting up") as status:
        data = run_serve_bench(options, say=lambda line: status.update(f"hwr bench --serve: {line}"))
    json_path = result_path(out_dir, "-serve.json")
    json_path.write_text(json.dumps(data, indent=2) + "\n")
    text = serve_markdown(data)
    result_path(out_dir, "-serve.md").write_text(text)
    if args.json:
        print_json(data)
    else:
        from rich.markdown import Markdown

        stdout_console().print(Markdown(text))
    _draw(data, args.plots)
    return EXIT_OK


def _run_store_peer(args: argparse.Namespace) -> int:
    """`hwr bench --vllm-omni`: the reference store as a peer row, written next to the other results."""
    with tools_needed("bench"):
        from hwr_tools.bench.report import result_path
        from hwr_tools.bench.store_peer import (
            StorePeerOptions,
            reference_unavailable_reason,
            run_store_peer_bench,
            store_peer_markdown,
        )

    out_dir: Path = args.out if args.out is not None else _default_results_dir()
    if not out_dir.is_dir():
        raise UsageError(f"--out {out_dir} is not a directory")
    reason = reference_unavailable_reason()
    if reason is not None:
        raise UsageError(reason)
    options = StorePeerOptions(
        size_mib=args.vllm_omni_mib, rounds=args.runs or 3, workers=args.workers, workdir=args.workdir
    )
    with stderr_console().status("hwr bench --vllm-omni: alternating rounds"):
        data = run_store_peer_bench(options)
    json_path = result_path(out_dir, "-vllm-omni.json")
    json_path.write_text(json.dumps(data, indent=2) + "\n")
    text = store_peer_markdown(data)
    result_path(out_dir, "-vllm-omni.md").write_text(text)
    if args.json:
        print_json(data)
    else:
        from rich.markdown import Markdown

        stdout_console().print(Markdown(text))
    return EXIT_OK


def _default_results_dir() -> Path:
    """benchmarks/results in a checkout of this project, else the current directory."""
    checkout = Path("benchmarks") / "results"
    return checkout if checkout.is_dir() else Path()

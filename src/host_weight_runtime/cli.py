"""The `hwr` command: inspect, verify and clean a domain, prewarm a model, run the demo and the benchmark.

Thin by design: parse arguments, call the library, print. Tables and progress bars
for people, `--json` for machines. Exit codes: 0 success, 1 a failure the command
reports, 2 a usage error (argparse's own, a bad key, a refused unattended cleanup).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)
from rich.prompt import Confirm
from rich.table import Table
from rich.text import Text

from . import __version__
from .canonical_json import JsonValue
from .config import ENV_ROOT, HostWeightRuntimeConfig, default_root
from .failures import HostWeightError, HostWeightUsageError
from .filesystem._layout import DomainLayout, check_key
from .filesystem.inspection import ArtifactInspection, ArtifactState, DomainInspection
from .filesystem.store import FilesystemHostWeightStore
from .outcomes import CleanupResult, CleanupStatus
from .tensors import ValidationLevel

__all__ = ["main"]

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2

SHORT_KEY = 12
MIN_KEY_PREFIX = 4
VERIFY_LOCK_TIMEOUT_S = 60.0

_HEX_PREFIX = re.compile(r"^[0-9a-f]+$")


class UsageError(Exception):
    """A command line that cannot run as given (exit 2); the message says what to change."""


class ReportedError(Exception):
    """A failure the command reports in one line (exit 1)."""


# --------------------------------------------------------------------------- shared helpers


def _stdout() -> Console:
    return Console(highlight=False, soft_wrap=True)


def _stderr() -> Console:
    return Console(stderr=True, highlight=False, soft_wrap=True)


def _print_json(value: JsonValue) -> None:
    sys.stdout.write(json.dumps(value, indent=2) + "\n")
    sys.stdout.flush()


def _size(nbytes: int | None) -> str:
    if nbytes is None:
        return "-"
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{nbytes} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")  # pragma: no cover


def _limit(nbytes: int | None) -> str:
    return "unlimited" if nbytes is None else _size(nbytes)


def _byte_progress(verb: str) -> Progress:
    """A transient progress bar on stderr for long byte-bound work (hashing, streaming)."""
    return Progress(
        TextColumn(verb + " {task.description}"),
        BarColumn(),
        DownloadColumn(binary_units=True),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=_stderr(),
        transient=True,
    )


def _domain_root(option: str | None) -> Path:
    """--root, else HWR_ROOT (validated as the library validates it), else the default root."""
    if option is not None:
        return Path(option).expanduser().absolute()
    if os.environ.get(ENV_ROOT, "").strip():
        return HostWeightRuntimeConfig.from_env({ENV_ROOT: os.environ[ENV_ROOT]}).resolved_root
    return default_root()


def _open_existing(root: Path) -> FilesystemHostWeightStore:
    """Open the domain at `root` without creating one (opening a store creates a missing domain)."""
    if not DomainLayout(root).domain_file.is_file():
        where = "nothing is there" if not root.exists() else f"{root} holds no domain.json"
        raise ReportedError(
            f"no domain at {root} ({where}); pass --root or set {ENV_ROOT} to the directory your workers use"
        )
    return FilesystemHostWeightStore(root)


def _resolve_key(store: FilesystemHostWeightStore, text: str) -> str:
    """A full key as given, or the one stored key that starts with an unambiguous hex prefix."""
    text = text.strip().lower()
    if len(text) == 64:
        try:
            return check_key(text)
        except ValueError as exc:
            raise UsageError(f"{exc}; `hwr inspect` lists the keys") from None
    if len(text) < MIN_KEY_PREFIX or len(text) > 64 or not _HEX_PREFIX.match(text):
        raise UsageError(
            f"{text!r} is not an artifact key: give the 64-character hex key or a unique prefix of at least "
            f"{MIN_KEY_PREFIX} characters (`hwr inspect` lists the keys)"
        )
    layout = store.layout
    known: set[str] = set()
    for directory in (layout.artifacts, layout.deny, layout.tmp):
        try:
            names = os.listdir(directory)
        except FileNotFoundError:
            continue
        known.update(name.split(".", 1)[0] for name in names)
    matches = sorted(key for key in known if key.startswith(text) and len(key) == 64)
    if not matches:
        raise ReportedError(f"no artifact key in {store.root} starts with {text}; `hwr inspect` lists the keys")
    if len(matches) > 1:
        listed = ", ".join(key[:SHORT_KEY] for key in matches)
        raise UsageError(f"key prefix {text} is ambiguous ({listed}); give more characters")
    return matches[0]


def _locks_text(entry: ArtifactInspection) -> str:
    held = [
        name for name, active in (("build", entry.locks.build_active), ("lease", entry.locks.lease_active)) if active
    ]
    return "+".join(held) if held else "-"


def _problem_text(entry: ArtifactInspection) -> str:
    return "" if entry.problem is None else f"{entry.problem.code.value}: {entry.problem.message}"


# --------------------------------------------------------------------------- hwr inspect


def _cmd_inspect(args: argparse.Namespace) -> int:
    store = _open_existing(_domain_root(args.root))
    snapshot = store.inspect_domain()
    if args.json:
        _print_json(snapshot.to_dict())
    else:
        _render_domain(_stdout(), snapshot)
    return EXIT_OK


def _render_domain(console: Console, snapshot: DomainInspection) -> None:
    capacity = snapshot.capacity
    policy = capacity.policy
    facts = Table.grid(padding=(0, 2))
    facts.add_column(style="bold")
    facts.add_column()
    facts.add_row("root", snapshot.root)
    facts.add_row("domain id", snapshot.domain_id)
    facts.add_row("scope", snapshot.scope)
    facts.add_row("filesystem", f"{snapshot.fs_type} mounted at {snapshot.mount_point}")
    facts.add_row("storage class", snapshot.storage_class)
    facts.add_row("huge_pages", "n/a (not tmpfs)" if snapshot.huge_pages is None else snapshot.huge_pages)
    medium = "memory (tmpfs: stored bytes are RAM)" if capacity.is_memory else "disk"
    facts.add_row(
        "capacity",
        f"total {_size(capacity.total_bytes)}, free {_size(capacity.free_bytes)}, "
        f"store {_size(capacity.store_bytes)}; {medium}",
    )
    facts.add_row(
        "policy",
        f"max_artifact_bytes {_limit(policy.max_artifact_bytes)}, max_store_bytes {_limit(policy.max_store_bytes)}, "
        f"min_free_bytes {_size(policy.min_free_bytes)}",
    )
    console.print(facts)
    console.print()
    if not snapshot.artifacts:
        console.print("no artifacts")
        return
    table = Table(title=f"inventory ({len(snapshot.artifacts)})", title_justify="left")
    for column in ("key", "state", "size", "model", "tensors", "locks held", "problem"):
        wraps = column in ("model", "problem")
        table.add_column(
            column,
            justify="right" if column in ("size", "tensors") else "left",
            no_wrap=not wraps,
            overflow="fold" if wraps else "ellipsis",
            min_width=SHORT_KEY if column == "key" else None,
        )
    for entry in snapshot.artifacts:
        table.add_row(
            entry.key[:SHORT_KEY],
            Text(entry.state.value, style="green" if entry.state is ArtifactState.READY else "red"),
            _size(entry.size_bytes),
            Text(entry.model_id or "-"),
            "-" if entry.tensor_count is None else str(entry.tensor_count),
            _locks_text(entry),
            Text(entry.problem.code.value if entry.problem is not None else "-"),
        )
    console.print(table)


# --------------------------------------------------------------------------- hwr verify


def _payload_bytes(directory: Path) -> int:
    """Bytes FULL_CHECKSUM hashes: every payload file, header included."""
    total = 0
    try:
        with os.scandir(directory) as listing:
            for entry in listing:
                if entry.name.endswith(".safetensors") and entry.is_file(follow_symlinks=False):
                    total += entry.stat(follow_symlinks=False).st_size
    except OSError:
        return 0
    return total


def _cmd_verify(args: argparse.Namespace) -> int:
    store = _open_existing(_domain_root(args.root))
    key = _resolve_key(store, args.key)
    validation = ValidationLevel.FULL_CHECKSUM if args.full else ValidationLevel.MANIFEST_AND_METADATA
    deadline = time.monotonic() + VERIFY_LOCK_TIMEOUT_S
    if args.full and sys.stderr.isatty():
        total = _payload_bytes(store.layout.artifact_dir(key))
        with _byte_progress("hashing") as progress:
            task = progress.add_task(key[:SHORT_KEY], total=total or None)

            def advance(nbytes: int) -> None:
                progress.advance(task, nbytes)

            result = store.inspect_artifact(key, validation=validation, deadline=deadline, progress=advance)
    else:
        result = store.inspect_artifact(key, validation=validation, deadline=deadline)
    verified = result.state is ArtifactState.READY and result.problem is None
    if args.json:
        _print_json({"validation": validation.value, "verified": verified, **result.to_dict()})
    else:
        _render_verify(verified, validation, result)
    return EXIT_OK if verified else EXIT_FAILURE


def _render_verify(verified: bool, validation: ValidationLevel, result: ArtifactInspection) -> None:
    what = "every payload byte re-hashed" if validation is ValidationLevel.FULL_CHECKSUM else "manifest and metadata"
    if verified:
        line = Text()
        line.append("ok ", style="green bold")
        line.append(
            f"{result.key}  {result.model_id or '-'}  {result.tensor_count} tensors  {_size(result.size_bytes)}  "
            f"({what})"
        )
        _stdout().print(line)
        return
    console = _stderr()
    line = Text()
    line.append(f"{result.state.value} ", style="red bold")
    line.append(f"{result.key} ({what})")
    console.print(line)
    if result.state is ArtifactState.MISSING:
        console.print(Text(f"no artifact with this key at {result.path}; `hwr inspect` lists what is stored"))
    elif result.state is ArtifactState.TEMPORARY:
        console.print(Text(f"only a build in progress (or a dead builder's leftovers) at {result.path}"))
    if result.problem is not None:
        console.print(Text(_problem_text(result)))
    if result.state in (ArtifactState.INVALID, ArtifactState.DENIED):
        first = "a worker's lookup will deny it and " if result.state is ArtifactState.INVALID else ""
        console.print(
            Text(
                f"workers will not use it: {first}the next build quarantines and rebuilds it; "
                f"`hwr cleanup {result.key[:SHORT_KEY]}` removes it now"
            )
        )


# --------------------------------------------------------------------------- hwr cleanup


def _cmd_cleanup(args: argparse.Namespace) -> int:
    interactive = sys.stdin.isatty()
    if not (args.yes or args.dry_run or interactive):
        raise UsageError(
            "refusing to remove files without a confirmation, and stdin is not a terminal to ask on: "
            "pass --yes to remove without asking, or --dry-run to only show what would be removed"
        )
    store = _open_existing(_domain_root(args.root))
    key = _resolve_key(store, args.key)
    if args.dry_run:
        return _report_cleanup(store.cleanup(key, dry_run=True), json_output=args.json)
    if not args.yes:
        plan = store.cleanup(key, dry_run=True)
        if plan.status is not CleanupStatus.PLANNED:
            return _report_cleanup(plan, json_output=args.json)
        console = _stderr() if args.json else _stdout()
        _render_cleanup(console, plan)
        try:
            confirmed = bool(Confirm.ask("Remove these paths?", default=False, console=console))
        except EOFError:
            confirmed = False
        if not confirmed:
            _stderr().print("cancelled; nothing was removed")
            return EXIT_FAILURE
    return _report_cleanup(store.cleanup(key), json_output=args.json)


def _report_cleanup(result: CleanupResult, *, json_output: bool) -> int:
    failed = result.status in (CleanupStatus.ACTIVE_BUILD, CleanupStatus.ACTIVE_LEASE, CleanupStatus.FAILED)
    if json_output:
        _print_json(result.to_dict())
    else:
        _render_cleanup(_stderr() if failed else _stdout(), result)
    return EXIT_FAILURE if failed else EXIT_OK


def _render_cleanup(console: Console, result: CleanupResult) -> None:
    key = result.key
    if result.status is CleanupStatus.NOT_PRESENT:
        console.print(Text(f"nothing stored under {key}; nothing to remove"))
        return
    if result.status not in (CleanupStatus.REMOVED, CleanupStatus.PLANNED):
        line = Text()
        line.append(f"{result.status.value} ", style="red bold")
        line.append(f"{key}: ")
        line.append(result.failure.message if result.failure is not None else "nothing was removed")
        console.print(line)
        return
    verb = "would remove" if result.dry_run else "removed"
    console.print(Text(f"{verb} {_size(result.removed_bytes)} for {key}:"))
    for path in result.removed_paths:
        console.print(Text(f"  {path}"))


# --------------------------------------------------------------------------- hwr demo


def _cmd_demo(args: argparse.Namespace) -> int:
    if not args.synthetic:
        return _cmd_flux_demo(args)
    from ._demo import DEFAULT_SIZE_MIB, DemoError, run_demo, summary_line

    size_mib = args.size_mib if args.size_mib is not None else DEFAULT_SIZE_MIB
    try:
        if not args.json:
            _stderr().print(
                f"publishing a {size_mib} MiB synthetic artifact in a fresh process, then leasing it from "
                f"{args.workers} more (a temporary tmpfs domain under /dev/shm)..."
            )
        report = run_demo(size_mib=size_mib, workers=args.workers)
    except DemoError as exc:
        raise ReportedError(str(exc)) from exc
    if args.json:
        _print_json(report.to_dict())
    else:
        console = _stdout()
        table = Table(
            title=f"artifact {report.key[:SHORT_KEY]}, {_size(report.artifact_bytes)}; ready in ms, memory in MiB",
            title_justify="left",
        )
        for column in ("process", "outcome", "ready", "RSS", "PSS", "artifact PSS"):
            table.add_column(column, justify="left" if column in ("process", "outcome") else "right", no_wrap=True)
        mib = float(1 << 20)
        for row in report.rows:
            table.add_row(
                row.process,
                Text(row.outcome, style="green" if row.failure is None else "red"),
                f"{row.time_to_ready_ms:.0f}",
                f"{row.rss_bytes / mib:.1f}",
                f"{row.pss_bytes / mib:.1f}",
                f"{row.artifact_pss_bytes / mib:.1f}",
            )
        console.print(table)
        console.print(Text(summary_line(report)))
        for row in report.rows:
            if row.failure is not None:
                _stderr().print(Text(f"{row.process}: {row.failure}"))
    if not report.ok:
        _stderr().print(
            "the demo did not go as expected: the publisher should report local_production and every worker local_hit"
        )
        return EXIT_FAILURE
    return EXIT_OK


def _cmd_flux_demo(args: argparse.Namespace) -> int:
    # The application layer may use the adapters; the core never does (C08).
    from ._demo import DemoError
    from .diffusion._demo import DEFAULT_SIZE_MIB, failure_reason, report_table, run_demo, summary_line

    size_mib = args.size_mib if args.size_mib is not None else DEFAULT_SIZE_MIB
    try:
        if not args.json:
            _stderr().print(
                f"building a {size_mib} MiB FP32 Flux transformer checkpoint, then loading it in fresh processes: "
                f"canonical from_pretrained, cold load_component, {args.workers} warm load_component "
                "(a temporary tmpfs domain under /dev/shm)..."
            )
        report = run_demo(size_mib=size_mib, workers=args.workers)
    except DemoError as exc:
        raise ReportedError(str(exc)) from exc
    if args.json:
        _print_json(report.to_dict())
    else:
        console = _stdout()
        console.print(report_table(report))
        console.print(Text(summary_line(report)))
        for row in report.rows:
            if row.failure is not None:
                _stderr().print(Text(f"{row.path}: {row.failure}"))
    if not report.ok:
        _stderr().print(Text(failure_reason(report)))
        return EXIT_FAILURE
    return EXIT_OK


def _runtime_config(root_option: str | None) -> HostWeightRuntimeConfig:
    config = HostWeightRuntimeConfig.from_env()
    if root_option is not None:
        config = dataclasses.replace(config, root=_domain_root(root_option))
    return config


def _cmd_prewarm(args: argparse.Namespace) -> int:
    # The application layer may use the adapters; the core never does (C08).
    from .diffusion.loader import PrewarmResult, prewarm_component
    from .runtime import HostWeightRuntime

    runtime = HostWeightRuntime(_runtime_config(args.root))
    kwargs: dict[str, Any] = {
        "subfolder": args.subfolder,
        "revision": args.revision,
        "runtime": runtime,
        "cache_dir": args.cache_dir,
    }
    result: PrewarmResult
    if not args.json and sys.stderr.isatty():
        with _byte_progress("streaming") as progress:
            task = progress.add_task(str(args.model), total=None)

            def advance(done: int, total: int) -> None:
                progress.update(task, completed=done, total=total or None)

            result = prewarm_component(args.model, progress=advance, **kwargs)
    else:
        result = prewarm_component(args.model, **kwargs)
    report = result.resolution
    if args.json:
        _print_json(
            {
                "model": str(args.model),
                "subfolder": args.subfolder,
                "identity_key": result.identity_key,
                "total_bytes": result.total_bytes,
                "tensor_count": result.tensor_count,
                "resolution": report.to_dict(),
            }
        )
        return EXIT_OK
    table = Table(title=f"prewarmed {args.model}", title_justify="left", show_header=False)
    table.add_column("field", style="bold")
    table.add_column("value")
    table.add_row("key", result.identity_key)
    table.add_row("outcome", Text(report.outcome.value, style="green"))
    table.add_row("artifact", f"{_size(result.total_bytes)} in {result.tensor_count} tensors")
    table.add_row("time", f"{report.elapsed_s:.2f} s")
    table.add_row("domain", str(runtime.config.resolved_root))
    _stdout().print(table)
    return EXIT_OK


# --------------------------------------------------------------------------- hwr bench


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return value


def _default_results_dir() -> Path:
    """benchmarks/results in a checkout of this project, else the current directory."""
    checkout = Path("benchmarks") / "results"
    return checkout if checkout.is_dir() else Path()


def _cmd_bench(args: argparse.Namespace) -> int:
    # The application layer may use the adapters; the core never does (C08).
    from .diffusion._bench.report import markdown, result_path
    from .diffusion._bench.runner import BenchOptions, run_bench

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
    )
    out_dir: Path = args.out if args.out is not None else _default_results_dir()
    if not out_dir.is_dir():
        raise UsageError(f"--out {out_dir} is not a directory")
    console = _stderr()
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
        _print_json(report.data)
    else:
        from rich.markdown import Markdown

        _stdout().print(Markdown(text))
        console.print(Text(f"wrote {json_path} and {markdown_path}"))
    return EXIT_OK


# --------------------------------------------------------------------------- parser and main


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hwr",
        description="Inspect, verify and clean a host weight runtime domain; run the sharing demo.",
        epilog=f"The domain root is --root, else ${ENV_ROOT}, else {default_root()}.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name: str, handler: Callable[[argparse.Namespace], int], help_text: str) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=help_text, description=help_text)
        sub.set_defaults(handler=handler)
        return sub

    def add_root(sub: argparse.ArgumentParser) -> None:
        sub.add_argument("--root", metavar="DIR", help=f"domain root (default: ${ENV_ROOT}, else {default_root()})")

    def add_json(sub: argparse.ArgumentParser) -> None:
        sub.add_argument("--json", action="store_true", help="print JSON for machines instead of tables")

    inspect = add("inspect", _cmd_inspect, "show the domain (filesystem, capacity, policy) and its artifacts")
    add_root(inspect)
    add_json(inspect)

    verify = add("verify", _cmd_verify, "validate one artifact read-only; exit 1 unless it is ready")
    verify.add_argument("key", help="artifact key, or a unique prefix of it (see `hwr inspect`)")
    verify.add_argument("--full", action="store_true", help="re-hash every payload byte (FULL_CHECKSUM)")
    add_root(verify)
    add_json(verify)

    cleanup = add("cleanup", _cmd_cleanup, "remove one artifact, its deny marker and leftover builds")
    cleanup.add_argument("key", help="artifact key, or a unique prefix of it (see `hwr inspect`)")
    cleanup.add_argument("--dry-run", action="store_true", help="only show what would be removed")
    cleanup.add_argument("--yes", action="store_true", help="remove without asking")
    add_root(cleanup)
    add_json(cleanup)

    prewarm = add("prewarm", _cmd_prewarm, "build a diffusers model's artifact straight from its checkpoint")
    prewarm.add_argument("model", help="diffusers model or pipeline folder, or a repo id in the local HF cache")
    prewarm.add_argument("--subfolder", default=None, help="component folder inside a pipeline, e.g. transformer")
    prewarm.add_argument("--revision", default=None, help="cache revision (branch, tag or commit); default main")
    prewarm.add_argument("--cache-dir", default=None, metavar="DIR", help="Hugging Face cache (default: $HF_HUB_CACHE)")
    add_root(prewarm)
    add_json(prewarm)

    demo = add(
        "demo",
        _cmd_demo,
        "load a real diffusers Flux transformer canonically, cold and warm in fresh processes: time, memory, parity",
    )
    demo.add_argument(
        "--synthetic", action="store_true", help="the synthetic demo instead: publish once, lease from fresh workers"
    )
    demo.add_argument(
        "--size-mib",
        type=_positive_int,
        default=None,
        metavar="N",
        help="FP32 Flux checkpoint size (default 320); with --synthetic, the artifact size (default 512)",
    )
    demo.add_argument("--workers", type=_positive_int, default=3, metavar="N", help="warm worker processes (default 3)")
    add_json(demo)

    bench = add(
        "bench",
        _cmd_bench,
        "time to ready, peak RSS and shared memory of canonical, cold, warm and peer loaders, side by side",
    )
    bench.add_argument(
        "--quick", action="store_true", help="under 3 minutes: 0.25 GiB, 3 runs, hot cache only, fewer memory groups"
    )
    bench.add_argument(
        "--size", type=_positive_float, default=None, metavar="GIB", help="BF16 weights in GiB (default 1)"
    )
    bench.add_argument(
        "--runs", type=_positive_int, default=None, metavar="N", help="fresh processes per figure (default 5)"
    )
    bench.add_argument(
        "--workers", type=_positive_int, default=4, metavar="N", help="concurrent workers for PSS (default 4)"
    )
    bench.add_argument(
        "--cold-starters", type=_positive_int, default=8, metavar="N", help="concurrent cold starters (default 8)"
    )
    bench.add_argument("--no-cold-cache", action="store_true", help="skip the page-cache-cold runs")
    bench.add_argument("--no-huge-pages", action="store_true", help="do not mount a huge-page tmpfs")
    bench.add_argument(
        "--workdir", type=Path, default=None, metavar="DIR", help="disk folder for the checkpoint (default /var/tmp)"
    )
    bench.add_argument(
        "--out", type=Path, default=None, metavar="DIR", help="results folder (default benchmarks/results, else .)"
    )
    add_json(bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run `hwr`; returns the exit status (argparse exits 2 itself on a malformed command line)."""
    args = _build_parser().parse_args(argv)
    handler: Callable[[argparse.Namespace], int] = args.handler
    try:
        return handler(args)
    except UsageError as exc:
        _stderr().print(Text(f"hwr {args.command}: {exc}"))
        return EXIT_USAGE
    except ReportedError as exc:
        _stderr().print(Text(f"hwr {args.command}: {exc}"))
        return EXIT_FAILURE
    except HostWeightUsageError as exc:  # a bad argument or model folder: a usage error, whatever its family
        _stderr().print(Text(f"hwr {args.command}: {exc.failure.message}"))
        return EXIT_USAGE
    except HostWeightError as exc:
        problem = exc.failure
        _stderr().print(Text(f"hwr {args.command}: [{problem.code.value}] {problem.message}"))
        return EXIT_FAILURE
    except ValueError as exc:
        _stderr().print(Text(f"hwr {args.command}: {exc}"))
        return EXIT_USAGE
    except KeyboardInterrupt:
        _stderr().print("interrupted")
        return 130


if __name__ == "__main__":
    sys.exit(main())

"""`hwr bench --serve`: the serving example (examples/serve) with N = 1, 2, 4 LitServe workers, canonical vs artifacts.

For each worker count, the service runs twice on a Flux pipeline of real proportions
(`save_proportional_flux_pipeline`): with the runtime DISABLED and the workers loading side by side
(what a plain deployment does), then in PREFERRED mode on a domain the first run published. Each
worker reports its time from process start to ready and its first request's time; the node's memory
is the workers' summed PSS (smaps_rollup) and, for the artifacts, the PSS of their mappings.
The reference for a warm worker is a bare process with the same imports that maps the published
artifact files with safetensors (`bare mmap time to ready`) plus one canonical inference step.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..common import REPO_ROOT
from ..memory import memory_rollup, total_mapped_memory
from ..synthetic_pipelines import PROMPT, T5_MAX_LENGTH, save_proportional_flux_pipeline

__all__ = ["ServeBenchOptions", "run_serve_bench", "serve_markdown", "stop_service"]

_REPO = REPO_ROOT
_START_TIMEOUT_S = 900.0
_HEIGHT = 64
_BARE_MMAP = """
import sys, time, json, pathlib
import diffusers, safetensors
getattr(diffusers, "FluxPipeline")
imported_at = time.time()
tensors = 0
for path in sorted(pathlib.Path(sys.argv[1]).rglob("*.safetensors")):
    with safetensors.safe_open(str(path), framework="pt") as handle:
        for name in handle.keys():
            tensors += handle.get_tensor(name).numel() > 0
print(json.dumps({"imported_at": imported_at, "ready_at": time.time(), "tensors": tensors}))
"""


@dataclass(frozen=True, slots=True)
class ServeBenchOptions:
    """What the serving benchmark runs: the transformer's FP32 size, the worker counts, torch threads per worker."""

    transformer_bytes: int = 128 * 2**20
    worker_counts: tuple[int, ...] = (1, 2, 4)
    threads: int = 1
    steps: int = 1
    workdir: Path | None = None
    example: Path = _REPO / "examples" / "serve" / "serve_app.py"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _get(url: str, body: dict[str, Any] | None = None, timeout_s: float = 600.0) -> Any:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout_s) as answer:
        return json.loads(answer.read())


def _environment() -> dict[str, str]:
    source = str(_REPO / "src")
    path = os.environ.get("PYTHONPATH", "")
    return {**os.environ, "PYTHONPATH": source if not path else f"{source}{os.pathsep}{path}"}


def _descendants(pid: int) -> list[int]:
    """Every live process below `pid` (children first found, then theirs), from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rpartition(")")[2].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(parent, []).append(int(entry.name))
    found, pending = [], [pid]
    while pending:
        below = children.get(pending.pop(), [])
        found += below
        pending += below
    return found


def stop_service(process: subprocess.Popen[bytes], signum: int = signal.SIGTERM, timeout_s: float = 120.0) -> int:
    """Stop the example service with `signum` and wait; if it does not stop in time, SIGKILL it and everything
    it started (LitServe's manager, HTTP and worker processes would otherwise outlive it). Returns its exit code."""
    if process.poll() is None:
        process.send_signal(signum)
        try:
            return process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            for pid in [*_descendants(process.pid), process.pid]:
                with contextlib.suppress(ProcessLookupError):  # it ended meanwhile
                    os.kill(pid, signal.SIGKILL)
            process.wait(timeout=30)
            raise
    return int(process.returncode)


class _Service:
    """One run of the example service, stopped with SIGTERM."""

    def __init__(self, options: ServeBenchOptions, model: Path, root: Path, workers: int, canonical: bool) -> None:
        self.port = _free_port()
        self.log = tempfile.TemporaryFile()  # noqa: SIM115 - kept for the service's life, closed in stop()
        mode = ["--mode", "disabled", "--parallel-load"] if canonical else ["--mode", "preferred"]
        command = [
            sys.executable,
            str(options.example),
            *("--model", str(model), "--root", str(root), "--workers", str(workers), "--port", str(self.port)),
            *("--threads", str(options.threads), f"--call-arg=max_sequence_length={T5_MAX_LENGTH}", *mode),
        ]
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT, env=_environment())
        self.url = f"http://127.0.0.1:{self.port}"

    def status(self) -> dict[str, Any] | None:
        try:
            answer: dict[str, Any] = _get(self.url + "/status", timeout_s=10)
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return None
        return answer

    def wait(self, check: Callable[[list[dict[str, Any]]], bool]) -> list[dict[str, Any]]:
        deadline = time.monotonic() + _START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the example service exited with {self.process.returncode}: {self._tail()}")
            status = self.status()
            if status is not None and check(status["workers"]):
                workers: list[dict[str, Any]] = status["workers"]
                return workers
            time.sleep(0.2)
        raise RuntimeError(f"the example service was not ready within {_START_TIMEOUT_S:.0f} s: {self._tail()}")

    def stop(self) -> None:
        try:
            stop_service(self.process)
        finally:
            self.log.close()

    def _tail(self) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")[-3000:]


def _one_each(service: _Service, workers: int, steps: int) -> list[dict[str, Any]]:
    """Send rounds of concurrent requests until every worker answered one (at most 8 rounds)."""
    body = {"prompt": PROMPT, "steps": steps, "height": _HEIGHT, "width": _HEIGHT}
    for round_index in range(8):
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            seeds = range(round_index * workers, (round_index + 1) * workers)
            list(pool.map(lambda seed: _get(service.url + "/predict", {**body, "seed": seed}), seeds))
        status = service.status()
        if status is not None and all(worker["requests"] > 0 for worker in status["workers"]):
            answered: list[dict[str, Any]] = status["workers"]
            return answered
    raise RuntimeError("some worker of the example service never got a request")


def _row(options: ServeBenchOptions, model: Path, root: Path, workers: int, canonical: bool) -> dict[str, Any]:
    service = _Service(options, model, root, workers, canonical)
    try:
        service.wait(lambda found: len(found) == workers and all(w["state"] == "ready" for w in found))
        answered = _one_each(service, workers, options.steps)
        pids = [int(worker["pid"]) for worker in answered]
        node_pss = sum(memory_rollup(pid)[1] for pid in pids)
        artifacts = total_mapped_memory(pids, root / "artifacts")
    finally:
        service.stop()
    rows = sorted(answered, key=lambda worker: float(worker["ready_s"]))
    return {
        "workers": workers,
        "loader": "canonical" if canonical else "load_pipeline",
        "node_pss_bytes": node_pss,
        "artifact_pss_bytes": artifacts.pss,
        "artifact_rss_bytes": artifacts.rss,
        "per_worker": [
            {
                "ready_s": worker["ready_s"],
                "import_s": worker.get("import_s"),
                "load_s": worker["load_s"],
                "lock_wait_s": worker.get("lock_wait_s"),
                "first_predict_s": worker["first_predict_s"],
                "first_response_s": float(worker["ready_s"]) + float(worker["first_predict_s"]),
                "outcomes": worker["outcomes"],
            }
            for worker in rows
        ],
    }


def _bare_mmap(root: Path) -> tuple[float, float]:
    """(process start to ready, mapping alone) of a process with the workers' imports that maps the artifacts
    with safetensors and does nothing else."""
    started = time.time()
    output = subprocess.run(
        [sys.executable, "-c", _BARE_MMAP, str(root / "artifacts")],
        capture_output=True,
        check=True,
        timeout=600,
        env=_environment(),
    ).stdout
    found = json.loads(output.decode().strip().splitlines()[-1])
    return float(found["ready_at"]) - started, float(found["ready_at"]) - float(found["imported_at"])


def run_serve_bench(options: ServeBenchOptions, say: Callable[[str], None] = lambda _line: None) -> dict[str, Any]:
    """Every row of the serving benchmark, with the goal checks; returns the JSON-ready result."""
    if not options.example.is_file():
        raise FileNotFoundError(f"{options.example} not found: run `hwr bench --serve` from a checkout of the project")
    with tempfile.TemporaryDirectory(prefix="hwr-bench-serve-", dir=options.workdir) as work:
        base = Path(work)
        say("building the pipeline")
        model = save_proportional_flux_pipeline(base / "flux", transformer_bytes=options.transformer_bytes)
        root = base / "hwr"
        root.mkdir(mode=0o700)
        rows = []
        say("publishing (one cold worker)")
        cold = _row(options, model, root, 1, canonical=False)
        for workers in options.worker_counts:
            for canonical in (True, False):
                say(f"{workers} {'canonical' if canonical else 'load_pipeline'} workers")
                rows.append(_row(options, model, root, workers, canonical))
        say("bare mmap reference")
        bare = _bare_mmap(root)
        artifact_bytes = sum(path.stat().st_size for path in (root / "artifacts").rglob("*.safetensors"))
    return _with_goals(options, cold, rows, bare, artifact_bytes)


def _with_goals(
    options: ServeBenchOptions,
    cold: dict[str, Any],
    rows: Sequence[dict[str, Any]],
    bare: tuple[float, float],
    artifact_bytes: int,
) -> dict[str, Any]:
    """Two ratios per load_pipeline row for its later workers (2..N): from process start (imports included,
    against the bare process's start to ready plus one canonical step), and the load alone (its wait for
    the load lock, the load and the first request, against mapping the artifacts plus one canonical step at
    the same N, since N workers share the CPUs)."""
    bare_ready, bare_map = bare
    goals = []
    for row in rows:
        if row["loader"] != "load_pipeline":
            continue
        canonical = next(r for r in rows if r["loader"] == "canonical" and r["workers"] == row["workers"])
        step = min(worker["first_predict_s"] for worker in canonical["per_worker"])
        later = row["per_worker"][1:]
        loads = [(w["lock_wait_s"] or 0.0) + w["load_s"] + w["first_predict_s"] for w in later]
        goals.append(
            {
                "workers": row["workers"],
                "canonical_step_s": step,
                "artifact_pss_over_one_copy": row["artifact_pss_bytes"] / artifact_bytes,
                "node_pss_over_canonical": row["node_pss_bytes"] / canonical["node_pss_bytes"],
                "slowest_later_first_response_over_reference": max(
                    (w["first_response_s"] / (bare_ready + step) for w in later), default=None
                ),
                "slowest_later_load_and_first_request_over_reference": max(
                    (load / (bare_map + step) for load in loads), default=None
                ),
            }
        )
    return {
        "options": {
            "transformer_bytes": options.transformer_bytes,
            "worker_counts": list(options.worker_counts),
            "threads": options.threads,
            "steps": options.steps,
        },
        "artifact_bytes": artifact_bytes,
        "bare_mmap_ready_s": bare_ready,
        "bare_mmap_map_s": bare_map,
        "cold": cold,
        "rows": list(rows),
        "goals": goals,
    }


def serve_markdown(data: dict[str, Any]) -> str:
    """The result as Markdown: one line per row and worker, then the goal ratios."""
    mib = 2**20
    lines = [
        "| workers | loader | worker | ready (s) | first predict (s) | first response (s) | outcomes |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in [data["cold"], *data["rows"]]:
        for index, worker in enumerate(row["per_worker"], 1):
            outcomes = ", ".join(sorted(set(worker["outcomes"].values())))
            lines.append(
                f"| {row['workers']} | {row['loader']} | {index} | {worker['ready_s']:.2f} | "
                f"{worker['first_predict_s']:.2f} | {worker['first_response_s']:.2f} | {outcomes} |"
            )
    lines += ["", "| workers | loader | node PSS (MiB) | artifact PSS (MiB) |", "|---|---|---|---|"]
    for row in data["rows"]:
        lines.append(
            f"| {row['workers']} | {row['loader']} | {row['node_pss_bytes'] / mib:.1f} | "
            f"{row['artifact_pss_bytes'] / mib:.1f} |"
        )
    lines += [
        "",
        f"Artifacts: {data['artifact_bytes'] / mib:.1f} MiB. Bare mmap process: ready {data['bare_mmap_ready_s']:.2f} s"
        f" after start, {data['bare_mmap_map_s'] * 1000:.0f} ms of it mapping.",
        "",
        "| workers | canonical step (s) | artifact PSS / one copy (goal <= 1.1) | node PSS / canonical |"
        " later workers: start to first response / (bare ready + step) | later workers: lock wait + load + first"
        " request / (bare map + step) (goal <= 1.5) |",
        "|---|---|---|---|---|---|",
    ]
    for goal in data["goals"]:
        ratios = [
            "-" if goal[name] is None else f"{goal[name]:.2f}"
            for name in (
                "slowest_later_first_response_over_reference",
                "slowest_later_load_and_first_request_over_reference",
            )
        ]
        lines.append(
            f"| {goal['workers']} | {goal['canonical_step_s']:.2f} | {goal['artifact_pss_over_one_copy']:.2f} |"
            f" {goal['node_pss_over_canonical']:.2f} | {ratios[0]} | {ratios[1]} |"
        )
    return "\n".join(lines) + "\n"

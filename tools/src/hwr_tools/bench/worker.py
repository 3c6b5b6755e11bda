"""One benchmark worker: a fresh interpreter that imports what its row needs, then runs the row once when told.

Imports are off the clock: the runner starts a batch of workers, waits until every one
says `ready`, and only then sends `go` (to one, or to a whole group at once), so no
import competes with a measured run for the CPUs. Each worker measures exactly one run
and exits: every run is a fresh process with nothing loaded.

Protocol, one JSON object per line: the worker writes `{"ready": true}`, reads `go`,
writes `{"row": ...}` (or `{"error": ...}`), and when held reads `release` before it
drops its model and exits. Its fd 1 points at stderr, so stray prints cannot corrupt
the protocol, which runs on a duplicate of the original stdout.
"""

from __future__ import annotations

import gc
import importlib
import json
import os
import re
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .measure import LoadKind, RowSpec, join_group, leave_group, model_class, run_row
from .peers import peer_named

__all__ = ["ENV_PROFILE", "main", "preimported_worker", "worker_arguments", "worker_command", "worker_environment"]

ENV_PROFILE = "HWR_BENCH_PROFILE"


def worker_arguments(spec: RowSpec, *, hold: bool) -> list[str]:
    """The arguments of `main` for one run of `spec`."""
    arguments = [json.dumps(spec.to_dict())]
    return [*arguments, "--hold"] if hold else arguments


def worker_command(spec: RowSpec, *, hold: bool) -> list[str]:
    """The command line of a worker for one run of `spec`."""
    return [sys.executable, "-m", "hwr_tools.bench.worker", *worker_arguments(spec, hold=hold)]


def preimported_worker(
    arguments: list[str], environment: dict[str, str] | None, stdin_fd: int, stdout_fd: int, stderr_fd: int
) -> None:
    """`main` in a child forked from the preimported server: the batch's pipes become its stdin and stdout, its
    log its stderr, and `environment` (if any) replaces the one it inherited, as `env=` does for a command."""
    if environment is not None:
        os.environ.clear()
        os.environ.update(environment)
    for fd, target in ((stdin_fd, 0), (stdout_fd, 1), (stderr_fd, 2)):
        os.dup2(fd, target)
        os.close(fd)
    sys.stdin = open(0, closefd=False)  # noqa: SIM115 - multiprocessing pointed it at /dev/null
    sys.exit(main(arguments))


def worker_environment(spec: RowSpec) -> dict[str, str] | None:
    """The worker's environment: a hub-cache row runs with HF_HUB_OFFLINE=1 (set before huggingface_hub is
    imported, which reads it once), so diffusers never asks the network; None inherits the runner's."""
    if spec.cache_dir is None:
        return None
    return {**os.environ, "HF_HUB_OFFLINE": "1"}


def _preload(spec: RowSpec) -> object:
    """Import everything the row uses, so the timed load pays no import."""
    flux_class = model_class()
    if spec.remote_url is not None:  # the remote's fsspec backend (s3fs, botocore) is imported off the clock too
        import fsspec.core

        fsspec.core.url_to_fs(spec.remote_url, **(spec.remote_options or {}))
    if spec.kind is LoadKind.PEER and spec.peer is not None:
        importlib.import_module("safetensors.torch")
        importlib.import_module(peer_named(spec.peer).requirement)
    join_group(spec)  # a TP rank: every rank of its group must have started, which the batch guarantees
    return flux_class


def _profiled(spec: RowSpec, flux_class: object) -> tuple[dict[str, Any], Any]:
    """run_row, under pyinstrument when HWR_BENCH_PROFILE names a folder (the profile goes there as text)."""
    folder = os.environ.get(ENV_PROFILE)
    if not folder:
        return run_row(spec, flux_class)
    import pyinstrument

    profiler = pyinstrument.Profiler(interval=0.0005)
    profiler.start()
    try:
        return run_row(spec, flux_class)
    finally:
        profiler.stop()
        name = re.sub(r"[^A-Za-z0-9_.-]+", "_", spec.name).strip("_")
        (Path(folder) / f"{name}-{os.getpid()}.txt").write_text(profiler.output_text(unicode=False, color=False))


def main(argv: Sequence[str] | None = None) -> int:
    """Run one row once, as the runner directs over stdin and stdout."""
    arguments = list(sys.argv[1:] if argv is None else argv)
    hold = "--hold" in arguments
    spec = RowSpec.from_dict(json.loads(next(argument for argument in arguments if argument != "--hold")))
    if spec.background_verify is not None:
        os.environ["HWR_BACKGROUND_VERIFY"] = spec.background_verify
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    flux_class = _preload(spec)
    # The imports left a full collection due: paid now, before any clock (a run's or a group's wall) starts,
    # it cannot land in the timed load of whichever row happens to allocate the most.
    gc.collect()
    replies.write(json.dumps({"ready": True}) + "\n")
    if sys.stdin.readline().strip() != "go":
        return 1
    loaded = None
    try:
        row, loaded = _profiled(spec, flux_class)
        replies.write(json.dumps({"row": row}) + "\n")
    except Exception:
        replies.write(json.dumps({"error": f"{spec.name}: {traceback.format_exc(limit=8)}"}) + "\n")
        return 1
    if hold:
        sys.stdin.readline()
    loaded.close()
    leave_group(spec)
    return 0


if __name__ == "__main__":
    sys.exit(main())

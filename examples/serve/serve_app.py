"""Serve a diffusers pipeline over HTTP with N LitServe worker processes on one copy of the weights.

    python examples/serve/serve_app.py --model /models/flux --workers 4 --root /dev/shm/hwr --port 8000

Every option has an environment variable (HWR_SERVE_MODEL, HWR_SERVE_WORKERS, HWR_SERVE_PORT, ...;
the domain is HWR_ROOT and the mode HWR_MODE, as for any runtime). Endpoints:

- POST /predict   {"prompt": ..., "seed": ...} -> the image tensor's exact bytes (see serve_api.py);
                  503 with Retry-After while no worker has finished loading.
- GET  /status    each worker's state, pid, time to ready and, per component, where its weights came from.
- GET  /ready     readiness: 200 once a worker is ready (it can serve /predict), 503 until then.
- GET  /live      liveness: 200 while the HTTP side answers, even while every worker still loads.
- GET  /health    LitServe's: 200 once every worker is ready.

Start-up checks the arguments: a `--call-arg` that is not JSON, that sets what each request sets
(num_inference_steps, height, width, guidance_scale, generator, prompt, output_type), or that the
pipeline's `__call__` does not take (for a pipeline folder) stops the service with one line.

Workers load one at a time (a file lock in the state directory): the first maps the node's artifact,
or loads canonically and publishes it, and every later worker, a restarted one too, maps it.
SIGTERM or SIGINT stops the service; each worker closes its leases on the way out.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

import litserve as ls
from fastapi import Request, Response
from fastapi.responses import JSONResponse
from litserve.utils import WorkerSetupStatus

import serve_status
from serve_api import DiffusionAPI, ServiceConfig, call_kwargs_problem

RETRY_AFTER_S = 1


class EarlyListeningServer(ls.LitServer):
    """A LitServer whose HTTP side starts with the workers, not after the first one is ready.

    So /status shows workers while they load, and a request that comes too early gets a 503.
    """

    def verify_worker_status(self) -> None:
        return None


def _pairs(values: list[str], what: str) -> dict[str, str]:
    found = {}
    for value in values:
        name, equals, rest = value.partition("=")
        if not equals or not name or not rest:
            raise SystemExit(f"--{what} takes NAME=VALUE, got {value!r}")
        found[name] = rest
    return found


def _parse(argv: list[str] | None) -> argparse.Namespace:
    env = os.environ.get
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=env("HWR_SERVE_MODEL"), help="pipeline folder or cached repo id")
    parser.add_argument("--workers", type=int, default=int(env("HWR_SERVE_WORKERS", "2")))
    parser.add_argument(
        "--revision", default=env("HWR_SERVE_REVISION"), help="a repo id's revision in the local cache (a commit)"
    )
    parser.add_argument("--root", default=env("HWR_ROOT"), help="the node's domain (HWR_ROOT)")
    parser.add_argument("--mode", default=env("HWR_MODE"), choices=["preferred", "required", "disabled"])
    parser.add_argument("--host", default=env("HWR_SERVE_HOST", "127.0.0.1"), choices=["127.0.0.1", "0.0.0.0", "::"])
    parser.add_argument("--port", type=int, default=int(env("HWR_SERVE_PORT", "8000")))
    parser.add_argument(
        "--threads", type=int, default=int(env("HWR_SERVE_THREADS", "1")), help="torch threads per worker"
    )
    parser.add_argument(
        "--state-dir", default=env("HWR_SERVE_STATE_DIR"), help="worker status files (default: a temporary directory)"
    )
    parser.add_argument("--parallel-load", action="store_true", help="let workers load at the same time")
    parser.add_argument("--lora", action="append", default=[], metavar="NAME=PATH", help="an adapter requests may name")
    parser.add_argument(
        "--call-arg", action="append", default=[], metavar="NAME=JSON", help="passed to every pipeline call"
    )
    parser.add_argument("--request-timeout", type=float, default=float(env("HWR_SERVE_REQUEST_TIMEOUT_S", "300")))
    args = parser.parse_args(argv)
    if not args.model:
        parser.error("give the pipeline with --model or HWR_SERVE_MODEL")
    if not Path(args.model).exists() and "/" not in args.model:
        parser.error(f"--model {args.model!r} is neither a folder nor a repo id")
    if args.workers < 1:
        parser.error("--workers must be at least 1")
    args.call_kwargs = _call_kwargs(parser, args.call_arg, args.model)
    return args


def _call_kwargs(parser: argparse.ArgumentParser, values: list[str], model: str) -> dict[str, Any]:
    """--call-arg NAME=JSON, checked at start: valid JSON, no clash with what a request sets, a name the call takes."""
    found: dict[str, Any] = {}
    for name, text in _pairs(values, "call-arg").items():
        try:
            found[name] = json.loads(text)
        except json.JSONDecodeError as exc:
            parser.error(f"--call-arg {name}={text}: the value must be JSON ({exc}), e.g. {name}=512 or {name}='\"x\"'")
    problem = call_kwargs_problem(found)
    if problem is not None:
        parser.error(problem)
    accepted = _call_parameters(model)
    unknown = sorted(set(found) - accepted[1]) if accepted is not None and not accepted[0] else []
    if unknown:
        parser.error(f"--call-arg {unknown[0]}: the pipeline's __call__ takes no argument {unknown[0]!r}")
    return found


def _call_parameters(model: str) -> tuple[bool, set[str]] | None:
    """(takes **kwargs, its parameter names) of the pipeline class model_index.json names; None when unknown."""
    index = Path(model) / "model_index.json"
    try:
        class_name = json.loads(index.read_text(encoding="utf-8")).get("_class_name")
    except (OSError, ValueError):
        return None
    import inspect

    import diffusers

    pipeline_class = getattr(diffusers, class_name, None) if isinstance(class_name, str) else None
    if pipeline_class is None:
        return None
    parameters = inspect.signature(pipeline_class.__call__).parameters
    variadic = any(parameter.kind is inspect.Parameter.VAR_KEYWORD for parameter in parameters.values())
    return variadic, set(parameters)


def _add_routes(server: ls.LitServer, state_dir: Path) -> None:
    app = server.app

    def any_worker_ready() -> bool:
        states = getattr(server, "workers_setup_status", None) or {}
        return any(state == WorkerSetupStatus.READY for state in states.values())

    @app.middleware("http")
    async def refuse_until_ready(request: Request, call_next: Any) -> Response:
        if request.url.path == "/predict" and not any_worker_ready():
            return JSONResponse(
                {"detail": "no worker has finished loading the pipeline yet; retry shortly (see GET /status)"},
                status_code=503,
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        response: Response = await call_next(request)
        return response

    @app.get("/ready")
    async def ready() -> JSONResponse:
        """The readiness probe: 200 once a worker can serve /predict, 503 until then."""
        ok = any_worker_ready()
        return JSONResponse({"ready": ok}, status_code=200 if ok else 503)

    @app.get("/live")
    async def live() -> JSONResponse:
        """The liveness probe: 200 while the HTTP side answers, loading or not (a load can take minutes)."""
        return JSONResponse({"live": True})

    @app.get("/status")
    async def status() -> JSONResponse:
        workers = serve_status.read_all(state_dir)
        return JSONResponse({"ready": any_worker_ready(), "workers": workers, "state_dir": str(state_dir)})


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.root:
        os.environ["HWR_ROOT"] = args.root
    if args.mode:
        os.environ["HWR_MODE"] = args.mode
    owned = None if args.state_dir else tempfile.TemporaryDirectory(prefix="hwr-serve-")
    state_dir = Path(args.state_dir or owned.name)  # type: ignore[union-attr]
    state_dir.mkdir(parents=True, exist_ok=True)
    for stale in state_dir.glob("worker-*.json"):
        stale.unlink()
    config = ServiceConfig(
        model=args.model,
        state_dir=state_dir,
        threads=args.threads,
        serial_load=not args.parallel_load,
        loras=_pairs(args.lora, "lora"),
        call_kwargs=args.call_kwargs,
        revision=args.revision,
    )
    server = EarlyListeningServer(
        DiffusionAPI(config),
        accelerator="cpu",
        workers_per_device=args.workers,
        timeout=args.request_timeout,
        restart_workers=True,
    )
    _add_routes(server, state_dir)

    def stop(_signum: int, _frame: object) -> None:
        event = server._shutdown_event
        if event is None:  # still starting: nothing to wind down yet
            raise KeyboardInterrupt
        # LitServe's run() waits on this event; setting it from another thread (its own connection to the
        # manager) lets run() stop its worker monitor, then stop the HTTP side and every worker with SIGTERM.
        threading.Thread(target=event.set, name="hwr-serve-stop", daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        server.run(host=args.host, port=args.port, num_api_servers=1, generate_client_file=False, log_level="warning")
    finally:
        if owned is not None:
            owned.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())

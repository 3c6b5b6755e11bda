"""The LitServe API each worker process runs: load the pipeline once in `setup`, then generate per request.

A request is JSON: {"prompt": str, "seed": int, "steps": int, "height": int, "width": int,
"guidance_scale": float, "adapter": str | null}. The answer carries the image tensor exactly
(`output_type="pt"`, its raw bytes in base64 with shape and dtype) so a client can compare it bit for bit,
and says which worker (id, pid) made it.
"""

from __future__ import annotations

import base64
import os
import signal
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import litserve as ls
import torch
from fastapi import HTTPException

import serve_status
from serve_loading import ServedPipeline, import_loading_modules, load_served_pipeline

_LIMITS = {"steps": (1, 50), "height": (8, 2048), "width": (8, 2048)}


@dataclass(frozen=True)
class ServiceConfig:
    """What every worker needs to know; pickled into each worker process by LitServe."""

    model: str
    state_dir: Path
    revision: str | None = None  # a repo id's revision in the local cache (the commit the node was prewarmed with)
    threads: int = 1
    serial_load: bool = True
    load_lock_timeout_s: float = 600.0
    loras: dict[str, str] = field(default_factory=dict)
    call_kwargs: dict[str, Any] = field(default_factory=dict)  # passed to every pipeline call


# Pipeline-call arguments every request sets itself (from its fields): a --call-arg may not set them too.
PER_REQUEST = {
    "prompt": "prompt",
    "num_inference_steps": "steps",
    "height": "height",
    "width": "width",
    "guidance_scale": "guidance_scale",
    "generator": "seed",
    "output_type": None,
}


def call_kwargs_problem(call_kwargs: dict[str, Any]) -> str | None:
    """Why these fixed pipeline-call arguments would break every request (None when they would not)."""
    for name in call_kwargs:
        if name in PER_REQUEST:
            field = PER_REQUEST[name]
            per_request = (
                f"each request's {field!r} field sets it" if field else "the service sets it (images as tensors)"
            )
            return f"--call-arg {name} clashes with a per-request argument: {per_request}; drop --call-arg {name}"
    return None


def _bounded_int(body: dict[str, Any], name: str, default: int) -> int:
    value = body.get(name, default)
    low, high = _LIMITS[name]
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise HTTPException(status_code=422, detail=f"{name} must be an integer from {low} to {high}, got {value!r}")
    return value


def encode_image(image: torch.Tensor) -> dict[str, Any]:
    """The tensor's exact bytes: base64 of its contiguous storage, with shape and dtype to rebuild it."""
    flat = image.detach().contiguous().reshape(-1)
    raw = flat.view(torch.uint8).numpy().tobytes()
    return {
        "shape": list(image.shape),
        "dtype": str(image.dtype).removeprefix("torch."),
        "data": base64.b64encode(raw).decode(),
    }


def decode_image(encoded: dict[str, Any]) -> torch.Tensor:
    """The inverse of `encode_image`, for clients."""
    dtype = getattr(torch, encoded["dtype"])
    raw = bytearray(base64.b64decode(encoded["data"]))
    return torch.frombuffer(raw, dtype=torch.uint8).view(dtype).reshape(encoded["shape"]).clone()


class DiffusionAPI(ls.LitAPI):
    """One worker: its pipeline, its status file, and its leases, closed when the worker is stopped."""

    def __init__(self, config: ServiceConfig) -> None:
        super().__init__()
        self.config = config
        self.worker_id = -1
        self.served: ServedPipeline | None = None
        self.status: dict[str, Any] = {}

    # ------------------------------------------------------------------ loading

    def setup(self, device: str) -> None:
        self.worker_id = int(os.environ.get("LITSERVE_WORKER_ID", "0"))
        torch.set_num_threads(self.config.threads)
        previous = serve_status.read_worker(self.config.state_dir, self.worker_id) or {}
        started_at = serve_status.process_started_at()
        self.status = {
            "worker_id": self.worker_id,
            "pid": os.getpid(),
            "device": device,
            "state": "waiting",
            "starts": int(previous.get("starts", 0)) + 1,
            "process_started_at": started_at,
            "mode": os.environ.get("HWR_MODE", "preferred"),
            "domain_root": os.environ.get("HWR_ROOT"),
            "requests": 0,
        }
        self._publish()
        signal.signal(signal.SIGTERM, self._stop)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the service stops its workers with SIGTERM
        import_started = time.perf_counter()
        import_loading_modules(
            self.config.model
        )  # outside the load lock: workers import side by side, then load one at a time
        self.status["import_s"] = time.perf_counter() - import_started
        lock_wait_s = 0.0
        try:
            if self.config.serial_load:
                with serve_status.one_load_at_a_time(self.config.state_dir, self.config.load_lock_timeout_s) as waited:
                    lock_wait_s = waited
                    self._load()
            else:
                self._load()
        except Exception as exc:  # reported on /status; LitServe marks the worker failed
            self.status.update(state="failed", error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc())
            self._publish()
            raise
        served = self.served
        assert served is not None
        self.status.update(
            state="ready",
            lock_wait_s=lock_wait_s,
            load_s=served.load_s,
            ready_s=time.time() - started_at,
            components=served.components,
            domain_error=served.domain_error,
            outcomes={name: report["outcome"] for name, report in served.components.items()},
            adapters=sorted(self.config.loras),
        )
        self._publish()

    def _load(self) -> None:
        self.status.update(state="loading")
        self._publish()
        served = load_served_pipeline(self.config.model, self.config.revision)
        for name, path in sorted(self.config.loras.items()):
            served.pipeline.load_lora_weights(path, adapter_name=name)
        if self.config.loras:
            served.pipeline.disable_lora()
        self.served = served

    def _publish(self) -> None:
        serve_status.write_worker(self.config.state_dir, self.worker_id, self.status)

    def _stop(self, signum: int, _frame: object) -> None:
        """Close the leases and leave: LitServe stops its workers with SIGTERM."""
        if self.served is not None:
            self.served.close()
        self.status.update(state="stopped", stopped_by=signal.Signals(signum).name)
        self._publish()
        sys.stdout.flush()
        os._exit(0)  # the worker's loop holds queues that must not be joined at exit

    # ------------------------------------------------------------------ serving

    def decode_request(self, request):  # type: ignore[no-untyped-def]  # unannotated: LitServe then passes the JSON body
        body = request if isinstance(request, dict) else {}
        prompt = body.get("prompt")
        if not isinstance(prompt, str) or not prompt:
            raise HTTPException(status_code=422, detail="prompt must be a non-empty string")
        seed = body.get("seed")
        if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
            raise HTTPException(status_code=422, detail=f"seed must be a non-negative integer, got {seed!r}")
        adapter = body.get("adapter")
        if adapter is not None and adapter not in self.config.loras:
            known = ", ".join(sorted(self.config.loras)) or "none"
            raise HTTPException(status_code=422, detail=f"unknown adapter {adapter!r}; this service has: {known}")
        guidance = body.get("guidance_scale", 3.5)
        if not isinstance(guidance, (int, float)) or isinstance(guidance, bool):
            raise HTTPException(status_code=422, detail=f"guidance_scale must be a number, got {guidance!r}")
        return {
            "prompt": prompt,
            "seed": seed,
            "steps": _bounded_int(body, "steps", 4),
            "height": _bounded_int(body, "height", 64),
            "width": _bounded_int(body, "width", 64),
            "guidance_scale": float(guidance),
            "adapter": adapter,
        }

    def predict(self, request: dict[str, Any]) -> dict[str, Any]:
        served = self.served
        if served is None:
            raise HTTPException(status_code=503, detail="this worker has no pipeline loaded")
        pipeline = served.pipeline
        started = time.perf_counter()
        if self.config.loras:
            if request["adapter"] is None:
                pipeline.disable_lora()
            else:
                pipeline.enable_lora()
                pipeline.set_adapters(request["adapter"])
        with torch.inference_mode():
            image = pipeline(
                request["prompt"],
                num_inference_steps=request["steps"],
                height=request["height"],
                width=request["width"],
                guidance_scale=request["guidance_scale"],
                generator=torch.Generator("cpu").manual_seed(request["seed"]),
                output_type="pt",
                **self.config.call_kwargs,
            ).images
        if not self.status["requests"]:
            self.status["first_predict_s"] = time.perf_counter() - started
            self.status["first_response_s"] = time.time() - float(self.status["process_started_at"])
        self.status["requests"] = int(self.status["requests"]) + 1
        self._publish()
        return {"image": encode_image(image), "seed": request["seed"], "adapter": request["adapter"]}

    def encode_response(self, output):  # type: ignore[no-untyped-def]  # unannotated: LitServe returns it as JSON
        return {**output, "worker_id": self.worker_id, "pid": os.getpid()}

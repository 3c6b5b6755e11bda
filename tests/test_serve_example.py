"""P05 and the serving example end to end: LitServe workers on 127.0.0.1 sharing one copy of the weights.

The example service (examples/serve/serve_app.py) runs as a real subprocess with 3 worker processes on a
tiny Flux pipeline, one LoRA adapter and a private domain. The test holds the service's load lock at start,
so the workers are certainly still loading when the first request comes (it gets a 503); every other wait
polls /status in a bounded loop. Canonical images come from `DiffusionPipeline.from_pretrained` in a fresh
process of their own (tests/_serve_support.py).
"""

from __future__ import annotations

import concurrent.futures
import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from host_weight_runtime import FilesystemHostWeightStore
from hwr_tools.bench.serve import stop_service
from hwr_tools.memory import mapped_file_memory, total_mapped_memory
from hwr_tools.synthetic_pipelines import save_tiny_pipeline
from tests._serve_support import CALL_KWARGS, SERVE_EXAMPLE, make_lora

pytestmark = pytest.mark.slow

WORKERS = 3
START_TIMEOUT_S = 240.0
REQUEST_TIMEOUT_S = 120.0
BASE = {"prompt": "red cube", "steps": 2, "height": 16, "width": 16, "guidance_scale": 3.5}
REQUESTS = [{**BASE, "seed": seed} for seed in range(5)] + [
    {**BASE, "seed": 1, "adapter": "ink"},
    {**BASE, "seed": 2, "adapter": "ink"},
]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _http(method: str, url: str, body: dict[str, Any] | None = None) -> tuple[int, dict[str, str], Any]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as answer:
            return (
                answer.status,
                {k.lower(): v for k, v in answer.headers.items()},
                json.loads(answer.read() or b"null"),
            )
    except urllib.error.HTTPError as error:
        text = error.read()
        try:
            payload = json.loads(text)
        except ValueError:
            payload = text.decode(errors="replace")
        return error.code, {k.lower(): v for k, v in error.headers.items()}, payload


@dataclass
class Service:
    """The example service as a child process, and what the test saw of it."""

    process: subprocess.Popen[bytes]
    port: int
    root: Path
    state_dir: Path
    log: Path
    seen: dict[str, Any] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def status(self) -> dict[str, Any] | None:
        """The /status answer, or None while the HTTP side is not up yet."""
        try:
            code, _, payload = _http("GET", self.url + "/status")
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return None
        return payload if code == 200 else None

    def wait_for(self, what: str, check: Callable[[dict[str, Any]], bool], timeout_s: float) -> dict[str, Any]:
        """Poll /status until `check` holds; fail with the last status and the log's tail after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        last: dict[str, Any] | None = None
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                pytest.fail(f"the service exited ({self.process.returncode}) waiting for {what}:\n{self.tail()}")
            last = self.status()
            if last is not None and check(last):
                return last
            time.sleep(0.2)
        pytest.fail(f"timed out after {timeout_s:.0f} s waiting for {what}; last status {last}\n{self.tail()}")

    def generate(self, request: dict[str, Any]) -> tuple[int, Any]:
        code, _, payload = _http("POST", self.url + "/predict", request)
        return code, payload

    def tail(self) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-40:])


def _workers(status: dict[str, Any]) -> list[dict[str, Any]]:
    return list(status["workers"])


def _all_ready(status: dict[str, Any]) -> bool:
    """Every worker says it is ready, and LitServe routes /predict (its own setup status, set after `setup`)."""
    workers = _workers(status)
    return bool(status["ready"]) and len(workers) == WORKERS and all(worker["state"] == "ready" for worker in workers)


def _start(tmp: Path, model: Path, root: Path, *, workers: int, extra: list[str], hold_load: bool) -> Service:
    state_dir = tmp / "state"
    state_dir.mkdir()
    log = tmp / "service.log"
    port = _free_port()
    command = [
        sys.executable,
        str(SERVE_EXAMPLE / "serve_app.py"),
        *("--model", str(model), "--workers", str(workers), "--root", str(root), "--mode", "preferred"),
        *("--port", str(port), "--state-dir", str(state_dir)),
        *(f"--call-arg={name}={json.dumps(value)}" for name, value in CALL_KWARGS.items()),
        *extra,
    ]
    lock = open(state_dir / "load.lock", "a+b")  # noqa: SIM115 - held while the service starts, closed below
    if hold_load:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
    with open(log, "wb") as output:
        process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, env={**os.environ})
    service = Service(process, port, root, state_dir, log)
    try:
        if hold_load:
            loading = service.wait_for(
                "every worker waiting for the load lock",
                lambda s: len(_workers(s)) == workers and all(w["state"] == "waiting" for w in _workers(s)),
                START_TIMEOUT_S,
            )
            service.seen["while_loading"] = _http("POST", service.url + "/predict", REQUESTS[0])
            service.seen["health_while_loading"] = _http("GET", service.url + "/health")[0]
            service.seen["ready_while_loading"] = _http("GET", service.url + "/ready")[0]
            service.seen["live_while_loading"] = _http("GET", service.url + "/live")[0]
            service.seen["status_while_loading"] = loading
    except BaseException:
        stop_service(process, timeout_s=90)
        raise
    finally:
        lock.close()  # releases the flock: the workers load
    return service


def _stop(service: Service, signum: int = signal.SIGTERM) -> int:
    try:
        return stop_service(service.process, signum, timeout_s=90)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the service did not stop within 90 s of {signal.Signals(signum).name}:\n{service.tail()}")


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    base = tmp_path_factory.mktemp("serve")
    model = save_tiny_pipeline(base / "flux", "flux", seed=7)
    lora = make_lora("flux", base / "lora-ink", seed=21)
    spec = {"folder": str(model), "requests": REQUESTS, "loras": {"ink": str(lora)}}
    reference = subprocess.Popen(
        [sys.executable, "-m", "tests._serve_support", json.dumps(spec)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        cwd=Path(__file__).resolve().parents[1],
    )
    try:
        yield {"base": base, "model": model, "lora": lora, "reference": reference}
    finally:
        if reference.poll() is None:
            reference.kill()
        reference.communicate(timeout=30)


@pytest.fixture(scope="module")
def canonical(setup: dict[str, Any]) -> list[dict[str, Any]]:
    output, _ = setup["reference"].communicate(timeout=START_TIMEOUT_S)
    assert setup["reference"].returncode == 0
    answers: list[dict[str, Any]] = json.loads(output)
    return answers


@pytest.fixture(scope="module")
def service(setup: dict[str, Any]) -> Iterator[Service]:
    base: Path = setup["base"]
    root = base / "hwr"
    root.mkdir(mode=0o700)
    (base / "main").mkdir()
    started = _start(
        base / "main", setup["model"], root, workers=WORKERS, extra=[f"--lora=ink={setup['lora']}"], hold_load=True
    )
    try:
        started.wait_for("all workers ready", _all_ready, START_TIMEOUT_S)
        yield started
    finally:
        stop_service(started.process, timeout_s=90)


def _served(worker: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {name: report for name, report in worker["components"].items() if report.get("handling") == "served"}


def test_a_request_while_every_worker_is_loading_gets_503(service: Service) -> None:
    """While no worker has its pipeline, /predict answers 503 with Retry-After and a message naming /status;
    /status already lists every worker (waiting), and LitServe's /health says 503. The readiness probe (/ready)
    says 503 until a worker is ready and 200 after; the liveness probe (/live) says 200 throughout."""
    code, headers, payload = service.seen["while_loading"]
    assert code == 503
    assert int(headers["retry-after"]) >= 1
    assert "/status" in payload["detail"]
    assert service.seen["health_while_loading"] == 503
    assert service.seen["ready_while_loading"] == 503 and service.seen["live_while_loading"] == 200
    assert _http("GET", service.url + "/ready")[0] == 200 and _http("GET", service.url + "/live")[0] == 200
    assert {worker["state"] for worker in _workers(service.seen["status_while_loading"])} == {"waiting"}


def test_concurrent_requests_equal_the_canonical_pipeline(service: Service, canonical: list[dict[str, Any]]) -> None:
    """P05: concurrent requests with fixed seeds, with and without the LoRA adapter (switched per request), get
    exactly the images of a canonical pipeline (with the same adapter) in a fresh process."""
    with concurrent.futures.ThreadPoolExecutor(len(REQUESTS)) as pool:
        answers = list(pool.map(service.generate, REQUESTS))
    for request, (code, payload), want in zip(REQUESTS, answers, canonical, strict=True):
        assert code == 200, payload
        assert payload["image"] == want, f"seed {request['seed']} adapter {request.get('adapter')}"
    assert canonical[1] != canonical[5], "the adapter changed nothing: the comparison would prove little"


def test_later_workers_map_the_first_workers_artifacts(service: Service) -> None:
    """P05: the first worker to load publishes; the two later workers report a local hit for every served
    component (at least the transformer and the VAE), every weighted component has a record, and the later
    workers' artifact mappings sum to about one copy (PSS), though each has all of it resident."""
    status = service.wait_for("all workers ready", _all_ready, START_TIMEOUT_S)
    workers = _workers(status)
    first = [w for w in workers if {r["outcome"] for r in _served(w).values()} == {"canonical_fallback"}]
    later = [w for w in workers if w not in first]
    assert len(first) == 1 and len(later) == WORKERS - 1, [w["outcomes"] for w in workers]
    assert {r["publication"] for r in _served(first[0]).values()} == {"published"}
    for worker in later:
        served = _served(worker)
        assert {"transformer", "vae"} <= served.keys()
        assert {name: report["outcome"] for name, report in served.items()} == dict.fromkeys(served, "local_hit")
        for name, report in worker["components"].items():
            assert report["handling"] == "served" or report["reason"], f"{name} is canonical without a reason"
    artifacts = service.root / "artifacts"
    copy = sum(path.stat().st_size for path in artifacts.rglob("*.safetensors"))
    memory = [mapped_file_memory(worker["pid"], artifacts) for worker in later]
    assert all(m.rss >= 0.9 * copy for m in memory), (copy, memory)
    assert sum(m.pss for m in memory) <= 1.1 * max(m.rss for m in memory), (copy, memory)
    assert mapped_file_memory(first[0]["pid"], artifacts).mappings == 0


def test_a_killed_worker_comes_back_as_a_local_hit(service: Service, canonical: list[dict[str, Any]]) -> None:
    """P05: the worker that loaded canonically is killed (SIGKILL); LitServe restarts it, the new process maps
    the artifacts (local hit for every served component), requests meanwhile are answered by the others,
    and then all three workers' artifact mappings sum to about one copy."""
    status = service.wait_for("all workers ready", _all_ready, START_TIMEOUT_S)
    victim = next(w for w in _workers(status) if "canonical_fallback" in w["outcomes"].values())
    os.kill(victim["pid"], signal.SIGKILL)

    def replaced(ready: bool) -> Callable[[dict[str, Any]], bool]:
        def check(s: dict[str, Any]) -> bool:
            worker = next((w for w in _workers(s) if w["worker_id"] == victim["worker_id"]), None)
            return worker is not None and worker["pid"] != victim["pid"] and (worker["state"] == "ready" or not ready)

        return check

    # A request sent within a second of the kill can be lost with the dead worker's pending queue read (LitServe's
    # manager queue), so this one goes once LitServe has noticed the death and started the new process.
    service.wait_for("a new process for the killed worker", replaced(ready=False), START_TIMEOUT_S)
    code, payload = service.generate(REQUESTS[3])
    assert code == 200 and payload["image"] == canonical[3]
    status = service.wait_for("the killed worker restarted and ready", replaced(ready=True), START_TIMEOUT_S)
    back = next(w for w in _workers(status) if w["worker_id"] == victim["worker_id"])
    assert back["starts"] == victim["starts"] + 1
    assert set(_served(back)) == set(_served(victim))
    assert {report["outcome"] for report in _served(back).values()} == {"local_hit"}
    artifacts = service.root / "artifacts"
    memory = [mapped_file_memory(w["pid"], artifacts) for w in _workers(status)]
    assert all(m.mappings > 0 for m in memory)
    total = total_mapped_memory((w["pid"] for w in _workers(status)), artifacts)
    assert total.pss <= 1.1 * max(m.rss for m in memory), memory
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        answers = list(pool.map(service.generate, REQUESTS[:3]))
    assert [payload["image"] for _, payload in answers] == canonical[:3]


def test_sigterm_stops_the_service_and_leaves_no_lease(service: Service) -> None:
    """P05: SIGTERM stops the service; every worker closed its leases and exited, and the domain's inspection
    shows no active lease lock on any artifact."""
    pids = [w["pid"] for w in _workers(service.wait_for("all workers ready", _all_ready, START_TIMEOUT_S))]
    store = FilesystemHostWeightStore(service.root)
    assert any(a.locks.lease_active for a in store.inspect_domain().artifacts)
    assert _stop(service) == 0
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text().lower()
    artifacts = store.inspect_domain().artifacts
    assert artifacts and not any(a.locks.lease_active or a.live_leases for a in artifacts)
    stopped = [json.loads(p.read_text()) for p in sorted(service.state_dir.glob("worker-*.json"))]
    assert [w["state"] for w in stopped] == ["stopped"] * WORKERS


def test_a_worker_on_an_unusable_domain_serves_canonically_and_says_so(
    setup: dict[str, Any], canonical: list[dict[str, Any]]
) -> None:
    """P05: with HWR_ROOT on a group-writable directory (a configuration error the runtime raises), a PREFERRED
    worker of the example loads the pipeline canonically (runtime disabled), answers exactly as the canonical
    pipeline, and its status carries the domain error; the refused root is never written to."""
    base: Path = setup["base"]
    bad = base / "shared-root"
    bad.mkdir()
    bad.chmod(0o770)
    (base / "bad").mkdir()
    service = _start(base / "bad", setup["model"], bad, workers=1, extra=[], hold_load=False)
    try:
        status = service.wait_for(
            "the worker ready", lambda s: bool(s["ready"]) and [w["state"] for w in _workers(s)] == ["ready"], 240
        )
        worker = _workers(status)[0]
        assert worker["domain_error"]["code"] == "unsafe_permissions"
        assert "writable by group or others" in worker["domain_error"]["message"]
        served = _served(worker)
        assert {"transformer", "vae"} <= served.keys()
        assert {report["outcome"] for report in served.values()} == {"canonical_direct"}
        code, payload = service.generate(REQUESTS[0])
        assert code == 200 and payload["image"] == canonical[0]
    finally:
        assert _stop(service, signal.SIGINT) == 0
    assert not any(bad.iterdir()), "a refused domain root must not be written to"


def test_a_full_domain_serves_canonically_and_says_why(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """P05: a worker whose domain is full (HWR_MAX_STORE_BYTES below one artifact) loads the pipeline canonically
    in PREFERRED; its report, which /status shows, names the typed, retryable capacity failure per served
    component, and nothing is published."""
    model = save_tiny_pipeline(tmp_path / "flux", "flux", seed=3)
    root = tmp_path / "hwr"
    root.mkdir(mode=0o700)
    for name, value in (("HWR_ROOT", str(root)), ("HWR_MODE", "preferred"), ("HWR_MAX_STORE_BYTES", "4096")):
        monkeypatch.setenv(name, value)
    monkeypatch.syspath_prepend(str(SERVE_EXAMPLE))
    import serve_loading

    served = serve_loading.load_served_pipeline(str(model))
    try:
        reports = {name: report for name, report in served.components.items() if report["handling"] == "served"}
        assert {"transformer", "vae"} <= reports.keys()
        for name, report in reports.items():
            assert report["outcome"] == "canonical_fallback" and report["load_path"] == "canonical", name
            failure = report["publication_report"]["failure"]
            assert failure["code"] in {"store_limit_exceeded", "artifact_too_large"} and failure["retryable"], name
        assert served.domain_error is None
        assert not any((root / "artifacts").glob("*"))
    finally:
        served.close()

"""One metrics endpoint per pod (X05), and runtimes observed by weak reference."""

from __future__ import annotations

import gc
import os
import socket
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from host_weight_runtime.config import HostWeightRuntimeConfig, RuntimeMode
from host_weight_runtime.metrics import register_metrics
from host_weight_runtime.runtime import HostWeightRuntime

from . import _metrics_children
from ._ops_children import model_identity, model_producer
from .support import recv_within
from .test_eviction import child
from .test_metrics import L, hwr_samples, scrape

RUNTIMES = 200


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_two_worker_processes_are_counted_by_one_scrape(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """X05: two worker processes of one pod, configured only by HWR_METRICS_PORT (one fixed port, no
    PROMETHEUS_MULTIPROC_DIR), each resolve a hit and hold the lease; one HTTP scrape of that port counts both
    resolutions and both live leases. A worker that exits drops out of the live leases at the next scrape; its counts remain."""
    root = tmp_path / "domain"
    setup = HostWeightRuntime(HostWeightRuntimeConfig(root=root)).resolve(model_identity(0), model_producer(0))
    assert setup.lease is not None
    setup.lease.close()
    port = _free_port()
    for name in list(os.environ):
        if name.startswith("HWR_") or name.lower() == "prometheus_multiproc_dir":
            monkeypatch.delenv(name)
    environment = {
        "HWR_ROOT": str(root),
        "HWR_MODE": "preferred",
        "HWR_METRICS_PORT": str(port),
        "HWR_METRICS_ADDR": "127.0.0.1",
    }
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # the pod's /tmp, where the library keeps the shared directory
    with (
        child(_metrics_children.pod_worker, environment) as (one, first),
        child(_metrics_children.pod_worker, environment) as (two, second),
    ):
        (outcome_one, serves_one), (outcome_two, serves_two) = recv_within(one), recv_within(two)  # type: ignore[misc]
        assert outcome_one == outcome_two == "local_hit" and serves_one != serves_two  # one binds the port
        samples = hwr_samples(scrape(port))
        assert samples[("hwr_resolutions_total", L(outcome="local_hit", failure_code="none"))] == 2.0
        assert samples[("hwr_live_leases", L())] == 2.0
        assert samples[("hwr_store_artifacts", L(storage_class="disk"))] == 1.0
        (quiet, quiet_process), (serving, _) = (
            ((one, first), (two, second)) if serves_two else ((two, second), (one, first))
        )
        quiet.send("close")
        assert recv_within(quiet) == "closed"
        quiet_process.join(120)  # type: ignore[attr-defined]
        samples = hwr_samples(scrape(port))  # it exited without an exit hook (os._exit): the scrape notices
        assert samples[("hwr_live_leases", L())] == 1.0
        assert samples[("hwr_resolutions_total", L(outcome="local_hit", failure_code="none"))] == 2.0
        serving.send("close")
        assert recv_within(serving) == "closed"
    shared = tmp_path / f"hwr-metrics-{os.getuid()}-{port}"
    assert shared.is_dir() and (shared.stat().st_mode & 0o777) == 0o700


def test_a_new_runtime_that_reuses_an_old_id_is_observed(tmp_path: Path) -> None:
    """X05: metrics hold runtimes by weak reference: once old runtimes are collected, a new runtime that CPython
    places at one of their addresses (the same id()) is observed like any other: its resolve counts."""
    registry = CollectorRegistry()
    config = HostWeightRuntimeConfig(mode=RuntimeMode.DISABLED, root=tmp_path / "never")
    metrics = register_metrics(registry)
    old = [HostWeightRuntime(config) for _ in range(RUNTIMES)]
    for runtime in old:
        metrics.attach(runtime)
    old_ids = {id(runtime) for runtime in old}
    del old, runtime
    gc.collect()
    kept = []  # alive, so that each new runtime takes another address until one takes an old one
    while len(kept) < 50 * RUNTIMES and (not kept or id(kept[-1]) not in old_ids):
        kept.append(HostWeightRuntime(config))
    reused = kept[-1]
    assert id(reused) in old_ids, "no address was reused; the test cannot show the reuse"
    metrics.attach(reused)
    reused.resolve(model_identity(0))
    samples = hwr_samples(generate_latest(registry).decode())
    assert samples[("hwr_resolutions_total", L(outcome="canonical_direct", failure_code="none"))] == 1.0

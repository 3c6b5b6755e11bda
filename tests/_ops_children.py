"""Child-process bodies for the eviction, gc and metrics tests (module level, so spawn can import them).

Nothing here imports prometheus_client at import time: a child that sets
PROMETHEUS_MULTIPROC_DIR must do so before prometheus_client is first imported.
"""

from __future__ import annotations

import os
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from host_weight_runtime._faults import Fault, FaultAction, arm
from host_weight_runtime.config import HostWeightRuntimeConfig
from host_weight_runtime.filesystem.store import FilesystemHostWeightStore
from host_weight_runtime.outcomes import StoreResult
from host_weight_runtime.protocols import BuildRequest
from host_weight_runtime.runtime import HostWeightRuntime
from host_weight_runtime.tensors import ValidationLevel

from .support import SyntheticProducer, make_identity, make_tensors

META = ValidationLevel.MANIFEST_AND_METADATA
TIMEOUT_S = 120.0


def model_identity(index: int) -> Any:
    """The identity of test model number `index` (same tensor shapes, so the same artifact size)."""
    return make_identity(tag=f"model-{index}")


def model_producer(index: int) -> SyntheticProducer:
    return SyntheticProducer(model_identity(index), make_tensors(index, scale=4), files=1)


def describe(result: StoreResult) -> dict[str, Any]:
    details = None if result.failure is None else result.failure.details.to_value()
    return {
        "status": result.status.value,
        "code": None if result.failure is None else result.failure.code.value,
        "details": details,
    }


def _wait(control: Connection) -> object:
    if not control.poll(TIMEOUT_S):
        raise TimeoutError("the test did not answer in time")
    return control.recv()


def hold_lease(root: str, index: int, conn: Connection) -> None:
    """Look up model `index`, report, hold the lease until told 'close'."""
    store = FilesystemHostWeightStore(Path(root))
    result = store.lookup(model_identity(index), validation=META)
    conn.send(describe(result))
    _wait(conn)
    if result.lease is not None:
        result.lease.close()
    conn.send("closed")


def build_model(
    root: str,
    index: int,
    conn: Connection,
    *,
    pause_at: tuple[str, ...] = (),
    crash_at: str | None = None,
    hold: bool = False,
) -> None:
    """get_or_build model `index`; at each `pause_at` point send its name and wait for 'go'.

    Reports the result; with `hold`, keeps the lease until told 'close'.
    """
    for point in pause_at:

        def hook(reached: str) -> None:
            conn.send(reached)
            _wait(conn)

        arm(point, Fault(FaultAction.PAUSE, hook=hook))
    if crash_at is not None:
        arm(crash_at, Fault(FaultAction.CRASH))
    store = FilesystemHostWeightStore(Path(root))
    result = store.get_or_build(
        BuildRequest(model_identity(index)),
        model_producer(index),
        validation=META,
        deadline=time.monotonic() + TIMEOUT_S,
    )
    conn.send(describe(result))
    if hold:
        _wait(conn)
    if result.lease is not None:
        result.lease.close()


def metrics_endpoint_worker(root: str, conn: Connection) -> None:
    """A worker configured only by HWR_* variables (HWR_METRICS_PORT=0): runs the steps the test sends."""
    os.environ.update({"HWR_ROOT": root, "HWR_METRICS_PORT": "0", "HWR_MODE": "preferred"})
    runtime = HostWeightRuntime.from_env()
    from host_weight_runtime.metrics import metrics_server_address

    conn.send(metrics_server_address())
    leases = []
    while True:
        step = _wait(conn)
        if step == "exit":
            break
        producer = model_producer(0) if step == "build" else None
        resolution = runtime.resolve(model_identity(0), producer)
        if resolution.lease is not None:
            leases.append(resolution.lease)
        if step == "build" and resolution.lease is not None:
            leases.pop().close()
        conn.send(resolution.outcome.value)
    for lease in leases:
        lease.close()


def multiprocess_worker(root: str, multiproc_dir: str, conn: Connection) -> None:
    """A worker in prometheus_client's multiprocess mode: one hit, lease held until told 'close'."""
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = multiproc_dir
    from host_weight_runtime.metrics import register_metrics

    runtime = HostWeightRuntime(HostWeightRuntimeConfig(root=Path(root)))
    register_metrics(runtime=runtime)
    resolution = runtime.resolve(model_identity(0))
    conn.send(resolution.outcome.value)
    _wait(conn)
    if resolution.lease is not None:
        resolution.lease.close()
    conn.send("closed")

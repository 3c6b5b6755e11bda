"""Worker bodies for the one-endpoint-per-pod metrics test (module level, so spawn can import them).

Nothing here imports prometheus_client: the runtime must be the first to, as in a real worker.
"""

from __future__ import annotations

import os
from multiprocessing.connection import Connection

from host_weight_runtime.runtime import HostWeightRuntime

from ._ops_children import model_identity

TIMEOUT_S = 120.0


def pod_worker(environment: dict[str, str], conn: Connection) -> None:
    """A worker configured only by HWR_* variables (as a pod's containers are): one hit, lease held until 'close'."""
    os.environ.update(environment)
    runtime = HostWeightRuntime.from_env()
    resolution = runtime.resolve(model_identity(0))
    from host_weight_runtime.metrics import metrics_server_address

    conn.send((resolution.outcome.value, metrics_server_address() is not None))
    if not conn.poll(TIMEOUT_S):
        raise TimeoutError("the test did not answer in time")
    conn.recv()
    if resolution.lease is not None:
        resolution.lease.close()
    conn.send("closed")

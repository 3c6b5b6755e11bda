"""Functions that run in spawned child processes (module level, so spawn can import them)."""

from __future__ import annotations

import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from host_weight_runtime._faults import Fault, FaultAction, arm
from host_weight_runtime.filesystem.store import FilesystemHostWeightStore
from host_weight_runtime.protocols import BuildRequest
from host_weight_runtime.tensors import ValidationLevel

from .support import SyntheticProducer, make_identity, make_tensors


def _arm_pause(point: str, notify: Connection, wait: Connection | None) -> None:
    def hook(reached: str) -> None:
        notify.send(reached)
        if wait is not None:
            wait.recv()

    arm(point, Fault(FaultAction.PAUSE, hook=hook))


def _describe(result: Any) -> dict[str, Any]:
    lease = result.lease
    return {
        "status": result.status.value,
        "code": None if result.failure is None else result.failure.code.value,
        "retryable": None if result.failure is None else result.failure.retryable,
        "publication_id": result.publication_id,
        "backing": None if lease is None else sorted((r.file, r.device, r.inode) for r in lease.mapped_regions),
        "source": None if lease is None else lease.provenance.source.value,
    }


def build_in_child(
    root: str,
    counter: str,
    report: Connection,
    *,
    seed: int = 0,
    pause_at: str | None = None,
    notify_at: str | None = None,
    crash_at: str | None = None,
    control: Connection | None = None,
    deadline_s: float = 60.0,
) -> None:
    """get_or_build the standard test identity; report the result over `report`, then wait for 'close'."""
    if pause_at is not None:
        _arm_pause(pause_at, report, control)
    if notify_at is not None:
        _arm_pause(notify_at, report, None)
    if crash_at is not None:
        arm(crash_at, Fault(FaultAction.CRASH))
    store = FilesystemHostWeightStore(Path(root))
    identity = make_identity()
    producer = SyntheticProducer(identity, make_tensors(seed), files=2, counter_path=Path(counter))
    result = store.get_or_build(
        BuildRequest(identity),
        producer,
        validation=ValidationLevel.MANIFEST_AND_METADATA,
        deadline=time.monotonic() + deadline_s,
    )
    report.send(_describe(result))
    if control is not None and result.lease is not None:
        control.recv()
    if result.lease is not None:
        result.lease.close()


def lookup_in_child(
    root: str,
    report: Connection,
    control: Connection,
    *,
    validation: str,
    pause_at: str | None = None,
) -> None:
    """Look up the standard identity, optionally pausing at a seam; report the result."""
    if pause_at is not None:
        _arm_pause(pause_at, report, control)
    store = FilesystemHostWeightStore(Path(root))
    result = store.lookup(make_identity(), validation=ValidationLevel(validation))
    report.send(_describe(result))
    if result.lease is not None:
        result.lease.close()

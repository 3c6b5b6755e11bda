"""Functions that import a remote artifact in spawned child processes (module level, so spawn can import them)."""

from __future__ import annotations

import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from host_weight_runtime._faults import Fault, FaultAction, arm
from host_weight_runtime.filesystem.store import FilesystemHostWeightStore
from host_weight_runtime.remote import FsspecArtifactProvider, import_remote_artifact
from host_weight_runtime.tensors import ValidationLevel

from .support import make_identity


def import_in_child(
    root: str,
    url: str,
    storage_options: dict[str, Any],
    report: Connection,
    control: Connection,
    *,
    crash_at: str | None = None,
) -> None:
    """Import the standard identity; say when waiting for the build lock and when fetching (then wait for 'go')."""
    if crash_at is not None:
        arm(crash_at, Fault(FaultAction.CRASH))

    def waiting(point: str) -> None:
        report.send(point)

    def fetching(point: str) -> None:
        report.send(point)
        control.recv()

    arm("build.waiting_for_lock", Fault(FaultAction.PAUSE, hook=waiting))
    arm("remote.fetch.start", Fault(FaultAction.PAUSE, hook=fetching))
    store = FilesystemHostWeightStore(Path(root))
    provider = FsspecArtifactProvider(url, storage_options=storage_options, chunk_bytes=4096)
    result = import_remote_artifact(
        store,
        make_identity(),
        provider,
        validation=ValidationLevel.MANIFEST_AND_METADATA,
        deadline=time.monotonic() + 60,
    )
    lease = None if result is None else result.lease
    report.send(
        {
            "status": None if result is None else result.status.value,
            "code": None if result is None or result.failure is None else result.failure.code.value,
            "publication_id": None if lease is None else lease.publication_id,
        }
    )
    if lease is not None:
        control.recv()
        lease.close()

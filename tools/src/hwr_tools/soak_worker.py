"""The soak's models and its worker process: what each worker resolves, and the reference digests the
controller (soak.py) compares every lease with."""

from __future__ import annotations

import hashlib
import os
import time
import traceback
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

from host_weight_runtime import (
    BuildRequest,
    FilesystemHostWeightStore,
    HostWeightRuntime,
    HostWeightRuntimeConfig,
    RuntimeMode,
    ValidationLevel,
    WeightArtifactIdentity,
)
from host_weight_runtime._faults import Fault, FaultAction, arm

from .common import JsonValue
from .demo_store import DemoProducer, demo_identity

__all__ = [
    "REPLY_TIMEOUT_S",
    "SoakModel",
    "diffusers_models",
    "diffusers_references",
    "synthetic_references",
    "tensors_digest",
    "worker_main",
]

MIB = 1 << 20
REPLY_TIMEOUT_S = 120.0


# --------------------------------------------------------------------------- the models


@dataclass(frozen=True, slots=True)
class SoakModel:
    """A synthetic model (identity + producer recipe) or a tiny diffusers pipeline folder."""

    index: int
    size_mib: int = 1
    seed: int = 0
    folder: str | None = None  # diffusers: the pipeline folder

    @property
    def name(self) -> str:
        return f"diffusers-{self.index}" if self.folder is not None else f"synthetic-{self.index}"

    def identity(self) -> WeightArtifactIdentity:
        return demo_identity(self.size_mib, seed=self.seed)

    def to_dict(self) -> dict[str, JsonValue]:
        return {"index": self.index, "size_mib": self.size_mib, "seed": self.seed, "folder": self.folder}

    @classmethod
    def from_dict(cls, value: dict[str, Any]) -> SoakModel:
        return cls(int(value["index"]), int(value["size_mib"]), int(value["seed"]), value.get("folder"))


def tensors_digest(tensors: Iterator[tuple[str, Any]]) -> str:
    """SHA-256 over every tensor's name, dtype, shape and bytes, in name order."""
    digest = hashlib.sha256()
    for name, tensor in sorted(tensors, key=lambda item: item[0]):
        flat = tensor.detach().contiguous().reshape(-1)
        digest.update(f"{name}|{flat.dtype}|{tuple(tensor.shape)}\n".encode())
        digest.update(flat.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


# --------------------------------------------------------------------------- the worker process


def _resolve_synthetic(
    store: FilesystemHostWeightStore, model: SoakModel, validation: ValidationLevel
) -> dict[str, Any]:
    identity = model.identity()
    result = store.get_or_build(
        BuildRequest(identity),
        DemoProducer(identity, model.size_mib, seed=model.seed),
        validation=validation,
        deadline=time.monotonic() + REPLY_TIMEOUT_S / 2,
    )
    reply: dict[str, Any] = {
        "status": result.status.value,
        "key": identity.key,
        "code": None if result.failure is None else result.failure.code.value,
        "publication_id": result.publication_id,
        "digest": None,
        "verification": None,
    }
    lease = result.lease
    if lease is not None:
        try:
            reply["digest"] = tensors_digest(iter(lease.tensors.items()))
            if lease.verification is not None:
                lease.verification.wait(REPLY_TIMEOUT_S / 2)
                reply["verification"] = lease.verification.state.value
        finally:
            lease.close()
    return reply


def _quiet_diffusers() -> None:
    """No per-load progress bars from diffusers: the soak loads thousands of times."""
    from diffusers.utils import logging as diffusers_logging

    diffusers_logging.disable_progress_bar()


def _resolve_diffusers(root: str, model: SoakModel, validation: ValidationLevel) -> dict[str, Any]:
    from host_weight_runtime.diffusion import load_component

    _quiet_diffusers()
    from .synthetic_models import TRANSFORMER_SUBFOLDER

    config = HostWeightRuntimeConfig(mode=RuntimeMode.PREFERRED, root=Path(root), validation=validation)
    assert model.folder is not None
    with load_component(model.folder, subfolder=TRANSFORMER_SUBFOLDER, runtime=HostWeightRuntime(config)) as loaded:
        lease = loaded.lease
        digest = tensors_digest(iter(loaded.model.state_dict().items()))
        verification = None
        if lease is not None and lease.verification is not None:
            lease.verification.wait(REPLY_TIMEOUT_S / 2)
            verification = lease.verification.state.value
        failure = loaded.resolution.failure
        return {
            "status": "hit" if lease is not None else "fallback",
            "key": None if lease is None else lease.identity.key,
            "code": None if failure is None else failure.code.value,
            "publication_id": None if lease is None else lease.publication_id,
            "digest": digest,
            "verification": verification,
        }


def worker_main(root: str, conn: Connection) -> None:
    """A soak worker: resolve what the controller asks, one request at a time; report over `conn`."""
    os.environ["HWR_BACKGROUND_VERIFY"] = "once"  # the soak exercises the background verifier too
    store = FilesystemHostWeightStore(Path(root))
    conn.send({"ready": os.getpid()})
    while True:
        try:
            request = conn.recv()
        except EOFError:
            return
        if request.get("op") == "stop":
            return
        model = SoakModel.from_dict(request["model"])
        validation = ValidationLevel(request["validation"])
        pause_at = request.get("pause_at")
        if pause_at is not None:

            def hook(point: str) -> None:
                conn.send({"paused": point})
                conn.recv()  # the controller kills this process here

            arm(pause_at, Fault(FaultAction.PAUSE, hook=hook))
        try:
            if model.folder is None:
                reply = _resolve_synthetic(store, model, validation)
            else:
                reply = _resolve_diffusers(root, model, validation)
        except Exception:
            reply = {"error": traceback.format_exc(limit=12)}
        conn.send(reply)



def diffusers_models(count: int, workdir: Path, first_index: int) -> list[SoakModel]:
    """Tiny real Flux pipelines on disk, each with different weights."""
    if count == 0:
        return []
    from .synthetic_models import save_flux_pipeline_folder

    models = []
    for offset in range(count):
        folder = workdir / f"flux-{offset}"
        save_flux_pipeline_folder(folder, target_bytes=2 * MIB, seed=offset)
        models.append(SoakModel(first_index + offset, folder=str(folder)))
    return models


def diffusers_references(models: Sequence[SoakModel]) -> dict[str, str]:
    """The canonical (diffusers from_pretrained, no HWR) digest of each diffusers model."""
    if not models:
        return {}
    from host_weight_runtime.diffusion import load_component

    from .synthetic_models import TRANSFORMER_SUBFOLDER

    _quiet_diffusers()
    references = {}
    runtime = HostWeightRuntime(HostWeightRuntimeConfig(mode=RuntimeMode.DISABLED))
    for model in models:
        assert model.folder is not None
        with load_component(model.folder, subfolder=TRANSFORMER_SUBFOLDER, runtime=runtime) as loaded:
            references[model.name] = tensors_digest(iter(loaded.model.state_dict().items()))
    return references


def synthetic_references(models: Sequence[SoakModel], workdir: Path) -> dict[str, str]:
    """Each synthetic model built once with FULL_CHECKSUM in a private reference domain."""
    store = FilesystemHostWeightStore(workdir / "reference-domain")
    references = {}
    for model in models:
        identity = model.identity()
        result = store.get_or_build(
            BuildRequest(identity),
            DemoProducer(identity, model.size_mib, seed=model.seed),
            validation=ValidationLevel.FULL_CHECKSUM,
            deadline=time.monotonic() + REPLY_TIMEOUT_S,
        )
        if result.lease is None:
            raise RuntimeError(f"could not build the reference of {model.name}: {result.failure}")
        with result.lease as lease:
            references[model.name] = tensors_digest(iter(lease.tensors.items()))
    return references

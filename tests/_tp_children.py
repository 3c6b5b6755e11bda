"""Tensor-parallel helpers shared by the TP tests and their spawned children (module level, so spawn imports them)."""

from __future__ import annotations

import dataclasses
import datetime
import os
import signal
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

from host_weight_runtime._faults import Fault, FaultAction, arm
from host_weight_runtime.config import HostWeightRuntimeConfig, RuntimeMode
from host_weight_runtime.diffusion import (
    FINAL_LAYOUT_BF16_POLICY,
    FINAL_LAYOUT_FP8_POLICY,
    FinalLayoutParallelIdentity,
    TensorParallelPlan,
)
from host_weight_runtime.diffusion.identity_adapter import FinalLayoutIdentityContext
from host_weight_runtime.diffusion.parallel.bundle import FinalLayoutBF16BundleProducer
from host_weight_runtime.diffusion.parallel.ranks import identify_ranks
from host_weight_runtime.diffusion.representation import quantize_model_fp8
from host_weight_runtime.failures import HostWeightError
from host_weight_runtime.filesystem.store import FilesystemHostWeightStore
from host_weight_runtime.protocols import BuildRequest
from host_weight_runtime.remote import FsspecArtifactProvider
from host_weight_runtime.runtime import HostWeightRuntime
from host_weight_runtime.tensors import ValidationLevel

from ._diffusion import DIT, Folder, Pipeline, identity_context


def rank_contexts(
    folder: Folder, size: int, plan: TensorParallelPlan | None = None, *, fp8: bool = False
) -> tuple[Pipeline, tuple[FinalLayoutIdentityContext, ...]]:
    """Every rank's identity context on one localized `meta` skeleton of `folder` (FP8-quantized with `fp8`)."""
    skeleton = folder.skeleton()
    if fp8:
        quantize_model_fp8(skeleton)
    holder = Pipeline(skeleton)
    base = identity_context(Pipeline(folder.skeleton()), folder.source()).request
    request = dataclasses.replace(base, parallel=FinalLayoutParallelIdentity(tensor_parallel_size=size))
    contexts = identify_ranks(
        holder,
        dit_name=DIT,
        skeleton=skeleton,
        prepared_sources=[folder.source()],
        request=request,
        policy=FINAL_LAYOUT_FP8_POLICY if fp8 else FINAL_LAYOUT_BF16_POLICY,
        ranks=list(range(size)),
        plan=plan,
    )
    return holder, contexts


def bundle_crash_child(folder_root: str, domain_root: str, crashes_after: int) -> None:
    """Build a TP=2 bundle (three parts) and SIGKILL this process before its (crashes_after + 1)-th commit."""
    for _ in range(crashes_after):
        arm("bundle.before_publish", Fault(FaultAction.PAUSE))
    arm("bundle.before_publish", Fault(FaultAction.CRASH))
    _, contexts = rank_contexts(Folder("flux", Path(folder_root)), 2)
    store = FilesystemHostWeightStore(Path(domain_root))
    bundle = FinalLayoutBF16BundleProducer(contexts)
    store.get_or_build(
        BuildRequest(bundle.parts[0].shard.identity),
        bundle,
        validation=ValidationLevel.MANIFEST_AND_METADATA,
        deadline=float("inf"),
    )


def group_child(rank: int, setup: dict[str, Any], report: Connection, control: Connection | None = None) -> None:
    """One TP rank in a gloo group: run each load step, report (load path, outcome, failure code, output)."""
    import torch.distributed as dist

    from host_weight_runtime.diffusion import load_component

    world, rendezvous, folder_root = setup["world"], setup["rendezvous"], setup["folder"]
    domain_root, steps = setup["domain"], setup["steps"]
    from hwr_tools.synthetic_models import forward_inputs, run_forward

    dist.init_process_group(
        "gloo", init_method=rendezvous, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=180)
    )
    try:
        for step in steps:
            _arm_step(step.get("faults", {}).get(str(rank), []), report, control)
            plan_name = step.get("plan_name", {}).get(str(rank))
            if plan_name is not None:
                _register_plan_named(plan_name, Path(folder_root) / DIT)
            runtime = HostWeightRuntime(
                HostWeightRuntimeConfig(
                    mode=RuntimeMode(step["mode"]),
                    root=Path(step.get("domain", domain_root)),
                    lock_timeout_s=float(step.get("lock_timeout_s", 120.0)),
                ),
                remote_providers=(
                    [FsspecArtifactProvider(step["remote"], storage_options=step.get("remote_options"))]
                    if "remote" in step
                    else ()
                ),
            )
            parallel = FinalLayoutParallelIdentity(tensor_parallel_size=world, tensor_parallel_rank=rank)
            try:
                loaded = load_component(
                    step.get("model", folder_root),  # a repo id and commit: a load by name
                    revision=step.get("revision"),
                    subfolder=DIT,
                    runtime=runtime,
                    parallel=parallel,
                    process_group=dist.group.WORLD if step.get("group", True) else None,
                    stream_on_miss=step.get("stream"),
                    representation=step.get("representation", "bf16"),
                )
            except HostWeightError as exc:
                report.send({"rank": rank, "failed": exc.failure.code.value})
                continue
            model = loaded.model
            kind = setup.get("kind", "flux")
            output = run_forward(kind, model, forward_inputs(kind, model, seed=5))
            report.send(
                {
                    "rank": rank,
                    "path": loaded.load_path.value,
                    "outcome": None if loaded.outcome is None else loaded.outcome.value,
                    "key": loaded.identity_key,
                    "output": output.detach().float().numpy(),  # numpy pickles by value (BF16 -> FP32 is exact)
                    "fp8": _fp8_bits(model) if step.get("fp8_bits") else None,
                    "placements": _placements(model) if step.get("placements") else None,
                }
            )
            loaded.close()
    finally:
        dist.destroy_process_group()


def _register_plan_named(name: str, config_dir: Path) -> None:
    """Declare Flux's own diffusers plan again under another name: the same rules, another plan version."""
    from diffusers import FluxTransformer2DModel

    from host_weight_runtime.diffusion import plan_for_model, register_tensor_parallel_plan

    skeleton = FluxTransformer2DModel.from_config(FluxTransformer2DModel.load_config(str(config_dir)))
    plan = plan_for_model(skeleton)
    register_tensor_parallel_plan("FluxTransformer2DModel", dataclasses.replace(plan, name=name))


def _placements(model: Any) -> dict[str, tuple[str, str, str]]:
    """Parameter name -> (DTensor placements or 'local', dtype, sha256 of this rank's local bytes)."""
    import hashlib

    found: dict[str, tuple[str, str, str]] = {}
    for name, parameter in model.named_parameters():
        local = parameter.to_local() if hasattr(parameter, "to_local") else parameter
        placements = str(tuple(parameter.placements)) if hasattr(parameter, "placements") else "local"
        data = local.detach().contiguous().view(torch.uint8).numpy().tobytes()
        found[name] = (placements, str(local.dtype), hashlib.sha256(data).hexdigest())
    return found


def _fp8_bits(model: Any) -> dict[str, tuple[Any, float]]:
    """Module name -> (this rank's local FP8 weight as raw bytes, its FP32 scale) for every FP8Linear."""
    from host_weight_runtime.diffusion import FP8Linear

    found: dict[str, tuple[Any, float]] = {}
    for name, module in model.named_modules():
        if isinstance(module, FP8Linear):
            weight = module.weight
            local = weight.to_local() if hasattr(weight, "to_local") else weight
            scale = module.weight_scale
            scale = scale.to_local() if hasattr(scale, "to_local") else scale
            found[name] = (local.detach().contiguous().view(torch.uint8).numpy().copy(), float(scale))
    return found


def _arm_step(faults: list[str], report: Connection, control: Connection | None) -> None:
    for fault in faults:
        if fault == "crash_building":

            def notify_then_die(point: str) -> None:
                report.send({"event": "building"})
                assert control is not None
                control.recv()
                os.kill(os.getpid(), signal.SIGKILL)  # mid-build: staging exists, nothing published

            arm("bundle.staging_created", Fault(FaultAction.PAUSE, hook=notify_then_die))
        elif fault == "wait_before_lock":

            def wait(point: str) -> None:
                assert control is not None
                control.recv()
                report.send({"event": "waiting_for_lock"})

            arm("bundle.waiting_for_lock", Fault(FaultAction.PAUSE, hook=wait))

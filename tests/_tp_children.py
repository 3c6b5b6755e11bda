"""Tensor-parallel helpers shared by the TP tests and their spawned children (module level, so spawn imports them)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from host_weight_runtime._faults import Fault, FaultAction, arm
from host_weight_runtime.diffusion import FINAL_LAYOUT_BF16_POLICY, FinalLayoutParallelIdentity
from host_weight_runtime.diffusion.identity_adapter import FinalLayoutIdentityContext
from host_weight_runtime.diffusion.parallel import TensorParallelPlan
from host_weight_runtime.diffusion.parallel.bundle import FinalLayoutBF16BundleProducer
from host_weight_runtime.diffusion.parallel.ranks import identify_ranks
from host_weight_runtime.filesystem.store import FilesystemHostWeightStore
from host_weight_runtime.protocols import BuildRequest
from host_weight_runtime.tensors import ValidationLevel

from ._diffusion import DIT, Folder, Pipeline, identity_context


def rank_contexts(
    folder: Folder, size: int, plan: TensorParallelPlan | None = None
) -> tuple[Pipeline, tuple[FinalLayoutIdentityContext, ...]]:
    """Every rank's identity context on one localized `meta` skeleton of `folder`."""
    skeleton = folder.skeleton()
    holder = Pipeline(skeleton)
    base = identity_context(Pipeline(folder.skeleton()), folder.source()).request
    request = dataclasses.replace(base, parallel=FinalLayoutParallelIdentity(tensor_parallel_size=size))
    contexts = identify_ranks(
        holder,
        dit_name=DIT,
        skeleton=skeleton,
        prepared_sources=[folder.source()],
        request=request,
        policy=FINAL_LAYOUT_BF16_POLICY,
        ranks=list(range(size)),
        plan=plan,
    )
    return holder, contexts


def bundle_crash_child(folder_root: str, domain_root: str, crashes_after: int) -> None:
    """Build a TP=2 bundle and SIGKILL this process before its (crashes_after + 1)-th commit."""
    for _ in range(crashes_after):
        arm("bundle.before_publish", Fault(FaultAction.PAUSE))
    arm("bundle.before_publish", Fault(FaultAction.CRASH))
    _, contexts = rank_contexts(Folder("flux", Path(folder_root)), 2)
    store = FilesystemHostWeightStore(Path(domain_root))
    store.get_or_build(
        BuildRequest(contexts[0].identity),
        FinalLayoutBF16BundleProducer(contexts),
        validation=ValidationLevel.MANIFEST_AND_METADATA,
        deadline=float("inf"),
    )

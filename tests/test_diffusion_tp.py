"""Tensor-parallel final layouts: plans, per-rank artifacts and ARTIFACT_BUNDLE builds (single process).

The multi-process group tests (torch.distributed gloo) are in tests/test_diffusion_tp_group.py.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from host_weight_runtime.config import RuntimeMode
from host_weight_runtime.diffusion import FINAL_LAYOUT_BF16_POLICY, FinalLayoutParallelIdentity
from host_weight_runtime.diffusion.identity_adapter import FinalLayoutIdentityContext
from host_weight_runtime.diffusion.parallel import (
    ShardStyle,
    TensorParallelPlan,
    TensorParallelRule,
    plan_for_model,
    resolve_tensor_shards,
)
from host_weight_runtime.diffusion.parallel.ranks import identify_ranks, localize_for_rank
from host_weight_runtime.diffusion.producers.checkpoint_stream import FinalLayoutBF16CheckpointProducer
from host_weight_runtime.diffusion.producers.finalized import FinalLayoutBF16Producer
from host_weight_runtime.diffusion.restorer import FinalLayoutTensorRestorer
from host_weight_runtime.failures import FailureCode, HostWeightError
from host_weight_runtime.outcomes import ResolutionOutcome

from ._diffusion import DIT, Folder, Pipeline, identity_context, runtime_at, save_folder

KINDS = ("flux", "flux2", "sd3", "wan", "minimax_h3")
FLUX_TP4 = {"num_attention_heads": 4, "attention_head_dim": 8, "axes_dims_rope": (2, 2, 4)}
"""A tiny Flux whose 4 heads split over 4 ranks."""


@pytest.fixture(scope="module")
def flux(tmp_path_factory: pytest.TempPathFactory) -> Folder:
    return save_folder(tmp_path_factory.mktemp("tp-flux"), "flux", seed=3, config_overrides=FLUX_TP4)


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


@pytest.mark.parametrize("kind", KINDS)
def test_first_class_models_have_plans_that_split_at_tp2(tmp_path: Path, kind: str) -> None:
    """D13: every first-class model has a plan; at TP=2 it splits Linears into halves and leaves the rest whole."""
    skeleton = save_folder(tmp_path, kind).skeleton()
    plan = plan_for_model(skeleton)
    shards = resolve_tensor_shards(skeleton, plan, 2, 1)
    assert shards
    full = dict(skeleton.named_parameters())
    for name, shard in shards.items():
        assert shard.local_shape(full[name].shape)[shard.dim] * 2 == full[name].shape[shard.dim], name
    assert any(shard.dim == 0 for shard in shards.values()) and any(shard.dim == 1 for shard in shards.values())


def test_indivisible_split_is_a_typed_refusal_before_anything_is_written(tmp_path: Path, flux: Folder) -> None:
    """D05/D06: a TP size that does not divide a split block is UNSUPPORTED before any file exists."""
    runtime = runtime_at(tmp_path / "hwr")
    with pytest.raises(HostWeightError) as raised:
        localize_for_rank(flux.skeleton(), FinalLayoutParallelIdentity(tensor_parallel_size=3, tensor_parallel_rank=0))
    assert raised.value.failure.code is FailureCode.UNSUPPORTED
    assert "not divisible by 3" in raised.value.failure.message or "heads" in raised.value.failure.message
    assert not (tmp_path / "hwr").exists()
    del runtime


def test_tp_size_rank_and_plan_each_change_the_key(flux: Folder) -> None:
    """D05: TP size, TP rank and the sharding plan are each a different key."""
    tp1 = identity_context(Pipeline(flux.skeleton()), flux.source()).identity.key
    _, (rank0, rank1) = rank_contexts(flux, 2)
    other_plan = TensorParallelPlan(
        "mlp-only", (TensorParallelRule("transformer_blocks.*.ff.net.2", ShardStyle.ROWWISE),)
    )
    _, (other0, _other1) = rank_contexts(flux, 2, other_plan)
    _, four = rank_contexts(flux, 4)
    keys = {tp1, rank0.identity.key, rank1.identity.key, other0.identity.key, four[0].identity.key}
    assert len(keys) == 5
    assert rank0.tensors == rank1.tensors  # same local shapes, different slices


def test_per_rank_artifacts_hold_exactly_their_slices_and_restore(tmp_path: Path, flux: Folder) -> None:
    """D05/D13: each rank's streamed artifact holds only its shards, bit-identical to slices of canonical BF16;
    the post-load producer on a localized canonical model gives the same bytes; restore binds them."""
    canonical = dict(flux.canonical().named_parameters())
    holder, contexts = rank_contexts(flux, 2)
    runtime = runtime_at(tmp_path / "hwr", RuntimeMode.REQUIRED)
    for context in contexts:
        producer = FinalLayoutBF16CheckpointProducer(context, chunk_bytes=64)
        resolution = runtime.resolve(context.identity, producer)
        assert resolution.outcome is ResolutionOutcome.LOCAL_PRODUCTION
        lease = resolution.lease
        assert lease is not None
        split = 0
        for name, full in canonical.items():
            stored = lease.tensors[f"{DIT}.{name}"]
            shard = context.tensor_shards.get(f"{DIT}.{name}")
            expected = full.detach() if shard is None else shard.take(full.detach())
            split += shard is not None
            assert stored.dtype == expected.dtype and torch.equal(stored.view(torch.uint8), expected.view(torch.uint8))
        assert split > 0
        assert context.total_bytes < sum(t.numel() * t.element_size() for t in canonical.values())

        model = flux.canonical()
        localize_for_rank(model, context.request.parallel)
        post_runtime = runtime_at(tmp_path / f"post{context.request.parallel.tensor_parallel_rank}")
        post_runtime.publish_after_load(context.identity, FinalLayoutBF16Producer(context, [(DIT, model)]))
        post = post_runtime.resolve(context.identity, None)
        assert post.outcome is ResolutionOutcome.LOCAL_HIT and post.lease is not None
        assert post.lease.manifest.content_digest == lease.manifest.content_digest
        post.lease.close()

        FinalLayoutTensorRestorer(context)._plan_on_identity_skeleton(holder, lease).commit()
        for name, tensor in holder.get_submodule(DIT).named_parameters():
            assert torch.equal(tensor, lease.tensors[f"{DIT}.{name}"]), name
        lease.close()

"""Tensor-parallel final layouts: plans, per-rank artifacts and ARTIFACT_BUNDLE builds (single process).

The multi-process group tests (torch.distributed gloo) are in tests/test_diffusion_tp_group.py.
"""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import pytest
import torch

from host_weight_runtime._faults import Fault, FaultAction, armed
from host_weight_runtime.config import RuntimeMode
from host_weight_runtime.diffusion import (
    FinalLayoutParallelIdentity,
    ShardStyle,
    TensorParallelPlan,
    TensorParallelRule,
    plan_for_model,
    prewarm_tensor_parallel,
    resolve_tensor_shards,
)
from host_weight_runtime.diffusion.parallel.bundle import FinalLayoutBF16BundleProducer, bundle_parts
from host_weight_runtime.diffusion.parallel.rank_lease import rank_lease, resolve_parts
from host_weight_runtime.diffusion.parallel.ranks import localize_for_rank
from host_weight_runtime.diffusion.producers._checkpoint import read_safetensors_header
from host_weight_runtime.diffusion.producers.checkpoint_stream import FinalLayoutBF16CheckpointProducer
from host_weight_runtime.diffusion.producers.finalized import FinalLayoutBF16Producer
from host_weight_runtime.diffusion.restorer import FinalLayoutTensorRestorer
from host_weight_runtime.failures import FailureCode, HostWeightError
from host_weight_runtime.filesystem.store import FilesystemHostWeightStore
from host_weight_runtime.outcomes import ResolutionOutcome, StoreResult, StoreStatus
from host_weight_runtime.protocols import BuildRequest
from host_weight_runtime.tensors import ValidationLevel
from hwr_tools.preimported import preimported_context

from ._diffusion import DIT, Folder, Pipeline, identity_context, runtime_at, save_folder
from ._tp_children import bundle_crash_child, rank_contexts

META = ValidationLevel.MANIFEST_AND_METADATA
WAIT_S = 60.0
CHILD_S = 120.0


def soon() -> float:
    return time.monotonic() + WAIT_S

KINDS = ("flux", "flux2", "sd3", "wan", "minimax_h3")
FLUX_TP4 = {"num_attention_heads": 4, "attention_head_dim": 8, "axes_dims_rope": (2, 2, 4)}
"""A tiny Flux whose 4 heads split over 4 ranks."""


@pytest.fixture(scope="module")
def flux(tmp_path_factory: pytest.TempPathFactory) -> Folder:
    return save_folder(tmp_path_factory.mktemp("tp-flux"), "flux", seed=3, config_overrides=FLUX_TP4)


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
    message = raised.value.failure.message
    assert message.startswith("cannot split transformer_blocks.0.attn.to_q.weight across 3 tensor-parallel ranks"), message
    assert message.endswith("is not divisible by 3; choose a TP size that divides it"), message
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


# ----------------------------------------------------------------------------- ARTIFACT_BUNDLE


def _bundle_store(root: Path) -> FilesystemHostWeightStore:
    return FilesystemHostWeightStore(root)


def test_bundle_builds_every_part_in_one_pass(tmp_path: Path, flux: Folder) -> None:
    """D05/T01: one bundle producer reads each owned tensor once and publishes the replicated part and every
    rank's shard part; a rank's lease over its two parts has the content digest of the one-artifact rank
    layout it replaces (streamed per rank); a second call is a HIT and builds nothing."""
    _, contexts = rank_contexts(flux, 2)
    store = _bundle_store(tmp_path / "hwr")
    bundle = FinalLayoutBF16BundleProducer(contexts, chunk_bytes=96)
    built = store.get_or_build(BuildRequest(bundle.parts[1].shard.identity), bundle, validation=META, deadline=soon())
    assert built.status is StoreStatus.BUILT and built.lease is not None
    built.lease.close()
    checkpoint = read_safetensors_header(flux.weights)
    assert bundle.bytes_read == sum(entry.end - entry.begin for entry in checkpoint.values())
    assert len(list(store.layout.artifacts.iterdir())) == 3  # one replicated part, two shard parts
    single = _bundle_store(tmp_path / "single")
    for parts in bundle.parts:
        replicated = store.lookup(parts.replicated.identity, validation=META)
        shard = store.lookup(parts.shard.identity, validation=META)
        assert replicated.lease is not None and shard.lease is not None
        lease = rank_lease(parts, replicated.lease, shard.lease)
        alone = single.get_or_build(
            BuildRequest(parts.rank.identity),
            FinalLayoutBF16CheckpointProducer(parts.rank),
            validation=META,
            deadline=soon(),
        )
        assert alone.lease is not None
        assert alone.lease.manifest.content_digest == lease.manifest.content_digest
        alone.lease.close()
        lease.close()
        assert replicated.lease.closed and shard.lease.closed
    bundle.bytes_read = 0
    again = store.get_or_build(BuildRequest(bundle.parts[0].shard.identity), bundle, validation=META, deadline=soon())
    assert again.status is StoreStatus.HIT and bundle.bytes_read == 0
    assert again.lease is not None
    again.lease.close()


def test_bundle_joiner_of_another_output_waits_for_the_bundle(tmp_path: Path, flux: Folder) -> None:
    """S15: while a bundle builds, a single build of another of its parts waits and then JOINS it."""
    _, contexts = rank_contexts(flux, 2)
    parts = bundle_parts(contexts)
    store = _bundle_store(tmp_path / "hwr")
    reached = threading.Event()
    release = threading.Event()
    joiner_waiting = threading.Event()

    def pause(point: str) -> None:
        reached.set()
        assert release.wait(WAIT_S)

    results: dict[str, StoreResult] = {}

    def bundle_build() -> None:
        bundle = FinalLayoutBF16BundleProducer(contexts)
        results["bundle"] = store.get_or_build(
            BuildRequest(parts[0].shard.identity), bundle, validation=META, deadline=soon()
        )

    def join() -> None:
        producer = FinalLayoutBF16CheckpointProducer(parts[1].shard)
        results["joiner"] = store.get_or_build(
            BuildRequest(parts[1].shard.identity), producer, validation=META, deadline=soon()
        )

    with armed("bundle.staging_created", Fault(FaultAction.PAUSE, hook=pause)):
        builder = threading.Thread(target=bundle_build)
        builder.start()
        assert reached.wait(WAIT_S)
        with armed("build.waiting_for_lock", Fault(FaultAction.PAUSE, hook=lambda _p: joiner_waiting.set())):
            joiner = threading.Thread(target=join)
            joiner.start()
            assert joiner_waiting.wait(WAIT_S)
            assert "joiner" not in results
            release.set()
            builder.join(WAIT_S)
            joiner.join(WAIT_S)
    assert results["bundle"].status is StoreStatus.BUILT
    assert results["joiner"].status is StoreStatus.JOINED
    for result in results.values():
        assert result.lease is not None
        result.lease.close()


@pytest.mark.parametrize(("crashes_after", "published"), [(0, 0), (1, 1), (2, 2)])
def test_bundle_crash_publishes_none_or_a_consistent_subset(
    tmp_path: Path, flux: Folder, crashes_after: int, published: int
) -> None:
    """S16/T02: a bundle builder killed before its first commit publishes nothing; killed between commits, only
    complete, valid parts; the next bundle builds exactly the rest, and every rank's two parts are then one
    build's bytes (their bundle records agree) with the content of the one-artifact rank layout."""
    root = tmp_path / "hwr"
    context = preimported_context()
    child = context.Process(target=bundle_crash_child, args=(str(flux.root), str(root), crashes_after))
    child.start()
    child.join(CHILD_S)
    assert child.exitcode == -signal.SIGKILL
    _, contexts = rank_contexts(flux, 2)
    bundle = FinalLayoutBF16BundleProducer(contexts)
    store = _bundle_store(root)
    missing = []
    for output in bundle.spec.outputs:
        found = store.lookup(output, validation=ValidationLevel.FULL_CHECKSUM)
        assert found.status in (StoreStatus.HIT, StoreStatus.MISS)
        if found.lease is None:
            missing.append(output)
        else:
            found.lease.close()
    assert len(bundle.spec.outputs) - len(missing) == published
    rebuilt = store.get_or_build(BuildRequest(missing[0]), bundle, validation=META, deadline=soon())
    assert rebuilt.status is StoreStatus.BUILT and rebuilt.lease is not None
    rebuilt.lease.close()
    runtime = runtime_at(root, RuntimeMode.REQUIRED)
    single = runtime_at(tmp_path / "single", RuntimeMode.REQUIRED)
    for parts in bundle.parts:
        resolution = resolve_parts(runtime, parts)
        assert resolution.failure is None and resolution.lease is not None
        alone = single.resolve(parts.rank.identity, FinalLayoutBF16CheckpointProducer(parts.rank))
        assert alone.lease is not None
        assert alone.lease.manifest.content_digest == resolution.lease.manifest.content_digest
        alone.lease.close()
        resolution.lease.close()
    assert not any(list(store.layout.staging_dirs(output.key)) for output in bundle.spec.outputs)


def test_prewarm_tensor_parallel_refuses_a_bad_size_before_writing(tmp_path: Path, flux: Folder) -> None:
    """D05/D06: prewarming all ranks with a TP size that does not divide the heads is a typed UNSUPPORTED
    refusal before any artifact exists; a size below 2 is a ValueError that says what to pass."""
    runtime = runtime_at(tmp_path / "hwr", RuntimeMode.REQUIRED)
    with pytest.raises(HostWeightError) as raised:
        prewarm_tensor_parallel(flux.root, tensor_parallel_size=3, subfolder=DIT, runtime=runtime)
    assert raised.value.failure.code is FailureCode.UNSUPPORTED
    assert not list(FilesystemHostWeightStore(tmp_path / "hwr").layout.artifacts.glob("*"))
    with pytest.raises(ValueError, match="tensor_parallel_size must be an int >= 2"):
        prewarm_tensor_parallel(flux.root, tensor_parallel_size=1, subfolder=DIT, runtime=runtime)

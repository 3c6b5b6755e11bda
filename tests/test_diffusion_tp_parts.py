"""Tensor parallel at one copy per node: the replicated part, the shard parts and a rank's lease over both.

Single-process tests of the parts' keys, bytes, rebuilds, refusals, eviction and remote push/import;
the gloo group tests (GROUP_COHORT, plan versions across ranks, placements) are in
tests/test_diffusion_tp_group.py, the PSS of 2 replicas x 4 ranks in tests/test_diffusion_tp_pss.py.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from host_weight_runtime.config import HostWeightRuntimeConfig, RuntimeMode
from host_weight_runtime.diffusion import ShardStyle, TensorParallelPlan, TensorParallelRule, plan_for_model
from host_weight_runtime.diffusion.parallel.bundle import FinalLayoutBF16BundleProducer, bundle_parts
from host_weight_runtime.diffusion.parallel.parts import PartKind, RankParts
from host_weight_runtime.diffusion.parallel.rank_lease import check_one_build, resolve_parts
from host_weight_runtime.diffusion.producers.checkpoint_stream import FinalLayoutBF16CheckpointProducer
from host_weight_runtime.diffusion.restorer import FinalLayoutTensorRestorer
from host_weight_runtime.diffusion.tensor_layout import FinalLayoutTensor
from host_weight_runtime.failures import FailureCode, HostWeightError
from host_weight_runtime.filesystem._eviction import Evictor
from host_weight_runtime.filesystem.bundle_record import bundle_outputs
from host_weight_runtime.filesystem.store import FilesystemHostWeightStore
from host_weight_runtime.lease import LeaseSource
from host_weight_runtime.outcomes import ResolutionOutcome
from host_weight_runtime.remote import push_artifact
from host_weight_runtime.runtime import HostWeightRuntime
from host_weight_runtime.tensors import ValidationLevel

from ._diffusion import DIT, Folder, Pipeline, identity_context, runtime_at, save_folder
from ._tp_children import rank_contexts
from .test_diffusion_tp import FLUX_TP4

META = ValidationLevel.MANIFEST_AND_METADATA


@pytest.fixture(scope="module")
def flux(tmp_path_factory: pytest.TempPathFactory) -> Folder:
    return save_folder(tmp_path_factory.mktemp("tp-parts-flux"), "flux", seed=5, config_overrides=FLUX_TP4)


def _payload(root: Path) -> int:
    return sum(path.stat().st_size for path in (root / "artifacts").rglob("*.safetensors"))


def _build_all(root: Path, bundle: FinalLayoutBF16BundleProducer) -> HostWeightRuntime:
    runtime = runtime_at(root, RuntimeMode.REQUIRED)
    for parts in bundle.parts:
        resolution = resolve_parts(runtime, parts, bundle)
        assert resolution.lease is not None, resolution.failure
        resolution.lease.close()
    return runtime


def _publication_ids(store: FilesystemHostWeightStore, bundle: FinalLayoutBF16BundleProducer) -> dict[str, str]:
    found = {}
    for output in bundle.spec.outputs:
        result = store.lookup(output, validation=META)
        if result.lease is not None:
            found[output.key] = result.lease.publication_id
            result.lease.close()
    return found


def _one_artifact_digest(root: Path, parts: RankParts) -> str:
    """The content digest of the one-artifact-per-rank layout the parts replace (streamed per rank)."""
    resolution = runtime_at(root, RuntimeMode.REQUIRED).resolve(
        parts.rank.identity, FinalLayoutBF16CheckpointProducer(parts.rank)
    )
    assert resolution.lease is not None
    with resolution.lease as lease:
        return lease.manifest.content_digest


def test_the_replicated_part_is_stored_once_for_every_rank(tmp_path: Path, flux: Folder) -> None:
    """T01/C04: at TP=4 every rank computes the same replicated key, the node holds 1 + 4 artifacts whose tensors
    add up to exactly the TP=1 artifact's bytes, every tensor lives in exactly one part; each rank's lease over
    its parts has the content of the one-artifact rank layout it replaces, restores bit-identically into the
    rank's skeleton, and the parts' keys differ from the rank, TP=1 and TP=2 keys."""
    holder, contexts = rank_contexts(flux, 4)
    bundle = FinalLayoutBF16BundleProducer(contexts)
    assert len({parts.replicated.identity.key for parts in bundle.parts}) == 1
    runtime = _build_all(tmp_path / "hwr", bundle)
    store = FilesystemHostWeightStore(tmp_path / "hwr")
    assert len(list(store.layout.artifacts.iterdir())) == 5
    tp1 = identity_context(Pipeline(flux.skeleton()), flux.source())
    single = runtime_at(tmp_path / "tp1", RuntimeMode.REQUIRED).resolve(
        tp1.identity, FinalLayoutBF16CheckpointProducer(tp1)
    )
    assert single.lease is not None
    single.lease.close()
    # The tensors' bytes add up exactly; the payload files differ only by their headers and alignment (a few
    # KiB per file, which `hwr bench` sets against a real model's size: goal <= 1.02x).
    parts_bytes = bundle.parts[0].replicated.total_bytes + sum(parts.shard.total_bytes for parts in bundle.parts)
    assert parts_bytes == tp1.total_bytes
    assert _payload(tmp_path / "hwr") - _payload(tmp_path / "tp1") <= 4 * 8192
    _, two = rank_contexts(flux, 2)
    other_keys = {tp1.identity.key, *(split.replicated.identity.key for split in bundle_parts(two))}
    canonical = dict(flux.canonical().named_parameters())
    for parts in bundle.parts:
        assert not parts.replicated.tensor_names & parts.shard.tensor_names
        assert parts.replicated.tensor_names | parts.shard.tensor_names == parts.rank.tensor_names
        keys = {parts.rank.identity.key, parts.replicated.identity.key, parts.shard.identity.key}
        assert len(keys) == 3 and not keys & other_keys
        resolution = resolve_parts(runtime, parts)
        assert resolution.lease is not None
        with resolution.lease as lease:
            assert lease.manifest.content_digest == _one_artifact_digest(tmp_path / "single", parts)
            FinalLayoutTensorRestorer(parts.rank)._plan_on_identity_skeleton(holder, lease).commit()
            for name, value in holder.get_submodule(DIT).named_parameters():
                shard = parts.rank.tensor_shards.get(f"{DIT}.{name}")
                full = canonical[name].detach()
                expected = full if shard is None else shard.take(full)
                assert value.dtype == expected.dtype and torch.equal(value, expected), name
                assert value.data_ptr() == lease.tensors[f"{DIT}.{name}"].data_ptr()  # bound, not copied
        holder, _ = rank_contexts(flux, 4)


@pytest.mark.parametrize("evicted", [PartKind.REPLICATED, PartKind.SHARD])
def test_an_evicted_part_is_rebuilt_alone(tmp_path: Path, flux: Folder, evicted: PartKind) -> None:
    """T02/S02: while a rank's lease is open neither part can be evicted; once closed, evicting one part leaves
    the rank a typed miss naming it (never half a layout); the next bundle rebuilds only that part, reading only
    its tensors, keeps the other parts' publications, and the rank's content is unchanged."""
    root = tmp_path / "hwr"
    _, contexts = rank_contexts(flux, 2)
    bundle = FinalLayoutBF16BundleProducer(contexts)
    runtime = _build_all(root, bundle)
    store = FilesystemHostWeightStore(root)
    parts = bundle.parts[1]
    victim = parts.part(evicted).identity.key
    evictor = Evictor(store.layout, "tmpfs")
    held = resolve_parts(runtime, parts)
    assert held.lease is not None
    digest = held.lease.manifest.content_digest
    assert evictor.evict(victim) is None  # a live rank lease holds both parts
    held.lease.close()
    assert evictor.evict(victim)
    before = _publication_ids(store, bundle)
    assert victim not in before and len(before) == 2
    lookup = resolve_parts(runtime_at(root), parts)
    assert lookup.lease is None and lookup.failure is None and lookup.missing_parts == (evicted.value,)
    rebuilt = resolve_parts(runtime, parts, bundle)
    assert rebuilt.lease is not None
    with rebuilt.lease as lease:
        assert lease.manifest.content_digest == digest
    after = _publication_ids(store, bundle)
    assert {key: after[key] for key in before} == before
    rebuilt_bytes = sum(tensor.nbytes for tensor in parts.part(evicted).tensors)
    assert 0 < bundle.bytes_read < sum(tensor.nbytes for tensor in parts.rank.tensors) * len(contexts)
    assert bundle.bytes_read >= rebuilt_bytes


def test_parts_of_two_builds_are_never_combined(tmp_path: Path, flux: Folder) -> None:
    """T02: the replicated part, removed and rebuilt by a producer whose bytes differ, no longer matches the
    content digest each shard recorded at its build: every rank is refused with a typed MANIFEST_INCOMPATIBLE
    and gets no lease (the parts' leases are closed again); once the shards are rebuilt beside it, the ranks
    are served again."""
    root = tmp_path / "hwr"
    _, contexts = rank_contexts(flux, 2)
    bundle = FinalLayoutBF16BundleProducer(contexts)
    runtime = _build_all(root, bundle)
    store = FilesystemHostWeightStore(root)
    replicated = bundle.parts[0].replicated
    target = replicated.tensors[0].name

    class OtherBytes(FinalLayoutBF16BundleProducer):
        def _final(self, rows: torch.Tensor, tensor: FinalLayoutTensor) -> torch.Tensor:
            final = rows.to(tensor.dtype)
            return final + 1 if tensor.name == target else final

    assert store.cleanup(replicated.identity.key).status.value == "removed"
    other = resolve_parts(runtime, bundle.parts[0], OtherBytes(contexts))
    assert other.lease is None and other.failure is not None
    assert other.failure.code is FailureCode.MANIFEST_INCOMPATIBLE
    for parts in bundle.parts:
        refused = resolve_parts(runtime, parts)
        assert refused.lease is None and refused.failure is not None
        assert refused.failure.code is FailureCode.MANIFEST_INCOMPATIBLE
        assert refused.shard.lease is not None and refused.shard.lease.closed
    for parts in bundle.parts:
        store.cleanup(parts.shard.identity.key)
    for parts in bundle.parts:
        served = resolve_parts(runtime, parts, OtherBytes(contexts))
        assert served.lease is not None
        replicated_lease = store.lookup(parts.replicated.identity, validation=META).lease
        shard_lease = store.lookup(parts.shard.identity, validation=META).lease
        assert replicated_lease is not None and shard_lease is not None
        assert check_one_build(parts, replicated_lease, shard_lease) is None
        assert bundle_outputs(shard_lease.manifest)[parts.replicated.identity.key] == (
            replicated_lease.manifest.content_digest
        )
        for lease in (served.lease, replicated_lease, shard_lease):
            lease.close()


def test_bad_plans_are_refused_before_anything_is_written(tmp_path: Path, flux: Folder) -> None:
    """T02/D05: a plan naming one Linear in two rules (split one way and another, or split and kept) and a bundle
    over ranks of two plan versions are typed UNSUPPORTED refusals raised before any store exists."""
    skeleton = flux.skeleton()
    plan = plan_for_model(skeleton)
    doubled = TensorParallelPlan(
        "doubled", (*plan.rules, TensorParallelRule("transformer_blocks.0.attn.to_q", ShardStyle.ROWWISE))
    )
    with pytest.raises(HostWeightError) as raised:
        rank_contexts(flux, 2, doubled)
    assert raised.value.failure.code is FailureCode.UNSUPPORTED
    assert "transformer_blocks.0.attn.to_q" in raised.value.failure.message
    _, first = rank_contexts(flux, 2)
    _, second = rank_contexts(flux, 2, dataclasses.replace(plan, name="flux-diffusers-tp-v2"))
    with pytest.raises(HostWeightError) as mixed:
        FinalLayoutBF16BundleProducer([first[0], second[1]])
    assert mixed.value.failure.code is FailureCode.UNSUPPORTED
    assert not (tmp_path / "hwr").exists()


def test_parts_push_to_a_remote_and_import_on_another_node(tmp_path: Path, flux: Folder) -> None:
    """T01/E01: every part is pushed as its own exact artifact; a fresh node with the remote configured imports
    the replicated part once (the second rank then hits it locally) and each shard, with their bundle records,
    and each rank's lease has the content of the node that built them."""
    _, contexts = rank_contexts(flux, 2)
    bundle = FinalLayoutBF16BundleProducer(contexts)
    runtime_a = _build_all(tmp_path / "node-a", bundle)
    store_a = FilesystemHostWeightStore(tmp_path / "node-a")
    url = f"file://{tmp_path / 'remote'}"
    (tmp_path / "remote").mkdir()
    for output in bundle.spec.outputs:
        push_artifact(store_a, output, url)
    runtime_b = HostWeightRuntime(
        HostWeightRuntimeConfig(mode=RuntimeMode.REQUIRED, root=tmp_path / "node-b", remote=(url,))
    )
    sources = []
    for parts in bundle.parts:
        expected = resolve_parts(runtime_a, parts)
        imported = resolve_parts(runtime_b, parts)
        assert expected.lease is not None and imported.lease is not None
        assert imported.lease.manifest.content_digest == expected.lease.manifest.content_digest
        assert imported.shard.outcome is ResolutionOutcome.REMOTE_IMPORT
        sources.append(imported.replicated.outcome)
        for lease in (expected.lease, imported.lease):
            lease.close()
        shard = FilesystemHostWeightStore(tmp_path / "node-b").lookup(parts.shard.identity, validation=META)
        assert shard.lease is not None
        assert parts.replicated.identity.key in bundle_outputs(shard.lease.manifest)
        assert shard.lease.provenance.source is LeaseSource.LOCAL_HIT
        shard.lease.close()
    assert sources == [ResolutionOutcome.REMOTE_IMPORT, ResolutionOutcome.LOCAL_HIT]

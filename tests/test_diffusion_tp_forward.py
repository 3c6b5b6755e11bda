"""TP forward coverage for SD3, Wan and MiniMax-H3 with attention heads split (one gloo group of 2 spawned ranks).

The group serves all three kinds (cold bundle build, then warm hit) and each rank reports its
forward output, its local weights and its attention modules; the tests below judge those
against the single-process canonical model. A TP=4 group serves SD3, whose 2 heads 4 ranks
cannot split, with the default MLP-only plan. The single-process tests need no group.
"""

from __future__ import annotations

from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy
import pytest
import torch

from host_weight_runtime.diffusion import (
    FIRST_CLASS_TENSOR_PARALLEL_PLANS,
    MLP_ONLY_TENSOR_PARALLEL_PLANS,
    FinalLayoutParallelIdentity,
    ShardStyle,
    TensorParallelPlan,
    TensorParallelRule,
    plan_for_model,
    resolve_tensor_shards,
)
from host_weight_runtime.diffusion.parallel.ranks import localize_for_rank
from host_weight_runtime.failures import FailureCode, HostWeightError
from hwr_tools.preimported import preimported_context
from hwr_tools.synthetic_models import forward_inputs, run_forward

from ._diffusion import Folder, save_folder
from ._tp_children import rank_contexts
from ._tp_forward_children import forward_group_child, local_bits

KINDS = ("sd3", "wan", "minimax_h3")
WORLD = 2
CHILD_S = 300.0
# BF16 keeps 8 significant bits: rowwise partial sums all-reduced across ranks (and Wan's q/k norm, whose
# squares are summed per rank first) round in another order than one process does, by a few BF16 ulps per
# layer. Weights are compared bit for bit instead.
BF16_TOLERANCE = {"atol": 2e-2, "rtol": 2e-2}
ATTENTION_PROJECTION = {"sd3": "transformer_blocks.0.attn.to_q", "wan": "blocks.0.attn2.add_k_proj"}
ATTENTION_PROJECTION["minimax_h3"] = "transformer_blocks.0.attn.to_q"


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Folder]:
    base = tmp_path_factory.mktemp("tp-forward")
    return {kind: save_folder(base / kind, kind, seed=17) for kind in KINDS}


def _receive(connection: Connection) -> dict[str, Any]:
    if not connection.poll(CHILD_S):
        raise AssertionError("a rank sent nothing before the deadline")
    value: dict[str, Any] = connection.recv()
    return value


def _run_group(
    world: int, kinds: tuple[str, ...], folders: dict[str, Folder], tmp: Path
) -> dict[tuple[str, str], list[dict[str, Any]]]:
    """(kind, mode) -> each rank's report, from one gloo group of `world` spawned ranks; children are always reaped."""
    context = preimported_context()
    setup = {
        "world": world,
        "rendezvous": f"file://{tmp / 'rendezvous'}",
        "domain": str(tmp / "hwr"),
        "folders": [(kind, str(folders[kind].root)) for kind in kinds],
    }
    receivers, processes = [], []
    for rank in range(world):
        receive, send = context.Pipe(duplex=False)
        process = context.Process(target=forward_group_child, args=(rank, setup, send))
        process.start()
        receivers.append(receive)
        processes.append(process)
    results: dict[tuple[str, str], list[dict[str, Any]]] = {}
    try:
        for _ in range(2 * len(kinds)):
            reports = [_receive(receiver) for receiver in receivers]
            results[(reports[0]["kind"], reports[0]["mode"])] = reports
    finally:
        for process in processes:
            process.join(CHILD_S)
            if process.exitcode is None:
                process.kill()
                process.join(CHILD_S)
    assert [process.exitcode for process in processes] == [0] * world
    return results


@pytest.fixture(scope="module")
def group_results(
    folders: dict[str, Folder], tmp_path_factory: pytest.TempPathFactory
) -> dict[tuple[str, str], list[dict[str, Any]]]:
    """Every kind at TP=WORLD, cold then warm, in one group."""
    return _run_group(WORLD, KINDS, folders, tmp_path_factory.mktemp("tp-forward-group"))


@pytest.mark.parametrize("kind", KINDS)
def test_tp2_forward_with_split_attention_matches_the_single_process_forward(
    kind: str, folders: dict[str, Folder], group_results: dict[tuple[str, str], list[dict[str, Any]]]
) -> None:
    """D13/D14/T01: at TP=2 on gloo, with attention heads split as well as the MLPs, a cold group in REQUIRED
    builds one bundle and serves from it, a warm group in PREFERRED hits on every rank; every rank's output
    matches the single-process canonical BF16 forward at BF16 rounding, and warm equals cold bit for bit."""
    model = folders[kind].canonical()
    reference = run_forward(kind, model, forward_inputs(kind, model, seed=5)).float()
    cold, warm = group_results[(kind, "required")], group_results[(kind, "preferred")]
    assert [report["path"] for report in cold + warm] == ["artifact"] * (2 * WORLD)
    assert [report["outcome"] for report in warm] == ["local_hit"] * WORLD
    for before, after in zip(cold, warm, strict=True):
        assert numpy.array_equal(before["output"], after["output"])
        torch.testing.assert_close(torch.from_numpy(after["output"]), reference, **BF16_TOLERANCE)


@pytest.mark.parametrize("kind", KINDS)
def test_each_rank_holds_its_heads_bit_for_bit_and_the_rest_whole(
    kind: str, folders: dict[str, Folder], group_results: dict[tuple[str, str], list[dict[str, Any]]]
) -> None:
    """T01/D13: every rank's split weights (attention q/k/v/out and MLP) are exactly its slice of the canonical
    BF16 weights, every replicated tensor is the canonical tensor bit for bit, and every split attention module
    runs on half its heads (Wan's across-head q/k norms as group-wide norms)."""
    canonical = folders[kind].canonical()
    full = {name: parameter.detach() for name, parameter in canonical.named_parameters()}
    for rank in range(WORLD):
        shards = resolve_tensor_shards(canonical, plan_for_model(canonical), WORLD, rank)
        assert f"{ATTENTION_PROJECTION[kind]}.weight" in shards
        report = group_results[(kind, "preferred")][rank]
        assert set(report["weights"]) == set(full)
        for name, bits in report["weights"].items():
            shard = shards.get(name)
            expected = full[name] if shard is None else shard.take(full[name])
            assert numpy.array_equal(bits, local_bits(expected)), name
        attention = report["attention"]
        assert attention, "no attention module was split"
        assert all(facts["heads"] * WORLD == facts["full_heads"] for facts in attention.values())
        norm_classes = {cls for facts in attention.values() for cls in facts["norms"].values()}
        assert ("HeadShardedRMSNorm" in norm_classes) is (kind == "wan"), norm_classes


def test_a_plan_splitting_part_of_an_attention_is_refused_before_anything_is_read(tmp_path: Path) -> None:
    """D05/D06: a plan that splits some of an attention module's projections but not the others is UNSUPPORTED
    on the `meta` skeleton (no weight read, no file written); so is an across-head q/k norm that is not an RMSNorm."""
    folder = save_folder(tmp_path / "wan", "wan", seed=17)
    partial = TensorParallelPlan("wan-q-only", (TensorParallelRule("blocks.*.attn1.to_q", ShardStyle.COLWISE),))
    parallel = FinalLayoutParallelIdentity(tensor_parallel_size=2, tensor_parallel_rank=0)
    with pytest.raises(HostWeightError) as raised:
        localize_for_rank(folder.skeleton(), parallel, partial)
    assert raised.value.failure.code is FailureCode.UNSUPPORTED
    assert "blocks.0.attn1" in raised.value.failure.message and "to_k" in raised.value.failure.message
    skeleton = folder.skeleton()
    attention = skeleton.get_submodule("blocks.0.attn1")
    with torch.device("meta"):
        attention.norm_q = torch.nn.LayerNorm(attention.inner_dim)
    with pytest.raises(HostWeightError) as raised:
        localize_for_rank(skeleton, parallel)
    assert raised.value.failure.code is FailureCode.UNSUPPORTED
    assert "blocks.0.attn1.norm_q" in raised.value.failure.message
    assert not (tmp_path / "hwr").exists()


@pytest.mark.parametrize("kind", KINDS)
def test_mlp_only_plans_split_every_mlp_and_no_attention(kind: str, folders: dict[str, Folder]) -> None:
    """D05/D13: each model's MLP-only plan splits MLP Linears (MiniMax-H3's SwiGLU projection as two halves) and
    no attention projection, and its plan dict (its key) differs from the attention-split plan's."""
    skeleton = folders[kind].skeleton()
    class_name = type(skeleton).__name__
    mlp_only = MLP_ONLY_TENSOR_PARALLEL_PLANS[class_name]
    assert mlp_only.to_dict() != FIRST_CLASS_TENSOR_PARALLEL_PLANS[class_name].to_dict()
    shards = resolve_tensor_shards(skeleton, mlp_only, 2, 1)
    assert shards and all(".ff" in name for name in shards), sorted(shards)
    assert not any(".attn" in name for name in shards)
    gated = [shard.block_sizes for name, shard in shards.items() if name.endswith("net.0.proj.weight")]
    assert all(len(blocks) == (2 if kind == "minimax_h3" else 1) for blocks in gated), gated


def test_default_plan_follows_the_tp_size_and_a_named_attention_split_is_still_refused(
    folders: dict[str, Folder],
) -> None:
    """D05/D06: SD3's 2 heads split at TP=2, so its default plan there splits attention; at TP=4 the default is
    the MLP-only plan (a plan name and key of its own), chosen alike on fresh skeletons (as every rank would);
    naming the attention-split plan at TP=4 stays UNSUPPORTED, naming the attention module and its heads."""
    folder = folders["sd3"]
    attention_split = FIRST_CLASS_TENSOR_PARALLEL_PLANS["SD3Transformer2DModel"]
    mlp_only = MLP_ONLY_TENSOR_PARALLEL_PLANS["SD3Transformer2DModel"]
    assert (attention_split.name, mlp_only.name) == ("sd3-attention-mlp-v1", "sd3-mlp-v1")
    assert plan_for_model(folder.skeleton(), 2) is attention_split
    assert plan_for_model(folder.skeleton()) is attention_split
    assert [plan_for_model(folder.skeleton(), 4) for _ in range(2)] == [mlp_only, mlp_only]

    skeleton = folder.skeleton()
    full = {name: tuple(p.shape) for name, p in skeleton.named_parameters()}
    tp4 = FinalLayoutParallelIdentity(tensor_parallel_size=4, tensor_parallel_rank=3)
    assert localize_for_rank(skeleton, tp4) is mlp_only
    local = {name: tuple(p.shape) for name, p in skeleton.named_parameters()}
    assert local["transformer_blocks.0.attn.to_q.weight"] == full["transformer_blocks.0.attn.to_q.weight"]
    inner, width = full["transformer_blocks.0.ff.net.0.proj.weight"]
    assert local["transformer_blocks.0.ff.net.0.proj.weight"] == (inner // 4, width)

    _, default_contexts = rank_contexts(folder, 4)
    _, named_contexts = rank_contexts(folder, 4, mlp_only)
    _, tp2_contexts = rank_contexts(folder, 2)
    assert [c.identity.key for c in default_contexts] == [c.identity.key for c in named_contexts]
    assert len({c.identity.key for c in default_contexts + tp2_contexts}) == 6

    with pytest.raises(HostWeightError) as raised:
        localize_for_rank(folder.skeleton(), tp4, attention_split)
    assert raised.value.failure.code is FailureCode.UNSUPPORTED
    assert "transformer_blocks.0.attn has 2 attention heads" in raised.value.failure.message


@pytest.mark.slow
def test_tp4_default_load_of_two_heads_serves_the_mlp_only_plan_on_every_rank(
    folders: dict[str, Folder], tmp_path: Path
) -> None:
    """D05/T01: a TP=4 gloo group loads the 2-head SD3 by default (cold REQUIRED build, warm PREFERRED hit): every
    rank reports the MLP-only plan, holds exactly its slice of each canonical MLP weight and every attention
    weight whole (no head split), and its forward matches the single-process canonical BF16 forward."""
    results = _run_group(4, ("sd3",), folders, tmp_path)
    canonical = folders["sd3"].canonical()
    reference = run_forward("sd3", canonical, forward_inputs("sd3", canonical, seed=5)).float()
    full = {name: parameter.detach() for name, parameter in canonical.named_parameters()}
    mlp_only = MLP_ONLY_TENSOR_PARALLEL_PLANS["SD3Transformer2DModel"]
    cold, warm = results[("sd3", "required")], results[("sd3", "preferred")]
    assert [report["plan"] for report in cold + warm] == [mlp_only.name] * 8
    assert [report["outcome"] for report in warm] == ["local_hit"] * 4
    for rank, report in enumerate(warm):
        shards = resolve_tensor_shards(canonical, mlp_only, 4, rank)
        assert shards and not any(".attn." in name for name in shards)
        assert set(report["weights"]) == set(full)
        for name, bits in report["weights"].items():
            shard = shards.get(name)
            expected = full[name] if shard is None else shard.take(full[name])
            assert numpy.array_equal(bits, local_bits(expected)), name
        assert report["attention"] == {}
        torch.testing.assert_close(torch.from_numpy(report["output"]), reference, **BF16_TOLERANCE)

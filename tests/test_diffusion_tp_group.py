"""GROUP_COHORT and TP forward parity: real gloo process groups of spawned ranks on CPU.

Every child is joined with a deadline and killed if it overstays; every pipe read has one.
"""

from __future__ import annotations

import signal
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import pytest
import torch

from host_weight_runtime.config import RuntimeMode
from host_weight_runtime.diffusion import plan_for_model, prewarm_tensor_parallel, resolve_tensor_shards
from host_weight_runtime.filesystem.store import FilesystemHostWeightStore
from host_weight_runtime.outcomes import ResolutionOutcome
from hwr_tools.preimported import preimported_context
from hwr_tools.synthetic_models import forward_inputs, run_forward

from ._diffusion import DIT, Folder, runtime_at, save_folder
from ._tp_children import group_child
from .test_diffusion_tp import FLUX_TP4

CHILD_S = 240.0
READ_S = 240.0


@pytest.fixture(scope="module")
def flux(tmp_path_factory: pytest.TempPathFactory) -> Folder:
    return save_folder(tmp_path_factory.mktemp("tp-group-flux"), "flux", seed=7, config_overrides=FLUX_TP4)


@pytest.fixture(scope="module")
def reference(flux: Folder) -> torch.Tensor:
    model = flux.canonical()
    return run_forward("flux", model, forward_inputs("flux", model, seed=5))


def _read(connection: Connection) -> Any:
    if not connection.poll(READ_S):
        raise AssertionError("a rank sent nothing before the deadline")
    value = connection.recv()
    if isinstance(value, dict) and "output" in value:
        value["output"] = torch.from_numpy(value["output"])
    return value


class Group:
    """`world` spawned ranks running `steps`; results per rank, children always reaped."""

    def __init__(self, tmp: Path, folder: Folder, domain: Path, world: int, steps: list[dict[str, Any]]) -> None:
        context = preimported_context()
        rendezvous = f"file://{tmp / f'rendezvous-{id(self)}'}"
        self.reports: list[Connection] = []
        self.controls: list[Connection] = []
        self.processes: list[BaseProcess] = []
        setup = {"world": world, "rendezvous": rendezvous, "folder": str(folder.root), "domain": str(domain)}
        setup["kind"] = folder.kind
        setup["steps"] = steps
        for rank in range(world):
            receive, send = context.Pipe(duplex=False)
            control_receive, control_send = context.Pipe(duplex=False)
            process = context.Process(
                target=group_child,
                args=(rank, setup, send, control_receive),
            )
            process.start()
            self.reports.append(receive)
            self.controls.append(control_send)
            self.processes.append(process)

    def results(self) -> list[dict[str, Any]]:
        return [_read(report) for report in self.reports]

    def reap(self) -> list[int | None]:
        for process in self.processes:
            process.join(CHILD_S)
            if process.exitcode is None:
                process.kill()
                process.join(CHILD_S)
        return [process.exitcode for process in self.processes]


def run_group(tmp: Path, folder: Folder, domain: Path, world: int, steps: list[dict[str, Any]]) -> list[list[Any]]:
    group = Group(tmp, folder, domain, world, steps)
    try:
        per_step = [group.results() for _step in steps]
    finally:
        exits = group.reap()
    assert exits == [0] * world
    return per_step


SharedGroup = tuple[dict[str, Path], dict[str, list[Any]]]
# The first test to use it runs the shared group in its setup: three tests' group work in one, so the
# tests that use it have a limit above the suite's default.
SHARED_GROUP_TIMEOUT = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def shared_group(tmp_path_factory: pytest.TempPathFactory, flux: Folder) -> SharedGroup:
    """One TP=2 group of two spawned ranks running the steps of three tests, each on its own domain (one group
    start instead of three): cold then warm in REQUIRED, cold then warm in PREFERRED with the parameters'
    placements, and ranks resolving without a cohort."""
    tmp = tmp_path_factory.mktemp("tp-shared-group")
    domains = {name: tmp / name for name in ("cold-warm", "restored", "alone")}
    placements = {"mode": "preferred", "placements": True, "domain": str(domains["restored"])}
    steps: dict[str, dict[str, Any]] = {
        "cold": {"mode": "required"},
        "warm": {"mode": "preferred"},
        "restored-cold": placements,
        "restored-warm": placements,
        "alone": {"mode": "required", "group": False, "domain": str(domains["alone"])},
    }
    results = run_group(tmp, flux, domains["cold-warm"], 2, list(steps.values()))
    return domains, dict(zip(steps, results, strict=True))


@SHARED_GROUP_TIMEOUT
def test_cold_group_builds_one_bundle_then_warm_group_hits_with_identical_forward(
    shared_group: SharedGroup, reference: torch.Tensor
) -> None:
    """D14/D13: a cold TP=2 group in REQUIRED builds one bundle and serves from it; a warm group in PREFERRED hits
    on every rank; the parallelized (DTensor, gloo) forward matches the unsharded canonical one within BF16
    tolerance and the warm forward equals the cold one bit for bit."""
    domains, results = shared_group
    domain = domains["cold-warm"]
    cold, warm = results["cold"], results["warm"]
    assert all(result["path"] == "artifact" for result in cold + warm)
    assert {result["outcome"] for result in warm} == {"local_hit"}
    for before, after in zip(cold, warm, strict=True):
        assert torch.equal(before["output"], after["output"])
        torch.testing.assert_close(before["output"].float(), reference.float(), atol=3e-2, rtol=3e-2)
    store = FilesystemHostWeightStore(domain)
    assert len(list(store.layout.artifacts.iterdir())) == 3  # the replicated part and two shards, one bundle


def test_mixed_group_falls_back_together_or_fails_together(tmp_path: Path, flux: Folder) -> None:
    """D14: with rank 1's artifact removed, PREFERRED sends the whole group to the canonical path (and republishes),
    REQUIRED without a build fails on every rank with the same typed code."""
    domain = tmp_path / "hwr"
    # The bundle a group builds, built here without starting one (the prewarm's keys are the ranks' keys).
    _replicated, _rank0, rank1 = prewarm_tensor_parallel(
        flux.root, tensor_parallel_size=2, subfolder=DIT, runtime=runtime_at(domain, RuntimeMode.REQUIRED)
    )
    assert rank1.resolution.outcome is ResolutionOutcome.LOCAL_HIT  # published by the same pass
    store = FilesystemHostWeightStore(domain)
    store.cleanup(rank1.identity_key)
    required, preferred, again = run_group(
        tmp_path,
        flux,
        domain,
        2,
        [{"mode": "required", "stream": False}, {"mode": "preferred"}, {"mode": "preferred"}],
    )
    assert [result.get("failed") for result in required] == ["not_found", "not_found"]
    assert [result["path"] for result in preferred] == ["canonical", "canonical"]
    assert [result["outcome"] for result in again] == ["local_hit", "local_hit"]


def test_rank_killed_mid_build_fails_the_group_typed_and_next_run_succeeds(tmp_path: Path, flux: Folder) -> None:
    """D14/S16: rank 1 is SIGKILLed while it builds the bundle; rank 0 fails with a typed error (never hangs);
    nothing partial is published and the next group run serves every rank from artifacts."""
    domain = tmp_path / "hwr"
    steps: list[dict[str, Any]] = [
        {"mode": "required", "lock_timeout_s": 20.0, "faults": {"1": ["crash_building"], "0": ["wait_before_lock"]}}
    ]
    group = Group(tmp_path, flux, domain, 2, steps)
    try:
        assert _read(group.reports[1]) == {"event": "building"}
        group.controls[0].send("go")
        assert _read(group.reports[0]) == {"event": "waiting_for_lock"}
        group.controls[1].send("crash")
        survivor = _read(group.reports[0])
    finally:
        exits = group.reap()
    assert exits[1] == -signal.SIGKILL
    assert survivor.get("failed") == "lock_timeout"
    (next_run,) = run_group(tmp_path, flux, domain, 2, [{"mode": "required"}])
    assert [result["path"] for result in next_run] == ["artifact", "artifact"]


def test_flux2_tp2_forward_matches_the_unsharded_forward(tmp_path: Path) -> None:
    """D14/D13: Flux.2 at TP=2 with diffusers' own `_tp_plan` (packed QKV+MLP projections split block by block):
    a cold group builds one bundle, a warm group hits; the parallelized forward (DTensor, gloo) matches the
    unsharded canonical forward within BF16 tolerance and warm equals cold bit for bit."""
    flux2 = save_folder(tmp_path / "flux2", "flux2", seed=11)
    model = flux2.canonical()
    reference = run_forward("flux2", model, forward_inputs("flux2", model, seed=5))
    cold, warm = run_group(tmp_path, flux2, tmp_path / "hwr", 2, [{"mode": "required"}, {"mode": "preferred"}])
    assert all(result["path"] == "artifact" for result in cold + warm)
    assert {result["outcome"] for result in warm} == {"local_hit"}
    for before, after in zip(cold, warm, strict=True):
        assert torch.equal(before["output"], after["output"])
        torch.testing.assert_close(after["output"].float(), reference.float(), atol=3e-2, rtol=3e-2)


def test_four_rank_group_cold_and_warm(tmp_path: Path, flux: Folder, reference: torch.Tensor) -> None:
    """D14: TP=4 (4 heads over 4 ranks): one cold bundle, then all ranks hit; forward parity as at TP=2."""
    cold, warm = run_group(tmp_path, flux, tmp_path / "hwr", 4, [{"mode": "required"}, {"mode": "preferred"}])
    assert {result["outcome"] for result in warm} == {"local_hit"}
    for before, after in zip(cold, warm, strict=True):
        assert torch.equal(before["output"], after["output"])
        torch.testing.assert_close(after["output"].float(), reference.float(), atol=3e-2, rtol=3e-2)


def test_fp8_ranks_publish_then_hit_with_reference_shards_and_identical_forward(tmp_path: Path, flux: Folder) -> None:
    """D14/D05: TP=2 FP8, with a group cohort and without one (ranks resolving independently): a cold load in
    PREFERRED loads canonically, quantizes with full-tensor scales and publishes each rank's FP8 shards under
    its own key; the warm load hits on every rank; every warm rank's FP8 weight is bit for bit the matching
    slice of the reference per-tensor quantization of the canonical BF16 weight, with the full tensor's
    scale; the parallelized FP8 forward is bit-identical warm vs cold and matches the unsharded FP8 forward
    within BF16 tolerance."""
    from host_weight_runtime.diffusion.representation import quantize_model_fp8

    from .test_diffusion_fp8 import reference_fp8

    canonical = flux.canonical()
    weights = {name: parameter.detach() for name, parameter in canonical.named_parameters()}
    shards = [resolve_tensor_shards(canonical, plan_for_model(canonical), 2, rank) for rank in range(2)]
    quantize_model_fp8(canonical)
    expected = run_forward("flux", canonical, forward_inputs("flux", canonical, seed=5))
    fp8 = {"mode": "preferred", "representation": "fp8"}
    alone = str(tmp_path / "hwr-no-group")
    steps: list[dict[str, Any]] = [
        fp8,
        {**fp8, "fp8_bits": True},
        {**fp8, "group": False, "domain": alone},
        {**fp8, "group": False, "domain": alone, "fp8_bits": True},
    ]
    cold, warm, cold_alone, warm_alone = run_group(tmp_path, flux, tmp_path / "hwr", 2, steps)
    for first, second in ((cold, warm), (cold_alone, warm_alone)):
        assert [result["path"] for result in first] == ["canonical", "canonical"]
        assert {result["outcome"] for result in second} == {"local_hit"}
        assert len({result["key"] for result in second}) == 2
        assert [result["key"] for result in first] == [result["key"] for result in second]
        for before, after in zip(first, second, strict=True):
            assert torch.equal(before["output"], after["output"])
            torch.testing.assert_close(after["output"].float(), expected.float(), atol=3e-2, rtol=3e-2)
    assert [result["key"] for result in warm] == [result["key"] for result in warm_alone]
    split = 0
    for rank, result in enumerate(warm + warm_alone):
        assert result["fp8"], "the warm ranks serve FP8Linear modules"
        for name, (local_bits, scale) in result["fp8"].items():
            q, reference_scale = reference_fp8(weights[f"{name}.weight"])
            shard = shards[rank % 2].get(f"{name}.weight")
            split += shard is not None
            local = q if shard is None else shard.take(q)
            assert torch.equal(torch.from_numpy(local_bits), local.contiguous().view(torch.uint8)), name
            assert scale == float(reference_scale), name
    assert split > 0


def test_prewarmed_ranks_hit_in_a_required_group_without_a_build(tmp_path: Path, flux: Folder) -> None:
    """D05/D14/T01: `prewarm_tensor_parallel` builds the replicated part and every rank's shard in one pass with
    no process group (a second call finds them all); a TP=2 group in REQUIRED without streaming then hits on
    every rank, under the shard keys the prewarm reported, so an operator can prewarm a node before its ranks
    start."""
    domain = tmp_path / "hwr"
    runtime = runtime_at(domain, RuntimeMode.REQUIRED)
    built = prewarm_tensor_parallel(flux.root, tensor_parallel_size=2, subfolder=DIT, runtime=runtime)
    outcomes = [result.resolution.outcome for result in built]
    assert outcomes == [ResolutionOutcome.LOCAL_PRODUCTION] + [ResolutionOutcome.LOCAL_HIT] * 2  # one bundle
    replicated, *shards = built
    assert shards[0].total_bytes == shards[1].total_bytes and shards[0].identity_key != shards[1].identity_key
    assert replicated.total_bytes > 0 and len({result.identity_key for result in built}) == 3
    again = prewarm_tensor_parallel(flux.root, tensor_parallel_size=2, subfolder=DIT, runtime=runtime)
    assert [result.resolution.outcome for result in again] == [ResolutionOutcome.LOCAL_HIT] * 3
    (warm,) = run_group(tmp_path, flux, domain, 2, [{"mode": "required", "stream": False}])
    assert [result["outcome"] for result in warm] == ["local_hit", "local_hit"]
    assert [result["key"] for result in warm] == [result.identity_key for result in shards]


def test_fp8_groups_stream_the_bundle_or_are_served_from_an_fp8_prewarm(tmp_path: Path, flux: Folder) -> None:
    """T03/T01/D14: `prewarm_tensor_parallel(..., representation="fp8")` streams the FP8 replicated part and both
    shard parts in one pass; a TP=2 group in REQUIRED without streaming then hits them on every rank, and
    each rank's FP8 weights are the matching slice of the reference quantization of the full canonical
    weight with the full tensor's scale. A cold REQUIRED FP8 group streams the same bundle on its miss
    (default stream_on_miss) and serves the same keys with a bit-identical forward."""
    from .test_diffusion_fp8 import reference_fp8

    canonical = flux.canonical()
    weights = {name: parameter.detach() for name, parameter in canonical.named_parameters()}
    shards = [resolve_tensor_shards(canonical, plan_for_model(canonical), 2, rank) for rank in range(2)]
    prewarmed = tmp_path / "hwr-prewarmed"
    built = prewarm_tensor_parallel(
        flux.root, tensor_parallel_size=2, subfolder=DIT, runtime=runtime_at(prewarmed), representation="fp8"
    )
    outcomes = [result.resolution.outcome for result in built]
    assert outcomes == [ResolutionOutcome.LOCAL_PRODUCTION, ResolutionOutcome.LOCAL_HIT, ResolutionOutcome.LOCAL_HIT]
    steps: list[dict[str, Any]] = [
        {"mode": "required", "stream": False, "representation": "fp8", "domain": str(prewarmed), "fp8_bits": True},
        {"mode": "required", "representation": "fp8"},
    ]
    served, streamed = run_group(tmp_path, flux, tmp_path / "hwr-cold", 2, steps)
    assert [result["outcome"] for result in served] == ["local_hit", "local_hit"]
    assert [result["key"] for result in served] == [result.identity_key for result in built[1:]]
    assert [result["path"] for result in streamed] == ["artifact", "artifact"]
    assert [result["key"] for result in streamed] == [result["key"] for result in served]
    for hit, cold in zip(served, streamed, strict=True):
        assert torch.equal(hit["output"], cold["output"])
    split = 0
    for rank, result in enumerate(served):
        assert result["fp8"], "the ranks serve FP8Linear modules"
        for name, (local_bits, scale) in result["fp8"].items():
            q, reference_scale = reference_fp8(weights[f"{name}.weight"])
            shard = shards[rank].get(f"{name}.weight")
            split += shard is not None
            local = q if shard is None else shard.take(q)
            assert torch.equal(torch.from_numpy(local_bits), local.contiguous().view(torch.uint8)), name
            assert scale == float(reference_scale), name
    assert split > 0
    assert len(list(FilesystemHostWeightStore(tmp_path / "hwr-cold").layout.artifacts.iterdir())) == 3


@SHARED_GROUP_TIMEOUT
def test_a_rank_restored_from_its_parts_equals_the_canonical_rank(shared_group: SharedGroup) -> None:
    """T01: a cold TP=2 group in PREFERRED loads canonically, localizes and publishes the two parts (the
    replicated part once); the warm group restores from them: every parameter has the same DTensor
    placements, dtype and local bytes as the canonical rank had, and the forward is bit-identical."""
    domains, results = shared_group
    domain = domains["restored"]
    cold, warm = results["restored-cold"], results["restored-warm"]
    assert [result["path"] for result in cold] == ["canonical", "canonical"]
    assert [result["outcome"] for result in warm] == ["local_hit", "local_hit"]
    for before, after in zip(cold, warm, strict=True):
        assert before["placements"] == after["placements"]
        assert any(placement.startswith("(Shard") for placement, _d, _h in after["placements"].values())
        assert torch.equal(before["output"], after["output"])
    assert len(list(FilesystemHostWeightStore(domain).layout.artifacts.iterdir())) == 3


def test_ranks_with_different_plan_versions_are_refused_before_touching_artifacts(
    tmp_path: Path, flux: Folder
) -> None:
    """T02: rank 1 declares the same rules under another plan version; both ranks of the group raise the same
    typed INVALID_CONFIGURATION before any lookup or build, so no artifact or staging exists afterwards."""
    domain = tmp_path / "hwr"
    steps: list[dict[str, Any]] = [{"mode": "required", "plan_name": {"1": "flux-diffusers-tp-v2"}}]
    (refused,) = run_group(tmp_path, flux, domain, 2, steps)
    assert [result.get("failed") for result in refused] == ["invalid_configuration"] * 2
    store = FilesystemHostWeightStore(domain)
    assert not list(store.layout.artifacts.glob("*")) and not list(store.layout.tmp.glob("*"))


@SHARED_GROUP_TIMEOUT
def test_ranks_without_a_group_build_one_bundle_and_join_it(shared_group: SharedGroup) -> None:
    """T01/S14: two ranks resolving independently (no cohort) in REQUIRED both stream on a miss: one bundle
    publishes the replicated part and both shards, the other rank joins or hits; both serve from artifacts."""
    domains, results = shared_group
    domain = domains["alone"]
    alone = results["alone"]
    assert [result["path"] for result in alone] == ["artifact", "artifact"]
    store = FilesystemHostWeightStore(domain)
    assert len(list(store.layout.artifacts.iterdir())) == 3
    assert not list(store.layout.tmp.glob("*"))

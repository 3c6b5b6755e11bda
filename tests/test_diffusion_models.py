"""First-class model contracts on real reduced diffusers models (D13).

For Flux, Flux2, MiniMax-H3, SD3 and Wan: publish a canonically loaded model after load,
restore the artifact into a fresh `meta` skeleton, check the contract's validator and
compare forward outputs bit for bit with `from_pretrained(torch_dtype=torch.bfloat16)`,
in this process and in a freshly spawned one; and show each validator refusing a model
that is not ready to serve.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import accelerate  # noqa: F401  (`make test` installs it: a missing one fails the module, never skips it)
import diffusers  # noqa: F401
import pytest
import torch

from host_weight_runtime.diffusion import (
    FIRST_CLASS_CONTRACTS,
    ComponentLoadPath,
    FinalLayoutTensorRestorer,
    ModelNotReadyError,
    contract_for_model,
    load_component,
)
from host_weight_runtime.failures import FailureCode, HostWeightError
from host_weight_runtime.lease import HostWeightLease
from host_weight_runtime.outcomes import PostLoadPublicationStatus, ResolutionOutcome
from hwr_tools.synthetic_models import MODEL_KINDS, forward_inputs, run_forward, tiny_spec

from ._diffusion import DIT, Folder, Pipeline, all_tensors, identity_context, publish_canonical, runtime_at, save_folder
from .support import recv_within, spawned_child


@dataclass
class Restored:
    """A model restored from an artifact published after a canonical load, next to that canonical model."""

    holder: Pipeline
    canonical: Any
    lease: HostWeightLease

    @property
    def model(self) -> Any:
        return self.holder.transformer


@pytest.fixture
def restore(tmp_path: Path) -> Iterator[Any]:
    """restore(kind) publishes a canonical `kind` model post-load and restores it into a fresh skeleton."""
    leases: list[HostWeightLease] = []

    def make(kind: str) -> Restored:
        folder = save_folder(tmp_path / kind, kind)
        runtime = runtime_at(tmp_path / "domain")
        canonical = folder.canonical()
        serving = Pipeline(canonical)
        report = publish_canonical(runtime, identity_context(serving, folder.source()), canonical)
        assert report.status is PostLoadPublicationStatus.PUBLISHED, report.failure
        holder = Pipeline(folder.skeleton())
        context = identity_context(holder, folder.source())
        assert context.identity.key == report.identity_key, "skeleton and loaded model must share the key"
        resolution = runtime.resolve(context.identity)
        assert resolution.outcome is ResolutionOutcome.LOCAL_HIT and resolution.lease is not None
        leases.append(resolution.lease)
        FinalLayoutTensorRestorer(context).plan_restore(holder, resolution.lease).commit()
        return Restored(holder, canonical, resolution.lease)

    yield make
    for lease in leases:
        lease.close()


def _contract(kind: str) -> Any:
    return FIRST_CLASS_CONTRACTS[tiny_spec(kind).class_name]


# ----------------------------------------------------------------------------- restore parity


@pytest.mark.parametrize("kind", MODEL_KINDS)
def test_first_class_model_restores_bit_identical_to_canonical(kind: str, restore: Any) -> None:
    """D13: publish, restore into a fresh skeleton, pass the validator, and match canonical forward outputs exactly."""
    restored = restore(kind)
    contract = _contract(kind)
    assert contract.first_class and contract_for_model(restored.model) is contract

    contract.validator(restored.model)

    canonical = all_tensors(restored.canonical)
    for name, tensor in all_tensors(restored.model).items():
        assert tensor.dtype == canonical[name].dtype and torch.equal(tensor, canonical[name]), name
    inputs = forward_inputs(kind, restored.canonical)
    expected = run_forward(kind, restored.canonical, inputs)
    actual = run_forward(kind, restored.model, inputs)
    assert bool(torch.isfinite(expected).all()) and bool(expected.abs().sum() > 0)
    assert actual.dtype == expected.dtype and torch.equal(actual, expected)


def _warm_hit_child(domain: str, folders: list[tuple[str, str]], threads: int, conn: Connection) -> None:
    """In a fresh process: load_component every folder from the domain and send back how and what it computed."""
    torch.set_num_threads(threads)
    answers: dict[str, dict[str, object]] = {}
    for kind, root in folders:
        with load_component(root, subfolder=DIT, runtime=runtime_at(Path(domain))) as loaded:
            model = loaded.model
            contract_for_model(model).validator(model)
            output = run_forward(kind, model, forward_inputs(kind, model))
            answers[kind] = {
                "load_path": loaded.load_path.value,
                "outcome": None if loaded.outcome is None else loaded.outcome.value,
                "dtype": str(output.dtype),
                "shape": tuple(output.shape),
                "bytes": output.contiguous().view(torch.uint8).numpy().tobytes(),
            }
    conn.send(answers)


def test_fresh_process_warm_hit_matches_canonical_outputs(tmp_path: Path) -> None:
    """D13: after one canonical load publishes each kind, a spawned process restores all of them bit-identically."""
    domain = tmp_path / "domain"
    folders: dict[str, Folder] = {kind: save_folder(tmp_path / kind, kind) for kind in MODEL_KINDS}
    expected: dict[str, torch.Tensor] = {}
    for kind, folder in folders.items():
        with load_component(
            folder.root, subfolder=DIT, runtime=runtime_at(domain), publish_in_background=False
        ) as first:
            assert first.load_path is ComponentLoadPath.CANONICAL
            assert first.publication is not None and first.publication.status is PostLoadPublicationStatus.PUBLISHED
        canonical = folder.canonical()
        expected[kind] = run_forward(kind, canonical, forward_inputs(kind, canonical))

    with spawned_child(
        _warm_hit_child, str(domain), [(kind, str(f.root)) for kind, f in folders.items()], torch.get_num_threads()
    ) as conn:
        answers = recv_within(conn)

    assert isinstance(answers, dict) and answers.keys() == expected.keys()
    for kind, answer in answers.items():
        assert answer["load_path"] == ComponentLoadPath.ARTIFACT.value, kind
        assert answer["outcome"] == ResolutionOutcome.LOCAL_HIT.value, kind
        want = expected[kind]
        assert (answer["dtype"], answer["shape"]) == (str(want.dtype), tuple(want.shape)), kind
        assert answer["bytes"] == want.contiguous().view(torch.uint8).numpy().tobytes(), kind


# ----------------------------------------------------------------------------- validators refuse


@pytest.mark.parametrize("kind", MODEL_KINDS)
def test_validator_refuses_a_skeleton_still_on_meta(kind: str, tmp_path: Path) -> None:
    """D13: an unrestored skeleton is not ready: its parameters are still on the meta device."""
    skeleton = save_folder(tmp_path / kind, kind).skeleton()
    with pytest.raises(ModelNotReadyError, match="meta device"):
        _contract(kind).validator(skeleton)


def test_validator_refuses_a_model_in_training_mode(restore: Any) -> None:
    """D13: a restored model serves in eval mode; the same model in train mode is refused."""
    restored = restore("flux")
    contract = _contract("flux")
    restored.model.train()
    with pytest.raises(ModelNotReadyError, match="training mode"):
        contract.validator(restored.model)
    restored.model.eval()
    contract.validator(restored.model)


def test_validator_refuses_wan_with_a_kept_fp32_tensor_cast_to_bf16(restore: Any) -> None:
    """D13: Wan keeps scale_shift_table in FP32; a model whose copy is BF16 is refused."""
    restored = restore("wan")
    contract = _contract("wan")
    model = restored.model
    assert model.scale_shift_table.dtype == torch.float32
    # A new parameter, never an in-place cast: the restored tensors view the read-only artifact.
    model.scale_shift_table = torch.nn.Parameter(model.scale_shift_table.to(torch.bfloat16), requires_grad=False)
    with pytest.raises(ModelNotReadyError, match="scale_shift_table"):
        contract.validator(model)


def test_validator_refuses_one_wrong_dtype_deep_in_a_block(restore: Any) -> None:
    """D13: the validator's one walk over the modules still sees every parameter: a single FP32 weight in the last
    block of a BF16 Flux model is refused by name."""
    restored = restore("flux")
    contract = _contract("flux")
    block = restored.model.single_transformer_blocks[-1]
    block.proj_out.weight = torch.nn.Parameter(block.proj_out.weight.to(torch.float32), requires_grad=False)
    with pytest.raises(ModelNotReadyError, match=r"single_transformer_blocks\.\d+\.proj_out\.weight is torch\.float32"):
        contract.validator(restored.model)


def test_validator_names_a_meta_buffer_before_an_earlier_dtype_mismatch(restore: Any) -> None:
    """D13: a buffer left on meta anywhere is reported as unrestored even when a parameter earlier in the walk has
    the wrong dtype (the dtype verdict waits until every tensor was seen)."""
    restored = restore("flux")
    contract = _contract("flux")
    model = restored.model
    model.x_embedder.weight = torch.nn.Parameter(model.x_embedder.weight.to(torch.float32), requires_grad=False)
    model.proj_out.register_buffer("left_behind", torch.empty(2, device="meta"))
    with pytest.raises(ModelNotReadyError, match=r"proj_out\.left_behind is still on the meta device"):
        contract.validator(model)
    del model.proj_out.left_behind
    with pytest.raises(ModelNotReadyError, match=r"x_embedder\.weight is torch\.float32"):
        contract.validator(model)


def test_validator_keeps_requires_grad_and_refuses_missing_modules(restore: Any) -> None:
    """D13: requires_grad is left as diffusers gives it (either value passes), and a model lacking a module its
    contract requires is refused."""
    restored = restore("sd3")
    contract = _contract("sd3")
    model = restored.model
    weight = model.proj_out.weight
    for requires_grad in (True, False):
        model.proj_out.weight = torch.nn.Parameter(weight, requires_grad=requires_grad)
        contract.validator(model)
    model.proj_out.weight = weight
    contract.validator(model)
    del model.proj_out
    with pytest.raises(ModelNotReadyError, match="proj_out"):
        contract.validator(model)


def test_commit_runs_the_validator_and_reports_restore_failed(tmp_path: Path) -> None:
    """D13: commit validates the restored model; a model left in train mode fails with RESTORE_FAILED."""
    folder = save_folder(tmp_path / "model", "minimax_h3")
    runtime = runtime_at(tmp_path / "domain")
    canonical = folder.canonical()
    publish_canonical(runtime, identity_context(Pipeline(canonical), folder.source()), canonical)
    holder = Pipeline(folder.skeleton().train())
    context = identity_context(holder, folder.source())
    resolution = runtime.resolve(context.identity)
    assert resolution.lease is not None
    with resolution.lease as lease:
        plan = FinalLayoutTensorRestorer(context).plan_restore(holder, lease)
        with pytest.raises(HostWeightError) as raised:
            plan.commit()
    assert raised.value.code is FailureCode.RESTORE_FAILED
    assert isinstance(raised.value.__cause__, ModelNotReadyError)


# The contracts' fingerprints enter every artifact key of their classes, so they are pinned.
GOLDEN_CONTRACT_FINGERPRINTS = {
    "Flux2Transformer2DModel": "aeb37a9961315fab2e5e749d67570d7b2396bb9518b0777040fe72b9643e320a",
    "FluxTransformer2DModel": "6b00b1439be0c28a427ac4c396f33aec68e71c6f865552fa83b92a0b7ce64ab1",
    "MiniMaxH3Transformer3DModel": "744a9f7c1be6a8f9dd20b9e339c4361b428b780bce78e7ec1040a916fe9dbe08",
    "SD3Transformer2DModel": "e6f83b31beb4639c911a0952e4df6f18ab43225e069d29d32ccb795d1c43ac6d",
    "WanTransformer3DModel": "75b804524879984c37edcf7fb9eddb055e602c54a0339376324e57b1182ff5ae",
}


def test_first_class_contract_fingerprints_are_pinned() -> None:
    """D13: each first-class contract's implementation fingerprint (part of the artifact key) is unchanged."""
    found = {name: contract.implementation.fingerprint for name, contract in FIRST_CLASS_CONTRACTS.items()}
    assert found == GOLDEN_CONTRACT_FINGERPRINTS

"""BF16, FP16 and FP32 final layouts of diffusers models, and tied tensors in the ownership contract (P03, P04, D07).

Each dtype is its own representation: its own policy, ABI and key, and a load at one dtype
never hits another's artifact. A restored FP16 or FP32 model equals diffusers'
`from_pretrained(torch_dtype=...)` bit for bit, `_keep_in_fp32_modules` included.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from host_weight_runtime.config import HostWeightRuntimeConfig, RuntimeMode
from host_weight_runtime.diffusion import load_component
from host_weight_runtime.diffusion.contracts import FINAL_LAYOUT_BF16_POLICY
from host_weight_runtime.diffusion.dtype_policies import SERVED_DTYPES, ModelFamilyName, dtype_policy
from host_weight_runtime.diffusion.tensor_layout import discover_tensor_ownership
from host_weight_runtime.failures import HostWeightError
from host_weight_runtime.outcomes import ResolutionOutcome
from host_weight_runtime.runtime import HostWeightRuntime
from hwr_tools.synthetic_models import save_pipeline_folder, tiny_spec

from ._diffusion import all_tensors


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in ("HWR_MODE", "HWR_ROOT", "HWR_REMOTE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-hub-cache"))


def _runtime(root: Path, mode: RuntimeMode = RuntimeMode.PREFERRED) -> HostWeightRuntime:
    return HostWeightRuntime(HostWeightRuntimeConfig(mode=mode, root=root))


def _bytes(module: torch.nn.Module) -> dict[str, tuple[torch.dtype, bytes]]:
    named = [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]
    return {
        name: (tensor.dtype, tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        for name, tensor in named
    }


# ----------------------------------------------------------------------------- policies and keys


def test_every_family_and_dtype_is_its_own_representation() -> None:
    """P04: six policies, six ABI documents, six producer fingerprints; diffusers BF16 is the original policy."""
    policies = [dtype_policy(family, dtype) for family in ModelFamilyName for dtype in SERVED_DTYPES]
    assert dtype_policy(ModelFamilyName.DIFFUSERS, torch.bfloat16) is FINAL_LAYOUT_BF16_POLICY
    assert len({policy.spec.producer.implementation_fingerprint for policy in policies}) == len(policies)
    assert len({(policy.spec.representation.name, policy.name) for policy in policies}) == len(policies)
    with pytest.raises(ValueError, match="no final-layout representation"):
        dtype_policy(ModelFamilyName.DIFFUSERS, torch.float64)


@pytest.mark.parametrize("kind", ["flux", "wan"])
def test_fp16_and_fp32_hits_equal_diffusers_and_never_cross(tmp_path: Path, kind: str) -> None:
    """P04/D14: BF16, FP16 and FP32 loads publish three keys; each hit equals diffusers' from_pretrained at that
    dtype bit for bit (Wan keeps its `_keep_in_fp32_modules` in FP32 at FP16 too); an FP16 load with only the BF16
    artifact present misses."""
    pipeline = save_pipeline_folder(tmp_path / "models" / kind, kind, seed=5)
    runtime = _runtime(tmp_path / "domain")
    model_class = tiny_spec(kind).model_class()
    keys: dict[torch.dtype, str | None] = {}
    for dtype in SERVED_DTYPES:
        with load_component(
            pipeline, subfolder="transformer", runtime=runtime, torch_dtype=dtype, publish_in_background=False
        ) as cold:
            assert cold.outcome is ResolutionOutcome.CANONICAL_FALLBACK  # nothing converted from another dtype
            keys[dtype] = cold.identity_key
        with load_component(
            pipeline, subfolder="transformer", runtime=runtime, torch_dtype=dtype, publish_in_background=False
        ) as warm:
            assert warm.outcome is ResolutionOutcome.LOCAL_HIT
            assert warm.identity_key == keys[dtype]
            reference = model_class.from_pretrained(str(pipeline / "transformer"), torch_dtype=dtype)
            assert _bytes(warm.model) == _bytes(reference)
            kept = tuple(getattr(model_class, "_keep_in_fp32_modules", None) or ())
            for name, tensor in all_tensors(warm.model).items():
                if tensor.is_floating_point() and any(module in name.split(".") for module in kept):
                    assert tensor.dtype == torch.float32, name
    assert len(set(keys.values())) == len(SERVED_DTYPES)


# ----------------------------------------------------------------------------- tied tensors in ownership


class _Tied(torch.nn.Module):
    """Two modules that share one weight, as a tied embedding does."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = torch.nn.Embedding(6, 4)
        self.embed = torch.nn.Embedding(6, 4)
        self.embed.weight = self.shared.weight
        self.other = torch.nn.Linear(4, 4, bias=False)


def _keep(dit_name: str, local_name: str, dtype: torch.dtype) -> torch.dtype:
    return dtype


def test_a_declared_tie_is_one_owned_tensor_and_part_of_the_contract() -> None:
    """D07/P03: a tie the model declares is owned once (under its owner) and keyed; undeclared aliases stay refused."""
    model = _Tied()
    with pytest.raises(HostWeightError, match="unless the model declares the tie"):
        discover_tensor_ownership([("m", model)], _keep)
    tied = discover_tensor_ownership([("m", model)], _keep, {"m.embed.weight": "m.shared.weight"})
    assert tied.names == {"m.shared.weight", "m.other.weight"}
    assert [(alias.name, alias.owner) for alias in tied.aliases] == [("m.embed.weight", "m.shared.weight")]
    untied = _Tied()
    untied.embed.weight = torch.nn.Parameter(untied.shared.weight.detach().clone())
    plain = discover_tensor_ownership([("m", untied)], _keep)
    assert plain.contract_digest != tied.contract_digest  # the tie is in the key
    model.other.weight = model.shared.weight  # a second, undeclared alias of the same tensor
    with pytest.raises(HostWeightError, match="unless the model declares the tie"):
        discover_tensor_ownership([("m", model)], _keep, {"m.embed.weight": "m.shared.weight"})


def test_a_declared_tie_that_a_loaded_model_does_not_hold_is_refused() -> None:
    """D07: on a host model a declared alias must be its owner's very tensor (a meta skeleton may hold a twin)."""
    untied = _Tied()
    untied.embed.weight = torch.nn.Parameter(untied.shared.weight.detach().clone())
    with pytest.raises(HostWeightError, match="separate cpu tensor"):
        discover_tensor_ownership([("m", untied)], _keep, {"m.embed.weight": "m.shared.weight"})
    with torch.device("meta"):
        skeleton = _Tied()
        skeleton.embed.weight = torch.nn.Parameter(torch.empty(6, 4))
    meta = discover_tensor_ownership([("m", skeleton)], _keep, {"m.embed.weight": "m.shared.weight"})
    assert meta.names == {"m.shared.weight", "m.other.weight"}
    with pytest.raises(HostWeightError, match="does not own"):
        discover_tensor_ownership([("m", _Tied())], _keep, {"m.embed.weight": "m.missing.weight"})


def test_the_transformers_policy_follows_the_models_own_dtype_plan() -> None:
    """P03/P04: the plan is read from the instance as from_pretrained reads it (`_keep_in_fp32_modules` at FP16,
    `_keep_in_fp32_modules_strict` at FP16 and BF16, nothing at FP32), matched by search in the name; every
    other tensor keeps the dtype the model was built with (a streamed tensor too, whatever the checkpoint holds)."""
    from host_weight_runtime.diffusion.model_contracts import contract_for_model

    from ._encoders import ENCODERS, model_class

    model = model_class("text_encoder_2")(ENCODERS["text_encoder_2"].config())
    model._keep_in_fp32_modules_strict = {"relative_attention_bias"}
    plans = {dtype: contract_for_model(model, dtype).keep_in_fp32_modules for dtype in SERVED_DTYPES}
    assert plans == {
        torch.bfloat16: ("relative_attention_bias",),
        torch.float16: ("relative_attention_bias", "wo"),
        torch.float32: (),
    }
    assert plans == {dtype: tuple(sorted(model._get_dtype_plan(dtype))) for dtype in SERVED_DTYPES}
    policy = dtype_policy(ModelFamilyName.TRANSFORMERS, torch.float16)
    wo = "encoder.block.0.layer.1.DenseReluDense.wo.weight"
    assert policy.final_dtype(wo, torch.float16, plans[torch.float16]) == torch.float32
    assert policy.final_dtype("shared.weight", torch.float16, plans[torch.float16]) == torch.float16
    assert policy.final_dtype("built.in.fp32", torch.float32, plans[torch.float16]) == torch.float32
    assert policy.final_dtype_from_checkpoint("shared.weight", torch.float32, torch.float16, ()) == torch.float16
    assert policy.final_dtype_from_checkpoint(wo, torch.bfloat16, torch.float16, ("wo",)) == torch.float32

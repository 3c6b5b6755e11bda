"""transformers components through `load_component` (P03, P04, D07, D14): real tiny encoders, real folders.

Every encoder is a real transformers class built small with a fixed seed and saved with
`save_pretrained` in a pipeline-shaped folder. The first worker loads it canonically and
publishes; a fresh process (spawned) then hits the artifact and must equal
`from_pretrained(folder, dtype=...)` in every parameter and buffer, byte for byte, and in its
forward output, at BF16, FP16 and FP32, each under its own key.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from host_weight_runtime.config import RuntimeMode
from host_weight_runtime.diffusion import ComponentLoadPath, load_component, prewarm_component
from host_weight_runtime.failures import ArgumentHint, FailureCode, HostWeightError, HostWeightUsageError
from host_weight_runtime.outcomes import PostLoadPublicationStatus, ResolutionOutcome

from ._encoders import (
    DTYPES,
    ENCODERS,
    canonical,
    every_tensor,
    forward,
    load_after_transformers_imported_in_no_init_weights,
    payload,
    runtime_at,
    save_encoder,
    save_encoder_pipeline,
    stand_in_initializers,
    warm_load_every_encoder_in_child,
)
from .support import CHILD_TIMEOUT_S, recv_within, spawned_child

HWR_VARIABLES = ("HWR_MODE", "HWR_ROOT", "HWR_REMOTE", "HWR_ALLOW_LOCAL_BUILD", "HWR_ALLOW_POST_LOAD_PUBLISH")


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in HWR_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-hub-cache"))


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every tiny encoder, saved as transformers saves it, in one pipeline-shaped folder."""
    return save_encoder_pipeline(tmp_path_factory.mktemp("encoders") / "pipeline")


def _tensor(sent: Any) -> torch.Tensor:
    """A tensor back from `payload`'s (dtype, shape, bytes)."""
    dtype_name, shape, raw = sent
    dtype = getattr(torch, dtype_name.removeprefix("torch."))
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape)


def _manifest_names(loaded: Any) -> set[str]:
    return {entry.name for entry in loaded.lease.manifest.tensors}


# ----------------------------------------------------------------------------- cold, then warm in a fresh process


@dataclass(frozen=True, slots=True)
class ColdLoad:
    """What a first (cold) load of an encoder at one dtype came back with."""

    outcome: ResolutionOutcome
    identity_failure: object
    publication: PostLoadPublicationStatus | None
    identity_key: str | None


@pytest.fixture(scope="module")
def cold_then_warm(
    tmp_path_factory: pytest.TempPathFactory, pipeline: Path
) -> tuple[dict[str, list[ColdLoad]], dict[str, list[dict[str, Any]]]]:
    """Every encoder loaded cold at every dtype into one domain, then warm in one fresh process (spawned, so
    nothing of the cold loads is in its memory): one interpreter start instead of one per encoder."""
    root = tmp_path_factory.mktemp("encoder-domain") / "domain"
    with pytest.MonkeyPatch.context() as environment:
        for name in HWR_VARIABLES:
            environment.delenv(name, raising=False)
        environment.setenv("HF_HUB_OFFLINE", "1")
        environment.setenv("HF_HUB_CACHE", str(root.parent / "empty-hub-cache"))
        cold: dict[str, list[ColdLoad]] = {}
        for subfolder in ENCODERS:
            cold[subfolder] = []
            for dtype in DTYPES:
                with load_component(
                    pipeline,
                    subfolder=subfolder,
                    runtime=runtime_at(root),
                    torch_dtype=dtype,
                    publish_in_background=False,
                ) as load:
                    publication = None if load.publication is None else load.publication.status
                    cold[subfolder].append(
                        ColdLoad(load.outcome, load.identity_failure, publication, load.identity_key)
                    )
        with spawned_child(warm_load_every_encoder_in_child, str(root), str(pipeline), list(ENCODERS)) as conn:
            warm: Any = recv_within(conn, len(ENCODERS) * CHILD_TIMEOUT_S)
    return cold, warm


# The first of these runs the module fixture, every encoder's cold loads and their one warm process: the
# work of seven tests in one setup, so its limit is above the suite's default.
@pytest.mark.timeout(900)
@pytest.mark.parametrize("subfolder", list(ENCODERS))
def test_warm_load_in_a_fresh_process_equals_from_pretrained(
    cold_then_warm: tuple[dict[str, list[ColdLoad]], dict[str, list[dict[str, Any]]]], pipeline: Path, subfolder: str
) -> None:
    """P03/P04/D14: cold = canonical + published; a fresh worker hits at BF16, FP16 and FP32 (three keys) and holds
    exactly `from_pretrained(folder, dtype=...)`: every parameter and buffer byte for byte, the same dtypes,
    ties, eval mode and forward output."""
    cold_loads = cold_then_warm[0][subfolder]
    for cold in cold_loads:
        assert cold.outcome is ResolutionOutcome.CANONICAL_FALLBACK, cold.identity_failure
        assert cold.publication is PostLoadPublicationStatus.PUBLISHED
    cold_keys = [cold.identity_key for cold in cold_loads]
    assert len(set(cold_keys)) == len(DTYPES)

    reports = cold_then_warm[1][subfolder]
    for dtype, report, key in zip(DTYPES, reports, cold_keys, strict=True):
        reference = canonical(pipeline, subfolder, dtype)
        assert report["outcome"] == ResolutionOutcome.LOCAL_HIT.value
        assert report["load_path"] == ComponentLoadPath.ARTIFACT.value
        assert report["identity_key"] == key
        assert report["tensors"] == every_tensor(reference), f"{subfolder} at {dtype} differs from from_pretrained"
        if dtype == torch.float32:
            # Every FP32 weight and buffer is equal byte for byte (above), but an FP32 CPU matmul's rounding
            # depends on where its operands sit in memory (MKL picks kernels by alignment), and two processes
            # place equal tensors differently: the outputs are compared at FP32's rounding, not bit for bit.
            torch.testing.assert_close(
                _tensor(report["compact_output"]), forward(subfolder, copy.deepcopy(reference)), rtol=1e-5, atol=1e-6
            )
        else:
            assert report["output"] == payload(forward(subfolder, reference))
        assert report["training"] is False
        expected_ties = sorted(
            name
            for name, tensor in reference.named_parameters(remove_duplicate=False)
            if any(other is tensor for o, other in reference.named_parameters(remove_duplicate=False) if o != name)
        )
        assert report["tied"] == expected_ties


def test_a_worker_whose_transformers_recorded_no_op_initializers_still_gets_from_pretrained(
    tmp_path: Path, pipeline: Path
) -> None:
    """P03/D13: transformers copies torch's initializers when first imported; a worker that first imported it
    inside diffusers' `no_init_weights()` holds the no-ops, which would leave Gemma2's non-persistent
    `embed_scale` as uninitialized memory. Its cold (canonical) and warm loads still equal a sound process's
    `from_pretrained` in every tensor, and its own `from_pretrained` does too afterwards (the table is repaired);
    a load inside `no_init_weights()` itself, where nothing can repair it, is a usage error, not wrong weights."""
    with spawned_child(
        load_after_transformers_imported_in_no_init_weights, str(tmp_path / "domain"), str(pipeline), "gemma2"
    ) as conn:
        child: Any = recv_within(conn, 2 * CHILD_TIMEOUT_S)
    assert child["imported_before"] is False  # else the child could not set the state up
    assert "constant_" in child["recorded"]  # what fills embed_scale
    assert "[invalid_configuration]" in child["refused"] and "outside no_init_weights()" in child["refused"]
    assert stand_in_initializers() == [], "this process's transformers recorded no-ops: the reference is unsound"
    reference = every_tensor(canonical(pipeline, "gemma2", torch.bfloat16))
    outcomes = [report["outcome"] for report in child["reports"]]
    assert outcomes == [ResolutionOutcome.CANONICAL_FALLBACK.value, ResolutionOutcome.LOCAL_HIT.value]
    for report in child["reports"]:
        assert report["tensors"]["embed_tokens.embed_scale"] == reference["embed_tokens.embed_scale"]
        assert report["tensors"] == reference
    assert child["after"] == []
    assert child["from_pretrained"] == reference


# ----------------------------------------------------------------------------- ties and the FP32 plan


def test_t5_tie_is_one_tensor_on_a_hit_and_stored_once(tmp_path: Path, pipeline: Path) -> None:
    """P03/D07: T5's `shared.weight` and `encoder.embed_tokens.weight` are one tensor on a hit, bound to the
    lease, and the artifact stores it once (the manifest lists the owner only)."""
    runtime = runtime_at(tmp_path / "domain")
    load_component(pipeline, subfolder="text_encoder_2", runtime=runtime).close()
    with load_component(pipeline, subfolder="text_encoder_2", runtime=runtime) as warm:
        assert warm.outcome is ResolutionOutcome.LOCAL_HIT
        model: Any = warm.model
        assert model.shared.weight is model.encoder.embed_tokens.weight
        assert model.shared.weight.data_ptr() == model.encoder.embed_tokens.weight.data_ptr()
        names = _manifest_names(warm)
        assert "text_encoder_2.shared.weight" in names
        assert "text_encoder_2.encoder.embed_tokens.weight" not in names
        leased = warm.lease.tensors["text_encoder_2.shared.weight"]  # type: ignore[union-attr]
        assert model.shared.weight.data_ptr() == leased.data_ptr()


@pytest.mark.parametrize("subfolder", ["text_encoder_2", "umt5"])
def test_keep_in_fp32_modules_follow_transformers(tmp_path: Path, pipeline: Path, subfolder: str) -> None:
    """P03: T5/UMT5 keep `wo` in FP32 under FP16 (transformers' `_keep_in_fp32_modules`), but not under BF16,
    on the cold load and on the hit alike."""
    runtime = runtime_at(tmp_path / "domain")
    for dtype, wo_dtype in ((torch.float16, torch.float32), (torch.bfloat16, torch.bfloat16)):
        for _attempt in ("cold", "warm"):
            with load_component(pipeline, subfolder=subfolder, runtime=runtime, torch_dtype=dtype) as loaded:
                parameters = dict(loaded.model.named_parameters())
                kept = [name for name in parameters if ".wo." in name]
                assert kept
                assert {parameters[name].dtype for name in kept} == {wo_dtype}
                assert parameters["shared.weight"].dtype == dtype
        assert loaded.outcome is ResolutionOutcome.LOCAL_HIT


# ----------------------------------------------------------------------------- representations (P04)


def test_an_fp16_request_never_hits_the_bf16_artifact(tmp_path: Path, pipeline: Path) -> None:
    """P04: with only the BF16 artifact on the node, an FP16 load misses (nothing is converted), loads FP16
    canonically and publishes its own artifact; the domain then holds two artifacts with different keys."""
    root = tmp_path / "domain"
    with load_component(
        pipeline, subfolder="text_encoder", runtime=runtime_at(root), publish_in_background=False
    ) as bf16:
        bf16_key = bf16.identity_key
    with load_component(
        pipeline, subfolder="text_encoder", runtime=runtime_at(root), torch_dtype="float16", publish_in_background=False
    ) as fp16:
        assert fp16.outcome is ResolutionOutcome.CANONICAL_FALLBACK
        assert fp16.identity_key != bf16_key
        assert {tensor.dtype for tensor in fp16.model.parameters()} == {torch.float16}
    with pytest.raises(HostWeightError):  # REQUIRED without a build: the BF16 artifact is no answer for FP32
        runtime = runtime_at(root, RuntimeMode.REQUIRED)
        load_component(
            pipeline,
            subfolder="text_encoder",
            runtime=runtime,
            torch_dtype=torch.float32,
            stream_on_miss=False,
            publish_in_background=False,
        )
    assert sorted(path.name for path in (root / "artifacts").iterdir()) == sorted([bf16_key, fp16.identity_key])


def test_streamed_and_prewarmed_artifacts_equal_the_post_load_ones(tmp_path: Path, pipeline: Path) -> None:
    """P03/P04: streaming the checkpoint (stream_on_miss, prewarm_component at FP16) gives the key and the
    bytes of the post-load artifact, renamed keys (Qwen2.5-VL's pre-v5 names) and ties (T5) included."""
    for subfolder in ("text_encoder_2", "qwen2_5_vl"):
        streamed_root, published_root = tmp_path / f"s-{subfolder}", tmp_path / f"p-{subfolder}"
        runtime = runtime_at(streamed_root)
        with load_component(
            pipeline, subfolder=subfolder, runtime=runtime, stream_on_miss=True, publish_in_background=False
        ) as first:
            assert first.outcome is ResolutionOutcome.LOCAL_PRODUCTION
        prewarmed = prewarm_component(pipeline, subfolder=subfolder, runtime=runtime, torch_dtype=torch.float16)
        load_component(
            pipeline, subfolder=subfolder, runtime=runtime_at(published_root), publish_in_background=False
        ).close()
        fp16_cold = load_component(
            pipeline,
            subfolder=subfolder,
            runtime=runtime_at(published_root),
            torch_dtype="float16",
            publish_in_background=False,
        )
        fp16_cold.close()
        assert prewarmed.identity_key == fp16_cold.identity_key
        for dtype, key in ((torch.bfloat16, first.identity_key), (torch.float16, prewarmed.identity_key)):
            with (
                load_component(
                    pipeline, subfolder=subfolder, runtime=runtime, torch_dtype=dtype, publish_in_background=False
                ) as streamed,
                load_component(
                    pipeline,
                    subfolder=subfolder,
                    runtime=runtime_at(published_root),
                    torch_dtype=dtype,
                    publish_in_background=False,
                ) as published,
            ):
                assert streamed.outcome is published.outcome is ResolutionOutcome.LOCAL_HIT
                assert streamed.identity_key == published.identity_key == key
                assert every_tensor(streamed.model) == every_tensor(published.model)
                assert every_tensor(streamed.model) == every_tensor(canonical(pipeline, subfolder, dtype))


def test_background_publication_serves_the_next_worker(tmp_path: Path, pipeline: Path) -> None:
    """P03: publish_in_background builds the encoder's artifact from its checkpoint; the next load hits it."""
    runtime = runtime_at(tmp_path / "domain")
    with load_component(pipeline, subfolder="gemma2", runtime=runtime, publish_in_background=True) as first:
        assert first.background_publication is not None
        assert first.background_publication.wait(120)
        assert first.background_publication.failure is None
    with load_component(pipeline, subfolder="gemma2", runtime=runtime) as warm:
        assert warm.outcome is ResolutionOutcome.LOCAL_HIT
        assert every_tensor(warm.model) == every_tensor(canonical(pipeline, "gemma2", torch.bfloat16))


# ----------------------------------------------------------------------------- folders a worker meets


def test_the_subfolder_hint_leads_to_a_text_encoder_that_loads(tmp_path: Path, pipeline: Path) -> None:
    """D14: a misspelt text-encoder subfolder gets a hint naming it, and following the hint loads the encoder."""
    with pytest.raises(HostWeightUsageError) as raised:
        load_component(pipeline, subfolder="text_encoder2", runtime=runtime_at(tmp_path / "domain"))
    found = ArgumentHint.of(raised.value.failure)
    assert found is not None
    problem, hint = found
    assert "text_encoder_2" in problem
    assert hint.use == (("subfolder", "text_encoder_2"),)
    with load_component(pipeline, subfolder="text_encoder_2", runtime=runtime_at(tmp_path / "domain")) as loaded:
        assert type(loaded.model).__name__ == "T5EncoderModel"
        assert loaded.identity_failure is None


def test_a_pickle_only_encoder_loads_canonically_with_a_reason(tmp_path: Path) -> None:
    """P03/P06: a transformers folder with only pytorch_model.bin loads canonically in PREFERRED, the reason
    reported (UNSUPPORTED identity failure); REQUIRED raises that typed error instead."""
    folder = tmp_path / "pickled"
    subfolder = "text_encoder"
    save_encoder(folder, subfolder, seed=3)
    reference = canonical(folder, subfolder, torch.bfloat16)
    (folder / subfolder / "model.safetensors").unlink()
    torch.save(reference.float().state_dict(), folder / subfolder / "pytorch_model.bin")
    with load_component(folder, subfolder=subfolder, runtime=runtime_at(tmp_path / "domain")) as loaded:
        assert loaded.outcome is ResolutionOutcome.CANONICAL_FALLBACK
        assert loaded.load_path is ComponentLoadPath.CANONICAL
        assert loaded.identity_failure is not None
        assert loaded.identity_failure.code is FailureCode.UNSUPPORTED
        assert "pickle" in loaded.identity_failure.message
        assert every_tensor(loaded.model) == every_tensor(canonical(folder, subfolder, torch.bfloat16))
    with pytest.raises(HostWeightError) as raised:
        load_component(folder, subfolder=subfolder, runtime=runtime_at(tmp_path / "domain", RuntimeMode.REQUIRED))
    assert raised.value.failure.code is FailureCode.UNSUPPORTED


def test_a_checkpoint_holding_both_tied_tensors_is_served_canonically(tmp_path: Path) -> None:
    """P03/D07: when the checkpoint holds both names of a tie, transformers ties them only if their values are
    equal; an artifact cannot know without reading them, so the encoder loads canonically, reason reported."""
    folder = tmp_path / "both-tied"
    save_encoder(folder, "text_encoder_2", seed=4)
    weights = folder / "text_encoder_2" / "model.safetensors"
    state = {
        name: tensor.clone() for name, tensor in canonical(folder, "text_encoder_2", torch.float32).state_dict().items()
    }
    save_file(state, str(weights), metadata={"format": "pt"})
    with load_component(folder, subfolder="text_encoder_2", runtime=runtime_at(tmp_path / "domain")) as loaded:
        assert loaded.outcome is ResolutionOutcome.CANONICAL_FALLBACK
        assert loaded.identity_failure is not None
        assert loaded.identity_failure.code is FailureCode.UNSUPPORTED
        model: Any = loaded.model
        assert model.shared.weight is model.encoder.embed_tokens.weight  # transformers tied the equal pair


def test_a_remote_code_class_is_a_usage_error(tmp_path: Path) -> None:
    """P06: a config naming a class transformers does not ship (remote code) is refused, never run."""
    folder = tmp_path / "remote" / "text_encoder"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(
        json.dumps({"architectures": ["MyCustomEncoder"], "model_type": "custom", "auto_map": {"AutoModel": "x.Y"}})
    )
    save_file({"w": torch.zeros(2)}, str(folder / "model.safetensors"))
    with pytest.raises(HostWeightUsageError, match="remote code"):
        load_component(folder.parent, subfolder="text_encoder", runtime=runtime_at(tmp_path / "domain"))

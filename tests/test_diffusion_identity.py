"""Diffusion final-layout identity (D01, D05, D06, D07, D08), on real reduced diffusers models.

Every identity here is built the way `load_component` builds one: the DiT under the
attribute `transformer` of a pipeline-like holder, a `PreparedWeightSource` over a real
safetensors folder written by diffusers' `save_pretrained`, a `FinalLayoutRequest` and
the BF16 policy. Models and folders are built once per module; tests that change a
model build their own.
"""

from __future__ import annotations

import dataclasses
import itertools
import shutil
from collections.abc import Callable, Iterator, Mapping
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import accelerate  # noqa: F401  (`make test` installs it: a missing one fails the module, never skips it)
import diffusers
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from host_weight_runtime.canonical_json import CanonicalJson, JsonValue
from host_weight_runtime.diffusion import build_skeleton, model_contracts
from host_weight_runtime.diffusion.contracts import (
    FINAL_LAYOUT_BF16_POLICY,
    FINAL_LAYOUT_BF16_SPEC,
    FinalLayoutArtifactSpec,
    FinalLayoutLoaderIdentity,
    FinalLayoutModelContract,
    FinalLayoutParallelIdentity,
    FinalLayoutRequest,
    FinalLayoutTensorPolicy,
    ImplementationIdentity,
    implementation_abi_fingerprint,
    keeps_fp32,
)
from host_weight_runtime.diffusion.identity_adapter import FinalLayoutIdentityContext, build_final_layout_identity
from host_weight_runtime.diffusion.source_identity import PreparedWeightSource, prepare_weight_source
from host_weight_runtime.failures import FailureCode, HostWeightError
from host_weight_runtime.identity import AdaptationIdentity, RuntimeWeightLayout
from host_weight_runtime.tensors import TensorKind
from hwr_tools.synthetic_models import MODEL_KINDS, build_model, save_pipeline_folder, tiny_spec

from .support import recv_within, spawned_child

WEIGHTS = "diffusion_pytorch_model.safetensors"
MODEL_ID = "tests/tiny-dit"
LOADER = FinalLayoutLoaderIdentity(
    implementation=ImplementationIdentity("tests.loader", "1", "1" * 64),
    model_config_fingerprint="c" * 64,
    weight_transform_fingerprint="d" * 64,
)


# ----------------------------------------------------------------------------- helpers


class _Pipeline(torch.nn.Module):
    """A pipeline-like holder: the DiT as `transformer`, plus any other components a test adds."""


def _holder(dit: torch.nn.Module, **others: torch.nn.Module) -> torch.nn.Module:
    holder = _Pipeline()
    holder.add_module("transformer", dit)
    for name, module in others.items():
        holder.add_module(name, module)
    return holder


def _source(folder: Path) -> PreparedWeightSource:
    return prepare_weight_source(str(folder), subfolder="transformer", prefix="transformer.")


def _request(**changes: Any) -> FinalLayoutRequest:
    return FinalLayoutRequest(**{"model_id": MODEL_ID, "loader": LOADER, **changes})


def _identity(
    dit: torch.nn.Module,
    source: PreparedWeightSource,
    *,
    request: FinalLayoutRequest | None = None,
    policy: FinalLayoutTensorPolicy = FINAL_LAYOUT_BF16_POLICY,
    holder: torch.nn.Module | None = None,
) -> FinalLayoutIdentityContext:
    return build_final_layout_identity(
        holder if holder is not None else _holder(dit),
        dit_modules=[("transformer", dit)],
        prepared_sources=[source],
        request=request if request is not None else _request(),
        policy=policy,
    )


def _contract_digest(context: FinalLayoutIdentityContext) -> str:
    metadata = context.identity.component.metadata.to_value()
    assert isinstance(metadata, dict)
    digest = metadata["tensor_contract"]
    assert isinstance(digest, str)
    return digest


def _skeleton(kind: str, folder: Path) -> torch.nn.Module:
    """The `meta` skeleton load_component builds before it loads anything."""
    source = _source(folder)
    return build_skeleton(tiny_spec(kind).model_class(), source.resolved_root, str(folder))


def _skeleton_key(kind: str, folder: Path) -> tuple[str, bytes]:
    context = _identity(_skeleton(kind, folder), _source(folder))
    return context.identity.key, context.identity.canonical_json().data


def _refusal(exc_info: pytest.ExceptionInfo[HostWeightError]) -> dict[str, JsonValue]:
    """Assert the typed UNSUPPORTED refusal and return its details."""
    failure = exc_info.value.failure
    assert failure.code is FailureCode.UNSUPPORTED
    assert failure.retryable is False
    details = failure.details.to_value()
    assert isinstance(details, dict)
    return details


def _json_keys(value: object) -> Iterator[str]:
    if isinstance(value, dict):
        for key, inner in value.items():
            yield key
            yield from _json_keys(inner)
    elif isinstance(value, list):
        for inner in value:
            yield from _json_keys(inner)


def _copy_folder(folder: Path, destination: Path) -> Path:
    shutil.copytree(folder, destination)
    return destination


def _flip_last_byte(path: Path) -> None:
    """Change one byte of tensor data (the last byte of a safetensors file is payload, not header)."""
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One real pipeline folder per first-class kind, from build_model(kind, seed=0)."""
    root = tmp_path_factory.mktemp("pipelines")
    return {kind: save_pipeline_folder(root / kind, kind, seed=0) for kind in MODEL_KINDS}


@pytest.fixture(scope="module")
def fp32_models() -> dict[str, torch.nn.Module]:
    """The FP32 models the folders hold; tests must not modify them."""
    return {kind: build_model(kind, seed=0) for kind in MODEL_KINDS}


@pytest.fixture(scope="module")
def flux_key(folders: dict[str, Path], fp32_models: dict[str, torch.nn.Module]) -> str:
    return _identity(fp32_models["flux"], _source(folders["flux"])).identity.key


@dataclasses.dataclass(frozen=True)
class _Base:
    """The base flux inputs every single-factor variant departs from."""

    model: torch.nn.Module
    folder: Path
    key: str


@pytest.fixture(scope="module")
def flux_base(folders: dict[str, Path], fp32_models: dict[str, torch.nn.Module], flux_key: str) -> _Base:
    return _Base(fp32_models["flux"], folders["flux"], flux_key)


# ----------------------------------------------------------------------------- D01


@pytest.mark.parametrize("kind", ["flux", "wan", "minimax_h3"])
def test_meta_skeleton_bf16_and_fp32_models_share_one_identity(
    kind: str, folders: dict[str, Path], fp32_models: dict[str, torch.nn.Module]
) -> None:
    """D01: a meta skeleton, from_pretrained(bfloat16) and the FP32 build give one key and one tensor contract."""
    folder = folders[kind]
    source = _source(folder)
    skeleton = _skeleton(kind, folder)
    assert all(parameter.is_meta for parameter in skeleton.parameters())
    materialized = tiny_spec(kind).model_class().from_pretrained(str(source.resolved_root), torch_dtype=torch.bfloat16)
    assert not any(tensor.is_meta for tensor in materialized.state_dict().values())
    fp32 = fp32_models[kind]
    assert {parameter.dtype for parameter in fp32.parameters()} == {torch.float32}

    contexts = [_identity(model, source) for model in (skeleton, materialized, fp32)]

    assert len({context.identity.key for context in contexts}) == 1
    assert len({_contract_digest(context) for context in contexts}) == 1
    assert contexts[0].tensors == contexts[1].tensors == contexts[2].tensors
    # The FP32 model's contract carries the policy's dtypes, not the live FP32 ones.
    assert torch.bfloat16 in {tensor.dtype for tensor in contexts[2].tensors}


def test_identity_carries_no_data_parallel_device_or_transport_facts(
    folders: dict[str, Path], flux_key: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """D01: no DP, device or host facts in the canonical JSON; env, shared memory and paths do not change the key."""
    folder = folders["flux"]
    model = build_model("flux", seed=0)
    context = _identity(model, _source(folder))
    document = context.identity.to_dict()
    keys = set(_json_keys(document))
    forbidden = ("device", "data_parallel", "dp_", "world", "local_rank", "transport", "host", "pid", "path", "cuda")
    assert not {key for key in keys if any(part in key.lower() for part in forbidden)}
    assert {key for key in keys if "rank" in key} == {"tensor_parallel_rank"}
    data = context.identity.canonical_json().data
    for needle in (b"cuda", b"dp_rank", str(folder).encode(), str(folder.parent).encode()):
        assert needle not in data
    assert context.identity.key == flux_key

    # Worker placement and the way the tensors are shared between processes are not identity.
    for variable, value in (("CUDA_VISIBLE_DEVICES", "3"), ("LOCAL_RANK", "5"), ("RANK", "13"), ("WORLD_SIZE", "16")):
        monkeypatch.setenv(variable, value)
    model.share_memory()
    assert all(parameter.is_shared() for parameter in model.parameters())  # type: ignore[no-untyped-call]
    assert _identity(model, _source(folder)).identity.key == flux_key


@pytest.mark.parametrize(
    ("kind", "non_persistent"),
    [("wan", {"rope.freqs_cos", "rope.freqs_sin"}), ("minimax_h3", {"rope.inv_freq"})],
)
def test_non_persistent_buffers_are_not_owned(
    kind: str, non_persistent: set[str], folders: dict[str, Path], fp32_models: dict[str, torch.nn.Module]
) -> None:
    """D01: the rope's non-persistent buffers exist on the model but never enter the tensor contract."""
    model = fp32_models[kind]
    assert non_persistent <= {name for name, _buffer in model.named_buffers()}
    context = _identity(model, _source(folders[kind]))
    assert not {f"transformer.{name}" for name in non_persistent} & context.tensor_names
    assert not [tensor for tensor in context.tensors if tensor.local_name.startswith("rope.")]


def test_registered_persistent_buffer_is_owned_and_non_persistent_one_is_not(
    folders: dict[str, Path], flux_key: str
) -> None:
    """D01: a persistent buffer is owned with kind BUFFER; a non-persistent one leaves the key unchanged."""
    source = _source(folders["flux"])
    model = build_model("flux", seed=0)
    model.proj_out.register_buffer("scratch", torch.ones(4), persistent=False)
    assert _identity(model, source).identity.key == flux_key

    model.proj_out.register_buffer("calibration", torch.ones(4, dtype=torch.float32), persistent=True)
    context = _identity(model, source)
    owned = {tensor.name: tensor for tensor in context.tensors}
    buffer = owned["transformer.proj_out.calibration"]
    assert (buffer.kind, buffer.role, buffer.shape, buffer.dtype) == (
        TensorKind.BUFFER,
        "calibration",
        (4,),
        torch.bfloat16,
    )
    assert "transformer.proj_out.scratch" not in context.tensor_names
    assert context.identity.key != flux_key


def test_other_pipeline_components_are_excluded(
    folders: dict[str, Path], fp32_models: dict[str, torch.nn.Module]
) -> None:
    """D01: only `transformer.` tensors are owned; the text encoder and VAE do not change the key."""
    source = _source(folders["flux"])
    dit = fp32_models["flux"]
    alone = _identity(dit, source, holder=_holder(dit))
    with_others = _identity(
        dit, source, holder=_holder(dit, text_encoder=torch.nn.Linear(8, 8), vae=torch.nn.Conv2d(3, 4, 3))
    )
    changed_others = _identity(
        dit, source, holder=_holder(dit, text_encoder=torch.nn.Linear(16, 4, bias=False), vae=torch.nn.Identity())
    )
    assert all(name.startswith("transformer.") for name in with_others.tensor_names)
    assert with_others.tensor_names == alone.tensor_names
    assert alone.identity.key == with_others.identity.key == changed_others.identity.key


# ----------------------------------------------------------------------------- D05


class _SpecPolicy:
    """The BF16 policy with another artifact spec: how a revised ABI would ship."""

    def __init__(self, spec: FinalLayoutArtifactSpec) -> None:
        self._spec = spec

    @property
    def name(self) -> str:
        return FINAL_LAYOUT_BF16_POLICY.name

    @property
    def spec(self) -> FinalLayoutArtifactSpec:
        return self._spec

    def final_dtype(self, local_name: str, dtype: torch.dtype, keep_in_fp32_modules: Any) -> torch.dtype:
        return FINAL_LAYOUT_BF16_POLICY.final_dtype(local_name, dtype, keep_in_fp32_modules)

    def check_request(self, request: FinalLayoutRequest) -> None:
        FINAL_LAYOUT_BF16_POLICY.check_request(request)

    def to_dict(self) -> dict[str, JsonValue]:
        return FINAL_LAYOUT_BF16_POLICY.to_dict()


def _revised_abi() -> CanonicalJson:
    document = FINAL_LAYOUT_BF16_SPEC.implementation_abi.to_value()
    assert isinstance(document, dict)
    return CanonicalJson.from_value({**document, "file_format": "safetensors; tensors in name order"})


def _spec_with_abi(abi: CanonicalJson) -> FinalLayoutArtifactSpec:
    producer = dataclasses.replace(
        FINAL_LAYOUT_BF16_SPEC.producer, implementation_fingerprint=implementation_abi_fingerprint(abi)
    )
    return dataclasses.replace(FINAL_LAYOUT_BF16_SPEC, producer=producer, implementation_abi=abi)


def _loader(**changes: Any) -> FinalLayoutLoaderIdentity:
    implementation = dataclasses.replace(LOADER.implementation, **changes.pop("implementation", {}))
    return dataclasses.replace(LOADER, implementation=implementation, **changes)


_ADAPTER_A = ImplementationIdentity("tests.adapter.rename", "1", "a" * 64)
_ADAPTER_B = ImplementationIdentity("tests.adapter.rename", "2", "b" * 64)

# Each factor changes exactly one semantic input of the base flux identity.
FACTORS = (
    "loader-implementation-version",
    "loader-implementation-fingerprint",
    "loader-implementation-id",
    "model-config",
    "weight-transform",
    "tp-2-rank-0",
    "tp-2-rank-1",
    "sp-ulysses-2",
    "sp-ring-2",
    "sp-usp-2x2",
    "sp-ulysses-2-mode",
    "contract-version",
    "source-content",
    "checkpoint-adapter-a",
    "checkpoint-adapter-b",
    "abi-document",
    "producer-version",
)


def _factor_key(
    factor: str, model: torch.nn.Module, folder: Path, scratch: Path, monkeypatch: pytest.MonkeyPatch
) -> str:
    source = _source(folder)
    requests: dict[str, FinalLayoutRequest] = {
        "loader-implementation-version": _request(loader=_loader(implementation={"version": "2"})),
        "loader-implementation-fingerprint": _request(loader=_loader(implementation={"fingerprint": "2" * 64})),
        "loader-implementation-id": _request(loader=_loader(implementation={"implementation_id": "tests.other"})),
        "model-config": _request(loader=_loader(model_config_fingerprint="e" * 64)),
        "weight-transform": _request(loader=_loader(weight_transform_fingerprint="f" * 64)),
        "tp-2-rank-0": _request(parallel=FinalLayoutParallelIdentity(tensor_parallel_size=2, tensor_parallel_rank=0)),
        "tp-2-rank-1": _request(parallel=FinalLayoutParallelIdentity(tensor_parallel_size=2, tensor_parallel_rank=1)),
        "sp-ulysses-2": _request(parallel=FinalLayoutParallelIdentity(sequence_parallel_size=2, ulysses_degree=2)),
        "sp-ring-2": _request(parallel=FinalLayoutParallelIdentity(sequence_parallel_size=2, ring_degree=2)),
        "sp-usp-2x2": _request(
            parallel=FinalLayoutParallelIdentity(sequence_parallel_size=4, ulysses_degree=2, ring_degree=2)
        ),
        "sp-ulysses-2-mode": _request(
            parallel=FinalLayoutParallelIdentity(sequence_parallel_size=2, ulysses_degree=2, ulysses_mode="relaxed")
        ),
    }
    if factor in requests:
        return _identity(model, source, request=requests[factor]).identity.key
    if factor == "contract-version":
        current = model_contracts.FIRST_CLASS_CONTRACTS["FluxTransformer2DModel"]
        bumped = dataclasses.replace(
            current, implementation=ImplementationIdentity(current.implementation.implementation_id, "2", "9" * 64)
        )
        with monkeypatch.context() as patch:
            patch.setattr(
                model_contracts, "FIRST_CLASS_CONTRACTS", {**model_contracts.FIRST_CLASS_CONTRACTS, current.model_class_name: bumped}
            )
            return _identity(model, source).identity.key
    if factor == "source-content":
        changed = _copy_folder(folder, scratch / "flipped")
        _flip_last_byte(changed / "transformer" / WEIGHTS)
        return _identity(model, _source(changed)).identity.key
    if factor.startswith("checkpoint-adapter-"):
        adapter = _ADAPTER_A if factor.endswith("-a") else _ADAPTER_B
        return _identity(model, dataclasses.replace(source, checkpoint_adapter=adapter)).identity.key
    if factor == "abi-document":
        return _identity(model, source, policy=_SpecPolicy(_spec_with_abi(_revised_abi()))).identity.key
    if factor == "producer-version":
        producer = dataclasses.replace(FINAL_LAYOUT_BF16_SPEC.producer, version="2")
        return _identity(
            model, source, policy=_SpecPolicy(dataclasses.replace(FINAL_LAYOUT_BF16_SPEC, producer=producer))
        ).identity.key
    raise AssertionError(f"unknown factor {factor}")


@pytest.mark.parametrize("factor", FACTORS)
def test_each_semantic_input_changes_the_key(
    factor: str, flux_base: _Base, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """D05: loader implementation, config, transform, TP, SP, contract version, source, adapter and ABI change the key."""
    assert _factor_key(factor, flux_base.model, flux_base.folder, tmp_path, monkeypatch) != flux_base.key
    # Nothing leaked out of the variant: the base inputs still give the base key.
    assert _identity(flux_base.model, _source(flux_base.folder)).identity.key == flux_base.key


def test_all_factor_variants_are_pairwise_distinct(
    flux_base: _Base, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """D05: no two single-factor variants (nor any and the base) share a key, e.g. TP rank 0 vs rank 1."""
    keys = {"base": flux_base.key}
    for index, factor in enumerate(FACTORS):
        keys[factor] = _factor_key(factor, flux_base.model, flux_base.folder, tmp_path / str(index), monkeypatch)
    collisions = [(a, b) for a, b in itertools.combinations(keys, 2) if keys[a] == keys[b]]
    assert not collisions


def test_same_spec_through_another_policy_object_keeps_the_key(
    folders: dict[str, Path], fp32_models: dict[str, torch.nn.Module], flux_key: str
) -> None:
    """D05: the ABI variant's key changes because of the ABI, not because the spec came from another policy object."""
    rebuilt = _spec_with_abi(FINAL_LAYOUT_BF16_SPEC.implementation_abi)
    policy = _SpecPolicy(rebuilt)
    assert isinstance(policy, FinalLayoutTensorPolicy)
    assert rebuilt == FINAL_LAYOUT_BF16_SPEC
    assert _identity(fp32_models["flux"], _source(folders["flux"]), policy=policy).identity.key == flux_key


def test_abi_whose_fingerprint_does_not_match_its_document_is_rejected() -> None:
    """D05: a spec whose producer fingerprint is not the digest of its ABI document cannot be constructed."""
    revised = _revised_abi()
    assert implementation_abi_fingerprint(revised) != FINAL_LAYOUT_BF16_SPEC.producer.implementation_fingerprint
    with pytest.raises(ValueError, match="does not match its ABI document"):
        dataclasses.replace(FINAL_LAYOUT_BF16_SPEC, implementation_abi=revised)
    stale = dataclasses.replace(FINAL_LAYOUT_BF16_SPEC.producer, implementation_fingerprint="0" * 64)
    with pytest.raises(ValueError, match="does not match its ABI document"):
        FinalLayoutArtifactSpec(
            representation=FINAL_LAYOUT_BF16_SPEC.representation,
            producer=stale,
            implementation_abi=FINAL_LAYOUT_BF16_SPEC.implementation_abi,
        )
    with pytest.raises(ValueError, match="CanonicalJson"):
        FinalLayoutArtifactSpec(
            representation=FINAL_LAYOUT_BF16_SPEC.representation,
            producer=FINAL_LAYOUT_BF16_SPEC.producer,
            implementation_abi=FINAL_LAYOUT_BF16_SPEC.implementation_abi.to_value(),  # type: ignore[arg-type]
        )
    # The matching fingerprint is accepted: the rejection is about the mismatch only.
    assert _spec_with_abi(revised).implementation_abi == revised


def test_data_parallel_and_sequence_parallel_rank_cannot_be_expressed() -> None:
    """D01, D05: no request, parallel or layout field can carry a DP rank/size or an SP rank."""
    names = {
        field.name
        for klass in (FinalLayoutParallelIdentity, FinalLayoutRequest, RuntimeWeightLayout)
        for field in dataclasses.fields(klass)
    }
    assert not {name for name in names if "data_parallel" in name or name.startswith("dp")}
    assert {name for name in names if "rank" in name} == {"tensor_parallel_rank"}
    for field_name in ("data_parallel_rank", "data_parallel_size", "dp_rank", "sequence_parallel_rank"):
        fields: dict[str, Any] = {field_name: 1}
        with pytest.raises(TypeError):
            FinalLayoutParallelIdentity(**fields)
    with pytest.raises(TypeError):
        FinalLayoutRequest(model_id=MODEL_ID, loader=LOADER, dp_rank=1)  # type: ignore[call-arg]


def test_identical_inputs_give_identical_keys_across_builds_and_locations(
    folders: dict[str, Path], tmp_path: Path
) -> None:
    """D05: two separate skeleton builds give byte-identical identities; so does a copy of the folder elsewhere."""
    folder = folders["flux"]
    first = _skeleton_key("flux", folder)
    second = _skeleton_key("flux", folder)
    moved = _skeleton_key("flux", _copy_folder(folder, tmp_path / "elsewhere" / "copy"))
    assert first == second == moved


def _child_skeleton_key(kind: str, folder: str, conn: Connection) -> None:
    """Spawned child: build the skeleton identity from scratch and send (key, canonical bytes)."""
    try:
        conn.send(_skeleton_key(kind, Path(folder)))
    finally:
        conn.close()


def test_identical_inputs_give_identical_key_in_a_spawned_process(folders: dict[str, Path]) -> None:
    """D05: a fresh spawned interpreter computes the same key and canonical bytes for the same inputs."""
    expected = _skeleton_key("flux", folders["flux"])
    with spawned_child(_child_skeleton_key, "flux", str(folders["flux"])) as conn:
        assert recv_within(conn) == expected


# ----------------------------------------------------------------------------- D06


UNSUPPORTED_REQUESTS: dict[str, dict[str, Any]] = {
    "load-format-dummy": {"load_format": "dummy"},
    "load-format-pt": {"load_format": "pt"},
    "pipeline-parallel": {"parallel": FinalLayoutParallelIdentity(pipeline_parallel_size=2)},
    "cfg-parallel": {"parallel": FinalLayoutParallelIdentity(cfg_parallel_size=2)},
    "hsdp": {"parallel": FinalLayoutParallelIdentity(use_hsdp=True)},
    "expert-parallel": {"parallel": FinalLayoutParallelIdentity(enable_expert_parallel=True)},
    "lora": {"adaptation": AdaptationIdentity(kind="lora", fingerprint="e" * 64)},
}


@pytest.mark.parametrize("case", sorted(UNSUPPORTED_REQUESTS))
def test_bf16_policy_refuses_unsupported_semantics(
    case: str, folders: dict[str, Path], fp32_models: dict[str, torch.nn.Module]
) -> None:
    """D06: non-default load format, PP, CFG parallel, HSDP, EP and LoRA are typed UNSUPPORTED refusals."""
    request = _request(**UNSUPPORTED_REQUESTS[case])
    with pytest.raises(HostWeightError) as checked:
        FINAL_LAYOUT_BF16_POLICY.check_request(request)
    assert _refusal(checked)["policy"] == FINAL_LAYOUT_BF16_POLICY.name
    with pytest.raises(HostWeightError) as built:
        _identity(fp32_models["flux"], _source(folders["flux"]), request=request)
    assert _refusal(built) == _refusal(checked)


def test_bf16_policy_accepts_the_supported_request(
    folders: dict[str, Path], fp32_models: dict[str, torch.nn.Module]
) -> None:
    """D06: the default request (and TP/SP, which the layout expresses) passes the policy: an identity is
    built for each, and its layout carries the parallel coordinates that change the bytes."""
    parallel = FinalLayoutParallelIdentity(
        tensor_parallel_size=2, tensor_parallel_rank=1, sequence_parallel_size=4, ulysses_degree=2, ring_degree=2
    )
    layouts = []
    for request in (_request(), _request(parallel=parallel)):
        FINAL_LAYOUT_BF16_POLICY.check_request(request)  # raises on a refusal
        context = _identity(fp32_models["flux"], _source(folders["flux"]), request=request)
        assert context.request == request and context.policy is FINAL_LAYOUT_BF16_POLICY
        layouts.append(context.identity.layout)
    assert (layouts[0].tensor_parallel_size, layouts[0].tensor_parallel_rank) == (1, 0)
    assert (layouts[1].tensor_parallel_size, layouts[1].tensor_parallel_rank) == (2, 1)


@pytest.mark.parametrize(
    "fields",
    [
        {"sequence_parallel_size": 2},
        {"ulysses_degree": 2},
        {"sequence_parallel_size": 4, "ulysses_degree": 2},
        {"sequence_parallel_size": 2, "ulysses_degree": 2, "ring_degree": 2},
        {"tensor_parallel_size": 2, "tensor_parallel_rank": 2},
        {"tensor_parallel_rank": 1},
        {"tensor_parallel_rank": -1},
        {"tensor_parallel_size": 0},
        {"tensor_parallel_size": True},
        {"pipeline_parallel_size": 0},
        {"use_hsdp": 1},
    ],
    ids=repr,
)
def test_inconsistent_parallel_identity_is_a_value_error(fields: dict[str, Any]) -> None:
    """D06: SP size != ulysses x ring, TP rank >= size and mistyped fields are ValueErrors at construction."""
    with pytest.raises(ValueError):
        FinalLayoutParallelIdentity(**fields)


@pytest.mark.parametrize(
    ("ulysses", "ring", "backend"), [(1, 1, "none"), (2, 1, "ulysses"), (1, 2, "ring"), (2, 2, "usp"), (4, 2, "usp")]
)
def test_sequence_parallel_backend_is_derived_from_the_degrees(
    ulysses: int, ring: int, backend: str, folders: dict[str, Path], fp32_models: dict[str, torch.nn.Module]
) -> None:
    """D06: the backend is none/ulysses/ring/usp from the two degrees, and the layout records it with the SP size."""
    parallel = FinalLayoutParallelIdentity(
        sequence_parallel_size=ulysses * ring, ulysses_degree=ulysses, ring_degree=ring
    )
    assert parallel.sequence_parallel_backend == backend
    assert parallel.to_dict()["sequence_parallel_backend"] == backend
    assert bool(parallel.layout_metadata()) == (ulysses * ring > 1)
    layout = _identity(
        fp32_models["flux"], _source(folders["flux"]), request=_request(parallel=parallel)
    ).identity.layout
    assert (layout.sequence_parallel_size, layout.sequence_parallel_backend) == (ulysses * ring, backend)


# ----------------------------------------------------------------------------- D07


@pytest.mark.parametrize("kind", MODEL_KINDS)
def test_ownership_is_complete_and_each_tensor_owned_once(
    kind: str, folders: dict[str, Path], fp32_models: dict[str, torch.nn.Module]
) -> None:
    """D07: every state_dict tensor (= every checkpoint tensor) appears once as `transformer.<name>`, nothing else."""
    model = fp32_models[kind]
    source = _source(folders[kind])
    context = _identity(model, source)
    state = model.state_dict()
    names = [tensor.name for tensor in context.tensors]

    assert len(names) == len(set(names)) == len(state)
    assert set(names) == {f"transformer.{name}" for name in state} == context.tensor_names
    (weights,) = source.weight_files
    with safe_open(str(weights), framework="pt") as checkpoint:
        assert context.tensor_names == {f"transformer.{name}" for name in checkpoint.keys()}  # noqa: SIM118
    assert context.tensor_sources == {f"transformer.{name}": (0, name) for name in state}
    metadata = context.identity.component.metadata.to_value()
    assert isinstance(metadata, dict)
    assert metadata["tensor_count"] == len(state)

    parameters = {name for name, _p in model.named_parameters()}
    for tensor in context.tensors:
        assert tensor.kind is (TensorKind.PARAMETER if tensor.local_name in parameters else TensorKind.BUFFER)
        assert tensor.role == tensor.local_name.rsplit(".", 1)[-1]
        assert tensor.shape == tuple(state[tensor.local_name].shape)
        assert tensor.stride == tuple(state[tensor.local_name].contiguous().stride())


def _tie_parameter(model: Any) -> None:
    attention = model.transformer_blocks[0].attn
    attention.to_k.weight = attention.to_q.weight


def _share_submodule(model: Any) -> None:
    model.transformer_blocks[1] = model.transformer_blocks[0]


def _second_parameter_on_same_storage(model: Any) -> None:
    attention = model.transformer_blocks[0].attn
    attention.to_k.weight = torch.nn.Parameter(attention.to_q.weight.detach())


def _parameter_on_a_slice_of_another(model: Any) -> None:
    attention = model.transformer_blocks[0].attn
    size = attention.to_k.bias.numel()
    attention.to_k.bias = torch.nn.Parameter(attention.to_q.weight.detach().reshape(-1)[5 : 5 + size])


def _buffer_viewing_a_parameter(model: Any) -> None:
    model.proj_out.register_buffer("shadow", model.proj_out.weight.detach(), persistent=True)


_SAME_OBJECT_ALIASES = (_tie_parameter, _share_submodule)
_STORAGE_ALIASES = (_second_parameter_on_same_storage, _parameter_on_a_slice_of_another, _buffer_viewing_a_parameter)


def _alias_cases() -> Iterator[Any]:
    for make_alias in (*_SAME_OBJECT_ALIASES, *_STORAGE_ALIASES):
        name = make_alias.__name__.strip("_")
        yield pytest.param(make_alias, "cpu", id=f"cpu-{name}")
        yield pytest.param(make_alias, "meta", id=f"meta-{name}")


@pytest.mark.parametrize(("make_alias", "materialized"), list(_alias_cases()))
def test_aliased_tensors_are_refused(
    make_alias: Callable[[Any], None], materialized: str, folders: dict[str, Path]
) -> None:
    """D07: tied parameters, shared submodules and tensors overlapping another's bytes are UNSUPPORTED, on CPU and meta."""
    model = build_model("flux", seed=0) if materialized == "cpu" else _skeleton("flux", folders["flux"])
    make_alias(model)
    with pytest.raises(HostWeightError) as refused:
        _identity(model, _source(folders["flux"]))
    details = _refusal(refused)
    assert str(details["alias_of"]).startswith("transformer.")
    assert details["tensor"] != details["alias_of"]


def test_non_contiguous_tensor_is_refused_and_its_contiguous_copy_accepted(
    folders: dict[str, Path], flux_key: str
) -> None:
    """D07: a transposed (non-contiguous) parameter is UNSUPPORTED; the same values made contiguous keep the key."""
    source = _source(folders["flux"])
    model = build_model("flux", seed=0)
    to_q = model.transformer_blocks[0].attn.to_q
    assert to_q.weight.shape[0] == to_q.weight.shape[1]
    transposed = to_q.weight.detach().t()
    to_q.weight = torch.nn.Parameter(transposed)
    with pytest.raises(HostWeightError) as refused:
        _identity(model, source)
    assert _refusal(refused)["tensor"] == "transformer.transformer_blocks.0.attn.to_q.weight"
    to_q.weight = torch.nn.Parameter(transposed.contiguous())
    assert _identity(model, source).identity.key == flux_key


class _ForeignDeviceTensor(torch.Tensor):
    """Tensor metadata on an accelerator device with no storage: the CPU-only stand-in for a moved weight."""

    @staticmethod
    def __new__(cls, like: torch.Tensor, device: str) -> _ForeignDeviceTensor:
        tensor: _ForeignDeviceTensor = torch.Tensor._make_wrapper_subclass(
            cls, like.shape, dtype=like.dtype, device=torch.device(device)
        )
        return tensor

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Mapping[str, Any] | None = None
    ) -> Any:
        if func is torch.ops.aten.detach.default:
            return _ForeignDeviceTensor(args[0], str(args[0].device))
        raise RuntimeError(f"{func} has no data on a simulated device")


@pytest.mark.parametrize("device", ["cuda:0", "cuda:1", "xpu"])
@pytest.mark.parametrize("kind", [TensorKind.PARAMETER, TensorKind.BUFFER])
def test_tensor_on_a_foreign_device_is_refused(device: str, kind: TensorKind, folders: dict[str, Path]) -> None:
    """D07: a parameter or persistent buffer that reports an accelerator device is UNSUPPORTED (simulated device)."""
    model = build_model("flux", seed=0)
    proj_out = model.proj_out
    moved = _ForeignDeviceTensor(proj_out.weight, device)
    assert moved.device == torch.device(device)
    if kind is TensorKind.PARAMETER:
        proj_out.weight = torch.nn.Parameter(moved, requires_grad=False)
        name = "transformer.proj_out.weight"
    else:
        proj_out.register_buffer("moved", moved, persistent=True)
        name = "transformer.proj_out.moved"
    with pytest.raises(HostWeightError) as refused:
        _identity(model, _source(folders["flux"]))
    assert _refusal(refused) == {"tensor": name, "device": device}


@pytest.mark.parametrize("kind", ["wan", "minimax_h3"])
def test_fp32_kept_tensors_stay_fp32_and_the_rest_is_bf16(
    kind: str, folders: dict[str, Path], fp32_models: dict[str, torch.nn.Module]
) -> None:
    """D07: the contract's dtypes are exactly what diffusers' from_pretrained(bfloat16) keeps (FP32 for kept modules)."""
    source = _source(folders[kind])
    canonical = tiny_spec(kind).model_class().from_pretrained(str(source.resolved_root), torch_dtype=torch.bfloat16)
    canonical_dtypes = {name: tensor.dtype for name, tensor in canonical.state_dict().items()}
    keep = tuple(type(canonical)._keep_in_fp32_modules)
    context = _identity(fp32_models[kind], source)

    assert {tensor.local_name: tensor.dtype for tensor in context.tensors} == canonical_dtypes
    kept = {tensor.local_name for tensor in context.tensors if tensor.dtype == torch.float32}
    assert kept == {name for name in canonical_dtypes if keeps_fp32(name, keep)}
    assert kept
    assert {tensor.dtype for tensor in context.tensors if tensor.local_name not in kept} == {torch.bfloat16}
    if kind == "wan":
        assert {
            "scale_shift_table",
            "blocks.0.scale_shift_table",
            "blocks.0.norm2.weight",
            "condition_embedder.time_embedder.linear_1.weight",
        } <= kept
        assert "blocks.0.attn1.to_q.weight" not in kept


def test_integer_buffers_keep_their_dtype_and_kept_floats_become_fp32(
    folders: dict[str, Path],
) -> None:
    """D07: int/bool buffers keep their dtype; float16 under a kept module is FP32, float64 elsewhere is BF16."""
    model = build_model("wan", seed=0)
    kept = model.condition_embedder.time_embedder
    kept.register_buffer("steps", torch.arange(3, dtype=torch.int64))
    kept.register_buffer("half_scale", torch.ones(3, dtype=torch.float16))
    model.proj_out.register_buffer("index", torch.arange(4, dtype=torch.int32))
    model.proj_out.register_buffer("mask", torch.ones(4, dtype=torch.bool))
    model.proj_out.register_buffer("wide", torch.ones(4, dtype=torch.float64))
    context = _identity(model, _source(folders["wan"]))
    dtypes = {tensor.local_name: tensor.dtype for tensor in context.tensors}
    assert {
        name: dtypes[name]
        for name in (
            "condition_embedder.time_embedder.steps",
            "condition_embedder.time_embedder.half_scale",
            "proj_out.index",
            "proj_out.mask",
            "proj_out.wide",
        )
    } == {
        "condition_embedder.time_embedder.steps": torch.int64,
        "condition_embedder.time_embedder.half_scale": torch.float32,
        "proj_out.index": torch.int32,
        "proj_out.mask": torch.bool,
        "proj_out.wide": torch.bfloat16,
    }


# ----------------------------------------------------------------------------- D08


class _PlainDiT(torch.nn.Module):
    """A DiT-shaped torch module that is not a diffusers ModelMixin."""

    def __init__(self) -> None:
        super().__init__()
        self.proj_in = torch.nn.Linear(4, 8)
        self.proj_out = torch.nn.Linear(8, 4)


# Same class name as a first-class diffusers model, but not a diffusers model.
_NamedLikeFlux = type("FluxTransformer2DModel", (_PlainDiT,), {})


class _WrappedDiT(torch.nn.Module):
    """A wrapper (as DDP/FSDP-style wrappers do) around a real diffusers model."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module


def _save_component(model: torch.nn.Module, root: Path, class_name: str) -> Path:
    """A pipeline-shaped folder holding `model`'s state dict as transformer/."""
    component = root / "transformer"
    component.mkdir(parents=True)
    (component / "config.json").write_text(f'{{"_class_name": "{class_name}"}}', encoding="utf-8")
    save_file({name: tensor.contiguous() for name, tensor in model.state_dict().items()}, str(component / WEIGHTS))
    return root


@pytest.mark.parametrize("make", ["plain", "named-like-flux", "wrapped-diffusers"])
def test_model_without_a_restore_contract_cannot_build_an_identity(
    make: str, tmp_path: Path, fp32_models: dict[str, torch.nn.Module]
) -> None:
    """D08: a plain torch.nn.Module DiT (even one named like a first-class class, or wrapping one) is UNSUPPORTED."""
    model: torch.nn.Module
    if make == "plain":
        model = _PlainDiT()
    elif make == "named-like-flux":
        model = _NamedLikeFlux()
    else:
        model = _WrappedDiT(fp32_models["flux"])
    folder = _save_component(model, tmp_path / make, type(model).__name__)
    with pytest.raises(HostWeightError) as refused:
        _identity(model, _source(folder))
    assert _refusal(refused) == {"model_class": type(model).__qualname__}
    with pytest.raises(HostWeightError):
        model_contracts.contract_for_model(model)


@pytest.mark.parametrize("kind", MODEL_KINDS)
def test_first_class_models_get_their_contract(kind: str, fp32_models: dict[str, torch.nn.Module]) -> None:
    """D08: Flux, Flux2, MiniMax-H3, SD3 and Wan resolve to their first-class contracts."""
    model = fp32_models[kind]
    contract = model_contracts.contract_for_model(model)
    assert contract is model_contracts.FIRST_CLASS_CONTRACTS[type(model).__name__]
    assert contract.first_class
    assert contract.keep_in_fp32_modules == tuple(getattr(type(model), "_keep_in_fp32_modules", None) or ())


class FluxTransformer2DModel(diffusers.FluxTransformer2DModel):
    """The diffusers class as a newer release might ship it: same name, another FP32 module list."""

    _keep_in_fp32_modules = ["proj_out"]  # noqa: RUF012


def test_first_class_contract_disagreeing_with_the_class_is_refused(
    folders: dict[str, Path], fp32_models: dict[str, torch.nn.Module], monkeypatch: pytest.MonkeyPatch
) -> None:
    """D08: a class whose _keep_in_fp32_modules differ from its first-class contract cannot build an identity."""
    changed_class: torch.nn.Module = FluxTransformer2DModel.from_config(tiny_spec("flux").config)  # type: ignore[no-untyped-call]
    with pytest.raises(HostWeightError) as refused:
        _identity(changed_class, _source(folders["flux"]))
    assert _refusal(refused) == {"model_class": "FluxTransformer2DModel"}

    wan = model_contracts.FIRST_CLASS_CONTRACTS["WanTransformer3DModel"]
    reviewed = dataclasses.replace(wan, keep_in_fp32_modules=tuple(m for m in wan.keep_in_fp32_modules if m != "norm3"))
    monkeypatch.setattr(
        model_contracts, "FIRST_CLASS_CONTRACTS", {**model_contracts.FIRST_CLASS_CONTRACTS, wan.model_class_name: reviewed}
    )
    with pytest.raises(HostWeightError) as refused_wan:
        _identity(fp32_models["wan"], _source(folders["wan"]))
    assert _refusal(refused_wan) == {"model_class": "WanTransformer3DModel"}


class _KeepsConvOutUNet(diffusers.UNet2DModel):
    """A non-first-class diffusers model that declares an FP32 module."""

    _keep_in_fp32_modules = ["conv_out"]  # noqa: RUF012


def _tiny_unet(model_class: Any) -> torch.nn.Module:
    model: torch.nn.Module = model_class(
        sample_size=8,
        in_channels=3,
        out_channels=3,
        layers_per_block=1,
        block_out_channels=(8, 16),
        down_block_types=("DownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "UpBlock2D"),
        norm_num_groups=4,
    )
    return model


def _tiny_dit() -> torch.nn.Module:
    dit_class: Any = diffusers.DiTTransformer2DModel
    model: torch.nn.Module = dit_class(
        num_attention_heads=2,
        attention_head_dim=8,
        in_channels=4,
        out_channels=4,
        num_layers=1,
        sample_size=8,
        patch_size=2,
        num_embeds_ada_norm=10,
    )
    return model


@pytest.mark.parametrize(
    ("build", "keep"),
    [
        (_tiny_dit, ()),
        (lambda: _tiny_unet(diffusers.UNet2DModel), ()),
        (lambda: _tiny_unet(_KeepsConvOutUNet), ("conv_out",)),
    ],
    ids=["DiTTransformer2DModel", "UNet2DModel", "UNet2DModel-keeping-conv_out"],
)
def test_other_diffusers_models_get_a_generic_contract(
    build: Callable[[], torch.nn.Module], keep: tuple[str, ...], tmp_path: Path
) -> None:
    """D08: any other diffusers ModelMixin gets a generic (not first-class) contract and builds a complete identity."""
    model: Any = build()
    model.save_pretrained(tmp_path / "pipeline" / "transformer", safe_serialization=True)
    contract = model_contracts.contract_for_model(model)
    assert isinstance(contract, FinalLayoutModelContract)
    assert not contract.first_class
    assert contract.implementation.implementation_id == f"diffusers.{type(model).__name__}"
    assert contract.keep_in_fp32_modules == keep

    context = _identity(model, _source(tmp_path / "pipeline"))
    assert context.model_contracts == (contract,)
    assert context.tensor_names == {f"transformer.{name}" for name in model.state_dict()}
    metadata = context.identity.component.metadata.to_value()
    assert isinstance(metadata, dict)
    assert metadata["dits"] == [{"name": "transformer", "contract": contract.to_dict()}]
    fp32 = {tensor.local_name for tensor in context.tensors if tensor.dtype == torch.float32}
    assert fp32 == {name for name in model.state_dict() if keeps_fp32(name, keep)}
    assert bool(fp32) == bool(keep)

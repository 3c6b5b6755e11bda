"""FP8 streamed from the checkpoint (T03): prewarm, stream_on_miss and background builds write the post-load bytes.

Every comparison is against an FP8 artifact published after a real canonical load
(`load_component(..., representation="fp8")` in PREFERRED mode), on real tiny diffusers models
(Flux and Wan 2.1, whose `_keep_in_fp32_modules` and skip patterns leave some Linears unquantized)
saved in their real safetensors format.
"""

from __future__ import annotations

import os
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from host_weight_runtime.config import RuntimeMode
from host_weight_runtime.diffusion import (
    ComponentLoadPath,
    FinalLayoutFP8BundleProducer,
    FinalLayoutFP8CheckpointProducer,
    FinalLayoutFP8Producer,
    FP8Linear,
    FP8StreamCast,
    HostWeightUsageError,
    load_component,
    prewarm_component,
    prewarm_tensor_parallel,
)
from host_weight_runtime.diffusion._load_options import LoadOptions
from host_weight_runtime.diffusion.component_source import ComponentLocation
from host_weight_runtime.diffusion.contracts import FinalLayoutParallelIdentity
from host_weight_runtime.diffusion.fp8 import quantize_to_fp8
from host_weight_runtime.diffusion.identity_adapter import FinalLayoutIdentityContext
from host_weight_runtime.diffusion.parallel.part_publish import publish_parts_after_load
from host_weight_runtime.diffusion.parallel.plan import localize_module
from host_weight_runtime.diffusion.parallel.rank_lease import resolve_parts
from host_weight_runtime.diffusion.producers._checkpoint import mapped_rows, read_safetensors_header, row_chunks
from host_weight_runtime.diffusion.producers.fp8_stream import (
    FP8Scratch,
    FP8TensorRole,
    full_tensor_scale,
    quantize_rows,
)
from host_weight_runtime.diffusion.representation import fp8_skeleton, quantize_model_fp8
from host_weight_runtime.diffusion.skeleton import identify_component, prepare_skeleton
from host_weight_runtime.failures import FailureCode, HostWeightError
from host_weight_runtime.lease import HostWeightLease
from host_weight_runtime.manifest import WeightManifest
from host_weight_runtime.outcomes import PostLoadPublicationStatus, ResolutionOutcome
from host_weight_runtime.runtime import HostWeightRuntime
from hwr_tools.synthetic_models import forward_inputs, run_forward, save_flux_pipeline_folder

from ._diffusion import DIT, Folder, runtime_at, save_folder
from ._encoders import save_encoder
from ._tp_children import rank_contexts
from .support import recv_within, spawned_child

FLUX_TP4 = {"num_attention_heads": 4, "attention_head_dim": 8, "axes_dims_rope": (2, 2, 4)}
TINY_CHUNK = 64
"""Bytes per chunk: a row or so, so every weight's amax pass and cast span many chunks."""


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in ("HWR_MODE", "HWR_ROOT", "HWR_ALLOW_LOCAL_BUILD", "HWR_ALLOW_POST_LOAD_PUBLISH", "HWR_REMOTE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-hub-cache"))


@pytest.fixture(scope="module")
def flux(tmp_path_factory: pytest.TempPathFactory) -> Folder:
    return save_folder(tmp_path_factory.mktemp("fp8-stream-flux"), "flux", seed=7, config_overrides=FLUX_TP4)


@pytest.fixture(scope="module")
def wan(tmp_path_factory: pytest.TempPathFactory) -> Folder:
    return save_folder(tmp_path_factory.mktemp("fp8-stream-wan"), "wan", seed=8)


def bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def fp8_context(folder: Folder, runtime: HostWeightRuntime) -> FinalLayoutIdentityContext:
    """The FP8 identity context `load_component(..., representation="fp8")` builds for the folder."""
    location = ComponentLocation(folder.root, DIT, None, None)
    skeleton = fp8_skeleton(prepare_skeleton(location, LoadOptions(), FinalLayoutParallelIdentity()))
    return identify_component(skeleton, runtime).context


def post_load_fp8(folder: Folder, root: Path) -> str:
    """Publish the FP8 artifact after a canonical load (the reference); returns its key."""
    with load_component(
        folder.root, subfolder=DIT, runtime=runtime_at(root), representation="fp8", publish_in_background=False
    ) as loaded:
        assert loaded.outcome is ResolutionOutcome.CANONICAL_FALLBACK
        assert loaded.publication is not None and loaded.publication.status is PostLoadPublicationStatus.PUBLISHED
        assert loaded.identity_key is not None
        return loaded.identity_key


def lease_of(root: Path, context: FinalLayoutIdentityContext) -> HostWeightLease:
    resolution = runtime_at(root).resolve(context.identity, None)
    assert resolution.outcome is ResolutionOutcome.LOCAL_HIT, resolution.report.failure
    assert resolution.lease is not None
    return resolution.lease


def without_source_mode(manifest: WeightManifest) -> dict[str, Any]:
    """The manifest's format metadata less `source_mode`, the one field that names how it was produced."""
    value = manifest.format_metadata.to_value()
    assert isinstance(value, dict)
    return {key: item for key, item in value.items() if key != "source_mode"}


def assert_same_artifact(streamed: HostWeightLease, post_load: HostWeightLease, *, same_files: bool) -> None:
    """Same key, tensor rows, digests and bytes; with `same_files`, the same payload files byte for byte."""
    ours, reference = streamed.manifest, post_load.manifest
    assert ours.identity.key == reference.identity.key
    assert ours.content_digest == reference.content_digest
    assert {e.name: e.digest for e in ours.tensors} == {e.name: e.digest for e in reference.tensors}
    assert {e.name: (e.dtype, e.shape) for e in ours.tensors} == {e.name: (e.dtype, e.shape) for e in reference.tensors}
    assert (ours.producer_schema, ours.restorer_schema) == (reference.producer_schema, reference.restorer_schema)
    assert without_source_mode(ours) == without_source_mode(reference)
    if same_files:
        assert ours.tensors == reference.tensors and ours.files == reference.files
    assert any(tensor.dtype == torch.float8_e4m3fn for tensor in post_load.tensors.values())
    for name, tensor in post_load.tensors.items():
        assert torch.equal(bits(streamed.tensors[name]), bits(tensor)), name


@pytest.mark.parametrize("kind", ["flux", "wan"])
def test_prewarmed_fp8_equals_the_post_load_fp8_artifact_bit_for_bit(
    tmp_path: Path, kind: str, flux: Folder, wan: Folder
) -> None:
    """T03: `prewarm_component(..., representation="fp8")` streams, without loading the model, the artifact a
    post-load FP8 publication writes: same key, same manifest (but for source_mode), same payload files byte
    for byte; and the same again in chunks of a row or so (the amax pass and the cast cross many chunks)."""
    folder = flux if kind == "flux" else wan
    key = post_load_fp8(folder, tmp_path / "post-load")
    result = prewarm_component(
        folder.root, subfolder=DIT, runtime=runtime_at(tmp_path / "prewarmed"), representation="fp8"
    )
    assert result.identity_key == key
    assert result.resolution.outcome is ResolutionOutcome.LOCAL_PRODUCTION
    context = fp8_context(folder, runtime_at(tmp_path / "prewarmed"))
    assert context.identity.key == key
    with lease_of(tmp_path / "prewarmed", context) as streamed, lease_of(tmp_path / "post-load", context) as post:
        assert_same_artifact(streamed, post, same_files=True)

    chunked = FinalLayoutFP8CheckpointProducer(context, chunk_bytes=TINY_CHUNK, shard_bytes=16 * 1024)
    resolution = runtime_at(tmp_path / "chunked", RuntimeMode.REQUIRED).resolve(context.identity, chunked)
    assert resolution.outcome is ResolutionOutcome.LOCAL_PRODUCTION, resolution.report.failure
    assert resolution.lease is not None
    assert chunked.largest_chunk_bytes <= max(TINY_CHUNK, _widest_row(folder))
    with resolution.lease as streamed, lease_of(tmp_path / "post-load", context) as post:
        assert len(streamed.manifest.files) > 1
        assert_same_artifact(streamed, post, same_files=False)


def _widest_row(folder: Folder) -> int:
    return max(entry.row_bytes for entry in read_safetensors_header(folder.weights).values())


def test_tp2_rank_artifacts_stream_with_the_full_tensor_scale(tmp_path: Path, flux: Folder) -> None:
    """T03: at TP=2 each rank's FP8 artifact streamed from the checkpoint equals the rank artifact published
    after a canonical load, quantize, then cut; and `FP8StreamCast` (what a bundle calls) quantizes full
    chunks with the full tensor's scale, so cutting them gives every rank's bytes."""
    holder, contexts = rank_contexts(flux, 2, fp8=True)
    del holder
    header = read_safetensors_header(flux.weights)
    cast = FP8StreamCast(contexts[0].tensors, chunk_bytes=TINY_CHUNK)
    quantized = cast.quantized_names()
    assert quantized and all(cast.role(f"{name}_scale") is FP8TensorRole.SCALE for name in quantized)
    split = 0
    fd = os.open(flux.weights, os.O_RDONLY)
    try:
        for context in contexts:
            rank = context.request.parallel.tensor_parallel_rank
            model = flux.canonical()
            quantize_model_fp8(model)
            localize_module(model, {n.removeprefix(f"{DIT}."): s for n, s in context.tensor_shards.items()})
            post_runtime = runtime_at(tmp_path / f"post-{rank}")
            report = post_runtime.publish_after_load(context.identity, FinalLayoutFP8Producer(context, [(DIT, model)]))
            assert report.status is PostLoadPublicationStatus.PUBLISHED, report.failure
            producer = FinalLayoutFP8CheckpointProducer(context, chunk_bytes=TINY_CHUNK)
            built = runtime_at(tmp_path / f"stream-{rank}", RuntimeMode.REQUIRED).resolve(context.identity, producer)
            assert built.lease is not None, built.report.failure
            with built.lease as streamed, lease_of(tmp_path / f"post-{rank}", context) as post:
                assert_same_artifact(streamed, post, same_files=True)
                for name in quantized:
                    entry = header[name.removeprefix(f"{DIT}.")]
                    full = torch.cat(  # a cast lives in a reused buffer until the next one: keep copies
                        [
                            cast.cast(name, mapped_rows(fd, entry, start, stop), fd, entry, torch.float8_e4m3fn).clone()
                            for start, stop in row_chunks(entry, TINY_CHUNK)
                        ]
                    )
                    shard = context.tensor_shards.get(name)
                    split += shard is not None
                    local = full if shard is None else shard.take(full)
                    assert torch.equal(bits(local), bits(post.tensors[name])), name
                    scale = cast.scale_value(f"{name}_scale", fd, entry)
                    assert torch.equal(bits(scale), bits(post.tensors[f"{name}_scale"])), name
    finally:
        os.close(fd)
    assert split > 0


def _part_digests(lease: HostWeightLease) -> tuple[str, str, dict[str, str]]:
    manifest = lease.manifest
    return manifest.identity.key, manifest.content_digest, {entry.name: entry.digest for entry in manifest.tensors}


def test_tp2_fp8_bundle_parts_equal_the_post_load_fp8_rank_layouts(tmp_path: Path, flux: Folder) -> None:
    """T03/T01: at TP=2 the FP8 bundle, in chunks of a row or so, writes the replicated part (every scale in it)
    and both shard parts in one pass that reads each checkpoint tensor once plus each quantized weight once
    more for its amax; every part has the key, content digest and tensor bytes of the part a rank publishes
    after a canonical FP8 load (quantize, then cut), and every rank's lease over its two parts has the key
    and content digest of the one-artifact FP8 rank layout published after that load."""
    _, contexts = rank_contexts(flux, 2, fp8=True)
    bundle = FinalLayoutFP8BundleProducer(contexts, chunk_bytes=TINY_CHUNK, shard_bytes=16 * 1024)
    built = runtime_at(tmp_path / "bundle", RuntimeMode.REQUIRED)
    header = read_safetensors_header(flux.weights)
    replicated = bundle.parts[0].replicated
    scales = {tensor.name for tensor in contexts[0].tensors if tensor.name.endswith("_scale")}
    assert scales and scales <= replicated.tensor_names
    quantized = {name.removesuffix("_scale") for name in scales}
    first = resolve_parts(built, bundle.parts[0], bundle)
    assert first.shard.outcome is ResolutionOutcome.LOCAL_PRODUCTION, first.failure
    assert first.lease is not None
    first.lease.close()
    stored = {f"{DIT}.{key}": entry.end - entry.begin for key, entry in header.items()}
    read_once = sum(stored[name] for name in contexts[0].tensor_names - scales)
    assert bundle.bytes_read == read_once + sum(stored[name] for name in quantized)  # + one amax pass each
    split = 0
    for parts in bundle.parts:
        rank = parts.rank_index
        model = flux.canonical()
        quantize_model_fp8(model)
        localize_module(model, {n.removeprefix(f"{DIT}."): s for n, s in parts.rank.tensor_shards.items()})
        split += sum(name in parts.shard.tensor_names for name in quantized)
        post_parts = runtime_at(tmp_path / f"post-parts-{rank}")
        report = publish_parts_after_load(post_parts, parts, DIT, model)
        assert report.status is PostLoadPublicationStatus.PUBLISHED, report.failure
        post_rank = runtime_at(tmp_path / f"post-rank-{rank}")
        report = post_rank.publish_after_load(parts.rank.identity, FinalLayoutFP8Producer(parts.rank, [(DIT, model)]))
        assert report.status is PostLoadPublicationStatus.PUBLISHED, report.failure
        for part in (parts.replicated, parts.shard):
            with lease_of(tmp_path / "bundle", part) as ours, lease_of(tmp_path / f"post-parts-{rank}", part) as post:
                assert _part_digests(ours) == _part_digests(post)
                for name, tensor in post.tensors.items():
                    assert torch.equal(bits(ours.tensors[name]), bits(tensor)), name
        served = resolve_parts(built, parts)
        assert served.lease is not None, served.failure
        with served.lease as lease, lease_of(tmp_path / f"post-rank-{rank}", parts.rank) as one_artifact:
            assert lease.manifest.identity.key == one_artifact.manifest.identity.key == parts.rank.identity.key
            assert lease.manifest.content_digest == one_artifact.manifest.content_digest
            assert any(tensor.dtype == torch.float8_e4m3fn for tensor in one_artifact.tensors.values())
            for name, tensor in one_artifact.tensors.items():
                assert torch.equal(bits(lease.tensors[name]), bits(tensor)), name
    assert split > 0


def _required_fp8_child(root: str, folder_root: str, conn: Connection) -> None:
    """A fresh REQUIRED worker that may not build: it must be served from what the prewarm left."""
    runtime = runtime_at(Path(root), RuntimeMode.REQUIRED)
    with load_component(
        folder_root, subfolder=DIT, runtime=runtime, representation="fp8", stream_on_miss=False
    ) as loaded:
        modules = [module for module in loaded.model.modules() if isinstance(module, FP8Linear)]
        conn.send(
            {
                "outcome": loaded.outcome.value,
                "load_path": loaded.load_path.value,
                "identity_key": loaded.identity_key,
                "fp8_modules": len(modules),
                "output": run_forward("flux", loaded.model, forward_inputs("flux", loaded.model)).float().numpy(),
            }
        )


def test_required_mode_is_served_fp8_from_a_prewarm(tmp_path: Path, flux: Folder) -> None:
    """T03/D14: after an FP8 prewarm, a fresh REQUIRED worker (no build allowed) gets LOCAL_HIT from the
    artifact with FP8Linear modules and the forward output of the canonical model quantized after load; a
    BF16 load in REQUIRED mode is not served by it (its own key, no conversion)."""
    root = tmp_path / "domain"
    prewarmed = prewarm_component(flux.root, subfolder=DIT, runtime=runtime_at(root), representation="fp8")
    canonical = flux.canonical()
    quantize_model_fp8(canonical)
    expected = run_forward("flux", canonical, forward_inputs("flux", canonical)).float()
    with spawned_child(_required_fp8_child, str(root), str(flux.root)) as conn:
        served = recv_within(conn)
    assert isinstance(served, dict)
    assert served["outcome"] == ResolutionOutcome.LOCAL_HIT.value
    assert served["load_path"] == ComponentLoadPath.ARTIFACT.value
    assert served["identity_key"] == prewarmed.identity_key
    assert served["fp8_modules"] == len([m for m in canonical.modules() if isinstance(m, FP8Linear)]) > 0
    assert torch.equal(torch.from_numpy(served["output"]), expected)
    with pytest.raises(HostWeightError) as refused:
        load_component(flux.root, subfolder=DIT, runtime=runtime_at(root, RuntimeMode.REQUIRED), stream_on_miss=False)
    assert refused.value.failure.code is FailureCode.NOT_FOUND


def test_stream_on_miss_and_background_publication_build_the_post_load_fp8_artifact(
    tmp_path: Path, wan: Folder
) -> None:
    """T03: REQUIRED mode streams FP8 on a miss (LOCAL_PRODUCTION, then restored from it), and a PREFERRED
    `publish_in_background=True` load returns the canonical FP8 model and builds the artifact behind it;
    both are the post-load FP8 artifact bit for bit, and the next load hits."""
    key = post_load_fp8(wan, tmp_path / "post-load")
    context = fp8_context(wan, runtime_at(tmp_path / "post-load"))
    required = runtime_at(tmp_path / "required", RuntimeMode.REQUIRED)
    with load_component(wan.root, subfolder=DIT, runtime=required, representation="fp8") as streamed:
        assert streamed.outcome is ResolutionOutcome.LOCAL_PRODUCTION
        assert streamed.load_path is ComponentLoadPath.ARTIFACT and streamed.identity_key == key
    with lease_of(tmp_path / "required", context) as ours, lease_of(tmp_path / "post-load", context) as post:
        assert_same_artifact(ours, post, same_files=True)

    behind = runtime_at(tmp_path / "background")
    with load_component(
        wan.root, subfolder=DIT, runtime=behind, representation="fp8", publish_in_background=True
    ) as first:
        assert first.load_path is ComponentLoadPath.CANONICAL
        assert any(isinstance(module, FP8Linear) for module in first.model.modules())
        background = first.background_publication
        assert background is not None and background.wait(300.0)
        assert background.failure is None and background.result is not None
        assert background.result.identity_key == key
    with lease_of(tmp_path / "background", context) as ours, lease_of(tmp_path / "post-load", context) as post:
        assert_same_artifact(ours, post, same_files=True)
    with load_component(wan.root, subfolder=DIT, runtime=behind, representation="fp8") as second:
        assert second.outcome is ResolutionOutcome.LOCAL_HIT and second.identity_key == key


def _artifacts(root: Path) -> list[Path]:
    return sorted((root / "artifacts").iterdir()) if (root / "artifacts").is_dir() else []


def test_fp8_requests_it_cannot_serve_are_typed_and_write_nothing(tmp_path: Path, flux: Folder) -> None:
    """T03/D06: FP8 for a transformers encoder, with an FP16 torch_dtype, or an unknown representation (also
    for a TP prewarm) are HostWeightUsageErrors; a checkpoint whose Linear weight is an integer tensor is
    PRODUCER_UNSUPPORTED, for one component and for the TP=2 bundle alike; none leaves an artifact behind."""
    root = tmp_path / "domain"
    encoder_root = tmp_path / "encoders"
    save_encoder(encoder_root, "text_encoder", seed=3)
    refused: list[tuple[Path, dict[str, Any]]] = [
        (encoder_root, {"subfolder": "text_encoder", "representation": "fp8"}),
        (flux.root, {"subfolder": DIT, "representation": "fp8", "torch_dtype": "float16"}),
        (flux.root, {"subfolder": DIT, "representation": "int8"}),
    ]
    for model_root, arguments in refused:
        with pytest.raises(HostWeightUsageError):
            prewarm_component(model_root, runtime=runtime_at(root), **arguments)
    with pytest.raises(HostWeightUsageError):
        prewarm_tensor_parallel(
            flux.root, tensor_parallel_size=2, subfolder=DIT, runtime=runtime_at(root), representation="int8"
        )

    broken = save_folder(tmp_path / "int-weight", "flux", seed=7, config_overrides=FLUX_TP4)
    tensors = load_file(broken.weights)
    name = "transformer_blocks.0.attn.to_q.weight"
    tensors[name] = torch.ones_like(tensors[name], dtype=torch.int32)
    save_file(tensors, broken.weights, metadata={"format": "pt"})
    with pytest.raises(HostWeightError) as failed:
        prewarm_component(broken.root, subfolder=DIT, runtime=runtime_at(root), representation="fp8")
    assert failed.value.failure.code is FailureCode.PRODUCER_UNSUPPORTED
    assert name in failed.value.failure.message
    with pytest.raises(HostWeightError) as failed:
        prewarm_tensor_parallel(
            broken.root, tensor_parallel_size=2, subfolder=DIT, runtime=runtime_at(root), representation="fp8"
        )
    assert failed.value.failure.code is FailureCode.PRODUCER_UNSUPPORTED
    assert name in failed.value.failure.message
    assert _artifacts(root) == []


def test_hwr_prewarm_builds_fp8_and_refuses_it_for_a_whole_pipeline(
    tmp_path: Path, flux: Folder, capsys: pytest.CaptureFixture[str]
) -> None:
    """T03/D14: `hwr prewarm MODEL --subfolder transformer --representation fp8 --json` streams the FP8
    artifact under the post-load key; without --subfolder on a pipeline folder FP8 is a usage error (2)."""
    import json

    from host_weight_runtime import cli

    key = post_load_fp8(flux, tmp_path / "post-load")
    root = tmp_path / "domain"
    args = ["prewarm", str(flux.root), "--subfolder", DIT, "--representation", "fp8", "--root", str(root), "--json"]
    assert cli.main(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["identity_key"] == key and report["representation"] == "fp8"
    assert report["resolution"]["outcome"] == ResolutionOutcome.LOCAL_PRODUCTION.value
    pipeline_args = ["prewarm", str(flux.root), "--representation", "fp8", "--root", str(tmp_path / "other")]
    assert cli.main(pipeline_args) == 2
    assert "--subfolder" in capsys.readouterr().err
    assert _artifacts(tmp_path / "other") == []


MIB = 2**20
BOUND_BEYOND_LARGEST = 256 * MIB
CHECKPOINT_BYTES = 400 * MIB


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"/proc/self/status has no {field}")


def _fp8_stream_child(pipeline: str, root: str, conn: Connection) -> None:
    """Identify (hashing the checkpoint) first, reset the peak-RSS counter, then stream the FP8 artifact."""
    runtime = runtime_at(Path(root), RuntimeMode.REQUIRED)
    context = fp8_context(Folder("flux", Path(pipeline)), runtime)
    producer = FinalLayoutFP8CheckpointProducer(context)
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
    before = _status_kib("VmRSS") * 1024
    resolution = runtime.resolve(context.identity, producer)
    peak = _status_kib("VmHWM") * 1024
    if resolution.lease is not None:
        resolution.lease.close()
    conn.send((resolution.outcome.value, before, peak))


@pytest.mark.slow
def test_fp8_streaming_rss_stays_within_the_largest_tensor_plus_256_mib(tmp_path: Path) -> None:
    """T03: streaming a 400 MiB FP32 checkpoint into its FP8 artifact (an amax pass and a cast pass per weight)
    raises the producing process's peak RSS by at most the largest tensor plus 256 MiB: the producer and the
    store's writer never hold the checkpoint or the artifact (the identity's hashing is done before)."""
    if not Path("/proc/self/clear_refs").exists():
        pytest.fail("this test needs /proc/self/clear_refs (Linux) to measure peak RSS")
    pipeline = save_flux_pipeline_folder(tmp_path / "pipeline", target_bytes=CHECKPOINT_BYTES)
    weights = pipeline / DIT
    checkpoint_bytes = sum(path.stat().st_size for path in weights.glob("*.safetensors"))
    largest = max(
        entry.end - entry.begin
        for path in weights.glob("*.safetensors")
        for entry in read_safetensors_header(path).values()
    )
    assert checkpoint_bytes > largest + BOUND_BEYOND_LARGEST, "the checkpoint must exceed the budget"
    with spawned_child(_fp8_stream_child, str(pipeline), str(tmp_path / "domain")) as conn:
        outcome, before, peak = recv_within(conn)  # type: ignore[misc]
    assert outcome == ResolutionOutcome.LOCAL_PRODUCTION.value
    growth = peak - before
    assert growth <= largest + BOUND_BEYOND_LARGEST, (
        f"peak RSS grew by {growth / MIB:.0f} MiB; the bound is {(largest + BOUND_BEYOND_LARGEST) / MIB:.0f} MiB"
    )


def test_full_tensor_scale_and_quantize_match_the_post_load_rule_on_edge_values(tmp_path: Path) -> None:
    """T03: on weights stored as FP32, FP16, BF16 and FP64 holding values just around BF16 rounding ties, an
    all-negative, an all-zero and a NaN-holding matrix, the streamed scale (chunk by chunk, amax rounded)
    and the streamed quantization equal `quantize_to_fp8`'s on the canonical BF16 weight, bit for bit."""
    generator = torch.Generator().manual_seed(3)
    tie = torch.tensor(1.0 + 2.0**-8, dtype=torch.float32)  # exactly halfway between two BF16 values
    base = torch.randn(64, 16, generator=generator, dtype=torch.float64)
    base[37, 5] = tie * 300.0  # the amax sits in a late chunk, on a rounding tie
    weights = {
        "fp32": base.to(torch.float32),
        "fp16": base.to(torch.float16),
        "bf16": base.to(torch.bfloat16),
        "fp64": base,
        "negative": -base.abs().to(torch.float32) - 1.0,
        "zero": torch.zeros(8, 16),
        "nan": torch.where(base > 2.0, torch.nan, base).to(torch.float32),
    }
    path = tmp_path / "edge.safetensors"
    save_file({name: tensor.contiguous() for name, tensor in weights.items()}, path)
    header = read_safetensors_header(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        for name, tensor in weights.items():
            canonical = torch.nn.Linear(tensor.shape[1], tensor.shape[0], bias=False)
            canonical.weight = torch.nn.Parameter(tensor.to(torch.bfloat16), requires_grad=False)
            holder = torch.nn.Sequential(canonical)
            quantize_to_fp8(holder, ["0"])
            expected = holder.get_submodule("0")
            assert isinstance(expected, FP8Linear)
            entry = header[name]
            scale = full_tensor_scale(fd, entry, TINY_CHUNK)
            assert torch.equal(bits(scale), bits(expected.weight_scale)), name
            streamed = torch.cat(
                [
                    quantize_rows(mapped_rows(fd, entry, start, stop), scale, scratch).clone()
                    for scratch in [FP8Scratch()]
                    for start, stop in row_chunks(entry, TINY_CHUNK)
                ]
            )
            assert torch.equal(bits(streamed), bits(expected.weight)), name
    finally:
        os.close(fd)

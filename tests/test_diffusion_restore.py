"""Final-layout publication and restore on real diffusers models (D09, D10, D11, D12) and the streaming producer.

Every test uses a small real diffusers model saved as a real safetensors folder, a real
`HostWeightRuntime` on `tmp_path`, and the public adapter pieces `load_component` is
built from. Nothing is mocked: a wrong byte, a dropped tensor or a stray mutation shows
up as a different tensor, a different digest or a different object.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import accelerate  # noqa: F401  (`make test` installs it: a missing one fails the module, never skips it)
import diffusers  # noqa: F401
import pytest
import torch
from safetensors.torch import load_file, save_file

from host_weight_runtime.config import RuntimeMode
from host_weight_runtime.diffusion import (
    FinalLayoutBF16CheckpointProducer,
    FinalLayoutIdentityContext,
    FinalLayoutTensorRestorer,
)
from host_weight_runtime.failures import FailureCode, HostWeightError
from host_weight_runtime.lease import HostWeightLease
from host_weight_runtime.manifest import WeightManifest
from host_weight_runtime.outcomes import AttemptResult, PostLoadPublicationStatus, ResolutionOutcome
from host_weight_runtime.protocols import (
    ArtifactWriter,
    LookupPhase,
    ProductionMetadata,
    ProductionSourceMode,
    TensorWriteSpec,
    WeightProductionSpec,
)
from host_weight_runtime.runtime import HostWeightRuntime
from host_weight_runtime.tensors import TensorKind
from hwr_tools.synthetic_models import build_model, forward_inputs, run_forward

from ._diffusion import (
    DIT,
    Folder,
    OtherPipeline,
    Pipeline,
    TensorSnapshot,
    all_tensors,
    identity_context,
    publish_canonical,
    runtime_at,
    save_folder,
)

REQUIRED = RuntimeMode.REQUIRED


# ----------------------------------------------------------------------------- fixtures and helpers


@pytest.fixture(scope="module")
def flux(tmp_path_factory: pytest.TempPathFactory) -> Folder:
    """A Flux folder that no test modifies."""
    return save_folder(tmp_path_factory.mktemp("flux"), "flux")


@pytest.fixture(scope="module")
def wan(tmp_path_factory: pytest.TempPathFactory) -> Folder:
    """A Wan folder (FP32-kept tensors, non-persistent buffers) that no test modifies."""
    return save_folder(tmp_path_factory.mktemp("wan"), "wan")


def _published(folder: Folder, domain: Path, **producer_kwargs: object) -> tuple[HostWeightRuntime, Pipeline]:
    """Load the folder canonically and publish it after load into `domain`; returns the runtime and serving holder."""
    runtime = runtime_at(domain)
    holder = Pipeline(folder.canonical())
    context = identity_context(holder, folder.source())
    report = publish_canonical(runtime, context, holder.transformer, **producer_kwargs)
    assert report.status is PostLoadPublicationStatus.PUBLISHED, report.failure
    return runtime, holder


_OPEN_LEASES: list[HostWeightLease] = []


@pytest.fixture(autouse=True)
def _close_leases() -> Iterator[None]:
    """Every lease `_lease_for` hands out is closed when the test ends, whether it passed or not."""
    yield
    while _OPEN_LEASES:
        _OPEN_LEASES.pop().close()


def _lease_for(runtime: HostWeightRuntime, context: FinalLayoutIdentityContext) -> HostWeightLease:
    resolution = runtime.resolve(context.identity)
    assert resolution.outcome is ResolutionOutcome.LOCAL_HIT, resolution.report.failure
    assert resolution.lease is not None
    _OPEN_LEASES.append(resolution.lease)
    return resolution.lease


def _assert_nothing_published(runtime: HostWeightRuntime, context: FinalLayoutIdentityContext) -> None:
    """A PREFERRED lookup of the key misses (a REQUIRED runtime reports FAILED after the same MISS)."""
    resolution = runtime.resolve(context.identity)
    assert resolution.lease is None
    assert resolution.report.attempts[0].result is AttemptResult.MISS


def _restore_error(excinfo: pytest.ExceptionInfo[HostWeightError]) -> Mapping[str, object]:
    assert excinfo.value.code is FailureCode.RESTORE_FAILED
    details = excinfo.value.failure.details.to_value()
    assert isinstance(details, dict)
    return details


def _digests(manifest: WeightManifest) -> dict[str, str]:
    return {entry.name: entry.digest for entry in manifest.tensors}


def _replace_file(path: Path, new_bytes_from: Path) -> None:
    """Replace `path` atomically (new inode) with the bytes of another file."""
    staged = path.with_name(path.name + ".staged")
    staged.write_bytes(new_bytes_from.read_bytes())
    os.replace(staged, path)


class _HandMadeProducer:
    """A real producer that writes chosen tensors under a context's identity.

    It stands for a faulty producer: the artifact carries the right key, but its tensors
    are whatever the test hands it, so only the restorer's planning can catch the damage.
    """

    def __init__(
        self, context: FinalLayoutIdentityContext, tensors: Mapping[str, tuple[TensorWriteSpec, torch.Tensor]]
    ) -> None:
        self._context = context
        self._tensors = dict(tensors)
        self._spec = WeightProductionSpec(
            producer_id=context.spec.producer.producer_id,
            outputs=(context.identity,),
            source_mode=ProductionSourceMode.CHECKPOINT_STREAM,
            lookup_phase=LookupPhase.PRE_LOAD_SAFE,
        )

    @property
    def spec(self) -> WeightProductionSpec:
        return self._spec

    def produce(self, writer: ArtifactWriter) -> ProductionMetadata:
        specs = tuple(spec for spec, _value in self._tensors.values())
        file_writer = writer.open_tensor_file("hand-made.safetensors", specs, ordered=True)
        for spec in getattr(file_writer, "layout", specs):
            file_writer.write_tensor(spec.name, self._tensors[spec.name][1])
        file_writer.close()
        producer = self._context.spec.producer
        return ProductionMetadata(producer_schema=producer.manifest_schema, restorer_schema=producer.restorer_schema)


def _final_tensors(
    context: FinalLayoutIdentityContext, model: torch.nn.Module
) -> dict[str, tuple[TensorWriteSpec, torch.Tensor]]:
    """The correct final-layout tensors of a canonical model, by artifact name."""
    live = {f"{DIT}.{name}": tensor for name, tensor in model.state_dict().items()}
    return {tensor.name: (tensor.write_spec(), live[tensor.name].detach()) for tensor in context.tensors}


# ----------------------------------------------------------------------------- D09


def test_post_load_publication_leaves_the_serving_model_untouched(wan: Folder, tmp_path: Path) -> None:
    """D09: publishing a loaded model reads it and changes nothing: same objects, values, storage and grad flags."""
    runtime = runtime_at(tmp_path / "domain")
    holder = Pipeline(wan.canonical())
    context = identity_context(holder, wan.source())
    before = TensorSnapshot.of(holder)
    assert any(before.requires_grad.values()), "a canonical model's parameters require grad"
    assert {t.dtype for t in before.objects.values()} >= {torch.bfloat16, torch.float32}

    report = publish_canonical(runtime, context, holder.transformer)

    assert report.status is PostLoadPublicationStatus.PUBLISHED, report.failure
    before.assert_unchanged(holder)
    assert holder.transformer.training is False


def test_plan_mutates_nothing_and_commit_binds_the_lease_zero_copy(wan: Folder, tmp_path: Path) -> None:
    """D09: plan_restore changes nothing; commit gives canonical values on the lease's storage; other parts untouched."""
    runtime, serving = _published(wan, tmp_path / "domain")
    holder = Pipeline(wan.skeleton())
    context = identity_context(holder, wan.source())
    lease = _lease_for(runtime, context)
    before = TensorSnapshot.of(holder)
    text_proj, text_proj_before = holder.text_proj, TensorSnapshot.of(holder.text_proj)
    owned = {name.removeprefix(f"{DIT}.") for name in context.tensor_names}
    assert all(before.objects[f"{DIT}.{name}"].is_meta for name in owned)

    plan = FinalLayoutTensorRestorer(context).plan_restore(holder, lease)

    before.assert_unchanged(holder)
    assert (plan.committed, plan.tensor_count) == (False, len(context.tensors))

    plan.commit()

    assert plan.committed
    canonical = all_tensors(serving.transformer)
    restored = all_tensors(holder.transformer)
    assert restored.keys() == canonical.keys()
    for name, tensor in restored.items():
        assert not tensor.is_meta, name
        assert tensor.dtype == canonical[name].dtype and torch.equal(tensor, canonical[name]), name
        if name in owned:
            assert tensor.data_ptr() == lease.tensors[f"{DIT}.{name}"].data_ptr(), name
    assert all(parameter.requires_grad for parameter in holder.transformer.parameters()), "as the model had them"
    # The other component of the pipeline is exactly as it was: same module, objects, values and storage.
    assert holder.text_proj is text_proj
    text_proj_before.assert_unchanged(holder.text_proj)

    with pytest.raises(HostWeightError) as second:
        plan.commit()
    _restore_error(second)


def test_plan_on_a_materialized_model_copies_nothing_until_commit(flux: Folder, tmp_path: Path) -> None:
    """D09: planning against a CPU model holding other values leaves every value in place; commit replaces them all."""
    runtime, serving = _published(flux, tmp_path / "domain")
    other = build_model("flux", seed=7)  # FP32, different values, same tensor contract under the BF16 policy
    holder = Pipeline(other)
    context = identity_context(Pipeline(flux.skeleton()), flux.source())
    lease = _lease_for(runtime, context)
    before = TensorSnapshot.of(holder)

    plan = FinalLayoutTensorRestorer(context).plan_restore(holder, lease)
    before.assert_unchanged(holder)

    plan.commit()
    canonical = serving.transformer.state_dict()
    for name, tensor in holder.transformer.state_dict().items():
        assert tensor.dtype == canonical[name].dtype and torch.equal(tensor, canonical[name]), name


def test_commit_after_the_lease_closed_changes_nothing(flux: Folder, tmp_path: Path) -> None:
    """D09: a commit whose lease was closed after planning raises RESTORE_FAILED before binding anything."""
    runtime, _serving = _published(flux, tmp_path / "domain")
    holder = Pipeline(flux.skeleton())
    context = identity_context(holder, flux.source())
    lease = _lease_for(runtime, context)
    plan = FinalLayoutTensorRestorer(context).plan_restore(holder, lease)
    before = TensorSnapshot.of(holder)
    lease.close()

    with pytest.raises(HostWeightError) as raised:
        plan.commit()
    _restore_error(raised)
    before.assert_unchanged(holder)
    with pytest.raises(HostWeightError) as again:
        FinalLayoutTensorRestorer(context).plan_restore(holder, lease)
    _restore_error(again)


# ----------------------------------------------------------------------------- D10


def test_shard_size_does_not_change_the_content_digest(flux: Folder, tmp_path: Path) -> None:
    """D10: two independent publications, one split into several payload files, have the same content digest."""
    key_holder = Pipeline(flux.skeleton())
    context = identity_context(key_holder, flux.source())
    small_runtime, _ = _published(flux, tmp_path / "small", shard_bytes=16 * 1024)
    default_runtime, _ = _published(flux, tmp_path / "default")

    with _lease_for(small_runtime, context) as small, _lease_for(default_runtime, context) as default:
        assert len(small.manifest.files) >= 3
        assert len(default.manifest.files) == 1
        assert {entry.file for entry in small.manifest.tensors} != {entry.file for entry in default.manifest.tensors}
        assert small.manifest.content_digest == default.manifest.content_digest
        assert _digests(small.manifest) == _digests(default.manifest)


def test_streaming_and_post_load_producers_publish_the_same_content(wan: Folder, tmp_path: Path) -> None:
    """D10: the checkpoint-streaming producer and post-load publication give identical content and tensor digests."""
    post_runtime, _ = _published(wan, tmp_path / "post-load")
    context = identity_context(Pipeline(wan.skeleton()), wan.source())
    stream_runtime = runtime_at(tmp_path / "streamed", REQUIRED)
    producer = FinalLayoutBF16CheckpointProducer(context, shard_bytes=32 * 1024)

    streamed = stream_runtime.resolve(context.identity, producer)

    assert streamed.outcome is ResolutionOutcome.LOCAL_PRODUCTION, streamed.report.failure
    assert streamed.lease is not None
    with streamed.lease as stream_lease, _lease_for(post_runtime, context) as post_lease:
        assert len(stream_lease.manifest.files) > 1
        assert stream_lease.manifest.content_digest == post_lease.manifest.content_digest
        assert _digests(stream_lease.manifest) == _digests(post_lease.manifest)
        assert any(entry.dtype != post_lease.manifest.tensors[0].dtype for entry in post_lease.manifest.tensors)


# ----------------------------------------------------------------------------- D11


def test_source_replaced_before_post_load_publication_fails_and_publishes_nothing(tmp_path: Path) -> None:
    """D11: a checkpoint replaced after the identity was built fails post-load publication; the key stays a MISS."""
    folder = save_folder(tmp_path / "model", "flux")
    other = save_folder(tmp_path / "other", "flux", seed=1)
    runtime = runtime_at(tmp_path / "domain")
    holder = Pipeline(folder.canonical())
    context = identity_context(holder, folder.source())

    _replace_file(folder.weights, other.weights)
    report = publish_canonical(runtime, context, holder.transformer)

    assert report.status is PostLoadPublicationStatus.FAILED
    assert report.failure is not None and report.failure.code is FailureCode.CANONICAL_SOURCE_FAILED
    _assert_nothing_published(runtime, context)


def test_source_replaced_before_streaming_production_fails_and_publishes_nothing(tmp_path: Path) -> None:
    """D11: in REQUIRED mode the streaming producer refuses a checkpoint replaced after the identity was built."""
    folder = save_folder(tmp_path / "model", "flux")
    other = save_folder(tmp_path / "other", "flux", seed=1)
    runtime = runtime_at(tmp_path / "domain", REQUIRED)
    context = identity_context(Pipeline(folder.skeleton()), folder.source())

    _replace_file(folder.weights, other.weights)
    resolution = runtime.resolve(context.identity, FinalLayoutBF16CheckpointProducer(context))

    assert resolution.outcome is ResolutionOutcome.FAILED and resolution.lease is None
    assert resolution.report.failure is not None
    assert resolution.report.failure.code is FailureCode.CANONICAL_SOURCE_FAILED
    _assert_nothing_published(runtime_at(tmp_path / "domain"), context)


def test_source_replaced_between_plan_and_commit_mutates_nothing(tmp_path: Path) -> None:
    """D11: a checkpoint replaced between plan_restore and commit fails the commit before any tensor is bound."""
    folder = save_folder(tmp_path / "model", "flux")
    other = save_folder(tmp_path / "other", "flux", seed=1)
    runtime, _serving = _published(folder, tmp_path / "domain")
    holder = Pipeline(folder.skeleton())
    context = identity_context(holder, folder.source())
    lease = _lease_for(runtime, context)
    plan = FinalLayoutTensorRestorer(context).plan_restore(holder, lease)
    before = TensorSnapshot.of(holder)

    _replace_file(folder.weights, other.weights)
    with pytest.raises(HostWeightError) as raised:
        plan.commit()

    assert raised.value.code is FailureCode.CANONICAL_SOURCE_FAILED
    before.assert_unchanged(holder)
    assert all(t.is_meta for t in holder.transformer.parameters())
    with pytest.raises(HostWeightError) as again:  # a failed commit is still spent
        plan.commit()
    _restore_error(again)


# ----------------------------------------------------------------------------- D12


def test_lease_of_another_model_is_rejected_at_planning(flux: Folder, tmp_path: Path) -> None:
    """D12: a lease for model A planned with the identity of model B (other weights) fails without mutation."""
    runtime, _ = _published(flux, tmp_path / "domain")
    lease = _lease_for(runtime, identity_context(Pipeline(flux.skeleton()), flux.source()))
    other = save_folder(tmp_path / "other", "flux", seed=1)
    holder = Pipeline(other.skeleton())
    context = identity_context(holder, other.source())
    before = TensorSnapshot.of(holder)

    with pytest.raises(HostWeightError) as raised:
        FinalLayoutTensorRestorer(context).plan_restore(holder, lease)

    details = _restore_error(raised)
    assert details == {"lease_key": lease.identity.key, "expected_key": context.identity.key}
    before.assert_unchanged(holder)


def test_artifact_of_a_bigger_model_is_rejected_at_planning(flux: Folder, tmp_path: Path) -> None:
    """D12: an artifact built from a config with one more layer never restores into the smaller model."""
    bigger = save_folder(tmp_path / "bigger", "flux", config_overrides={"num_layers": 3})
    runtime, _ = _published(bigger, tmp_path / "domain")
    big_context = identity_context(Pipeline(bigger.skeleton()), bigger.source())
    lease = _lease_for(runtime, big_context)
    holder = Pipeline(flux.skeleton())
    context = identity_context(holder, flux.source())
    assert big_context.tensor_names > context.tensor_names
    before = TensorSnapshot.of(holder)

    with pytest.raises(HostWeightError) as raised:
        FinalLayoutTensorRestorer(context).plan_restore(holder, lease)

    _restore_error(raised)
    before.assert_unchanged(holder)


def _remove_proj_out(model: torch.nn.Module) -> None:
    del model.proj_out


def _add_buffer(model: torch.nn.Module) -> None:
    model.register_buffer("extra_scale", torch.ones(3, device="meta"))


@pytest.mark.parametrize(
    "change",
    [_remove_proj_out, _add_buffer],
    ids=["model-lacks-a-module", "model-has-an-extra-buffer"],
)
def test_model_that_differs_from_its_identity_is_rejected_at_planning(
    flux: Folder, tmp_path: Path, change: Callable[[torch.nn.Module], None]
) -> None:
    """D12: a model with a missing module or an extra tensor is not covered by the artifact: rejected, untouched."""
    runtime, _ = _published(flux, tmp_path / "domain")
    holder = Pipeline(flux.skeleton())
    context = identity_context(holder, flux.source())
    lease = _lease_for(runtime, context)
    change(holder.transformer)
    before = TensorSnapshot.of(holder)

    with pytest.raises(HostWeightError) as raised:
        FinalLayoutTensorRestorer(context).plan_restore(holder, lease)

    _restore_error(raised)
    before.assert_unchanged(holder)


def test_model_of_another_pipeline_or_dit_type_is_rejected_at_planning(
    flux: Folder, wan: Folder, tmp_path: Path
) -> None:
    """D12: the identity names its pipeline and DiT classes; a model of other classes is refused untouched."""
    runtime, _ = _published(flux, tmp_path / "domain")
    holder = Pipeline(flux.skeleton())
    context = identity_context(holder, flux.source())
    lease = _lease_for(runtime, context)
    restorer = FinalLayoutTensorRestorer(context)
    other_pipeline = OtherPipeline(flux.skeleton())
    other_dit = Pipeline(wan.skeleton())
    snapshots = [TensorSnapshot.of(model) for model in (other_pipeline, other_dit)]

    for model, before in zip((other_pipeline, other_dit), snapshots, strict=True):
        with pytest.raises(HostWeightError) as raised:
            restorer.plan_restore(model, lease)
        _restore_error(raised)
        before.assert_unchanged(model)


def test_artifact_missing_or_adding_a_tensor_is_rejected_at_planning(flux: Folder, tmp_path: Path) -> None:
    """D12: an artifact under the right key that lacks a tensor, or holds one too many, is incomplete coverage."""
    canonical = flux.canonical()
    holder = Pipeline(flux.skeleton())
    context = identity_context(holder, flux.source())
    correct = _final_tensors(context, canonical)
    dropped = sorted(correct)[0]
    missing = {name: value for name, value in correct.items() if name != dropped}
    extra_value = torch.zeros(4, dtype=torch.bfloat16)
    extra = {
        **correct,
        f"{DIT}.stray.weight": (TensorWriteSpec(f"{DIT}.stray.weight", (4,), torch.bfloat16), extra_value),
    }
    before = TensorSnapshot.of(holder)

    for label, tensors, expected in (("missing", missing, (1, 0)), ("extra", extra, (0, 1))):
        runtime = runtime_at(tmp_path / label)
        built = runtime.resolve(context.identity, _HandMadeProducer(context, tensors))
        assert built.outcome is ResolutionOutcome.LOCAL_PRODUCTION and built.lease is not None, built.report.failure
        with built.lease as lease, pytest.raises(HostWeightError) as raised:
            FinalLayoutTensorRestorer(context).plan_restore(holder, lease)
        details = _restore_error(raised)
        assert (details["missing"], details["unexpected"]) == expected, label
        before.assert_unchanged(holder)


def test_artifact_tensor_of_the_wrong_dtype_or_role_is_rejected_at_planning(flux: Folder, tmp_path: Path) -> None:
    """D12: every tensor must match the model's final dtype, kind and role; one that does not fails planning."""
    canonical = flux.canonical()
    holder = Pipeline(flux.skeleton())
    context = identity_context(holder, flux.source())
    correct = _final_tensors(context, canonical)
    target = next(t for t in context.tensors if t.kind is TensorKind.PARAMETER and t.role == "weight")
    spec, value = correct[target.name]
    as_fp32 = {**correct, target.name: (TensorWriteSpec(spec.name, spec.shape, torch.float32), value.float())}
    as_buffer = {
        **correct,
        target.name: (TensorWriteSpec(spec.name, spec.shape, spec.dtype, TensorKind.BUFFER, "weight"), value),
    }
    before = TensorSnapshot.of(holder)

    for label, tensors in (("dtype", as_fp32), ("kind", as_buffer)):
        runtime = runtime_at(tmp_path / label)
        built = runtime.resolve(context.identity, _HandMadeProducer(context, tensors))
        assert built.lease is not None, built.report.failure
        with built.lease as lease, pytest.raises(HostWeightError) as raised:
            FinalLayoutTensorRestorer(context).plan_restore(holder, lease)
        assert _restore_error(raised) == {"tensor": target.name}, label
        before.assert_unchanged(holder)

    # The same hand-made producer with the correct tensors restores: the rejections above are the tampering.
    runtime = runtime_at(tmp_path / "correct")
    built = runtime.resolve(context.identity, _HandMadeProducer(context, correct))
    assert built.lease is not None, built.report.failure
    with built.lease as lease:
        FinalLayoutTensorRestorer(context).plan_restore(holder, lease).commit()
        inputs = forward_inputs("flux", canonical)
        assert torch.equal(run_forward("flux", holder.transformer, inputs), run_forward("flux", canonical, inputs))


# ----------------------------------------------------------------------------- streaming producer


def _max_row_bytes(path: Path) -> int:
    rows = [t.numel() * t.element_size() // t.shape[0] for t in load_file(path).values() if t.dim() and t.shape[0]]
    return max(rows)


def test_streaming_producer_reads_in_bounded_chunks(wan: Folder, tmp_path: Path) -> None:
    """Streaming with a 4 KiB chunk never reads more than max(chunk, one row) at once, and publishes the same bytes."""
    post_runtime, _ = _published(wan, tmp_path / "post-load")
    context = identity_context(Pipeline(wan.skeleton()), wan.source())
    chunk = 4096
    largest_tensor = max(t.numel() * t.element_size() for t in load_file(wan.weights).values())
    assert largest_tensor > 4 * chunk, "the model must have tensors that need several chunks"
    producer = FinalLayoutBF16CheckpointProducer(context, chunk_bytes=chunk)

    streamed = runtime_at(tmp_path / "streamed", REQUIRED).resolve(context.identity, producer)

    assert streamed.lease is not None, streamed.report.failure
    assert 0 < producer.largest_chunk_bytes <= max(chunk, _max_row_bytes(wan.weights))
    assert producer.largest_chunk_bytes < largest_tensor
    with streamed.lease as stream_lease, _lease_for(post_runtime, context) as post_lease:
        assert stream_lease.manifest.content_digest == post_lease.manifest.content_digest


def test_streaming_producer_refuses_a_checkpoint_missing_a_tensor(tmp_path: Path) -> None:
    """A checkpoint that lacks one of the model's tensors fails the streaming producer with PRODUCER_FAILED."""
    folder = save_folder(tmp_path / "model", "flux")
    tensors = load_file(folder.weights)
    del tensors[sorted(tensors)[0]]
    save_file(tensors, folder.weights)
    context = identity_context(Pipeline(folder.skeleton()), folder.source())
    runtime = runtime_at(tmp_path / "domain", REQUIRED)

    resolution = runtime.resolve(context.identity, FinalLayoutBF16CheckpointProducer(context))

    assert resolution.outcome is ResolutionOutcome.FAILED and resolution.lease is None
    assert resolution.report.failure is not None
    assert resolution.report.failure.code is FailureCode.PRODUCER_FAILED
    _assert_nothing_published(runtime_at(tmp_path / "domain"), context)


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _corrupt_header(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[8] = ord("[")  # the header's opening brace: still JSON-shaped bytes, no longer an object
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", [_truncate, _corrupt_header], ids=["truncated", "corrupt-header"])
def test_streaming_producer_refuses_a_damaged_checkpoint(tmp_path: Path, damage: Callable[[Path], None]) -> None:
    """A truncated checkpoint or one with an unreadable header fails the streaming producer with PRODUCER_FAILED."""
    folder = save_folder(tmp_path / "model", "flux")
    damage(folder.weights)
    context = identity_context(Pipeline(folder.skeleton()), folder.source())
    runtime = runtime_at(tmp_path / "domain", REQUIRED)

    resolution = runtime.resolve(context.identity, FinalLayoutBF16CheckpointProducer(context))

    assert resolution.lease is None and resolution.report.failure is not None
    assert resolution.report.failure.code is FailureCode.PRODUCER_FAILED
    _assert_nothing_published(runtime_at(tmp_path / "domain"), context)

"""Splitting the owned tensors into payload files, and the spec and metadata every final-layout producer reports."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ...canonical_json import CanonicalJson
from ...failures import FailureCode, HostWeightError, HostWeightFailure, ResolutionStage
from ...protocols import (
    ArtifactWriter,
    LookupPhase,
    ProductionMetadata,
    ProductionSourceMode,
    TensorFileWriter,
    WeightProductionSpec,
)
from ..identity_adapter import FinalLayoutIdentityContext
from ..tensor_layout import FinalLayoutTensor

DEFAULT_SHARD_BYTES = 4 * 2**30

ProgressCallback = Callable[[int, int], None]
"""Called with (bytes written so far, total bytes)."""

TensorWriter = Callable[[TensorFileWriter, FinalLayoutTensor], None]

_LOOKUP_PHASE = {
    ProductionSourceMode.CHECKPOINT_STREAM: LookupPhase.PRE_LOAD_SAFE,
    ProductionSourceMode.FINALIZED_MODEL: LookupPhase.POST_LOAD_ONLY,
}


def producer_error(code: FailureCode, message: str, **details: str | int) -> HostWeightError:
    return HostWeightError(
        HostWeightFailure(ResolutionStage.PRODUCTION, code, False, message, CanonicalJson.from_value(details))
    )


def plan_shards(tensors: Sequence[FinalLayoutTensor], shard_bytes: int) -> list[tuple[str, list[FinalLayoutTensor]]]:
    """Name-ordered tensors packed greedily into files of at most `shard_bytes` (a larger tensor gets its own)."""
    if type(shard_bytes) is not int or shard_bytes <= 0:
        raise ValueError(f"shard_bytes must be a positive int, got {shard_bytes!r}")
    groups: list[list[FinalLayoutTensor]] = [[]]
    filled = 0
    for tensor in sorted(tensors, key=lambda item: item.name):
        if groups[-1] and filled + tensor.nbytes > shard_bytes:
            groups.append([])
            filled = 0
        groups[-1].append(tensor)
        filled += tensor.nbytes
    count = len(groups)
    return [(f"final-layout-{index + 1:05d}-of-{count:05d}.safetensors", group) for index, group in enumerate(groups)]


def write_all(
    writer: ArtifactWriter,
    context: FinalLayoutIdentityContext,
    shard_bytes: int,
    write_one: TensorWriter,
    progress: ProgressCallback | None,
) -> None:
    """Write the context's tensors into payload files of at most `shard_bytes` (`write_files`)."""
    write_files(writer, plan_shards(context.tensors, shard_bytes), write_one, progress)


def write_files(
    writer: ArtifactWriter,
    files: Sequence[tuple[str, Sequence[FinalLayoutTensor]]],
    write_one: TensorWriter,
    progress: ProgressCallback | None = None,
) -> None:
    """Open each payload file ordered, write its tensors in the writer's layout order, close it."""
    total = sum(tensor.nbytes for _file_name, group in files for tensor in group)
    done = 0
    if progress is not None:
        progress(0, total)
    for file_name, group in files:
        by_name = {tensor.name: tensor for tensor in group}
        file_writer = writer.open_tensor_file(file_name, tuple(t.write_spec() for t in group), ordered=True)
        for spec in getattr(file_writer, "layout", tuple(t.write_spec() for t in group)):
            tensor = by_name[spec.name]
            write_one(file_writer, tensor)
            done += tensor.nbytes
            if progress is not None:
                progress(done, total)
        file_writer.close()


def production_spec(context: FinalLayoutIdentityContext, source_mode: ProductionSourceMode) -> WeightProductionSpec:
    """The spec of a producer of the one artifact `context` identifies: one that reads the checkpoint may run
    before the load, one that reads the finalized model only after it."""
    return WeightProductionSpec(
        producer_id=context.spec.producer.producer_id,
        outputs=(context.identity,),
        source_mode=source_mode,
        lookup_phase=_LOOKUP_PHASE[source_mode],
        digest_algorithm=context.spec.digest_algorithm,
    )


class SingleArtifactProducer:
    """What every producer of one final-layout artifact holds: its context, payload-file size, progress
    callback and spec, and the check that ends each production."""

    def __init__(
        self,
        context: FinalLayoutIdentityContext,
        source_mode: ProductionSourceMode,
        *,
        shard_bytes: int,
        progress: ProgressCallback | None,
    ) -> None:
        self._context = context
        self._shard_bytes = shard_bytes
        self._progress = progress
        self._spec = production_spec(context, source_mode)

    @property
    def spec(self) -> WeightProductionSpec:
        return self._spec

    def _finish(self) -> ProductionMetadata:
        """The sources held still through the production: report it (else a typed failure, nothing published)."""
        self._context.ensure_sources_unchanged()
        return production_metadata(self._context, self._spec.source_mode.value)


def production_metadata(context: FinalLayoutIdentityContext, source_mode: str) -> ProductionMetadata:
    return ProductionMetadata(
        producer_schema=context.spec.producer.manifest_schema,
        restorer_schema=context.spec.producer.restorer_schema,
        format_metadata=CanonicalJson.from_value(
            {
                "policy": context.policy.name,
                "tensor_contract": _contract_digest(context),
                "tensor_count": len(context.tensors),
                "source_mode": source_mode,
                "built_from": context.built_from(),  # display only: the key is content-addressed
            }
        ),
    )


def _contract_digest(context: FinalLayoutIdentityContext) -> str:
    value = context.identity.component.metadata.to_value()
    digest = value.get("tensor_contract") if isinstance(value, dict) else None
    return digest if isinstance(digest, str) else ""

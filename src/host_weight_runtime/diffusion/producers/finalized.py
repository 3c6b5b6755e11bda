"""Post-load publication: the finalized CPU model's tensors, written as they serve (in one pass, `_live_write`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from ...failures import FailureCode
from ...protocols import ArtifactWriter, ProductionMetadata, ProductionSourceMode, TensorFileWriter
from ..identity_adapter import FinalLayoutIdentityContext, discover_final_layout
from ..tensor_layout import FinalLayoutTensor, tensors_by_name
from ._live_write import write_live_files
from ._shards import DEFAULT_SHARD_BYTES, ProgressCallback, SingleArtifactProducer, plan_shards, producer_error


class FinalLayoutBF16Producer(SingleArtifactProducer):
    """Publish finalized BF16-policy tensors through a store-scoped writer.

    Reads the serving model and never modifies it; its tensors must already be in their
    final dtype and layout, or production fails instead of publishing something else.
    `model_is_private=True` promises that nothing writes the model's tensors until `produce`
    returns (`load_component` publishes a model it has not handed out yet): they are then hashed
    and written straight from their memory instead of from a private copy of each piece.
    """

    def __init__(
        self,
        context: FinalLayoutIdentityContext,
        dit_modules: Sequence[tuple[str, torch.nn.Module]],
        *,
        shard_bytes: int = DEFAULT_SHARD_BYTES,
        progress: ProgressCallback | None = None,
        model_is_private: bool = False,
    ) -> None:
        super().__init__(context, ProductionSourceMode.FINALIZED_MODEL, shard_bytes=shard_bytes, progress=progress)
        self._dit_modules = tuple(dit_modules)
        self._model_is_private = model_is_private is True

    def produce(self, writer: ArtifactWriter) -> ProductionMetadata:
        context = self._context
        context.ensure_sources_unchanged()
        files = plan_shards(context.tensors, self._shard_bytes)
        if self._model_is_private:  # checked on the hash lane while the first bytes are written
            publish_live(
                writer, files, self._dit_modules, self._progress, model_is_private=True, check=self._check_contract
            )
        else:
            self._check_contract()
            publish_live(writer, files, self._dit_modules, self._progress)
        return self._finish()

    def _check_contract(self) -> None:
        """The loaded model's tensors are the identity's (names, shapes, dtypes, roles), or PRODUCER_FAILED."""
        context = self._context
        ownership, _contracts = discover_final_layout(self._dit_modules, context.policy, context.aliases)
        if ownership.tensors != context.tensors:
            expected = {tensor.name: tensor for tensor in context.tensors}
            differing = sorted(
                tensor.name for tensor in ownership.tensors if expected.get(tensor.name) != tensor
            ) + sorted(expected.keys() - ownership.names)
            raise producer_error(
                FailureCode.PRODUCER_FAILED,
                f"the loaded model does not match the identity's tensor contract ({len(differing)} tensors differ, "
                f"e.g. {differing[:5]}); it cannot be published under this key",
                differing=len(differing),
            )


def publish_live(
    writer: ArtifactWriter,
    files: Sequence[tuple[str, Sequence[FinalLayoutTensor]]],
    dit_modules: Sequence[tuple[str, torch.nn.Module]],
    progress: ProgressCallback | None = None,
    *,
    model_is_private: bool = False,
    check: Callable[[], None] | None = None,
) -> None:
    """Write the serving model's tensors into the planned files in one pass (`write_live_files`; `check` as there)."""
    live = tensors_by_name(dit_modules)
    write_live_files(
        writer,
        files,
        lambda tensor: checked_live(tensor, live),
        lambda file_writer, tensor: write_live(file_writer, tensor, live),
        progress,
        model_is_private=model_is_private,
        check=check,
    )


def write_live(file_writer: TensorFileWriter, tensor: FinalLayoutTensor, live: Mapping[str, torch.Tensor]) -> None:
    """Write the serving model's tensor as it is (the writer hashes it behind)."""
    file_writer.write_tensor(tensor.name, checked_live(tensor, live))


def checked_live(tensor: FinalLayoutTensor, live: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The serving model's tensor for `tensor`; one not on the host in its final dtype fails the production."""
    value = live[tensor.name].detach()
    if value.device.type != "cpu" or value.dtype != tensor.dtype:
        raise producer_error(
            FailureCode.PRODUCER_FAILED,
            f"{tensor.name} is {value.dtype} on {value.device}; a finalized model publishes host tensors "
            f"already in their final dtype {tensor.dtype}",
            tensor=tensor.name,
        )
    return value

"""A load by name: a node whose Hugging Face cache lacks a model finds it through the remote's name index.

Taken only when the checkpoint is absent here (a checkpoint that is present always computes its own
key), a remote is configured and the revision is a commit hash. The index entry gives the key and
the checkpoint files' names, sizes, content ids and tensor names; the snapshot's non-weight files
(config.json, model_index.json, scheduler and tokenizer files) are fetched, checked against their
SHA-256, and kept under the domain::

    <root>/named-snapshots-v1/models--<org>--<name>/snapshots/<revision>/...

The skeleton is built from that config, the key is recomputed on this node from the records,
and a key that differs from the index's is refused: the index is trusted with name -> key only
(as a registry's tag -> digest); the bytes are then imported and verified as for any key.

The name carries the representation's dtype (`float8_e4m3fn` for FP8) and, for a
tensor-parallel rank, the TP size and the rank's shard part: a rank checks its shard key
against the index, and that key names the replicated part's key, so one check covers both.

The remotes are asked in order, past one that fails (as the import stage goes past it); the
snapshot files come first from the remote whose entry was taken. When none answers and one
failed, that failure is raised: a remote that is down is a retryable REMOTE_FAILED, not a name
the index lacks.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch

from ..failures import FailureCode, HostWeightError, ResolutionStage, failure, usage_error
from ..remote import FsspecArtifactProvider
from ..remote.names import ArtifactName, NameIndexEntry, is_pinned_revision
from ..remote.pull import read_name_entry
from ..remote.snapshot_files import SnapshotFile, read_snapshot_file, read_snapshot_files
from ..runtime import HostWeightRuntime
from ._load_options import LoadOptions
from .component_source import ComponentLocation, checkpoint_source, existing_node_digest_cache
from .fp8 import FP8_DTYPE
from .source_identity import PreparedWeightSource, RecordedCheckpoint, RecordedWeightFile, WeightSourceKind

__all__ = [
    "NAMED_SNAPSHOTS_FOLDER",
    "NameLayout",
    "check_index_key",
    "checkpoint_or_named_source",
    "name_dtype",
    "named_component_source",
    "named_pipeline_root",
    "named_snapshot",
    "wants_name",
]

NAMED_SNAPSHOTS_FOLDER = "named-snapshots-v1"

_LOG = logging.getLogger("host_weight_runtime")
_Found = TypeVar("_Found")


@dataclass(frozen=True, slots=True)
class NameLayout:
    """The part of a name a load settles besides the location: the representation's dtype, and for a
    tensor-parallel rank its TP size and part (`shard-<rank>`)."""

    dtype: str
    tensor_parallel_size: int = 1
    part: str | None = None


def name_dtype(dtype: torch.dtype, fp8: bool) -> str:
    """The dtype an artifact's name carries: its representation's (float8_e4m3fn for FP8, else the load's)."""
    return str(FP8_DTYPE if fp8 else dtype).removeprefix("torch.")


def _providers(runtime: HostWeightRuntime) -> list[FsspecArtifactProvider]:
    return [provider for provider in runtime.remote_providers if isinstance(provider, FsspecArtifactProvider)]


def wants_name(location: ComponentLocation, runtime: HostWeightRuntime, exc: HostWeightError) -> bool:
    """Whether a checkpoint that is not cached here may be looked up by name: a repo id, a remote to ask."""
    return (
        exc.failure.code is FailureCode.NOT_FOUND
        and exc.failure.stage is ResolutionStage.CANONICAL
        and not os.path.isdir(os.fspath(location.model_or_path))
        and bool(_providers(runtime))
    )


def _require_pinned(location: ComponentLocation, exc: HostWeightError) -> str:
    revision = location.revision
    if revision is None or not is_pinned_revision(revision):
        raise usage_error(
            f"{exc.failure.message}. A remote is configured, but a load by name takes a commit hash as the "
            f"revision (a branch or tag such as {revision or 'main'!r} may move, so the artifact it names may not "
            "be the checkpoint you mean): pass revision=<the 40-hex commit>",
            argument="revision",
            revision=revision,
        ) from exc
    return revision


def _not_named(location: ComponentLocation, exc: HostWeightError, why: str) -> HostWeightError:
    """The cache miss, with what the name lookup found: NOT_FOUND, so PREFERRED and REQUIRED both see a miss."""
    return HostWeightError(
        failure(
            ResolutionStage.REMOTE,
            FailureCode.NOT_FOUND,
            f"{exc.failure.message}; and by name: {why}",
            model_or_path=str(location.model_or_path),
        )
    )


def _materialize(root: Path, file: SnapshotFile, data: bytes) -> None:
    """Write one checked file in place atomically (a concurrent writer writes the same bytes)."""
    target = root.joinpath(*file.path.split("/"))
    target.parent.mkdir(parents=True, exist_ok=True)
    descriptor, temporary = tempfile.mkstemp(dir=target.parent, prefix=".hwr-named-")
    try:
        with os.fdopen(descriptor, "wb") as stream:
            stream.write(data)
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(temporary, target)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def _holds(root: Path, file: SnapshotFile) -> bool:
    target = root.joinpath(*file.path.split("/"))
    try:
        if target.stat().st_size != file.size:
            return False
        return hashlib.sha256(target.read_bytes()).hexdigest() == file.sha256
    except OSError:
        return False


def named_snapshot(
    runtime: HostWeightRuntime, repo_id: str, revision: str, prefer: str | None = None
) -> tuple[Path, str] | None:
    """The domain's copy of the snapshot's non-weight files (fetched and checked where missing) and the remote
    it came from (the `prefer`red one first: the remote whose index entry the load took); None when no
    configured remote lists files for this repo id and revision."""
    init_failure = runtime.ensure_store()
    if init_failure is not None:
        raise HostWeightError(init_failure)
    base = runtime.config.resolved_root / NAMED_SNAPSHOTS_FOLDER / ("models--" + repo_id.replace("/", "--"))
    root = base / "snapshots" / revision

    def fetch(provider: FsspecArtifactProvider) -> Path | None:
        listed = read_snapshot_files(provider.location, repo_id, revision)
        if listed is None:
            return None
        for file in listed.files:
            if not _holds(root, file):
                _materialize(root, file, read_snapshot_file(provider.location, file))
        return root

    return _first_answer(runtime, fetch, f"the files of {repo_id}@{revision}", prefer)


def named_pipeline_root(location: ComponentLocation, runtime: HostWeightRuntime, exc: HostWeightError) -> Path:
    """The domain's copy of a pipeline snapshot's non-weight files (model_index.json, configs, tokenizers) for a
    pipeline whose checkpoint is not cached here; `exc` (the cache miss) stays raised when no remote lists them."""
    revision = _require_pinned(location, exc)
    repo_id = os.fspath(location.model_or_path)
    snapshot = named_snapshot(runtime, repo_id, revision)
    if snapshot is None or not (snapshot[0] / "model_index.json").is_file():
        why = f"no configured remote holds the pipeline files of {repo_id}@{revision}"
        raise _not_named(location, exc, why) from exc
    return snapshot[0]


def _first_answer(
    runtime: HostWeightRuntime,
    ask: Callable[[FsspecArtifactProvider], _Found | None],
    what: str,
    prefer: str | None = None,
) -> tuple[_Found, str] | None:
    """The first remote's answer (the `prefer`red one first, then in order), past remotes that fail, as the
    import stage goes past them; when none answers, the first failure is raised: a remote that is down is not an
    index that lacks the name, so the caller sees a (retryable) REMOTE_FAILED, not a NOT_FOUND."""
    providers = sorted(_providers(runtime), key=lambda provider: provider.provider_id != prefer)
    first_failure: HostWeightError | None = None
    for provider in providers:
        try:
            found = ask(provider)
        except HostWeightError as exc:
            code, message = exc.failure.code.value, exc.failure.message
            _LOG.warning("remote %s failed on %s: [%s] %s", provider.provider_id, what, code, message)
            first_failure = first_failure or exc
            continue
        if found is not None:
            return found, provider.provider_id
    if first_failure is not None:
        raise first_failure
    return None


def _entry(runtime: HostWeightRuntime, name: ArtifactName) -> tuple[NameIndexEntry, str] | None:
    return _first_answer(runtime, lambda provider: read_name_entry(provider.location, name), f"the index entry {name}")


def checkpoint_or_named_source(
    location: ComponentLocation, options: LoadOptions, runtime: HostWeightRuntime, layout: NameLayout
) -> PreparedWeightSource:
    """The checkpoint here; else, with a remote configured, the one its name index records (never both)."""
    try:
        return checkpoint_source(location, options, existing_node_digest_cache(runtime))
    except HostWeightError as exc:
        if not wants_name(location, runtime, exc):
            raise
        return named_component_source(location, options, runtime, exc, layout)


def named_component_source(
    location: ComponentLocation,
    options: LoadOptions,
    runtime: HostWeightRuntime,
    exc: HostWeightError,
    layout: NameLayout | None = None,
) -> PreparedWeightSource:
    """The component's source as the remote's index records it; `exc` (the cache miss) is what stays raised,
    with the reason, when the index has no usable entry. `layout` defaults to one artifact at the load's dtype."""
    revision = _require_pinned(location, exc)
    repo_id = os.fspath(location.model_or_path)
    layout = layout if layout is not None else NameLayout(name_dtype(options.dtype, fp8=False))
    name = ArtifactName(
        repo_id, revision, location.subfolder, options.variant, layout.dtype, layout.tensor_parallel_size, layout.part
    )
    found = _entry(runtime, name)
    if found is None:
        raise _not_named(location, exc, f"no configured remote's index has {name}") from exc
    entry, remote = found
    if not entry.checkpoint:
        raise _not_named(
            location,
            exc,
            f"{remote} indexes {name} without its checkpoint files; push it again from a node that holds the snapshot",
        ) from exc
    snapshot = named_snapshot(runtime, repo_id, revision, prefer=remote)
    root = None if snapshot is None else snapshot[0].joinpath(*(location.subfolder or "").split("/"))
    if root is None or not (root / "config.json").is_file():
        raise _not_named(location, exc, f"no remote holds the config files of {name}; push it again") from exc
    files = tuple(
        sorted(
            (RecordedWeightFile(root / record.name, record.size, record.content_id, record.tensor_names)
             for record in entry.checkpoint),
            key=lambda file: file.path,
        )
    )  # fmt: skip
    return PreparedWeightSource(
        repo_id,
        revision,
        root,
        location.subfolder,
        f"{location.component_name}.",
        tuple(file.path for file in files),
        True,
        WeightSourceKind.HUGGING_FACE_HUB,
        recorded=RecordedCheckpoint(files, entry.key, str(name), remote),
    )


def check_index_key(source: PreparedWeightSource, computed_key: str) -> None:
    """A load by name goes on only when this node computes the key the index gave (REMOTE_FAILED otherwise)."""
    recorded = source.recorded
    if recorded is None or recorded.index_key == computed_key:
        return
    raise HostWeightError(
        failure(
            ResolutionStage.REMOTE,
            FailureCode.REMOTE_FAILED,
            f"the name index of {recorded.remote} maps {recorded.index_name} to {recorded.index_key[:16]}..., but "
            f"this node computes {computed_key[:16]}... from the same files (another diffusers/transformers/torch "
            "version, or an index that names another artifact); nothing was imported. Download the checkpoint "
            "here, or push from a node with the same library versions",
            retryable=False,
            provider_id=recorded.remote,
            index_key=recorded.index_key,
            computed_key=computed_key,
        )
    )

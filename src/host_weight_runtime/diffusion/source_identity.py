"""Canonical diffusion weight-source identity and one-load replacement guard.

The artifact key must describe the exact checkpoint bytes a canonical load would read.
`prepare_weight_source` picks those files the way the ordinary diffusers loader does
(local folder or local Hugging Face cache, never the network); `snapshot_sources`
records every file's stat state and a content id; `FinalLayoutSourceContext` re-checks
the states before anything is published or restored (D11).

A content id is either

    hub-blob:<name>     the blob name of a validated Hugging Face cache snapshot (D04)
    sha256:<64 hex>     the SHA-256 of the file's bytes, for everything else

and `NodeSourceDigestCache` lets the workers of a node hash a local file once (D03).
The fingerprint (the key's source part) holds content only (D05): per source its prefix,
format, adapter, and each file's name inside the component folder, size and content id,
a 64-hex blob name spelled as the `sha256:` it is. Where the files were read from (repo
id, revision, path) is recorded for display, outside the key.
Only a source that changes fails a load. The parts live in private modules, one idea each:

    _weight_source     PreparedWeightSource: the files one load reads, and their prefix
    _source_files      which weight files the ordinary loader picks in a folder
    hub_snapshot      the local Hugging Face cache: snapshots, trusted blob names
    _file_state        a file's stat state; hashing it while that state holds
    _digest_cache      NodeSourceDigestCache
    _source_snapshot   content ids, the fingerprint, and the re-check before publish
    _source_coverage   binding each DiT tensor to one source by prefix
"""

from __future__ import annotations

import difflib
import os
import re
from pathlib import Path, PurePosixPath

from ..canonical_json import JsonValue
from ..failures import ArgumentHint, FailureCode, HostWeightUsageError, ResolutionStage, raise_failure, usage_error
from ._digest_cache import NodeSourceDigestCache
from ._file_state import FileState
from ._hub_snapshot import hub_blob_content_id, hub_snapshot, not_cached
from ._source_coverage import bind_tensors_to_sources
from ._source_files import select_weight_files
from ._source_snapshot import (
    FinalLayoutSourceContext,
    SourceFileRecord,
    free_content_id,
    is_content_id_known,
    snapshot_sources,
)
from ._weight_source import (
    MAX_LISTED,
    PreparedWeightSource,
    RecordedCheckpoint,
    RecordedWeightFile,
    WeightSourceKind,
    relative_parts,
    resolved_revision,
)

__all__ = [
    "FileState",
    "FinalLayoutSourceContext",
    "NodeSourceDigestCache",
    "PreparedWeightSource",
    "RecordedCheckpoint",
    "RecordedWeightFile",
    "SourceFileRecord",
    "WeightSourceKind",
    "bind_tensors_to_sources",
    "hub_blob_content_id",
    "free_content_id",
    "is_content_id_known",
    "prepare_weight_source",
    "resolved_revision",
    "snapshot_sources",
]

_REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?")


def prepare_weight_source(
    model_or_path: str | os.PathLike[str],
    *,
    subfolder: str | None = None,
    revision: str | None = None,
    prefix: str = "",
    cache_dir: Path | None = None,
    variant: str | None = None,
    use_safetensors: bool | None = None,
) -> PreparedWeightSource:
    """Select the checkpoint files a diffusers load of this folder or cached hub repo would read.

    `variant` and `use_safetensors` choose among them as in diffusers' `from_pretrained`.
    """
    text = os.fspath(model_or_path)
    if type(text) is not str or not text:
        raise ValueError(f"model_or_path must be a non-empty folder path or 'org/name', got {model_or_path!r}")
    sub_parts: tuple[str, ...] = ()
    if subfolder is not None:
        if type(subfolder) is not str:
            raise ValueError(f"subfolder must be None or a str, got {type(subfolder).__name__}")
        sub_parts = relative_parts("/".join(PurePosixPath(subfolder).parts), "subfolder")
    normal_subfolder = "/".join(sub_parts) if sub_parts else None
    if os.path.isdir(text):
        top = Path(os.path.abspath(text))
        root = top.joinpath(*sub_parts)
        if not (root / "config.json").is_file():
            raise _no_model_folder(top, root, normal_subfolder, where=str(top))
        files, safe = select_weight_files(root, variant, use_safetensors)
        return PreparedWeightSource(
            text, revision, root, normal_subfolder, prefix, files, safe, WeightSourceKind.LOCAL_PATH
        )
    if not _REPO_ID.fullmatch(text) or "--" in text or ".." in text:
        raise raise_failure(
            ResolutionStage.CANONICAL,
            FailureCode.NOT_FOUND,
            f"{text!r} is neither an existing local folder nor a Hugging Face repo id ('org/name'); "
            f"check the path or the model name",
            model_or_path=text,
        )
    snapshot = hub_snapshot(text, revision, cache_dir)
    root = snapshot.joinpath(*sub_parts)
    wanted = revision if revision is not None else "main"
    if not (root / "config.json").is_file():
        if (root.is_dir() and normal_subfolder is not None) or not _component_folders(snapshot):
            raise not_cached(text, wanted, root, "the snapshot has no config.json there (a partial download?)")
        where = f"snapshot {snapshot.name[:12]} of {text!r} (revision {wanted!r})"
        raise _no_model_folder(snapshot, root, normal_subfolder, where=where, repo_id=text, revision=wanted)
    try:
        files, safe = select_weight_files(root, variant, use_safetensors)
    except HostWeightUsageError:
        raise  # another `variant` would find weights: the call is wrong, not the cache
    except ValueError as exc:
        raise not_cached(text, wanted, root, str(exc)) from exc
    return PreparedWeightSource(
        text, revision, root, normal_subfolder, prefix, files, safe, WeightSourceKind.HUGGING_FACE_HUB
    )


# The component a pipeline folder is most often loaded for, first (every subfolder with a config.json is served).
_PREFERRED_COMPONENTS = ("transformer", "unet")


def _component_folders(top: Path) -> list[str]:
    """The subfolders of a pipeline folder that hold a config.json (the components `subfolder` can name)."""
    try:
        return sorted(entry.name for entry in top.iterdir() if (entry / "config.json").is_file())
    except OSError:
        return []


def _suggested_component(components: list[str], given: str | None) -> str | None:
    """The component to suggest: the closest to a misspelt `subfolder`, else the usual one, else the only one."""
    if given is not None:
        close = difflib.get_close_matches(given, components, n=1)
        if close:
            return close[0]
    preferred = [name for name in _PREFERRED_COMPONENTS if name in components]
    if preferred:
        return preferred[0]
    return components[0] if len(components) == 1 else None


def _no_model_folder(
    top: Path, root: Path, subfolder: str | None, *, where: str, **details: JsonValue
) -> HostWeightUsageError:
    """The folder (or pipeline component) named by the call holds no model: say which subfolders do."""
    components = _component_folders(top)
    if subfolder is not None and not root.is_dir():
        problem = f"subfolder {subfolder!r} does not exist in {where}"
    else:
        problem = f"{root} has no config.json, so it is not a model folder (diffusers or transformers)"
    if components:
        listed = ", ".join(components[:MAX_LISTED]) + (" ..." if len(components) > MAX_LISTED else "")
        problem += f"; the subfolders that hold a config.json: {listed}"
    suggestion = _suggested_component(components, subfolder)
    return usage_error(
        problem,
        code=FailureCode.INVALID_CONFIGURATION,
        hint=None if suggestion is None else ArgumentHint(use=(("subfolder", suggestion),)),
        subfolder=subfolder,
        components=list[JsonValue](components),
        looked_in=str(root),
        **details,
    )

"""The source step: where a component's files are, which checkpoint files a load reads, and which class they hold.

Everything here is cheap and hashes nothing: a bad folder, a damaged checkpoint header or a
config.json that names no model class is refused up front, in every mode, as a usage error.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..canonical_json import decode_json
from ..failures import HostWeightError, usage_error
from ..runtime import HostWeightRuntime
from ._file_state import FileState
from ._load_options import LoadOptions
from .family_diffusers import DIFFUSERS_FAMILY
from .family_transformers import TRANSFORMERS_FAMILY, is_transformers_config
from .model_family import ImportClock, ModelFamily
from .producers._checkpoint import CheckpointFormatError, read_safetensors_header
from .source_identity import (
    NodeSourceDigestCache,
    PreparedWeightSource,
    WeightSourceKind,
    free_content_id,
    prepare_weight_source,
)

__all__ = [
    "DEFAULT_COMPONENT_NAME",
    "ComponentLocation",
    "checkpoint_source",
    "component_model_class",
    "family_for_config",
    "model_id",
    "never_identified_here",
    "node_digest_cache",
    "read_model_config",
    "usage_errors",
]

_LOG = logging.getLogger(__name__)
_CONFIG_LIMIT_BYTES = 16 * 2**20
DEFAULT_COMPONENT_NAME = "transformer"
"""The name a component gets in tensor names when its subfolder gives none (a lone model folder)."""


@dataclass(frozen=True, slots=True)
class ComponentLocation:
    """Where a component is, as the caller named it: a folder or cached repo id, maybe a subfolder of it."""

    model_or_path: str | os.PathLike[str]
    subfolder: str | None = None
    revision: str | None = None
    cache_dir: Path | None = None

    @property
    def component_name(self) -> str:
        """The component's name in tensor names: its subfolder's last part, else `transformer`."""
        if self.subfolder:
            last = Path(self.subfolder).name
            if last.isidentifier():
                return last
        return DEFAULT_COMPONENT_NAME

    @property
    def name_or_path(self) -> str:
        return str(self.model_or_path)


@contextmanager
def usage_errors() -> Iterator[None]:
    """A ValueError about the caller's model folder or arguments leaves as a HostWeightUsageError."""
    try:
        yield
    except HostWeightError:
        raise
    except ValueError as exc:
        raise usage_error(str(exc)) from exc


def checkpoint_source(
    location: ComponentLocation, options: LoadOptions, checked: NodeSourceDigestCache | None = None
) -> PreparedWeightSource:
    """The checkpoint files the canonical load would read; a problem with the folder is a HostWeightUsageError.

    Every safetensors file's header is checked here (offsets inside the file, sizes matching shapes), so a
    truncated or foreign shard is refused up front in every mode, before any hashing, build or load. With the
    node's cache (`checked`), a file whose header some worker already checked in its exact stat state is not
    read again; any other state (rewritten, replaced, moved) is read and checked.
    """
    with usage_errors():
        source = prepare_weight_source(
            location.model_or_path,
            subfolder=location.subfolder,
            revision=location.revision,
            prefix=f"{location.component_name}.",
            cache_dir=location.cache_dir,
            variant=options.variant,
            use_safetensors=options.use_safetensors,
        )
    if source.use_safetensors:
        for path in source.weight_files:
            _check_header(path, checked)
    return source


def _check_header(path: Path, checked: NodeSourceDigestCache | None) -> None:
    """Read and check one safetensors header, unless the node checked it in this very state before."""
    try:
        state = None if checked is None else FileState.of(path)
        if state is not None and checked is not None and checked.header_checked(path, state):
            return
        read_safetensors_header(path)
        if state is not None and checked is not None and FileState.of(path) == state:
            checked.record_header_checked(path, state)  # the state held across the read: it names these bytes
    except CheckpointFormatError as exc:
        raise usage_error(
            f"{exc}; the checkpoint file is damaged, incomplete or not safetensors: re-download or re-save it",
            file=str(path),
        ) from exc
    except OSError as exc:
        raise usage_error(f"cannot read the checkpoint file {path}: {exc}", file=str(path)) from exc


def read_model_config(resolved_root: Path) -> tuple[Path, dict[str, Any]]:
    """The folder's config.json, read bounded (size and nesting): a hostile or broken one is a usage error,
    never a RecursionError or AttributeError from a parser."""
    config_path = resolved_root / "config.json"
    try:
        with open(config_path, "rb") as stream:  # a hub snapshot's config.json is a link to its blob: follow it
            config = decode_json(stream.read(_CONFIG_LIMIT_BYTES + 1), max_bytes=_CONFIG_LIMIT_BYTES)
    except (OSError, ValueError) as exc:
        raise usage_error(
            f"cannot read {config_path}: {exc}; point load_component at a diffusers or transformers model folder "
            "(its config.json must be one JSON object)"
        ) from exc
    if not isinstance(config, dict):
        raise usage_error(
            f"{config_path} holds a JSON {type(config).__name__}, not an object; it is not a model config"
        )
    return config_path, config


def family_for_config(config: Mapping[str, Any]) -> ModelFamily:
    """transformers for a config with `model_type` or `architectures` and no `_class_name`; else diffusers."""
    return TRANSFORMERS_FAMILY if is_transformers_config(config) else DIFFUSERS_FAMILY


def component_model_class(
    source: PreparedWeightSource, family: ModelFamily | None = None, clock: ImportClock | None = None
) -> tuple[ModelFamily, type[Any]]:
    """The component's family (given, or as its config.json says) and the class the config names in it."""
    config_path, config = read_model_config(source.resolved_root)
    chosen = family if family is not None else family_for_config(config)
    return chosen, chosen.model_class(config, config_path, clock)


def model_id(model_or_path: str | os.PathLike[str], source: PreparedWeightSource) -> str:
    """The model as the manifest shows it (never in the key): a repo id as given, a local folder by its real path."""
    if source.source_kind is WeightSourceKind.HUGGING_FACE_HUB:
        return str(model_or_path)
    return os.path.realpath(model_or_path)


def node_digest_cache(runtime: HostWeightRuntime) -> NodeSourceDigestCache | None:
    """The node's source-digest cache under the domain root, only once the domain itself checked out."""
    init_failure = runtime.ensure_store()
    if init_failure is not None:
        _LOG.info("no node source-digest cache (%s); checkpoint files are hashed directly", init_failure.message)
        return None
    return NodeSourceDigestCache(runtime.config.resolved_root, timeout_seconds=runtime.config.lock_timeout_s)


def existing_node_digest_cache(runtime: HostWeightRuntime) -> NodeSourceDigestCache | None:
    """The node's cache only where its domain exists already: checking a folder's headers never creates a domain.

    Bad input (a malformed folder, a wrong subfolder) is refused before anything is written; a first
    load on a new node reads its headers directly and later workers find the domain.
    """
    if not runtime.config.resolved_root.is_dir():
        return None
    return node_digest_cache(runtime)


def never_identified_here(source: PreparedWeightSource, runtime: HostWeightRuntime) -> bool:
    """Whether no worker of this node ever built an identity from some checkpoint file: then no artifact of it
    exists here (every build and import first identifies its sources, which marks them in the digest cache).

    Without a usable digest cache, or in a domain whose artifacts predate the marks, only a file whose content
    id needs hashing counts (a hub blob name is free).
    """
    cache = node_digest_cache(runtime)
    content_ids = [free_content_id(path, cache) for path in source.weight_files]
    known = [content_id for content_id in content_ids if content_id is not None]
    if len(known) < len(content_ids):
        return True  # a file that needs hashing was never hashed here, so never identified
    return bool(cache is not None and cache.any_unseen(known))

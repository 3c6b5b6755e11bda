"""What a weight source is: the checkpoint files one load reads, where they came from, and their prefix."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from .contracts import ImplementationIdentity

MAX_LISTED = 10
"""How many file or tensor names an error message lists before it says '...'."""


class WeightSourceKind(str, enum.Enum):
    """Where the checkpoint files came from (a local folder or the local Hugging Face cache)."""

    HUGGING_FACE_HUB = "hugging_face_hub"
    LOCAL_PATH = "local_path"


def relative_parts(value: str, what: str) -> tuple[str, ...]:
    """Split a relative POSIX path, refusing absolute paths, `..`, and non-normal spellings."""
    parts = PurePosixPath(value).parts
    if not value or value.startswith("/") or ".." in parts or "/".join(parts) != value:
        raise ValueError(
            f"{what} must be a normalised relative path such as 'transformer' (no leading '/', no '..', "
            f"no '.', no trailing or doubled '/'), got {value!r}"
        )
    return parts


@dataclass(frozen=True, slots=True)
class RecordedWeightFile:
    """A weight file a remote's name index describes instead of this node's disk: where it would be, its size,
    content id and the tensor names its header lists."""

    path: Path
    size: int
    content_id: str
    tensor_names: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class RecordedCheckpoint:
    """The checkpoint of a load by name: files the node does not hold, and the key the index gave for them.

    The key is recomputed from these records and the node's own skeleton; it must equal `index_key`.
    """

    files: tuple[RecordedWeightFile, ...]
    index_key: str
    index_name: str
    remote: str


@dataclass(frozen=True, slots=True)
class PreparedWeightSource:
    """Canonical source files and adapter ABI selected by the ordinary loader."""

    model_or_path: str
    requested_revision: str | None
    resolved_root: Path
    subfolder: str | None
    prefix: str
    weight_files: tuple[Path, ...]
    use_safetensors: bool
    source_kind: WeightSourceKind = WeightSourceKind.LOCAL_PATH
    checkpoint_adapter: ImplementationIdentity | None = None
    recorded: RecordedCheckpoint | None = None
    """Set for a load by name: the weight files are not on this node (nothing to read, hash or re-check)."""

    def __post_init__(self) -> None:
        if type(self.model_or_path) is not str or not self.model_or_path:
            raise ValueError("PreparedWeightSource.model_or_path must be a non-empty str (a folder or 'org/name')")
        if self.requested_revision is not None and (
            type(self.requested_revision) is not str or not self.requested_revision
        ):
            raise ValueError("PreparedWeightSource.requested_revision must be None or a non-empty str")
        if not isinstance(self.resolved_root, Path) or not self.resolved_root.is_absolute():
            raise ValueError(
                f"PreparedWeightSource.resolved_root must be an absolute Path, got {self.resolved_root!r}; "
                f"use prepare_weight_source(...) or Path(...).absolute()"
            )
        if self.subfolder is not None:
            if type(self.subfolder) is not str:
                raise ValueError("PreparedWeightSource.subfolder must be None or a str")
            parts = relative_parts(self.subfolder, "PreparedWeightSource.subfolder")
            if self.resolved_root.parts[-len(parts) :] != parts:
                raise ValueError(
                    f"PreparedWeightSource.resolved_root {self.resolved_root} must end with its subfolder "
                    f"{self.subfolder!r}"
                )
        if type(self.prefix) is not str:
            raise ValueError("PreparedWeightSource.prefix must be a str")
        if self.prefix and (not self.prefix.endswith(".") or self.prefix.startswith(".") or ".." in self.prefix):
            raise ValueError(
                f"PreparedWeightSource.prefix must be '' or dotted names ending in '.', such as 'transformer.'; "
                f"got {self.prefix!r}"
            )
        self._check_weight_files()
        if type(self.use_safetensors) is not bool:
            raise ValueError("PreparedWeightSource.use_safetensors must be a bool")
        if self.use_safetensors and any(path.suffix != ".safetensors" for path in self.weight_files):
            raise ValueError(
                "PreparedWeightSource.use_safetensors is True but not every weight file ends in .safetensors; "
                "set use_safetensors=False for .bin checkpoints"
            )
        if not isinstance(self.source_kind, WeightSourceKind):
            raise ValueError("PreparedWeightSource.source_kind must be a WeightSourceKind")
        if self.checkpoint_adapter is not None and not isinstance(self.checkpoint_adapter, ImplementationIdentity):
            raise ValueError("PreparedWeightSource.checkpoint_adapter must be None or an ImplementationIdentity")
        if self.recorded is not None and (
            not isinstance(self.recorded, RecordedCheckpoint)
            or tuple(file.path for file in self.recorded.files) != self.weight_files
        ):
            raise ValueError("PreparedWeightSource.recorded must be a RecordedCheckpoint listing weight_files in order")

    def _check_weight_files(self) -> None:
        files = self.weight_files
        if type(files) is not tuple or not files:
            raise ValueError("PreparedWeightSource.weight_files must be a non-empty tuple of Paths")
        for path in files:
            if not isinstance(path, Path) or not path.is_absolute() or ".." in path.parts:
                raise ValueError(
                    f"PreparedWeightSource.weight_files must hold absolute Paths without '..', got {path!r}"
                )
            if path == self.resolved_root or not path.is_relative_to(self.resolved_root):
                raise ValueError(f"weight file {path} is not inside the source's resolved_root {self.resolved_root}")
        if tuple(sorted(set(files))) != files:
            raise ValueError("PreparedWeightSource.weight_files must be sorted and free of duplicates")

    def relative_name(self, path: Path) -> str:
        """The file's name below `resolved_root`, which enters the fingerprint instead of the absolute path."""
        return path.relative_to(self.resolved_root).as_posix()


def resolved_revision(source: PreparedWeightSource) -> str | None:
    """The snapshot (commit) a hub source resolved to; None for local folders."""
    if source.source_kind is not WeightSourceKind.HUGGING_FACE_HUB:
        return None
    snapshot = source.resolved_root
    if source.subfolder is not None:
        depth = len(PurePosixPath(source.subfolder).parts)
        if len(snapshot.parts) <= depth:
            return None
        snapshot = snapshot.parents[depth - 1]
    if snapshot.parent.name != "snapshots":
        return None
    return snapshot.name

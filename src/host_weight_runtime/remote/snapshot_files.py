"""The non-weight files of a named snapshot on the remote, so a node without the checkpoint can build skeletons.

A load by name needs what a checkpoint folder holds besides its weights: each component's
`config.json` (the skeleton and the key's config fingerprint), the pipeline's `model_index.json`,
and the scheduler, tokenizer and processor files diffusers assembles a pipeline from. `push`
records them once per repo id and pinned revision::

    <url>/names/<org>/<repo>/<revision>/-files.json     path -> sha256, size (SnapshotFiles)
    <url>/name-files/sha256/<hex>                        each file's bytes, stored by content

A reader checks every file's SHA-256 against the list before using it. Weight files (by suffix)
never travel this way: their bytes are the artifact. A file over `MAX_FILE_BYTES` is left out.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path

from ..canonical_json import CanonicalJson, JsonValue
from ._location import RemoteLocation, remote_failed
from .names import NAME_INDEX_FOLDER, ArtifactName, CheckpointFileRecord

__all__ = [
    "MAX_FILE_BYTES",
    "SnapshotFile",
    "SnapshotFiles",
    "checkpoint_records",
    "local_snapshot_of",
    "publish_snapshot_files",
    "read_snapshot_file",
    "read_snapshot_files",
    "snapshot_files_in",
]

MAX_FILE_BYTES = 64 * 2**20
"""The largest non-weight file recorded (a big tokenizer.json is a few MiB)."""
_MAX_FILES = 2048
_MAX_LIST_BYTES = 4 * 2**20
_MAX_HEADER_BYTES = 100 * 2**20
_SCHEMA = "hwr-snapshot-files-v1"
_FILES_FOLDER = "name-files"
_WEIGHT_SUFFIXES = (
    ".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".onnx", ".onnx_data", ".msgpack", ".h5", ".pb",
)  # fmt: skip
_RELATIVE = re.compile(r"[A-Za-z0-9_.][A-Za-z0-9._-]{0,127}(?:/[A-Za-z0-9_.][A-Za-z0-9._-]{0,127}){0,7}")
_HEX64 = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True, slots=True)
class SnapshotFile:
    """One non-weight file: its path inside the snapshot, SHA-256 and size."""

    path: str
    sha256: str
    size: int

    @property
    def object_path(self) -> str:
        return f"{_FILES_FOLDER}/sha256/{self.sha256}"


@dataclass(frozen=True, slots=True)
class SnapshotFiles:
    """The non-weight files of one repo id at one pinned revision."""

    repo_id: str
    revision: str
    files: tuple[SnapshotFile, ...]

    @staticmethod
    def object_path_for(repo_id: str, revision: str) -> str:
        return f"{NAME_INDEX_FOLDER}/{repo_id}/{revision}/-files.json"

    def to_bytes(self) -> bytes:
        listed: list[JsonValue] = [{"path": f.path, "sha256": f.sha256, "size": f.size} for f in self.files]
        return CanonicalJson.from_value(
            {"schema": _SCHEMA, "repo_id": self.repo_id, "revision": self.revision, "files": listed}
        ).data

    @classmethod
    def from_bytes(cls, data: bytes) -> SnapshotFiles:
        """Parse the list; ValueError for anything but this schema with safe relative paths."""
        value = CanonicalJson(bytes(data)).to_value()
        if not isinstance(value, dict) or value.get("schema") != _SCHEMA:
            raise ValueError(f"not a {_SCHEMA} object")
        if set(value) != {"schema", "repo_id", "revision", "files"}:
            raise ValueError("unexpected or missing fields")
        listed, repo_id, revision = value["files"], value["repo_id"], value["revision"]
        if type(repo_id) is not str or type(revision) is not str:
            raise ValueError("mistyped repo id or revision")
        if not isinstance(listed, list) or len(listed) > _MAX_FILES:
            raise ValueError("files is not a list (or too long)")
        files = []
        for item in listed:
            if not isinstance(item, dict) or set(item) != {"path", "sha256", "size"}:
                raise ValueError("a malformed file entry")
            path, sha256, size = item["path"], item["sha256"], item["size"]
            if type(path) is not str or not _RELATIVE.fullmatch(path) or ".." in path.split("/"):
                raise ValueError(f"{str(path)[:80]!r} is not a safe relative path")
            if path.endswith(_WEIGHT_SUFFIXES):  # weights come only as a verified artifact, never this way
                raise ValueError(f"{path[:80]!r} is a weight file")
            if type(sha256) is not str or not _HEX64.fullmatch(sha256):
                raise ValueError("a file's sha256 is not 64 lowercase hex digits")
            if type(size) is not int or not 0 <= size <= MAX_FILE_BYTES:
                raise ValueError("a file's size is out of range")
            files.append(SnapshotFile(path, sha256, size))
        if len({file.path for file in files}) != len(files):
            raise ValueError("a path is listed twice")
        return cls(repo_id, revision, tuple(files))


def local_snapshot_of(name: ArtifactName, built_from: JsonValue) -> Path | None:
    """The Hugging Face cache snapshot this node built the named artifact from, if it is still here."""
    sources = built_from.get("sources") if isinstance(built_from, dict) else None
    if not isinstance(sources, list) or len(sources) != 1 or not isinstance(sources[0], dict):
        return None
    path = sources[0].get("path")
    if type(path) is not str:
        return None
    snapshot = Path(path)
    for _part in (name.component or "").split("/") if name.component else ():
        snapshot = snapshot.parent
    if snapshot.name != name.revision or snapshot.parent.name != "snapshots" or not snapshot.is_dir():
        return None
    return snapshot


def snapshot_files_in(snapshot: Path) -> dict[str, Path]:
    """Every non-weight file of a snapshot (relative path -> path), links followed, large files left out."""
    found: dict[str, Path] = {}
    for folder, folders, names in os.walk(snapshot, followlinks=False):
        folders[:] = sorted(entry for entry in folders if not entry.startswith("."))
        for entry in sorted(names):
            path = Path(folder) / entry
            relative = path.relative_to(snapshot).as_posix()
            if entry.startswith(".") or entry.endswith(_WEIGHT_SUFFIXES) or not _RELATIVE.fullmatch(relative):
                continue
            try:
                if path.is_file() and path.stat().st_size <= MAX_FILE_BYTES:
                    found[relative] = path
            except OSError:
                continue
            if len(found) >= _MAX_FILES:
                return found
    return found


def _tensor_names(path: Path) -> tuple[str, ...] | None:
    """The tensor names a safetensors file's header lists; None when it is not a readable safetensors file."""
    try:
        with open(path, "rb") as stream:
            head = stream.read(8)
            if len(head) != 8:
                return None
            (length,) = struct.unpack("<Q", head)
            if not 0 < length <= _MAX_HEADER_BYTES:
                return None
            header = json.loads(stream.read(length))
    except (OSError, ValueError):
        return None
    if not isinstance(header, dict):
        return None
    return tuple(name for name in header if name != "__metadata__")


def checkpoint_records(
    snapshot: Path, name: ArtifactName, source_metadata: JsonValue
) -> tuple[CheckpointFileRecord, ...]:
    """The weight files the identity lists, each with the tensor names its header holds; () when a file is
    missing here, has another size, or is not safetensors (then a load by name cannot build the skeleton)."""
    sources = source_metadata.get("sources") if isinstance(source_metadata, dict) else None
    if not isinstance(sources, list) or len(sources) != 1 or not isinstance(sources[0], dict):
        return ()
    files = sources[0].get("files")
    folder = snapshot.joinpath(*name.component.split("/")) if name.component else snapshot
    records: list[CheckpointFileRecord] = []
    for entry in files if isinstance(files, list) else ():
        if not isinstance(entry, dict):
            return ()
        relative, size, content_id = entry.get("name"), entry.get("size"), entry.get("content_id")
        if type(relative) is not str or type(size) is not int or type(content_id) is not str:
            return ()
        path = folder / relative
        try:
            if path.stat().st_size != size:
                return ()
        except OSError:
            return ()
        names = _tensor_names(path)
        if names is None:
            return ()
        records.append(CheckpointFileRecord(relative, size, content_id, names))
    return tuple(records)


def read_snapshot_files(location: RemoteLocation, repo_id: str, revision: str) -> SnapshotFiles | None:
    """The remote's file list for a repo id at a revision; None when it has none; a malformed one is typed."""
    relative = SnapshotFiles.object_path_for(repo_id, revision)
    size = location.size_of(relative)
    if size is None:
        return None
    try:
        if not 0 < size <= _MAX_LIST_BYTES:
            raise ValueError(f"{size} bytes")
        listed = SnapshotFiles.from_bytes(location.read(relative))
        if (listed.repo_id, listed.revision) != (repo_id, revision):
            raise ValueError("it names another repo id or revision")
    except ValueError as exc:
        raise remote_failed(
            f"the file list of {repo_id}@{revision} at {location.name} is invalid ({exc}); push the artifact again",
            retryable=False,
            provider_id=location.name,
            object=relative,
        ) from None
    return listed


def read_snapshot_file(location: RemoteLocation, file: SnapshotFile) -> bytes:
    """One listed file's bytes, checked against its SHA-256 and size (REMOTE_FAILED, non-retryable, if not)."""
    data = location.read(file.object_path)
    if len(data) != file.size or hashlib.sha256(data).hexdigest() != file.sha256:
        raise remote_failed(
            f"{file.path} from {location.name} does not match its recorded SHA-256 and size; push the artifact again",
            retryable=False,
            provider_id=location.name,
            object=file.object_path,
        )
    return data


def publish_snapshot_files(location: RemoteLocation, repo_id: str, revision: str, snapshot: Path) -> None:
    """Upload the snapshot's non-weight files (each once, by content), then the list (merged with the remote's)."""
    listed: dict[str, SnapshotFile] = {}
    current = read_snapshot_files(location, repo_id, revision)
    if current is not None:
        listed.update((file.path, file) for file in current.files)
    for relative, path in snapshot_files_in(snapshot).items():
        try:
            data = path.read_bytes()
        except OSError:
            continue
        file = SnapshotFile(relative, hashlib.sha256(data).hexdigest(), len(data))
        if location.size_of(file.object_path) != file.size:
            location.write(file.object_path, data)
        listed[relative] = file
    merged = SnapshotFiles(repo_id, revision, tuple(listed[path] for path in sorted(listed)))
    if current is None or current.files != merged.files:
        location.write(SnapshotFiles.object_path_for(repo_id, revision), merged.to_bytes())

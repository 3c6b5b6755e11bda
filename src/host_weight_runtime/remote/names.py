"""A remote's name index: which artifact key a model name maps to, so a node without the checkpoint can pull it.

A node that never downloaded a model cannot compute its key (the key follows the
checkpoint's content). `push` therefore records, next to the artifacts, one small object
per name a published artifact was built from::

    <url>/names/<org>/<repo>/<revision>/<component>/<variant>/<dtype>.json             one artifact (TP=1)
    <url>/names/<org>/<repo>/<revision>/<component>/<variant>/<dtype>/tp<N>/<part>.json  a TP=N part
         component: the checkpoint subfolder ("-" for the repo root); variant: "-" for none;
         dtype: the representation's (bfloat16, float16, float32, float8_e4m3fn for FP8);
         part: "replicated" (one per TP size) or "shard-<rank>"

holding the key, the identity's representation and, when the pushing node still held the
snapshot, the checkpoint files the key was computed from (`NameIndexEntry.checkpoint`: name,
size, content id, tensor names), which a load by name needs to recompute the key and bind the
skeleton (the snapshot's configs travel beside it: `snapshot_files`). Names come from the
artifact's manifest (`format_metadata.built_from`: the repo id and the commit a Hugging Face
cache snapshot resolved to) and its identity's layout (the TP size and part); an artifact built
from a local folder, or a layout no load asks for by name (a TP rank stored whole, sequence
parallel), has no name and is not indexed.

Trust. Like a registry's tag -> digest, the index is the one thing a pulling node takes on
the remote's word: whoever can write the remote decides which key a name means. Everything
after that is verified as for any import (the descriptor's identity must carry that key, every
byte must hash to the manifest). Pinned revisions (40-hex commit hashes) are the default so a
name means one checkpoint; a name lookup is only ever used where no checkpoint is present (a
present checkpoint always computes its own key), and the entry is rewritten by the latest push.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..canonical_json import CanonicalJson, JsonValue
from ..failures import usage_error

__all__ = [
    "NAME_INDEX_FOLDER",
    "ArtifactName",
    "CheckpointFileRecord",
    "NameIndexEntry",
    "is_pinned_revision",
    "name_of_manifest_metadata",
    "tensor_parallel_names",
]

NAME_INDEX_FOLDER = "names"
_FIRST_ENTRY_SCHEMA = "hwr-name-index-v1"
_ENTRY_SCHEMA = "hwr-name-index-v2"
_MAX_CHECKPOINT_FILES = 4096
_RELATIVE_FILE = re.compile(r"[A-Za-z0-9_.][A-Za-z0-9._/-]{0,255}")
_CONTENT_ID = re.compile(r"sha256:[0-9a-f]{64}|hub-blob:[0-9a-f]{40}")
_PART = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}")
_SUBFOLDER_PART = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,95}")
_PINNED = re.compile(r"[0-9a-f]{40}")
_DTYPE = re.compile(r"[a-z0-9_]{2,32}")
_TP_PART = re.compile(r"replicated|shard-(0|[1-9][0-9]{0,3})")
_MAX_TP_SIZE = 4096
_NONE = "-"
_LAYOUT_FIELDS = frozenset({"tensor_parallel_size", "part"})


def is_pinned_revision(revision: str) -> bool:
    """A commit hash (40 lowercase hex digits): the only revision that names one checkpoint for good."""
    return bool(_PINNED.fullmatch(revision))


@dataclass(frozen=True, slots=True)
class ArtifactName:
    """What a person calls an artifact: repo id, revision, component subfolder, variant and dtype; for a
    tensor-parallel part also the TP size and the part (`replicated`, or `shard-<rank>`)."""

    repo_id: str
    revision: str
    component: str | None = None
    variant: str | None = None
    dtype: str = "bfloat16"
    tensor_parallel_size: int = 1
    part: str | None = None

    def __post_init__(self) -> None:
        parts = self.repo_id.split("/") if type(self.repo_id) is str else []
        if len(parts) != 2 or not all(_PART.fullmatch(part) for part in parts):
            raise usage_error(f"a repo id looks like org/name (letters, digits, . _ -), got {self.repo_id!r:.80}")
        if type(self.revision) is not str or not _PART.fullmatch(self.revision):
            raise usage_error(f"a revision is a branch, tag or 40-hex commit hash, got {self.revision!r:.80}")
        if self.component is not None and (
            type(self.component) is not str
            or not all(_SUBFOLDER_PART.fullmatch(part) for part in self.component.split("/"))
        ):
            raise usage_error(f"a subfolder is a relative folder name such as transformer, got {self.component!r:.80}")
        if self.variant is not None and (type(self.variant) is not str or not _PART.fullmatch(self.variant)):
            raise usage_error(f"a variant is a short name such as fp16, got {self.variant!r:.80}")
        dtype = self.dtype.removeprefix("torch.") if type(self.dtype) is str else ""
        if not _DTYPE.fullmatch(dtype):
            raise usage_error(f"a dtype is a torch dtype name such as bfloat16, got {self.dtype!r:.80}")
        object.__setattr__(self, "dtype", dtype)
        self._check_layout()

    def _check_layout(self) -> None:
        size, part = self.tensor_parallel_size, self.part
        if type(size) is not int or not 1 <= size <= _MAX_TP_SIZE:
            raise usage_error(f"a tensor-parallel size is an int from 1 to {_MAX_TP_SIZE}, got {size!r:.80}")
        if size == 1 and part is None:
            return
        if size == 1 or part is None or type(part) is not str or not _TP_PART.fullmatch(part):
            raise usage_error(
                "a tensor-parallel name (size >= 2) names its part, 'replicated' or 'shard-<rank>', and a TP=1 "
                f"name none; got size {size} and part {part!r:.80}"
            )
        if part != "replicated" and int(part.removeprefix("shard-")) >= size:
            raise usage_error(f"{part} is not a rank of tensor-parallel size {size}")

    @classmethod
    def shard_part(cls, rank: int) -> str:
        """The part name of rank `rank`'s shard."""
        return f"shard-{rank}"

    @property
    def pinned(self) -> bool:
        return is_pinned_revision(self.revision)

    def object_path(self) -> str:
        """The index object's path relative to the remote root."""
        component = (self.component or _NONE).replace("/", "--")
        folder = [NAME_INDEX_FOLDER, self.repo_id, self.revision, component, self.variant or _NONE]
        if self.part is None:
            return "/".join([*folder, f"{self.dtype}.json"])
        return "/".join([*folder, self.dtype, f"tp{self.tensor_parallel_size}", f"{self.part}.json"])

    def to_dict(self) -> dict[str, JsonValue]:
        """The name's fields; the layout fields only for a TP part, so a TP=1 entry reads as it always did."""
        value: dict[str, JsonValue] = {
            "repo_id": self.repo_id,
            "revision": self.revision,
            "component": self.component,
            "variant": self.variant,
            "dtype": self.dtype,
        }
        if self.part is not None:
            value.update(tensor_parallel_size=self.tensor_parallel_size, part=self.part)
        return value

    @classmethod
    def from_dict(cls, value: JsonValue) -> ArtifactName:
        """A name as `to_dict` writes it; ValueError (a usage error) for any other shape."""
        fields = {"repo_id", "revision", "component", "variant", "dtype"}
        if not isinstance(value, dict) or set(value) not in (fields, fields | _LAYOUT_FIELDS):
            raise ValueError("a malformed name")
        size = value.get("tensor_parallel_size", 1)
        part = value.get("part")
        return cls(
            repo_id=str(value["repo_id"]),
            revision=str(value["revision"]),
            component=None if value["component"] is None else str(value["component"]),
            variant=None if value["variant"] is None else str(value["variant"]),
            dtype=str(value["dtype"]),
            tensor_parallel_size=size if type(size) is int else -1,
            part=None if part is None else str(part),
        )

    def __str__(self) -> str:
        text = f"{self.repo_id}@{self.revision}"
        if self.component:
            text += f" {self.component}"
        if self.variant:
            text += f" variant {self.variant}"
        text += f" {self.dtype}"
        if self.part is not None:
            text += f" tp{self.tensor_parallel_size} {self.part}"
        return text


@dataclass(frozen=True, slots=True)
class CheckpointFileRecord:
    """One weight file the artifact was built from, as the key saw it: name in the component folder, size,
    content id, and the tensor names its safetensors header lists (what a skeleton binds without the file)."""

    name: str
    size: int
    content_id: str
    tensor_names: tuple[str, ...]

    def to_dict(self) -> dict[str, JsonValue]:
        return {
            "name": self.name,
            "size": self.size,
            "content_id": self.content_id,
            "tensor_names": list[JsonValue](self.tensor_names),
        }

    @classmethod
    def from_value(cls, value: JsonValue) -> CheckpointFileRecord:
        if not isinstance(value, dict) or set(value) != {"name", "size", "content_id", "tensor_names"}:
            raise ValueError("a malformed checkpoint file record")
        name, size, content_id, names = value["name"], value["size"], value["content_id"], value["tensor_names"]
        if type(name) is not str or not _RELATIVE_FILE.fullmatch(name) or ".." in name.split("/"):
            raise ValueError("a checkpoint file name is not a relative file name")
        if type(size) is not int or size < 0 or type(content_id) is not str or not _CONTENT_ID.fullmatch(content_id):
            raise ValueError("a checkpoint file's size or content id is mistyped")
        if not isinstance(names, list) or not all(type(item) is str and item for item in names):
            raise ValueError("a checkpoint file's tensor names are not a list of names")
        return cls(name, size, content_id, tuple(str(item) for item in names))


@dataclass(frozen=True, slots=True)
class NameIndexEntry:
    """One index object: the name, the key it maps to, what the key's artifact is, and what a load needs.

    `checkpoint` lists the weight files the key was computed from (empty when the pushing node did
    not hold them: such an entry serves `hwr pull`, not a load by name).
    """

    name: ArtifactName
    key: str
    representation: str
    content_sha256: str
    uploaded_at_ns: int
    checkpoint: tuple[CheckpointFileRecord, ...] = ()

    def to_bytes(self) -> bytes:
        return CanonicalJson.from_value(
            {
                "schema": _ENTRY_SCHEMA,
                "name": self.name.to_dict(),
                "key": self.key,
                "representation": self.representation,
                "content_sha256": self.content_sha256,
                "uploaded_at_ns": self.uploaded_at_ns,
                "checkpoint": [record.to_dict() for record in self.checkpoint],
            }
        ).data

    def same_target(self, other: NameIndexEntry) -> bool:
        """Whether two entries say the same thing (the upload time aside)."""
        return (self.name, self.key, self.representation, self.content_sha256, self.checkpoint) == (
            other.name,
            other.key,
            other.representation,
            other.content_sha256,
            other.checkpoint,
        )

    @classmethod
    def from_bytes(cls, data: bytes) -> NameIndexEntry:
        """Parse an index object (this schema, or the first one without `checkpoint`); ValueError otherwise."""
        value = CanonicalJson(bytes(data)).to_value()
        if not isinstance(value, dict) or value.get("schema") not in (_ENTRY_SCHEMA, _FIRST_ENTRY_SCHEMA):
            raise ValueError(f"not a {_ENTRY_SCHEMA} object")
        fields = {"schema", "name", "key", "representation", "content_sha256", "uploaded_at_ns"}
        if value["schema"] == _ENTRY_SCHEMA:
            fields.add("checkpoint")
        if set(value) != fields:
            raise ValueError("unexpected or missing fields")
        name, key, representation = value["name"], value["key"], value["representation"]
        content, uploaded = value["content_sha256"], value["uploaded_at_ns"]
        listed = value.get("checkpoint", [])
        if type(key) is not str or not re.fullmatch(r"[0-9a-f]{64}", key):
            raise ValueError("the key is not 64 lowercase hex digits")
        if type(representation) is not str or type(content) is not str or type(uploaded) is not int:
            raise ValueError("mistyped fields")
        if not isinstance(listed, list) or len(listed) > _MAX_CHECKPOINT_FILES:
            raise ValueError("the checkpoint is not a list of files")
        parsed = ArtifactName.from_dict(name)
        checkpoint = tuple(CheckpointFileRecord.from_value(item) for item in listed)
        return cls(parsed, key, representation, content, uploaded, checkpoint)


def tensor_parallel_names(name: ArtifactName, size: int) -> tuple[ArtifactName, ...]:
    """Every part a TP=`size` load of `name` (a TP=1 name) reads: the replicated part, then each rank's shard."""
    if name.part is not None:
        raise usage_error(f"{name} already names one part; give the name of the whole artifact")
    parts = ["replicated", *(ArtifactName.shard_part(rank) for rank in range(size))] if size > 1 else [None]
    return tuple(
        ArtifactName(name.repo_id, name.revision, name.component, name.variant, name.dtype, size, part)
        for part in parts
    )


# diffusers' weight file names: `<base>[.<variant>][-00001-of-00002].safetensors` (or .bin).
_WEIGHT_FILE = re.compile(
    r"(?:diffusion_pytorch_model|model|pytorch_model)(?:\.(?P<variant>[A-Za-z0-9_]+))?(?:-\d{5}-of-\d{5})?"
    r"\.(?:safetensors|bin)"
)


def _file_names(source_metadata: JsonValue) -> list[str] | None:
    """The weight file names an identity's source metadata lists, or None when it lists them in another shape."""
    sources = source_metadata.get("sources") if isinstance(source_metadata, dict) else None
    if not isinstance(sources, list):
        return None
    names: list[str] = []
    for source in sources:
        files = source.get("files") if isinstance(source, dict) else None
        if not isinstance(files, list):
            return None
        for entry in files:
            name = entry.get("name") if isinstance(entry, dict) else None
            if type(name) is not str:
                return None
            names.append(name)
    return names


def _variant_of(source_metadata: JsonValue) -> tuple[bool, str | None]:
    """(known, variant): the weights variant the source files spell (None: the default files). Not known when
    they do not say one variant unambiguously; then the artifact gets no name rather than a wrong one."""
    names = _file_names(source_metadata)
    if not names:
        return False, None
    variants: set[str | None] = set()
    for name in names:
        match = _WEIGHT_FILE.fullmatch(name.rsplit("/", 1)[-1])
        if match is None:
            return False, None
        variants.add(match.group("variant"))
    if len(variants) != 1:
        return False, None
    return True, variants.pop()


def _layout_of(layout: JsonValue) -> tuple[int, str | None] | None:
    """(TP size, part) of an identity's layout: (1, None) for one whole artifact, the part of a TP rank's
    layout (its `part` metadata, as the adapter writes it); None for a layout no load asks for by name."""
    if layout is None:
        return 1, None
    if not isinstance(layout, dict) or layout.get("sequence_parallel_size") != 1:
        return None
    size, rank = layout.get("tensor_parallel_size"), layout.get("tensor_parallel_rank")
    metadata = layout.get("metadata")
    part = metadata.get("part") if isinstance(metadata, dict) else None
    if type(size) is not int or type(rank) is not int:
        return None
    if size == 1 and part is None:
        return 1, None
    kind = part.get("kind") if isinstance(part, dict) else None
    if size < 2 or kind not in ("replicated", "shard"):
        return None  # a TP rank stored whole (no part) is not what a rank loads
    return size, "replicated" if kind == "replicated" else ArtifactName.shard_part(rank)


def name_of_manifest_metadata(
    format_metadata: JsonValue, dtype: str, source_metadata: JsonValue = None, layout: JsonValue = None
) -> ArtifactName | None:
    """The name an artifact was built from, when its manifest says it came from one pinned hub snapshot.

    The variant comes from the source file names the identity lists (`*.fp16.safetensors`); files
    that do not say one variant unambiguously leave the artifact unnamed. `layout` (the identity's
    layout as a dict) adds the TP size and part of a tensor-parallel part; None means one artifact.
    """
    tensor_parallel = _layout_of(layout)
    if tensor_parallel is None:
        return None
    built_from = format_metadata.get("built_from") if isinstance(format_metadata, dict) else None
    if not isinstance(built_from, dict):
        return None
    repo_id = built_from.get("model_id")
    sources = built_from.get("sources")
    if type(repo_id) is not str or not isinstance(sources, list) or not sources:
        return None
    revisions = {source.get("revision") for source in sources if isinstance(source, dict)}
    subfolders = {source.get("subfolder") for source in sources if isinstance(source, dict)}
    if len(revisions) != 1 or len(subfolders) != 1:
        return None
    [revision], [subfolder] = revisions, subfolders
    known, variant = _variant_of(source_metadata)
    if type(revision) is not str or not is_pinned_revision(revision) or not known:
        return None
    try:
        return ArtifactName(
            repo_id=repo_id,
            revision=revision,
            component=subfolder if type(subfolder) is str else None,
            variant=variant,
            dtype=dtype,
            tensor_parallel_size=tensor_parallel[0],
            part=tensor_parallel[1],
        )
    except ValueError:
        return None

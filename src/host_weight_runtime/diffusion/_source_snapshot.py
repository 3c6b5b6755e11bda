"""Snapshotting the sources: every file's state and content id, the fingerprint over them, and the re-check (D11)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from .._digest import default_hash_threads
from ..canonical_json import JsonValue, canonical_sha256
from ..failures import FailureCode, HostWeightError, ResolutionStage, raise_failure
from ._digest_cache import NodeSourceDigestCache
from ._file_state import FileState, check_state, hash_file, stat_source
from ._hub_snapshot import hub_blob_content_id
from ._weight_source import MAX_LISTED, PreparedWeightSource

SOURCES_SCHEMA = "hwr-final-layout-sources-v2"
_HEX64 = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True, slots=True)
class SourceFileRecord:
    """One weight file as it was when the identity was computed."""

    source_index: int
    path: Path
    relative_name: str
    state: FileState
    content_id: str

    def __post_init__(self) -> None:
        if type(self.source_index) is not int or self.source_index < 0:
            raise ValueError("SourceFileRecord.source_index must be an int >= 0")
        if not isinstance(self.path, Path) or not isinstance(self.state, FileState):
            raise ValueError("SourceFileRecord.path must be a Path and state a FileState")
        if type(self.relative_name) is not str or not self.relative_name:
            raise ValueError("SourceFileRecord.relative_name must be a non-empty str")
        if type(self.content_id) is not str or not self.content_id.startswith(("sha256:", "hub-blob:")):
            raise ValueError("SourceFileRecord.content_id must be 'sha256:<hex>' or 'hub-blob:<name>'")


def key_content_id(content_id: str) -> str:
    """The content id as the key spells it: a 64-hex hub blob name is the file's SHA-256, so one spelling.

    huggingface_hub names an LFS blob by the SHA-256 of its bytes, so a cached snapshot and a
    plain copy of it share a key. A 40-hex (git SHA-1) blob, a small file kept in git, stays
    `hub-blob:<name>`: its SHA-256 is unknown without reading it.
    """
    name = content_id.removeprefix("hub-blob:")
    return f"sha256:{name}" if name != content_id and _HEX64.fullmatch(name) else content_id


def sources_document(
    sources: Sequence[PreparedWeightSource], files: Sequence[SourceFileRecord]
) -> dict[str, JsonValue]:
    """What identifies the sources: content, never where it was read from (D05).

    Per source: the prefix (the component the tensors belong to), the checkpoint format and
    adapter, and each file's name inside the component folder (which tensors come from which
    shard), content id and size. No model id, revision, path, subfolder spelling, source kind
    or stat fact: the same bytes reached through a repo id, a snapshot folder, a copy or
    another mount are one source.
    """
    documents: list[JsonValue] = []
    for index, source in enumerate(sources):
        adapter: dict[str, JsonValue] | None = None
        if source.checkpoint_adapter is not None:
            adapter = {**source.checkpoint_adapter.to_dict()}
        listed: list[JsonValue] = [
            {"name": record.relative_name, "content_id": key_content_id(record.content_id), "size": record.state.size}
            for record in files
            if record.source_index == index
        ]
        documents.append(
            {
                "prefix": source.prefix,
                "use_safetensors": source.use_safetensors,
                "checkpoint_adapter": adapter,
                "files": listed,
            }
        )
    return {"schema": SOURCES_SCHEMA, "sources": documents}


@dataclass(frozen=True, slots=True)
class FinalLayoutSourceContext:
    """The sources' content ids and stat states at identity time, to re-check before publish or restore."""

    sources: tuple[PreparedWeightSource, ...]
    files: tuple[SourceFileRecord, ...]
    fingerprint: str

    def __post_init__(self) -> None:
        if type(self.sources) is not tuple or not self.sources:
            raise ValueError("FinalLayoutSourceContext.sources must be a non-empty tuple")
        if type(self.files) is not tuple or not all(isinstance(record, SourceFileRecord) for record in self.files):
            raise ValueError("FinalLayoutSourceContext.files must be a tuple of SourceFileRecord")
        if type(self.fingerprint) is not str or not _HEX64.fullmatch(self.fingerprint):
            raise ValueError("FinalLayoutSourceContext.fingerprint must be 64 lowercase hex characters")
        if canonical_sha256(self.to_metadata()) != self.fingerprint:
            raise ValueError("FinalLayoutSourceContext.fingerprint does not match its sources; use snapshot_sources")

    def to_metadata(self) -> dict[str, JsonValue]:
        """The document the fingerprint hashes: per source its files' relative names, content ids and sizes."""
        return sources_document(self.sources, self.files)

    def changed_files(self) -> tuple[SourceFileRecord, ...]:
        """Records whose file vanished or no longer has the recorded state (symlinks followed)."""
        changed = []
        for record in self.files:
            if self.sources[record.source_index].recorded is not None:
                continue  # named by a remote's index, never on this node: nothing can change under the load
            try:
                current = FileState.of(record.path)
            except OSError:
                changed.append(record)
                continue
            if current != record.state:
                changed.append(record)
        return tuple(changed)

    def unchanged(self) -> bool:
        return not self.changed_files()

    def ensure_unchanged(self) -> None:
        """Raise CANONICAL_SOURCE_FAILED when any source file changed since the identity was computed."""
        changed = self.changed_files()
        if not changed:
            return
        names = [str(record.path) for record in changed]
        raise raise_failure(
            ResolutionStage.CANONICAL,
            FailureCode.CANONICAL_SOURCE_FAILED,
            f"{len(changed)} weight file(s) changed since the artifact identity was computed: "
            f"{', '.join(names[:MAX_LISTED])}{' ...' if len(names) > MAX_LISTED else ''}. The identity no "
            f"longer describes them, so nothing was published or restored; load the model again (a new identity "
            f"is computed) and do not modify checkpoint files while a load runs",
            retryable=False,
            changed=list[JsonValue](names[:MAX_LISTED]),
            changed_count=len(changed),
        )


def is_content_id_known(path: Path, cache: NodeSourceDigestCache | None) -> bool:
    """Whether the file's content id comes without hashing: a trusted hub blob name, or a cache entry."""
    return free_content_id(path, cache) is not None


def free_content_id(path: Path, cache: NodeSourceDigestCache | None) -> str | None:
    """The file's content id as the key spells it, where it comes without hashing (a trusted hub blob name,
    a cache entry); None where it would need hashing."""
    content_id = hub_blob_content_id(path)
    if content_id is None and cache is not None:
        try:
            state = stat_source(path, "does not exist")
        except HostWeightError:
            return None
        content_id = cache.cached_content_id(path, state)
    return None if content_id is None else key_content_id(content_id)


def _known_content_id(path: Path, cache: NodeSourceDigestCache | None) -> tuple[FileState, str] | None:
    """The file's state and content id when they come without hashing, else None."""
    state = stat_source(path, "does not exist")
    content_id = hub_blob_content_id(path)
    if content_id is None and cache is not None:
        content_id = cache.cached_content_id(path, state)
    if content_id is None:
        return None
    check_state(path, state)
    return state, content_id


def _content_id(path: Path, cache: NodeSourceDigestCache | None) -> tuple[FileState, str]:
    state = stat_source(path, "does not exist")
    content_id = hub_blob_content_id(path)
    if content_id is None:
        content_id = cache.content_id(path, state) if cache is not None else hash_file(path, state)
    check_state(path, state)
    return state, content_id


def _size_or_zero(path: Path) -> int:
    """The file's size for ordering only (a file that cannot be stat'ed fails later, where it is hashed)."""
    try:
        return path.stat().st_size
    except OSError:
        return 0


def snapshot_sources(
    sources: Sequence[PreparedWeightSource],
    *,
    cache: NodeSourceDigestCache | None = None,
    max_workers: int | None = None,
) -> FinalLayoutSourceContext:
    """Record every source file's state and content id (hashed in parallel), and fingerprint them."""
    sources = tuple(sources)
    if not sources:
        raise ValueError("snapshot_sources needs at least one PreparedWeightSource")
    for source in sources:
        if not isinstance(source, PreparedWeightSource):
            raise ValueError(f"snapshot_sources takes PreparedWeightSource values, got {type(source).__name__}")
    if max_workers is not None and (type(max_workers) is not int or max_workers < 1):
        raise ValueError(f"max_workers must be None or an int >= 1, got {max_workers!r}")
    jobs = [(index, path) for index, source in enumerate(sources) for path in source.weight_files]
    recorded = {
        file.path: (FileState(0, 0, file.size, 0, 0), file.content_id)
        for source in sources
        if source.recorded is not None
        for file in source.recorded.files
    }
    # Content ids that need no hashing (recorded by a name index, hub blob names, digest-cache entries) come
    # first, without threads.
    found: list[tuple[FileState, str] | None] = [
        recorded[path] if path in recorded else _known_content_id(path, cache) for _index, path in jobs
    ]
    # Largest files first: the thread that gets the last file finishes soonest after the others.
    to_hash = sorted(
        (position for position, known in enumerate(found) if known is None),
        key=lambda position: -_size_or_zero(jobs[position][1]),
    )
    workers = min(len(to_hash), max_workers if max_workers is not None else default_hash_threads())
    if workers <= 1:
        for position in to_hash:
            found[position] = _content_id(jobs[position][1], cache)
    else:
        pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="hwr-source-hash")
        try:
            futures: dict[int, Future[tuple[FileState, str]]] = {
                position: pool.submit(_content_id, jobs[position][1], cache) for position in to_hash
            }
            for position, future in futures.items():
                found[position] = future.result()
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
    results = [known for known in found if known is not None]
    if len(results) != len(jobs):  # pragma: no cover - every position was filled above
        raise AssertionError("a source file has no content id")
    records = tuple(
        SourceFileRecord(index, path, sources[index].relative_name(path), state, content_id)
        for (index, path), (state, content_id) in zip(jobs, results, strict=True)
    )
    fingerprint = canonical_sha256(sources_document(sources, records))
    if cache is not None:
        # Before any lookup or build under this identity: a content id without a marker has no artifact here.
        cache.record_content_seen(key_content_id(record.content_id) for record in records)
    return FinalLayoutSourceContext(sources, records, fingerprint)

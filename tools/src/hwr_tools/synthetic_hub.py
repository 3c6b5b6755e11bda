"""A folder saved as the huggingface_hub cache lays out a repo, so loads by repo id work offline:

    <cache_dir>/models--<org>--<name>/
    ├── blobs/<sha256 of the content>   one regular file per distinct content
    ├── refs/main                       the revision, 40 hex digits, no newline
    └── snapshots/<revision>/…          relative symlinks into ../../blobs (one more ../ per subfolder)
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

__all__ = ["save_hub_snapshot"]

_REVISION = re.compile(r"[0-9a-f]{40}")
_REPO_PART = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_COPY_CHUNK = 8 * 2**20



def save_hub_snapshot(
    cache_dir: Path, repo_id: str, folder: Path, *, revision: str | None = None, hard_link: bool = False
) -> Path:
    """Copy `folder` into `cache_dir` as the huggingface_hub cache does; returns the snapshot directory.

    `hard_link=True` makes each blob a hard link of its source file instead of a copy (same
    filesystem only): the same bytes, no second copy on disk or in the page cache. Running it
    again with the same content is a no-op; a snapshot path that already links to different
    content raises FileExistsError.
    """
    parts = repo_id.split("/")
    if len(parts) != 2 or not all(_REPO_PART.fullmatch(part) for part in parts):
        raise ValueError(f"repo_id must look like 'org/name', got {repo_id!r}")
    if revision is None:
        revision = hashlib.sha1(repo_id.encode()).hexdigest()
    if not _REVISION.fullmatch(revision):
        raise ValueError(f"revision must be 40 lowercase hex digits (a commit hash), got {revision!r}")
    if not folder.is_dir():
        raise NotADirectoryError(f"{folder} is not a directory: pass a pipeline or model folder")

    repo_dir = cache_dir / f"models--{parts[0]}--{parts[1]}"
    blobs = repo_dir / "blobs"
    snapshot = repo_dir / "snapshots" / revision
    blobs.mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)

    for source in sorted(path for path in folder.rglob("*") if path.is_file()):
        relative = source.relative_to(folder)
        digest = _sha256_file(source)
        blob = blobs / digest
        if not blob.exists():
            if hard_link:
                os.link(source, blob)
            else:
                _copy_to_new_file(source, blob)
        link = snapshot / relative
        link.parent.mkdir(parents=True, exist_ok=True)
        target = Path(*([".."] * (len(relative.parts) + 1)), "blobs", digest)
        if link.is_symlink() and Path(os.readlink(link)) == target:
            continue
        os.symlink(target, link)

    refs = repo_dir / "refs"
    refs.mkdir(exist_ok=True)
    (refs / "main").write_text(revision, encoding="ascii")
    return snapshot


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as stream:
        while chunk := stream.read(_COPY_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _copy_to_new_file(source: Path, destination: Path) -> None:
    """Copy through a unique temporary and rename, so a crashed copy never leaves a blob with the wrong content."""
    temporary = destination.with_name(f".{destination.name}.{os.getpid()}.incomplete")
    with source.open("rb") as reader, temporary.open("xb") as writer:
        while chunk := reader.read(_COPY_CHUNK):
            writer.write(chunk)
    os.rename(temporary, destination)

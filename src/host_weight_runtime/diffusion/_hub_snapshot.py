"""The local Hugging Face cache: finding a repo's snapshot, and trusting a blob name as a content id (D04).

    <cache>/models--<org>--<name>/
      refs/<ref>                                  the commit a ref points at
      blobs/<40 or 64 hex>                        regular file
      snapshots/<revision>/[sub/...]file -> ../../[../...]blobs/<hash>

A blob name is trusted only when every directory on the way is a real directory and
the symlink resolves to that very blob; anything else is content-hashed by the caller.
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path, PurePosixPath

from ..failures import ArgumentHint, FailureCode, HostWeightError, ResolutionStage, hinted_failure
from ._weight_source import relative_parts

_HUB_BLOB_NAME = re.compile(r"[0-9a-f]{40}|[0-9a-f]{64}")
_COMMIT = re.compile(r"[0-9a-f]{40}")


def _is_real_dir(path: Path) -> bool:
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def _validated_hub_blob(repo: Path, link: Path, inner: tuple[str, ...], target: str) -> str | None:
    """The blob name when `link` (below repo/snapshots/inner...) is a well-formed cache symlink."""
    depth = len(inner) + 1  # up from the link's directory, through snapshots/<revision>/..., to the repo
    target_parts = PurePosixPath(target).parts
    if len(target_parts) != depth + 2 or target_parts[:depth] != ("..",) * depth or target_parts[depth] != "blobs":
        return None
    name = target_parts[-1]
    if not _HUB_BLOB_NAME.fullmatch(name):
        return None
    directories = [repo, repo / "snapshots", repo / "blobs"]
    current = repo / "snapshots"
    for part in inner:
        current = current / part
        directories.append(current)
    if not all(_is_real_dir(directory) for directory in directories):
        return None  # a symlinked directory could lead anywhere
    blob = repo / "blobs" / name
    try:
        blob_info = os.lstat(blob)
        link_info = os.stat(link)
    except OSError:
        return None
    if not stat.S_ISREG(blob_info.st_mode):
        return None
    if (blob_info.st_dev, blob_info.st_ino) != (link_info.st_dev, link_info.st_ino):
        return None
    return name


def hub_blob_content_id(path: Path) -> str | None:
    """`hub-blob:<name>` when `path` is a validated Hugging Face cache snapshot symlink, else None (hash it)."""
    link = Path(os.path.abspath(path))
    try:
        if not stat.S_ISLNK(os.lstat(link).st_mode):
            return None
        target = os.readlink(link)
    except OSError:
        return None
    parts = link.parts
    # parts: (..., "models--org--name", "snapshots", revision, [sub...], file)
    for index in range(len(parts) - 3, 1, -1):
        repo_name = parts[index - 1]
        if parts[index] != "snapshots" or not repo_name.startswith("models--") or repo_name == "models--":
            continue
        name = _validated_hub_blob(Path(*parts[:index]), link, parts[index + 1 : -1], target)
        if name is not None:
            return f"hub-blob:{name}"
    return None


def _hub_cache_dir(cache_dir: Path | None) -> Path:
    """The hub cache the way huggingface_hub finds it: argument, HF_HUB_CACHE, HF_HOME/hub, XDG, ~/.cache."""
    if cache_dir is not None:
        return Path(os.path.abspath(os.path.expanduser(cache_dir)))
    for variable in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        value = os.environ.get(variable)
        if value:
            return Path(os.path.abspath(os.path.expanduser(value)))
    home = os.environ.get("HF_HOME")
    if not home:
        xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache")
        home = os.path.join(xdg, "huggingface")
    return Path(os.path.abspath(os.path.expanduser(home))) / "hub"


def not_cached(repo_id: str, revision: str, looked_in: Path, reason: str) -> HostWeightError:
    """NOT_FOUND for a repo, revision or file the local cache lacks; says how to fetch it (HWR never downloads)."""
    fetch = f"hf download {repo_id}" if revision == "main" else f"hf download {repo_id} --revision {revision}"
    return hinted_failure(
        ResolutionStage.CANONICAL,
        FailureCode.NOT_FOUND,
        f"model {repo_id!r} (revision {revision!r}) is not in the local Hugging Face cache: {reason} "
        f"(looked in {looked_in}). HWR never downloads: fetch it first with `{fetch}`, or set HF_HUB_CACHE "
        f"to the cache that holds it",
        ArgumentHint(use=(("cache_dir", None),), lead="or"),
        repo_id=repo_id,
        revision=revision,
        looked_in=str(looked_in),
    )


def hub_snapshot(repo_id: str, revision: str | None, cache_dir: Path | None) -> Path:
    """The snapshot directory of `repo_id` at `revision` in the local cache; never the network."""
    cache = _hub_cache_dir(cache_dir)
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    wanted = revision if revision is not None else "main"
    if not repo.is_dir():
        raise not_cached(repo_id, wanted, repo, "the repository folder does not exist")
    if _COMMIT.fullmatch(wanted):
        commit = wanted
    else:
        try:
            ref_parts = relative_parts(wanted, "revision")
        except ValueError as exc:
            raise not_cached(repo_id, wanted, repo, "the revision is not a commit hash or a ref name") from exc
        ref = repo / "refs" / Path(*ref_parts)
        try:
            commit = ref.read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise not_cached(repo_id, wanted, ref, f"the ref {wanted!r} is not cached ({exc})") from exc
        if not _COMMIT.fullmatch(commit):
            raise not_cached(repo_id, wanted, ref, f"the ref file holds {commit[:80]!r}, not a commit hash")
    snapshot = repo / "snapshots" / commit
    if not snapshot.is_dir():
        raise not_cached(repo_id, wanted, snapshot, f"snapshot {commit} is not cached")
    return snapshot

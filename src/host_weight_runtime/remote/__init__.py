"""Remote exact artifacts: one conversion per fleet, imported by every other node as verified bytes.

A remote is any fsspec URL: ``s3://bucket/prefix`` (s3fs), ``gs://bucket/prefix``,
``file:///shared/hwr`` (an NFS share read as a remote, never as a domain) or
``https://host/prefix`` (read-only). It holds one folder per artifact key::

    <url>/
      <key>/                                 64-hex identity key, as under a domain's artifacts/
        manifest.json                        the artifact's manifest, byte-identical to the local one
        model-00001-of-00002.safetensors     payloads, byte-identical to the published local files
        model-00002-of-00002.safetensors
        DESCRIPTOR.json                      written LAST: identity, manifest_sha256, content_sha256,
                                             object sizes; its presence makes the artifact visible

Object stores cannot rename, so the descriptor is what publishes: an upload that dies
leaves no descriptor and `probe` never offers it (`hwr remote ls` shows it INCOMPLETE;
the next push replaces the leftovers). A descriptor whose objects are missing, extra or
of the wrong size is a typed, non-retryable ``remote_failed``; so is any byte that does
not hash to the manifest. Network errors and timeouts are ``remote_failed`` and
retryable. Nothing secret is ever written to the remote, a message or a listing.

Import (`import_remote_artifact`) is an ordinary build of the local store: the
provider's `fetch` streams the payloads into the store's writer in tmp/, under the build
lock, and publication is the usual atomic rename. Export (`push_artifact`) verifies the
local artifact with FULL_CHECKSUM first (unless the remote already holds a complete copy
with the same manifest digest: then nothing is read or sent). `push_all_artifacts` does
that for every complete local artifact. A push also keeps the remote's name index
(`names`): `pull_by_name` lets a node that holds nothing of a model import it by repo id and
pinned revision. Every URL is checked before anything is written:
an unsupported scheme, a file:// folder that does not exist (a push creates only the last
folder, never its parents) and a missing bucket are usage errors, never retryable.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ._descriptor import DESCRIPTOR_FILE_NAME, RemoteDescriptorRecord, RemoteFileRecord
from ._location import DEFAULT_TIMEOUT_S, check_remote_url
from .importer import RemoteImportProducer, import_remote_artifact, verify_imported
from .names import ArtifactName, NameIndexEntry, is_pinned_revision, tensor_parallel_names
from .provider import DEFAULT_CHUNK_BYTES, DEFAULT_MAX_CONCURRENCY, FsspecArtifactProvider
from .pull import PulledArtifact, pull_by_name
from .push import (
    PushResult,
    PushStatus,
    RemoteArtifactListing,
    RemoteArtifactState,
    list_remote,
    push_artifact,
    push_in_background,
)
from .push_all import PushAllOutcome, push_all_artifacts, pushable_keys

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "ArtifactName",
    "NameIndexEntry",
    "PulledArtifact",
    "DEFAULT_MAX_CONCURRENCY",
    "DEFAULT_TIMEOUT_S",
    "DESCRIPTOR_FILE_NAME",
    "FsspecArtifactProvider",
    "PushAllOutcome",
    "PushResult",
    "PushStatus",
    "RemoteArtifactListing",
    "RemoteArtifactState",
    "RemoteDescriptorRecord",
    "RemoteFileRecord",
    "RemoteImportProducer",
    "check_remote_url",
    "import_remote_artifact",
    "is_pinned_revision",
    "list_remote",
    "providers_from_urls",
    "pull_by_name",
    "tensor_parallel_names",
    "push_all_artifacts",
    "push_artifact",
    "push_in_background",
    "pushable_keys",
    "storage_options_for",
    "verify_imported",
]


def storage_options_for(url: str, *, endpoint_url: str | None = None) -> dict[str, Any]:
    """fsspec storage options for `url` from the runtime's settings (HWR_REMOTE_ENDPOINT_URL applies to s3 only)."""
    scheme = check_remote_url(url).split("://", 1)[0]
    if endpoint_url and scheme in ("s3", "s3a"):
        return {"endpoint_url": endpoint_url}
    return {}


def providers_from_urls(
    urls: str | Iterable[str],
    *,
    endpoint_url: str | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> tuple[FsspecArtifactProvider, ...]:
    """Providers for HWR_REMOTE: a comma-separated string (or a list) of URLs, tried in the order given."""
    items = urls.split(",") if isinstance(urls, str) else list(urls)
    cleaned = [url.strip() for url in items if url.strip()]
    return tuple(
        FsspecArtifactProvider(
            url, storage_options=storage_options_for(url, endpoint_url=endpoint_url), timeout_s=timeout_s
        )
        for url in cleaned
    )

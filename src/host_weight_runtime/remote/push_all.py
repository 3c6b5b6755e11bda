"""Push every complete local artifact a remote lacks (`hwr push --all`): one outcome per key, idempotent.

A node whose artifacts came from local builds, post-load publications or imports can
seed a new remote (or a second region) in one call. Each key goes through `push_artifact`,
so what the remote already holds is reported ALREADY_PRESENT without being re-read, and a
local copy that fails its re-hash is reported for that key without stopping the others.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ..canonical_json import JsonValue
from ..failures import HostWeightError, HostWeightFailure, HostWeightUsageError
from ..filesystem.inspection import ArtifactState
from ..filesystem.store import FilesystemHostWeightStore
from ._location import DEFAULT_TIMEOUT_S, RemoteLocation
from .push import PushResult, push_artifact

__all__ = ["PushAllOutcome", "pushable_keys", "push_all_artifacts"]

# A complete local artifact: published and valid by metadata (push uploads only bytes this node hashed).
_PUSHABLE = frozenset({ArtifactState.READY, ArtifactState.UNVERIFIED})


@dataclass(frozen=True, slots=True)
class PushAllOutcome:
    """One key of a push of everything: its result, or the typed failure that stopped that key alone."""

    key: str
    result: PushResult | None
    failure: HostWeightFailure | None

    def to_dict(self) -> dict[str, JsonValue]:
        if self.result is not None:
            return self.result.to_dict()
        assert self.failure is not None
        return {"key": self.key, "status": "failed", "failure": self.failure.to_dict()}


def pushable_keys(store: FilesystemHostWeightStore) -> tuple[str, ...]:
    """The keys of the domain's published artifacts that are not denied, invalid or being evicted, sorted."""
    return tuple(sorted(entry.key for entry in store.inspect_domain().artifacts if entry.state in _PUSHABLE))


def push_all_artifacts(
    store: FilesystemHostWeightStore,
    url: str,
    *,
    storage_options: Mapping[str, Any] | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    lock_timeout_s: float = 60.0,
    on_outcome: Callable[[PushAllOutcome], None] | None = None,
) -> tuple[PushAllOutcome, ...]:
    """Push each pushable key to `url` in key order; raise only for a URL that cannot be used at all.

    The URL is checked before the first key (a usage error: unsupported, read-only, or naming
    a folder or bucket that does not exist); after that, a failure is recorded per key.
    """
    location = RemoteLocation(url, storage_options=storage_options, timeout_s=timeout_s)
    location.require_writable("")
    location.check_target(for_write=True)
    outcomes: list[PushAllOutcome] = []
    for key in pushable_keys(store):
        try:
            result = push_artifact(
                store,
                key,
                url,
                storage_options=storage_options,
                timeout_s=timeout_s,
                deadline=time.monotonic() + lock_timeout_s,
            )
            outcome = PushAllOutcome(key, result, None)
        except HostWeightUsageError:
            raise
        except HostWeightError as exc:
            outcome = PushAllOutcome(key, None, exc.failure)
        outcomes.append(outcome)
        if on_outcome is not None:
            on_outcome(outcome)
    return tuple(outcomes)

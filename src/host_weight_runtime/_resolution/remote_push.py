"""HWR_REMOTE_PUBLISH: push what this node built to the first writable remote, off the request path.

After a local build (resolve's BUILT) or a post-load publication (PUBLISHED), the
runtime hands the key to `RemotePublisher.push`, which uploads it on a thread of its own
(`remote.push_in_background`: only bytes this node hashed in full, descriptor last). The
request never waits; the process waits for the upload at exit. Every outcome is logged
(never a credential) and kept for `wait`.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

from ..config import HostWeightRuntimeConfig
from ..failures import HostWeightFailure
from ..identity import WeightArtifactIdentity
from ..protocols import HostWeightStore

if TYPE_CHECKING:
    from ..remote import PushResult

__all__ = ["RemotePublisher"]

_LOG = logging.getLogger("host_weight_runtime")


class RemotePublisher:
    """Background pushes to one remote URL; `wait` joins them and returns their outcomes."""

    def __init__(self, config: HostWeightRuntimeConfig) -> None:
        url = config.remote_push_url
        if url is None:  # the configuration refuses remote_publish without a writable remote
            raise ValueError("remote_publish needs a writable remote URL")
        self._url = url
        self._endpoint_url = config.remote_endpoint_url
        self._timeout_s = config.remote_timeout_s
        self._threads: list[threading.Thread] = []
        self._outcomes: list[PushResult | HostWeightFailure] = []
        self._guard = threading.Lock()

    @property
    def url(self) -> str:
        return self._url

    def push(self, store: HostWeightStore, identity: WeightArtifactIdentity) -> None:
        """Start uploading `identity`'s published artifact; never raises, never waits."""
        from ..filesystem.store import FilesystemHostWeightStore
        from ..remote import push_in_background, storage_options_for

        if not isinstance(store, FilesystemHostWeightStore):
            _LOG.warning(
                "HWR_REMOTE_PUBLISH: the store %s is not a FilesystemHostWeightStore; %s is not pushed",
                type(store).__name__,
                identity.key,
            )
            return
        options = storage_options_for(self._url, endpoint_url=self._endpoint_url)
        thread = push_in_background(
            store, identity, self._url, storage_options=options, timeout_s=self._timeout_s, report=self._record
        )
        with self._guard:
            self._threads.append(thread)

    def _record(self, outcome: PushResult | HostWeightFailure) -> None:
        if isinstance(outcome, HostWeightFailure):
            _LOG.warning("pushing an artifact to %s failed: [%s] %s", self._url, outcome.code.value, outcome.message)
        else:
            _LOG.info(
                "pushed %s to %s: %s, %d bytes in %.2f s",
                outcome.key,
                outcome.remote,
                outcome.status.value,
                outcome.bytes_uploaded,
                outcome.elapsed_s,
            )
        with self._guard:
            self._outcomes.append(outcome)

    def wait(self, timeout: float | None = None) -> tuple[PushResult | HostWeightFailure, ...]:
        """Join the pushes started so far (up to `timeout` seconds in all); the outcomes of those that ended."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._guard:
            threads = list(self._threads)
        for thread in threads:
            thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        with self._guard:
            self._threads = [thread for thread in self._threads if thread.is_alive()]
            return tuple(self._outcomes)

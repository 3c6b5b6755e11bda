"""HostWeightRuntime: `resolve()` and `publish_after_load()`, each a sequence of small stages.

The runtime applies policy only. The store owns files, locks and lifecycle; the runtime
decides, per stage and mode, whether to use a result, continue, fall back to canonical
loading or fail, and emits exactly one report per call to every observer.

resolve: DOMAIN (open the store; an attempt only when that fails) -> local lookup ->
remote import (the configured remotes in order; no attempt without one) -> local build
(a PRE_LOAD_SAFE producer) -> canonical fallback. publish_after_load is the post-load
publication stage. With `remote_publish` (HWR_REMOTE_PUBLISH), what a local build or a
post-load publication published is then pushed to the first writable remote, off the
request path. The stages live in `host_weight_runtime._resolution`; the
decision table (DESIGN section 7, behaviours R02 and R10) is in
`host_weight_runtime._resolution.decisions`, and `ALWAYS_FATAL` and `may_fall_back` are
re-exported here.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from ._resolution.checks import check_identity, check_producer, deadline_from
from ._resolution.decisions import ALWAYS_FATAL, may_fall_back
from ._resolution.pipeline import run_resolution
from ._resolution.post_load_publication import post_load_publication
from ._resolution.remote_push import RemotePublisher
from ._resolution.resolve_reports import ResolveConclusion, publication_report, resolution_report
from ._resolution.store_calls import StoreFactory, StoreOpener, default_store_factory
from .config import HostWeightRuntimeConfig, RuntimeMode
from .failures import FailureCode, HostWeightFailure, ResolutionStage, failure
from .identity import WeightArtifactIdentity
from .outcomes import (
    AttemptResult,
    HostWeightResolution,
    PostLoadPublicationReport,
    PostLoadPublicationStatus,
    ResolutionOutcome,
    ResolutionReport,
)
from .protocols import RemoteArtifactProvider, WeightProducer

if TYPE_CHECKING:
    from .remote import PushResult

__all__ = [
    "ALWAYS_FATAL",
    "HostWeightRuntime",
    "RuntimeObserver",
    "StoreFactory",
    "may_fall_back",
]

_LOG = logging.getLogger("host_weight_runtime")

RuntimeObserver = Callable[[ResolutionReport | PostLoadPublicationReport], None]


class HostWeightRuntime:
    """Policy over a lazily opened store: resolve artifacts and publish after load, reporting every call.

    The store is created on first need and cached; a failed creation is not cached, so a
    later call can succeed once the cause (e.g. a stalled init lock) is gone. DISABLED never
    creates it. The caller owns any lease a resolution returns and must close it.

    Remotes: `remote_providers` (any `RemoteArtifactProvider`), when given, are probed in
    order after a local miss; otherwise the configuration's `remote` URLs (HWR_REMOTE) are,
    through `FsspecArtifactProvider`. A remote whose fsspec backend is not installed
    raises `HostWeightError` (CONFIGURATION) here, not on the first request.
    """

    def __init__(
        self,
        config: HostWeightRuntimeConfig,
        *,
        store_factory: StoreFactory | None = None,
        observers: Sequence[RuntimeObserver] = (),
        remote_providers: Sequence[RemoteArtifactProvider] = (),
    ) -> None:
        if not isinstance(config, HostWeightRuntimeConfig):
            raise TypeError(f"config must be a HostWeightRuntimeConfig, got {type(config).__name__}")
        for provider in remote_providers:
            if not isinstance(provider, RemoteArtifactProvider):
                raise TypeError(
                    f"remote provider {type(provider).__name__} does not implement RemoteArtifactProvider "
                    "(provider_id, probe, fetch)"
                )
        for observer in observers:
            if not callable(observer):
                raise TypeError(f"observer {observer!r} is not callable")
        self._config = config
        self._stores = StoreOpener(config, store_factory if store_factory is not None else default_store_factory)
        self._observers: list[RuntimeObserver] = list(observers)
        self._observer_guard = threading.Lock()
        enabled = config.mode is not RuntimeMode.DISABLED
        self._given_providers: tuple[RemoteArtifactProvider, ...] = tuple(remote_providers)
        self._remote_providers: tuple[RemoteArtifactProvider, ...] = (
            self._given_providers if self._given_providers else _configured_providers(config) if enabled else ()
        )
        self._remote_publisher = RemotePublisher(config) if enabled and config.remote_publish else None

    def with_policy(self, mode: RuntimeMode, *, allow_local_build: bool | None = None) -> HostWeightRuntime:
        """This runtime under another mode (and local-build rule), sharing everything else it was given.

        The derived runtime opens the same store (one store per runtime, whatever factory built it),
        asks the same remote providers, reports to the same observers (ones added later to either too)
        and pushes through the same HWR_REMOTE_PUBLISH uploader, so an adapter that must build in
        REQUIRED mode never loses what the caller configured. Returns `self` when nothing changes.
        """
        if not isinstance(mode, RuntimeMode):
            raise TypeError(f"mode must be a RuntimeMode, got {type(mode).__name__}")
        local_build = self._config.allow_local_build if allow_local_build is None else allow_local_build
        config = replace(self._config, mode=mode, allow_local_build=local_build)
        if config == self._config:
            return self
        derived = HostWeightRuntime.__new__(HostWeightRuntime)
        derived._config = config
        derived._stores = self._stores
        derived._observers = self._observers
        derived._observer_guard = self._observer_guard
        derived._given_providers = self._given_providers
        enabled, enabled_before = mode is not RuntimeMode.DISABLED, self._config.mode is not RuntimeMode.DISABLED
        derived._remote_providers = (
            self._remote_providers
            if self._given_providers or (enabled and enabled_before)
            else _configured_providers(config)
            if enabled
            else ()
        )
        if not enabled:
            derived._remote_publisher = None
        elif enabled_before:
            derived._remote_publisher = self._remote_publisher
        else:
            derived._remote_publisher = RemotePublisher(config) if config.remote_publish else None
        return derived

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **kwargs: Any) -> HostWeightRuntime:
        """Configure from HWR_* variables so operators can switch the runtime on without code changes.

        With HWR_METRICS_PORT set, the process's Prometheus endpoint is started (once) and
        this runtime's reports feed it (`host_weight_runtime.metrics`).
        """
        runtime = cls(HostWeightRuntimeConfig.from_env(environ), **kwargs)
        if runtime.config.metrics_port is not None:
            from .metrics import serve_runtime_metrics

            serve_runtime_metrics(runtime)
        return runtime

    @property
    def config(self) -> HostWeightRuntimeConfig:
        return self._config

    @property
    def remote_providers(self) -> tuple[RemoteArtifactProvider, ...]:
        """The remotes resolve probes after a local miss, in order (empty: no remote stage)."""
        return self._remote_providers

    def wait_for_remote_pushes(self, timeout: float | None = None) -> tuple[PushResult | HostWeightFailure, ...]:
        """Wait for the HWR_REMOTE_PUBLISH uploads started so far (the process also waits at exit).

        Returns the outcome of every push that ended (a `PushResult` or a typed failure);
        empty when remote publishing is off.
        """
        return () if self._remote_publisher is None else self._remote_publisher.wait(timeout)

    def add_observer(self, observer: RuntimeObserver) -> None:
        """Register a callback that receives every later report; it cannot change an outcome."""
        if not callable(observer):
            raise TypeError(f"observer {observer!r} is not callable")
        with self._observer_guard:
            self._observers.append(observer)

    def ensure_store(self) -> HostWeightFailure | None:
        """Open the store now instead of on first need; returns why it cannot be opened (None when it is open).

        Adapters call this before placing their own node-shared files under the domain root,
        so those are only created where the domain checks (locality, permissions) passed.
        """
        if self._config.mode is RuntimeMode.DISABLED:
            return failure(
                ResolutionStage.CONFIGURATION,
                FailureCode.INVALID_CONFIGURATION,
                "the runtime is DISABLED; it opens no store",
            )
        _store, init_failure = self._stores.acquire()
        return init_failure

    def resolve(
        self,
        identity: WeightArtifactIdentity,
        producer: WeightProducer | None = None,
        *,
        deadline: float | None = None,
    ) -> HostWeightResolution:
        """Find or build the exact artifact, or say why canonical loading must (or may not) be used.

        Returns exactly one report; store and policy outcomes are never raised. `deadline`
        is an absolute `time.monotonic()` value bounding lock waits (default: now +
        `config.lock_timeout_s`). A returned lease belongs to the caller.
        """
        check_identity(identity)
        if producer is not None:
            check_producer(producer)
        started = time.monotonic()
        deadline = deadline_from(deadline, started, self._config.lock_timeout_s)
        if self._config.mode is RuntimeMode.DISABLED:
            conclusion = ResolveConclusion(ResolutionOutcome.CANONICAL_DIRECT, ())
        else:
            # DOMAIN, then local lookup -> remote -> local build -> canonical fallback.
            conclusion = run_resolution(
                self._config,
                identity,
                producer,
                deadline=deadline,
                acquire_store=self._stores.acquire,
                remote_providers=self._remote_providers,
            )
        made = resolution_report(identity.key, self._config.mode.value, conclusion, started)
        if made.outcome is ResolutionOutcome.LOCAL_PRODUCTION and any(
            attempt.stage is ResolutionStage.PRODUCTION and attempt.result is AttemptResult.BUILT
            for attempt in made.attempts
        ):
            self._push(identity)
        self._notify(made)
        return HostWeightResolution(made, conclusion.lease)

    def publish_after_load(
        self,
        identity: WeightArtifactIdentity,
        producer: WeightProducer,
        *,
        deadline: float | None = None,
    ) -> PostLoadPublicationReport:
        """Publish a loaded model's weights for later workers; every outcome is a report, never raised.

        Only POST_LOAD_ONLY producers are accepted; the lease the store hands back is
        always closed here, and the serving model is never touched. `deadline` as in
        `resolve` (an addition to the DESIGN signature; optional).
        """
        check_identity(identity)
        check_producer(producer)
        started = time.monotonic()
        deadline = deadline_from(deadline, started, self._config.lock_timeout_s)
        outcome = post_load_publication(self._config, identity, producer, deadline, self._stores.acquire)
        made = publication_report(identity.key, outcome, started)
        if made.status is PostLoadPublicationStatus.PUBLISHED:
            self._push(identity)
        self._notify(made)
        return made

    def _push(self, identity: WeightArtifactIdentity) -> None:
        """HWR_REMOTE_PUBLISH: upload what this process just published, on a thread; never raises."""
        if self._remote_publisher is None:
            return
        store, _failure = self._stores.acquire()
        if store is None:  # pragma: no cover - it was open a moment ago, and an open store is cached
            return
        try:
            self._remote_publisher.push(store, identity)
        except Exception:  # the push is best effort: the request it follows has succeeded
            _LOG.exception("starting the remote push of %s failed", identity.key)

    def _notify(self, made: ResolutionReport | PostLoadPublicationReport) -> None:
        """Deliver a report to every observer; an observer's exception is logged and changes nothing."""
        with self._observer_guard:
            observers = tuple(self._observers)
        for observer in observers:
            try:
                observer(made)
            except Exception:
                _LOG.exception("host weight runtime observer %r raised; the outcome is unchanged", observer)


def _configured_providers(config: HostWeightRuntimeConfig) -> tuple[RemoteArtifactProvider, ...]:
    """FsspecArtifactProvider for each HWR_REMOTE URL; fsspec is imported only when one is configured."""
    if not config.remote:
        return ()
    from .remote import providers_from_urls

    return providers_from_urls(
        config.remote, endpoint_url=config.remote_endpoint_url, timeout_s=config.remote_timeout_s
    )

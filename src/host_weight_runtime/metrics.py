"""Prometheus metrics for the runtime and its domain (the `metrics` extra: `pip install host-weight-runtime[metrics]`).

`prometheus_client` is imported only when metrics are asked for, so the core runs without it.
Three sources feed the metrics:

- the runtime's reports (an observer per runtime): resolutions by outcome and failure code,
  attempts by stage, latency, build and import seconds, post-load publications;
- store events in this process (`_telemetry`): bytes published and evicted, live leases;
- the domain itself, read on each scrape from a cheap summary (one directory listing, one
  read of the kernel's lock table, a stat walk; never a hash): store bytes, free and total
  bytes, the store limit, artifacts and leased artifacts.

Labels are bounded values only: stage, outcome, failure_code, storage_class. A key, a
model id or a path is never a label value.

Multiprocess workers follow prometheus_client's documented mode: when
`PROMETHEUS_MULTIPROC_DIR` is set (before the workers start), every process writes its
values there, the live-leases gauge sums live processes (`livesum`), and the process
that serves (the one whose `HWR_METRICS_PORT` bind succeeded) exposes a
`MultiProcessCollector` plus the domain gauges. When it is not set, a fixed
`HWR_METRICS_PORT` sets it to a private directory per uid and port (`_metrics_pod`), so the
worker processes of one pod are all counted by one endpoint; live gauges of processes that
are gone are marked dead at start and at exit.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from . import _telemetry
from ._metrics_pod import LiveProcessCollector, enable_pod_multiprocess, multiprocess_directory, multiprocess_enabled
from .config import HostWeightRuntimeConfig, RuntimeMode
from .failures import HostWeightError, HostWeightFailure, ResolutionStage
from .outcomes import (
    AttemptAction,
    AttemptResult,
    PostLoadPublicationReport,
    PostLoadPublicationStatus,
    ResolutionReport,
)

if TYPE_CHECKING:
    from prometheus_client.registry import CollectorRegistry

    from .filesystem.store import FilesystemHostWeightStore

__all__ = [
    "LATENCY_BUCKETS",
    "NO_FAILURE",
    "HostWeightMetrics",
    "MetricsUnavailableError",
    "ObservableRuntime",
    "metrics_server_address",
    "record_restore",
    "register_metrics",
    "serve_runtime_metrics",
    "start_metrics_server",
]


class ObservableRuntime(Protocol):
    """What the metrics need of a runtime (`HostWeightRuntime` is one): its configuration and its reports."""

    @property
    def config(self) -> HostWeightRuntimeConfig: ...

    def add_observer(self, observer: Callable[[ResolutionReport | PostLoadPublicationReport], None]) -> None: ...


_LOG = logging.getLogger("host_weight_runtime.metrics")

NO_FAILURE = "none"  # the failure_code label of a call that did not fail
# Seconds: a warm hit is milliseconds, a build of a large model minutes.
LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
    600.0,
    1800.0,
)


class MetricsUnavailableError(ImportError):
    """prometheus_client is not installed."""


def _prometheus() -> Any:
    try:
        import prometheus_client
        import prometheus_client.core  # so that `client.core` and `client.multiprocess` are loaded
        import prometheus_client.multiprocess
    except ImportError as exc:
        raise MetricsUnavailableError(
            "host weight runtime metrics need prometheus_client: pip install 'host-weight-runtime[metrics]' "
            "(or unset HWR_METRICS_PORT)"
        ) from exc
    return prometheus_client


def _multiprocess() -> bool:
    return multiprocess_enabled()


def _code(failure: HostWeightFailure | None) -> str:
    return NO_FAILURE if failure is None else failure.code.value


def record_restore(seconds: float, *, ok: bool) -> None:
    """Adapters call this after restoring a model from a lease (or failing to); a no-op without metrics."""
    _telemetry.emit(_telemetry.TelemetryEvent(_telemetry.TelemetryKind.RESTORED, seconds=seconds, ok=ok))


class HostWeightMetrics:
    """The runtime's metric objects in one registry, and the callbacks that feed them.

    Obtain it from `register_metrics`; `observe` is the runtime observer.
    """

    def __init__(self, registry: CollectorRegistry | None) -> None:
        client = _prometheus()
        counter, histogram, gauge = client.Counter, client.Histogram, client.Gauge
        kwargs: dict[str, Any] = {"registry": registry}
        self.resolutions = counter(
            "hwr_resolutions",
            "Resolve calls by terminal outcome and failure code.",
            ("outcome", "failure_code"),
            **kwargs,
        )
        self.attempts = counter(
            "hwr_resolution_attempts",
            "Stages tried during resolves, by stage, result and failure code.",
            ("stage", "outcome", "failure_code"),
            **kwargs,
        )
        self.resolution_seconds = histogram(
            "hwr_resolution_seconds",
            "Wall time of resolve calls, by terminal outcome.",
            ("outcome",),
            buckets=LATENCY_BUCKETS,
            **kwargs,
        )
        self.publications = counter(
            "hwr_post_load_publications",
            "Post-load publications by status and failure code.",
            ("outcome", "failure_code"),
            **kwargs,
        )
        self.build_seconds = histogram(
            "hwr_build_seconds",
            "Seconds to build and publish an artifact (stage production: before load; post_load_publication: after).",
            ("stage",),
            buckets=LATENCY_BUCKETS,
            **kwargs,
        )
        self.import_seconds = histogram(
            "hwr_import_seconds",
            "Seconds to import an artifact from a remote provider.",
            buckets=LATENCY_BUCKETS,
            **kwargs,
        )
        self.restore_seconds = histogram(
            "hwr_restore_seconds",
            "Seconds to restore a model from a lease, by outcome (ok, failed).",
            ("outcome",),
            buckets=LATENCY_BUCKETS,
            **kwargs,
        )
        self.published_bytes = counter(
            "hwr_published_bytes", "Payload bytes of artifacts this process published.", ("storage_class",), **kwargs
        )
        self.evicted_bytes = counter(
            "hwr_evicted_bytes", "Bytes of artifacts this process evicted (LRU or gc).", ("storage_class",), **kwargs
        )
        self.evictions = counter(
            "hwr_evictions", "Artifacts this process evicted (LRU or gc).", ("storage_class",), **kwargs
        )
        self.background_verifications = counter(
            "hwr_background_verifications",
            "Background full verifications that ended, by outcome (verified, denied) and storage class.",
            ("outcome", "storage_class"),
            **kwargs,
        )
        self.live_leases = gauge(
            "hwr_live_leases",
            "Leases open in this process (summed over live processes in multiprocess mode).",
            multiprocess_mode="livesum",
            **kwargs,
        )
        self.live_leases.set(_telemetry.live_leases())
        # Weak: a runtime that is gone drops out, and a new one that reuses its id() is still observed.
        self._attached: weakref.WeakSet[ObservableRuntime] = weakref.WeakSet()
        self._guard = threading.Lock()
        _telemetry.add_listener(self._on_event)

    def attach(self, runtime: ObservableRuntime) -> None:
        """Observe `runtime`'s reports (once per runtime)."""
        with self._guard:
            if runtime in self._attached:
                return
            self._attached.add(runtime)
        runtime.add_observer(self.observe)

    def observe(self, report: ResolutionReport | PostLoadPublicationReport) -> None:
        """The runtime observer: count one report."""
        if isinstance(report, PostLoadPublicationReport):
            self.publications.labels(report.status.value, _code(report.failure)).inc()
            if report.status is PostLoadPublicationStatus.PUBLISHED:
                self.build_seconds.labels(ResolutionStage.POST_LOAD_PUBLICATION.value).observe(report.elapsed_s)
            return
        outcome = report.outcome.value
        self.resolutions.labels(outcome, _code(report.failure)).inc()
        self.resolution_seconds.labels(outcome).observe(report.elapsed_s)
        for attempt in report.attempts:
            self.attempts.labels(attempt.stage.value, attempt.result.value, _code(attempt.failure)).inc()
            if attempt.stage is ResolutionStage.PRODUCTION and attempt.result is AttemptResult.BUILT:
                self.build_seconds.labels(ResolutionStage.PRODUCTION.value).observe(attempt.elapsed_s)
            elif attempt.stage is ResolutionStage.REMOTE and attempt.action is AttemptAction.USE:
                self.import_seconds.observe(attempt.elapsed_s)

    def _on_event(self, event: _telemetry.TelemetryEvent) -> None:
        kind = event.kind
        if kind is _telemetry.TelemetryKind.PUBLISHED:
            self.published_bytes.labels(event.storage_class).inc(event.nbytes)
        elif kind is _telemetry.TelemetryKind.EVICTED:
            self.evicted_bytes.labels(event.storage_class).inc(event.nbytes)
            self.evictions.labels(event.storage_class).inc()
        elif kind in (_telemetry.TelemetryKind.LEASE_OPENED, _telemetry.TelemetryKind.LEASE_CLOSED):
            self.live_leases.set(_telemetry.live_leases())
        elif kind is _telemetry.TelemetryKind.RESTORED:
            self.restore_seconds.labels("ok" if event.ok else "failed").observe(event.seconds)
        elif kind is _telemetry.TelemetryKind.VERIFIED:
            outcome = "verified" if event.ok else "denied"
            self.background_verifications.labels(outcome, event.storage_class).inc()


class DomainCollector:
    """Gauges read from the domains on each scrape, summed per storage class.

    A domain that does not exist yet is skipped (a scrape never creates one).
    """

    def __init__(self) -> None:
        self._roots: list[Path] = []
        self._stores: dict[Path, FilesystemHostWeightStore] = {}
        self._guard = threading.Lock()

    def add_root(self, root: Path) -> None:
        with self._guard:
            if root not in self._roots:
                self._roots.append(root)

    def describe(self) -> Iterable[Any]:
        return ()  # computed on scrape; registering must not read the domain

    def _store(self, root: Path) -> FilesystemHostWeightStore | None:
        from .filesystem import DomainLayout
        from .filesystem.store import FilesystemHostWeightStore

        with self._guard:
            store = self._stores.get(root)
        if store is not None:
            return store
        if not DomainLayout(root).domain_file.is_file():
            return None
        store = FilesystemHostWeightStore(root)
        with self._guard:
            self._stores.setdefault(root, store)
        return store

    def collect(self) -> Iterator[Any]:
        client = _prometheus()
        family = client.core.GaugeMetricFamily
        names = {
            "store_bytes": ("hwr_store_bytes", "Bytes the domain's store occupies (artifacts, builds, quarantine)."),
            "free_bytes": ("hwr_store_free_bytes", "Free bytes of the domain's filesystem."),
            "total_bytes": ("hwr_store_total_bytes", "Size of the domain's filesystem."),
            "max_store_bytes": ("hwr_store_limit_bytes", "The domain's max_store_bytes (absent when unlimited)."),
            "min_free_bytes": ("hwr_store_min_free_bytes", "The domain's min_free_bytes."),
            "artifacts": ("hwr_store_artifacts", "Published artifacts in the domain."),
            "leased_artifacts": ("hwr_store_leased_artifacts", "Published artifacts with at least one live lease."),
            "live_leases": ("hwr_store_leases", "Live leases on the domain's artifacts, across every process."),
        }
        totals: dict[str, dict[str, float]] = {field: {} for field in names}
        with self._guard:
            roots = list(self._roots)
        for root in roots:
            try:
                store = self._store(root)
                if store is None:
                    continue
                usage = store.usage().to_dict()
            except (HostWeightError, OSError, ValueError) as exc:
                _LOG.debug("host weight metrics: domain %s could not be summarised: %s", root, exc)
                continue
            storage_class = str(usage["storage_class"])
            for field in names:
                value = usage[field]
                if isinstance(value, int):
                    bucket = totals[field]
                    bucket[storage_class] = bucket.get(storage_class, 0.0) + value
        for field, (name, documentation) in names.items():
            metric = family(name, documentation, labels=("storage_class",))
            for storage_class, value in sorted(totals[field].items()):
                metric.add_metric((storage_class,), value)
            yield metric


class _Registration:
    """The metrics and the domain collector registered into one registry."""

    def __init__(self, metrics: HostWeightMetrics, domains: DomainCollector) -> None:
        self.metrics = metrics
        self.domains = domains


_registrations: dict[int, _Registration] = {}
_process_metrics: list[HostWeightMetrics] = []  # multiprocess mode: one unregistered set per process
_guard = threading.Lock()


def register_metrics(
    registry: CollectorRegistry | None = None,
    *,
    runtime: ObservableRuntime | None = None,
    domain_root: Path | None = None,
) -> HostWeightMetrics:
    """Add the runtime's metrics to `registry` (default: prometheus_client's REGISTRY) and feed them.

    `runtime` is observed (its domain's gauges are added unless it is DISABLED); `domain_root`
    adds another domain's gauges. Idempotent per registry: calling again adds runtimes and
    roots to the same metrics. In multiprocess mode the counters live in the multiprocess
    files and only the domain gauges are registered into `registry`, which should carry
    a `MultiProcessCollector` (prometheus_client's documented pattern).
    Raises MetricsUnavailableError when prometheus_client is not installed.
    """
    client = _prometheus()
    target = registry if registry is not None else client.REGISTRY
    with _guard:
        registration = _registrations.get(id(target))
        if registration is None:
            if _multiprocess():
                if not _process_metrics:
                    _process_metrics.append(HostWeightMetrics(None))
                metrics = _process_metrics[0]
            else:
                metrics = HostWeightMetrics(target)
            domains = DomainCollector()
            target.register(domains)
            registration = _Registration(metrics, domains)
            _registrations[id(target)] = registration
    if runtime is not None:
        registration.metrics.attach(runtime)
        if runtime.config.mode is not RuntimeMode.DISABLED:
            registration.domains.add_root(runtime.config.resolved_root)
    if domain_root is not None:
        registration.domains.add_root(Path(domain_root))
    return registration.metrics


_server: list[tuple[str, int, Any]] = []  # (address, port, registry) of this process's endpoint


def start_metrics_server(
    port: int, addr: str = "127.0.0.1", *, registry: CollectorRegistry | None = None
) -> tuple[str, int]:
    """Serve `/metrics` over HTTP once per process; returns the bound (address, port) (port 0 picks one).

    A second call returns the running endpoint unchanged. Without `registry` it serves
    REGISTRY, or in multiprocess mode a registry with a `MultiProcessCollector`.
    Raises OSError when the port cannot be bound (another worker may already serve it).
    """
    client = _prometheus()
    with _guard:
        if _server:
            address, bound, _registry = _server[0]
            return address, bound
        if registry is None:
            if _multiprocess():
                registry = client.CollectorRegistry()
                registry.register(LiveProcessCollector(Path(multiprocess_directory())))
            else:
                registry = client.REGISTRY
        server, _thread = client.start_http_server(port, addr=addr, registry=registry)
        bound = int(server.server_port)
        _server.append((addr, bound, registry))
    _LOG.info("host weight runtime metrics at http://%s:%d/metrics", addr, bound)
    return addr, bound


def metrics_server_address() -> tuple[str, int] | None:
    """The (address, port) this process serves metrics on, or None."""
    with _guard:
        return (_server[0][0], _server[0][1]) if _server else None


def serve_runtime_metrics(runtime: ObservableRuntime) -> tuple[str, int] | None:
    """What HWR_METRICS_PORT does: start this process's endpoint if needed and feed it `runtime`.

    Never fails the caller: a missing prometheus_client or a port another process already
    serves is logged (in multiprocess mode that other process serves ours too). A fixed port
    switches on multiprocess mode first (`_metrics_pod`), so every worker process of a pod
    that shares the port is counted by the one endpoint that binds it.
    """
    config = runtime.config
    if config.metrics_port is None:
        return None
    enable_pod_multiprocess(config.metrics_port)
    try:
        address = start_metrics_server(config.metrics_port, config.metrics_addr)
    except MetricsUnavailableError as exc:
        _LOG.warning("%s", exc)
        return None
    except OSError as exc:
        if _multiprocess():
            _LOG.info(
                "host weight runtime metrics: %s:%d is served by another worker process (%s); it counts this one too",
                config.metrics_addr,
                config.metrics_port,
                exc,
            )
        else:
            _LOG.warning(
                "host weight runtime metrics: cannot serve on %s:%d (%s); this process's metrics are not exported",
                config.metrics_addr,
                config.metrics_port,
                exc,
            )
        address = None
    with _guard:
        serving = _server[0][2] if _server else None
    register_metrics(serving, runtime=runtime)
    return address

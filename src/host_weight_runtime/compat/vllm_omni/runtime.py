"""The reference's `HostWeightRuntime` signature over this runtime: one resolve, its report in both shapes."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from typing import TypeVar, cast

from ... import outcomes as native_outcomes
from ...config import RuntimeMode
from ...failures import HostWeightError, HostWeightFailure, ResolutionStage
from ...filesystem.store import FilesystemHostWeightStore as NativeFilesystemStore
from ...identity import WeightArtifactIdentity
from ...lease import HostWeightLease
from ...outcomes import StoreResult as NativeStoreResult
from ...protocols import BuildRequest, LookupPhase, WeightProducer
from ...protocols import HostWeightStore as NativeStore
from ...runtime import HostWeightRuntime as NativeRuntime
from ...tensors import ValidationLevel as NativeValidationLevel
from ._providers import remote_providers
from .config import HostWeightRuntimeConfig, ValidationLevel, native_config
from .filesystem.store import FilesystemHostWeightStore, native_store_result
from .outcomes import (
    HostWeightResolution,
    PostLoadPublicationOutcome,
    PostLoadPublicationReport,
    ResolutionOutcome,
    ResolutionReport,
    StoreResult,
    publication_report_of,
    resolution_of,
    resolution_report_of,
)

__all__ = ["HostWeightRuntime"]

_LOG = logging.getLogger("host_weight_runtime")

_Report = TypeVar("_Report", ResolutionReport, PostLoadPublicationReport)

ResolutionObserver = Callable[[ResolutionReport], None]
PublicationObserver = Callable[[PostLoadPublicationReport], None]


class HostWeightRuntime:
    """Resolve or publish one exact representation; every call runs this runtime's own resolve once."""

    def __init__(
        self,
        config: HostWeightRuntimeConfig,
        store: object | None = None,
        *,
        observer: ResolutionObserver | None = None,
        publication_observer: PublicationObserver | None = None,
        _initialization_failure: HostWeightFailure | None = None,
    ) -> None:
        if observer is not None and not callable(observer):
            raise ValueError("Host Weight Runtime observer must be callable")
        if publication_observer is not None and not callable(publication_observer):
            raise ValueError("Host Weight Runtime publication observer must be callable")
        enabled = config.mode is not RuntimeMode.DISABLED
        if not enabled and (store is not None or _initialization_failure is not None):
            raise ValueError("disabled Host Weight Runtime must not initialize a store")
        if enabled and (store is None) == (_initialization_failure is None):
            raise ValueError("enabled Host Weight Runtime requires exactly one store or initialization failure")
        self.config = config
        self.store = store
        self._initialization_failure = _initialization_failure
        self._observer = observer
        self._publication_observer = publication_observer
        self._native = NativeRuntime(
            native_config(config),
            store_factory=self._native_store,
            observers=(self._notify,),
            remote_providers=remote_providers(config),
        )

    @classmethod
    def from_config(
        cls,
        config: HostWeightRuntimeConfig,
        *,
        observer: ResolutionObserver | None = None,
        publication_observer: PublicationObserver | None = None,
    ) -> HostWeightRuntime:
        """Open the store now (DISABLED opens nothing); a store that cannot be opened is reported, not raised."""
        if config.mode is RuntimeMode.DISABLED:
            return cls(config, observer=observer, publication_observer=publication_observer)
        assert config.domain is not None
        try:
            store = FilesystemHostWeightStore(config.domain, config.capacity, config.integrity, wait=config.wait)
        except HostWeightError as exc:
            return cls(
                config,
                observer=observer,
                publication_observer=publication_observer,
                _initialization_failure=exc.failure,
            )
        return cls(config, store, observer=observer, publication_observer=publication_observer)

    @property
    def enabled(self) -> bool:
        return self.config.mode is not RuntimeMode.DISABLED

    @property
    def native(self) -> NativeRuntime:
        """This runtime's own `HostWeightRuntime` doing the work."""
        return self._native

    def resolve(
        self, identity: WeightArtifactIdentity | None = None, *, producer: WeightProducer | None = None
    ) -> HostWeightResolution:
        if not self.enabled:
            started = time.monotonic()
            report = ResolutionReport(
                uuid.uuid4().hex, ResolutionOutcome.CANONICAL_DIRECT, (), time.monotonic() - started
            )
            self._deliver(self._observer, report)
            return HostWeightResolution(report)
        if identity is None:
            raise ValueError("enabled Host Weight Runtime requires an exact artifact identity")
        return resolution_of(self._native.resolve(identity, producer))

    def publish_after_load(
        self, identity: WeightArtifactIdentity | None = None, *, producer: WeightProducer | None = None
    ) -> PostLoadPublicationReport:
        started = time.monotonic()
        disabled = (
            PostLoadPublicationOutcome.RUNTIME_DISABLED
            if not self.enabled
            else PostLoadPublicationOutcome.POLICY_DISABLED
            if not self.config.production.allow_post_load_publish
            else None
        )
        if disabled is not None:
            report = PostLoadPublicationReport(uuid.uuid4().hex, disabled, None, time.monotonic() - started)
            self._deliver(self._publication_observer, report)
            return report
        if identity is None:
            raise ValueError("enabled post-load publication requires an exact artifact identity")
        if producer is None:
            raise ValueError("enabled post-load publication requires one producer")
        if producer.spec.lookup_phase is not LookupPhase.POST_LOAD_ONLY:
            raise ValueError("publish_after_load requires a POST_LOAD_ONLY producer")
        return publication_report_of(self._native.publish_after_load(identity, producer))

    # -- the native runtime's store and observers

    def _native_store(self, _config: object) -> NativeStore:
        if self._initialization_failure is not None:
            raise HostWeightError(self._initialization_failure)
        store = self.store
        if isinstance(store, NativeFilesystemStore):
            return store
        return _ReferenceStore(store)  # the reference's store object itself, so what replaces its methods counts

    def _notify(self, report: native_outcomes.ResolutionReport | native_outcomes.PostLoadPublicationReport) -> None:
        if isinstance(report, native_outcomes.ResolutionReport):
            self._deliver(self._observer, resolution_report_of(report))
        else:
            self._deliver(self._publication_observer, publication_report_of(report))

    @staticmethod
    def _deliver(observer: Callable[[_Report], None] | None, report: _Report) -> None:
        if observer is None:
            return
        try:
            observer(report)
        except Exception:  # an observer never changes the outcome
            _LOG.exception("host weight runtime observer %r raised; the outcome is unchanged", observer)


class _ReferenceStore:
    """A store written to the reference's protocol (its `StoreResult`, its `ValidationLevel`), for this runtime."""

    def __init__(self, store: object) -> None:
        self._store = store

    def lookup(
        self, identity: WeightArtifactIdentity, *, validation: NativeValidationLevel, deadline: float | None = None
    ) -> native_outcomes.StoreResult:
        found = self._store.lookup(identity, validation=ValidationLevel(validation.value), deadline=deadline)  # type: ignore[attr-defined]
        return native_store_result(found, identity)

    def get_or_build(
        self, request: BuildRequest, producer: WeightProducer, *, validation: NativeValidationLevel, deadline: float
    ) -> native_outcomes.StoreResult:
        built = self._store.get_or_build(  # type: ignore[attr-defined]
            request, producer, validation=ValidationLevel(validation.value), deadline=deadline
        )
        lease: object = getattr(built, "lease", None)
        post_load = producer.spec.lookup_phase is LookupPhase.POST_LOAD_ONLY
        if (
            post_load
            and isinstance(built, StoreResult)
            and lease is not None
            and not isinstance(lease, HostWeightLease)
        ):
            # a post-load publication only closes the lease: it is never handed to a caller
            closed_only = cast(HostWeightLease, _ClosedOnly(request.identity, lease))
            return NativeStoreResult(built.status, request.identity, closed_only)
        return native_store_result(built, request.identity, stage=ResolutionStage.PRODUCTION)


class _ClosedOnly:
    """A reference store's own lease object in a post-load publication, which only ever closes it.

    The reference accepts any lease with `close()` there; the runtime never hands this one to a
    caller (resolve still refuses anything but a `HostWeightLease`), so closing it is all it needs.
    """

    publication_id = ""

    def __init__(self, identity: WeightArtifactIdentity, lease: object) -> None:
        self.identity = identity
        self._lease = lease

    def close(self) -> None:
        self._lease.close()  # type: ignore[attr-defined]

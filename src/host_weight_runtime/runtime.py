"""HostWeightRuntime: `resolve()`, `publish_after_load()` and the decision table between them.

The runtime applies policy only. The store owns files, locks and lifecycle; the runtime
decides, per stage and mode, whether to use a result, continue, fall back to canonical
loading or fail, and emits exactly one report per call to every observer.

Decision table (DESIGN section 7, behaviours R02 and R10):

==============================================  ===========  ========
what a stage produced                           PREFERRED    REQUIRED
==============================================  ===========  ========
clean miss, nothing else could build it         fall back    fail
invalid artifact (StoreStatus.INVALID)          fall back    fail
failure marked retryable                        fall back    fail
failure not retryable, or a code in ALWAYS_FATAL  fail       fail
==============================================  ===========  ========

An invalid artifact found by the lookup is not final: the producer stage still runs
(the store quarantines the copy and rebuilds). A retryable *lookup* failure (a lock
timeout, EIO) ends the resolve: the build would need the same locks and reads.

No remote provider can be configured in V1, so the remote stage is never tried and
records no attempt; attempts list only the stages that were tried. Store construction
records a DOMAIN attempt only when it fails.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .canonical_json import CanonicalJson, JsonValue
from .config import HostWeightRuntimeConfig, RuntimeMode
from .failures import FailureCode, HostWeightError, HostWeightFailure, ResolutionStage, failure
from .identity import WeightArtifactIdentity
from .lease import HostWeightLease
from .outcomes import (
    AttemptAction,
    AttemptResult,
    HostWeightResolution,
    PostLoadPublicationReport,
    PostLoadPublicationStatus,
    ResolutionAttempt,
    ResolutionOutcome,
    ResolutionReport,
    StoreResult,
    StoreStatus,
)
from .protocols import (
    BuildRequest,
    CoordinationScope,
    HostWeightStore,
    LookupPhase,
    RemoteArtifactProvider,
    WeightProducer,
)

__all__ = [
    "ALWAYS_FATAL",
    "HostWeightRuntime",
    "RuntimeObserver",
    "StoreFactory",
    "may_fall_back",
]

_LOG = logging.getLogger("host_weight_runtime")

RuntimeObserver = Callable[[ResolutionReport | PostLoadPublicationReport], None]
StoreFactory = Callable[[HostWeightRuntimeConfig], HostWeightStore]

# Codes that are semantic or configuration errors: they fail in every mode, even if a
# store marked them retryable, so a real problem is never disguised as a miss (R10).
ALWAYS_FATAL: frozenset[FailureCode] = frozenset(
    {
        FailureCode.INVALID_CONFIGURATION,
        FailureCode.UNSUPPORTED,
        FailureCode.PRODUCER_UNSUPPORTED,
        FailureCode.UNSUPPORTED_FILESYSTEM,
        FailureCode.STORAGE_CLASS_MISMATCH,
        FailureCode.UNSAFE_PERMISSIONS,
        FailureCode.DOMAIN_POLICY_CONFLICT,
        FailureCode.IDENTITY_COLLISION,
        FailureCode.PRODUCER_FAILED,
        FailureCode.PUBLICATION_FAILED,
        FailureCode.STORE_INIT_FAILED,
        FailureCode.UNEXPECTED_STATUS,
    }
)

_UNSUPPORTED_SCOPES = frozenset({CoordinationScope.GROUP_COHORT, CoordinationScope.ARTIFACT_BUNDLE})


def may_fall_back(failure: HostWeightFailure | None, *, invalid_artifact: bool = False) -> bool:
    """The mode-independent half of the decision table: may PREFERRED fall back after this?

    A clean miss (no failure) and an invalid artifact may; otherwise only a failure
    marked retryable whose code is not in `ALWAYS_FATAL`.
    """
    if failure is None:
        return True
    if failure.code in ALWAYS_FATAL:
        return False
    return invalid_artifact or failure.retryable


def _default_store_factory(config: HostWeightRuntimeConfig) -> HostWeightStore:
    """Open the filesystem store; imported lazily so DISABLED runtimes never load it."""
    from .filesystem.store import FilesystemHostWeightStore

    return FilesystemHostWeightStore.from_config(config)


def _exception_details(exc: BaseException) -> dict[str, JsonValue]:
    return {"exception_type": f"{type(exc).__module__}.{type(exc).__qualname__}", "error": str(exc)}


def _failure_with(
    stage: ResolutionStage, code: FailureCode, message: str, details: dict[str, JsonValue]
) -> HostWeightFailure:
    """A non-retryable failure whose details are built as a dict (exception type and text included)."""
    return HostWeightFailure(stage, code, False, message, CanonicalJson.from_value(details))


class HostWeightRuntime:
    """Policy over a lazily opened store: resolve artifacts and publish after load, reporting every call.

    The store is created on first need and cached; a failed creation is not cached, so a
    later call can succeed once the cause (e.g. a stalled init lock) is gone. DISABLED never
    creates it. The caller owns any lease a resolution returns and must close it.
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
        if remote_providers:
            # Modelled by the protocols but not implemented: refuse loudly rather than ignore (S24).
            raise HostWeightError(
                failure(
                    ResolutionStage.REMOTE,
                    FailureCode.UNSUPPORTED,
                    "remote artifact providers are not implemented in this version; "
                    "construct the runtime without remote_providers",
                    provider_ids=[str(provider.provider_id) for provider in remote_providers],
                )
            )
        for observer in observers:
            if not callable(observer):
                raise TypeError(f"observer {observer!r} is not callable")
        self._config = config
        self._store_factory: StoreFactory = store_factory if store_factory is not None else _default_store_factory
        self._store: HostWeightStore | None = None
        self._store_guard = threading.Lock()
        self._observers: list[RuntimeObserver] = list(observers)
        self._observer_guard = threading.Lock()

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **kwargs: Any) -> HostWeightRuntime:
        """Configure from HWR_* variables so operators can switch the runtime on without code changes."""
        return cls(HostWeightRuntimeConfig.from_env(environ), **kwargs)

    @property
    def config(self) -> HostWeightRuntimeConfig:
        return self._config

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
        _store, init_failure = self._acquire_store()
        return init_failure

    # ------------------------------------------------------------------ resolve

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
        _check_identity(identity)
        if producer is not None:
            _check_producer(producer)
        started = time.monotonic()
        if deadline is None:
            deadline = started + self._config.lock_timeout_s
        elif type(deadline) not in (int, float) or not math.isfinite(deadline):
            raise ValueError(f"deadline must be a finite time.monotonic() value, got {deadline!r}")
        key = identity.key
        if self._config.mode is RuntimeMode.DISABLED:
            return self._conclude(key, ResolutionOutcome.CANONICAL_DIRECT, [], started)

        attempts: list[ResolutionAttempt] = []

        # Stage DOMAIN: only recorded when the store cannot be opened.
        stage_start = time.monotonic()
        store, init_failure = self._acquire_store()
        if store is None:
            assert init_failure is not None
            action = self._action_after(init_failure)
            attempts.append(
                ResolutionAttempt(
                    ResolutionStage.DOMAIN,
                    AttemptResult.FAILED,
                    action,
                    time.monotonic() - stage_start,
                    init_failure,
                    "the host weight store could not be opened",
                )
            )
            return self._conclude_without_lease(key, attempts, started, action, init_failure)

        # Stage LOOKUP.
        stage_start = time.monotonic()
        validation = self._config.validation
        result, call_failure = _call_store(
            ResolutionStage.LOOKUP,
            identity,
            lambda: store.lookup(identity, validation=validation, deadline=deadline),
            allowed=(StoreStatus.HIT, StoreStatus.MISS, StoreStatus.INVALID, StoreStatus.FAILED),
        )
        elapsed = time.monotonic() - stage_start
        pending: HostWeightFailure | None = None
        if result is None:
            assert call_failure is not None
            action = self._action_after(call_failure)
            attempts.append(
                ResolutionAttempt(
                    ResolutionStage.LOOKUP, AttemptResult.FAILED, action, elapsed, call_failure, "store lookup failed"
                )
            )
            return self._conclude_without_lease(key, attempts, started, action, call_failure)
        if result.status is StoreStatus.HIT:
            lease = result.lease
            assert lease is not None
            attempts.append(
                ResolutionAttempt(
                    ResolutionStage.LOOKUP, AttemptResult.HIT, AttemptAction.USE, elapsed, None, "validated local hit"
                )
            )
            return self._conclude(
                key, ResolutionOutcome.LOCAL_HIT, attempts, started, lease=lease, publication_id=_pub_id(result, lease)
            )
        if result.status is StoreStatus.MISS:
            attempts.append(
                ResolutionAttempt(
                    ResolutionStage.LOOKUP, AttemptResult.MISS, AttemptAction.CONTINUE, elapsed, None, "no artifact"
                )
            )
        elif result.status is StoreStatus.INVALID:
            pending = result.failure
            assert pending is not None
            if pending.code in ALWAYS_FATAL:
                attempts.append(
                    ResolutionAttempt(
                        ResolutionStage.LOOKUP,
                        AttemptResult.INVALID,
                        AttemptAction.FAIL,
                        elapsed,
                        pending,
                        "invalid artifact with a fatal failure code",
                    )
                )
                return self._conclude_without_lease(key, attempts, started, AttemptAction.FAIL, pending)
            attempts.append(
                ResolutionAttempt(
                    ResolutionStage.LOOKUP,
                    AttemptResult.INVALID,
                    AttemptAction.CONTINUE,
                    elapsed,
                    pending,
                    "artifact denied; a producer may rebuild it",
                )
            )
        else:  # FAILED
            lookup_failure = result.failure
            assert lookup_failure is not None
            action = self._action_after(lookup_failure)
            attempts.append(
                ResolutionAttempt(
                    ResolutionStage.LOOKUP, AttemptResult.FAILED, action, elapsed, lookup_failure, "store lookup failed"
                )
            )
            return self._conclude_without_lease(key, attempts, started, action, lookup_failure)

        # Stage REMOTE: no provider can be configured in V1; nothing is tried or recorded.

        # Stage PRODUCTION.
        stage_start = time.monotonic()
        skip_reason = self._production_skip_reason(producer)
        if skip_reason is not None:
            terminal = pending
            if terminal is None and self._config.mode is RuntimeMode.REQUIRED:
                terminal = failure(
                    ResolutionStage.LOOKUP,
                    FailureCode.NOT_FOUND,
                    f"no artifact for key {key} and no producer could build it ({skip_reason}); "
                    "REQUIRED mode does not fall back to canonical loading",
                    retryable=True,
                    key=key,
                    reason=skip_reason,
                )
            action = self._action_after(pending, invalid_artifact=pending is not None)
            attempts.append(
                ResolutionAttempt(
                    ResolutionStage.PRODUCTION,
                    AttemptResult.SKIPPED,
                    action,
                    time.monotonic() - stage_start,
                    None,
                    skip_reason,
                )
            )
            return self._conclude_without_lease(key, attempts, started, action, terminal)

        assert producer is not None
        rejection = _producer_rejection(ResolutionStage.PRODUCTION, identity, producer)
        if rejection is not None:
            attempts.append(
                ResolutionAttempt(
                    ResolutionStage.PRODUCTION,
                    AttemptResult.FAILED,
                    AttemptAction.FAIL,
                    time.monotonic() - stage_start,
                    rejection,
                    "producer rejected before running",
                )
            )
            return self._conclude_without_lease(key, attempts, started, AttemptAction.FAIL, rejection)

        result, call_failure = _call_store(
            ResolutionStage.PRODUCTION,
            identity,
            lambda: store.get_or_build(BuildRequest(identity), producer, validation=validation, deadline=deadline),
            allowed=(StoreStatus.HIT, StoreStatus.BUILT, StoreStatus.JOINED, StoreStatus.INVALID, StoreStatus.FAILED),
        )
        elapsed = time.monotonic() - stage_start
        if result is None:
            assert call_failure is not None
            action = self._action_after(call_failure)
            attempts.append(
                ResolutionAttempt(
                    ResolutionStage.PRODUCTION,
                    AttemptResult.FAILED,
                    action,
                    elapsed,
                    call_failure,
                    "get_or_build failed",
                )
            )
            return self._conclude_without_lease(key, attempts, started, action, call_failure)
        if result.lease is not None:
            lease = result.lease
            attempt_result, outcome, detail = {
                StoreStatus.BUILT: (AttemptResult.BUILT, ResolutionOutcome.LOCAL_PRODUCTION, "built and published"),
                StoreStatus.JOINED: (
                    AttemptResult.JOINED,
                    ResolutionOutcome.LOCAL_PRODUCTION,
                    "joined another process's build",
                ),
                StoreStatus.HIT: (AttemptResult.HIT, ResolutionOutcome.LOCAL_HIT, "published meanwhile by another"),
            }[result.status]
            attempts.append(
                ResolutionAttempt(ResolutionStage.PRODUCTION, attempt_result, AttemptAction.USE, elapsed, None, detail)
            )
            return self._conclude(key, outcome, attempts, started, lease=lease, publication_id=_pub_id(result, lease))
        build_failure = result.failure
        assert build_failure is not None
        invalid = result.status is StoreStatus.INVALID
        action = self._action_after(build_failure, invalid_artifact=invalid)
        attempts.append(
            ResolutionAttempt(
                ResolutionStage.PRODUCTION,
                AttemptResult.INVALID if invalid else AttemptResult.FAILED,
                action,
                elapsed,
                build_failure,
                "get_or_build returned an invalid artifact" if invalid else "get_or_build failed",
            )
        )
        return self._conclude_without_lease(key, attempts, started, action, build_failure)

    # -------------------------------------------------------- publish_after_load

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
        _check_identity(identity)
        _check_producer(producer)
        started = time.monotonic()
        if deadline is None:
            deadline = started + self._config.lock_timeout_s
        elif type(deadline) not in (int, float) or not math.isfinite(deadline):
            raise ValueError(f"deadline must be a finite time.monotonic() value, got {deadline!r}")
        key = identity.key
        stage = ResolutionStage.POST_LOAD_PUBLICATION

        def report(
            status: PostLoadPublicationStatus,
            fail: HostWeightFailure | None = None,
            publication_id: str | None = None,
        ) -> PostLoadPublicationReport:
            made = PostLoadPublicationReport(key, status, time.monotonic() - started, fail, publication_id)
            if fail is not None:
                _LOG.warning("post-load publication of %s failed: [%s] %s", key, fail.code.value, fail.message)
            self._notify(made)
            return made

        if self._config.mode is RuntimeMode.DISABLED:
            return report(PostLoadPublicationStatus.RUNTIME_DISABLED)
        if not self._config.allow_post_load_publish:
            return report(PostLoadPublicationStatus.POLICY_DISABLED)
        if producer.spec.lookup_phase is not LookupPhase.POST_LOAD_ONLY:
            return report(
                PostLoadPublicationStatus.FAILED,
                failure(
                    stage,
                    FailureCode.PRODUCER_UNSUPPORTED,
                    f"publish_after_load accepts only POST_LOAD_ONLY producers; {producer.spec.producer_id!r} is "
                    f"{producer.spec.lookup_phase.value}; pass it to resolve() instead",
                    producer_id=producer.spec.producer_id,
                    lookup_phase=producer.spec.lookup_phase.value,
                ),
            )
        rejection = _producer_rejection(stage, identity, producer)
        if rejection is not None:
            return report(PostLoadPublicationStatus.FAILED, rejection)

        store, init_failure = self._acquire_store()
        if store is None:
            return report(PostLoadPublicationStatus.FAILED, init_failure)

        validation = self._config.validation
        result, call_failure = _call_store(
            stage,
            identity,
            lambda: store.get_or_build(BuildRequest(identity), producer, validation=validation, deadline=deadline),
            allowed=(StoreStatus.HIT, StoreStatus.BUILT, StoreStatus.JOINED, StoreStatus.INVALID, StoreStatus.FAILED),
        )
        if result is None:
            return report(PostLoadPublicationStatus.FAILED, call_failure)
        lease = result.lease
        if lease is None:
            return report(PostLoadPublicationStatus.FAILED, result.failure, result.publication_id)
        publication_id = _pub_id(result, lease)
        status = {
            StoreStatus.BUILT: PostLoadPublicationStatus.PUBLISHED,
            StoreStatus.HIT: PostLoadPublicationStatus.ALREADY_PRESENT,
            StoreStatus.JOINED: PostLoadPublicationStatus.JOINED,
        }[result.status]
        try:
            lease.close()
        except Exception as exc:
            _LOG.exception("closing the post-load publication lease of %s failed", key)
            return report(
                PostLoadPublicationStatus.FAILED,
                _failure_with(
                    ResolutionStage.LEASE,
                    FailureCode.LEASE_CLOSE_FAILED,
                    f"the artifact is {status.value} but its lease could not be closed; "
                    "the shared artifact lock may stay held until this process exits",
                    {"publication_status": status.value, **_exception_details(exc)},
                ),
                publication_id,
            )
        return report(status, None, publication_id)

    # ----------------------------------------------------------------- internals

    def _acquire_store(self) -> tuple[HostWeightStore | None, HostWeightFailure | None]:
        """Open the store once; a failure is returned (stage DOMAIN) and not cached, so a later call retries."""
        with self._store_guard:
            if self._store is not None:
                return self._store, None
            try:
                store = self._store_factory(self._config)
            except HostWeightError as exc:
                domain_failure = exc.failure
                if domain_failure.stage is not ResolutionStage.DOMAIN:
                    domain_failure = domain_failure.with_stage(ResolutionStage.DOMAIN)
                _LOG.warning(
                    "host weight store at %s could not be opened: [%s] %s",
                    self._config.resolved_root,
                    domain_failure.code.value,
                    domain_failure.message,
                )
                return None, domain_failure
            except Exception as exc:
                _LOG.exception("host weight store factory raised unexpectedly")
                return None, _failure_with(
                    ResolutionStage.DOMAIN,
                    FailureCode.STORE_INIT_FAILED,
                    f"the host weight store could not be created: {type(exc).__name__}: {exc}",
                    _exception_details(exc),
                )
            self._store = store
            return store, None

    def _production_skip_reason(self, producer: WeightProducer | None) -> str | None:
        """Why resolve will not run this producer, or None when it may (subject to validation)."""
        if producer is None:
            return "no producer was given"
        if not self._config.allow_local_build:
            return "local builds are disabled by policy (allow_local_build=False)"
        if producer.spec.lookup_phase is LookupPhase.POST_LOAD_ONLY:
            return (
                f"producer {producer.spec.producer_id!r} is POST_LOAD_ONLY; resolve never runs it "
                "(publish it with publish_after_load once the model is loaded)"
            )
        return None

    def _action_after(self, fail: HostWeightFailure | None, *, invalid_artifact: bool = False) -> AttemptAction:
        """Apply the decision table for this runtime's mode to a stage's terminal result."""
        if self._config.mode is RuntimeMode.PREFERRED and may_fall_back(fail, invalid_artifact=invalid_artifact):
            return AttemptAction.FALL_BACK
        return AttemptAction.FAIL

    def _conclude_without_lease(
        self,
        key: str,
        attempts: list[ResolutionAttempt],
        started: float,
        action: AttemptAction,
        fail: HostWeightFailure | None,
    ) -> HostWeightResolution:
        if action is AttemptAction.FALL_BACK:
            return self._conclude(key, ResolutionOutcome.CANONICAL_FALLBACK, attempts, started, fail=fail)
        if fail is None:  # defensive: a FAILED report always carries a failure
            fail = failure(ResolutionStage.CONFIGURATION, FailureCode.NOT_FOUND, f"no artifact for key {key}", key=key)
        return self._conclude(key, ResolutionOutcome.FAILED, attempts, started, fail=fail)

    def _conclude(
        self,
        key: str,
        outcome: ResolutionOutcome,
        attempts: list[ResolutionAttempt],
        started: float,
        *,
        lease: HostWeightLease | None = None,
        fail: HostWeightFailure | None = None,
        publication_id: str | None = None,
    ) -> HostWeightResolution:
        """Build the one terminal report, log fallbacks and failures loudly, and tell the observers."""
        made = ResolutionReport(
            identity_key=key,
            mode=self._config.mode.value,
            outcome=outcome,
            attempts=tuple(attempts),
            elapsed_s=time.monotonic() - started,
            failure=fail,
            publication_id=publication_id,
        )
        if outcome is ResolutionOutcome.FAILED and fail is not None:
            _LOG.warning("host weight resolve of %s failed: [%s] %s", key, fail.code.value, fail.message)
        elif outcome is ResolutionOutcome.CANONICAL_FALLBACK and fail is None:
            # A clean miss is an ordinary cold start, not a problem.
            _LOG.info("host weight resolve of %s: no artifact yet; loading canonically", key)
        elif outcome is ResolutionOutcome.CANONICAL_FALLBACK and fail is not None:
            _LOG.warning(
                "host weight resolve of %s falls back to canonical loading: [%s] %s", key, fail.code.value, fail.message
            )
        self._notify(made)
        return HostWeightResolution(made, lease)

    def _notify(self, made: ResolutionReport | PostLoadPublicationReport) -> None:
        """Deliver a report to every observer; an observer's exception is logged and changes nothing."""
        with self._observer_guard:
            observers = tuple(self._observers)
        for observer in observers:
            try:
                observer(made)
            except Exception:
                _LOG.exception("host weight runtime observer %r raised; the outcome is unchanged", observer)


def _check_identity(identity: object) -> None:
    if not isinstance(identity, WeightArtifactIdentity):
        raise TypeError(f"identity must be a WeightArtifactIdentity, got {type(identity).__name__}")


def _check_producer(producer: object) -> None:
    if not isinstance(producer, WeightProducer):
        raise TypeError(f"producer must implement WeightProducer (spec, produce), got {type(producer).__name__}")


def _producer_rejection(
    stage: ResolutionStage, identity: WeightArtifactIdentity, producer: WeightProducer
) -> HostWeightFailure | None:
    """Refuse producers V1 cannot run correctly (S24) or that do not make this identity."""
    spec = producer.spec
    if spec.coordination_scope in _UNSUPPORTED_SCOPES:
        return failure(
            stage,
            FailureCode.UNSUPPORTED,
            f"producer {spec.producer_id!r} needs coordination scope {spec.coordination_scope.value}, which this "
            "version does not implement; use a single_process producer",
            producer_id=spec.producer_id,
            coordination_scope=spec.coordination_scope.value,
        )
    key = identity.key
    if not any(output.key == key for output in spec.outputs):
        return failure(
            stage,
            FailureCode.INVALID_CONFIGURATION,
            f"producer {spec.producer_id!r} does not declare identity {key} among its outputs",
            producer_id=spec.producer_id,
            key=key,
            outputs=[output.key for output in spec.outputs],
        )
    return None


def _call_store(
    stage: ResolutionStage,
    identity: WeightArtifactIdentity,
    call: Callable[[], StoreResult],
    *,
    allowed: tuple[StoreStatus, ...],
) -> tuple[StoreResult | None, HostWeightFailure | None]:
    """Run one store call and hold it to its contract; a raise or a wrong result becomes a failure value."""
    try:
        result: object = call()
    except HostWeightError as exc:
        return None, exc.failure
    except Exception as exc:
        _LOG.exception("host weight store raised unexpectedly during %s", stage.value)
        return None, _failure_with(
            stage,
            FailureCode.UNEXPECTED_STATUS,
            f"the store raised {type(exc).__name__} instead of returning a result: {exc}",
            _exception_details(exc),
        )
    if not isinstance(result, StoreResult):
        return None, failure(
            stage,
            FailureCode.UNEXPECTED_STATUS,
            f"the store returned {type(result).__name__}, not a StoreResult",
            result_type=type(result).__name__,
        )
    key = identity.key
    problem: str | None = None
    if result.status not in allowed:
        problem = f"the store returned status {result.status.value} during {stage.value}"
    elif result.identity.key != key:
        problem = f"the store answered for key {result.identity.key}, not {key}"
    elif result.lease is not None and result.lease.identity.key != key:
        problem = f"the store's lease is for key {result.lease.identity.key}, not {key}"
    if problem is None:
        return result, None
    details: dict[str, JsonValue] = {"status": result.status.value, "key": key}
    if result.lease is not None:
        try:
            result.lease.close()
        except Exception as exc:
            _LOG.exception("closing a lease from an unexpected store result failed")
            details.update({"lease_close_" + name: value for name, value in _exception_details(exc).items()})
    return None, _failure_with(stage, FailureCode.UNEXPECTED_STATUS, problem, details)


def _pub_id(result: StoreResult, lease: HostWeightLease) -> str:
    return result.publication_id if result.publication_id is not None else lease.publication_id

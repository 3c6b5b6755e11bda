"""Opening the store once and calling it under its contract, so store misbehaviour becomes failure values."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from ..canonical_json import CanonicalJson, JsonValue
from ..config import HostWeightRuntimeConfig
from ..failures import FailureCode, HostWeightError, HostWeightFailure, ResolutionStage, failure
from ..identity import WeightArtifactIdentity
from ..lease import HostWeightLease
from ..outcomes import StoreResult, StoreStatus
from ..protocols import HostWeightStore

__all__ = [
    "StoreAcquirer",
    "StoreFactory",
    "StoreOpener",
    "call_store",
    "default_store_factory",
    "exception_details",
    "failure_with",
    "publication_id_of",
]

_LOG = logging.getLogger("host_weight_runtime")

StoreFactory = Callable[[HostWeightRuntimeConfig], HostWeightStore]
StoreAcquirer = Callable[[], tuple[HostWeightStore | None, HostWeightFailure | None]]


def default_store_factory(config: HostWeightRuntimeConfig) -> HostWeightStore:
    """Open the filesystem store; imported lazily so DISABLED runtimes never load it."""
    from ..filesystem.store import FilesystemHostWeightStore

    return FilesystemHostWeightStore.from_config(config)


def exception_details(exc: BaseException) -> dict[str, JsonValue]:
    return {"exception_type": f"{type(exc).__module__}.{type(exc).__qualname__}", "error": str(exc)}


def failure_with(
    stage: ResolutionStage, code: FailureCode, message: str, details: dict[str, JsonValue]
) -> HostWeightFailure:
    """A non-retryable failure whose details are built as a dict (exception type and text included)."""
    return HostWeightFailure(stage, code, False, message, CanonicalJson.from_value(details))


class StoreOpener:
    """The runtime's store, created on first need and cached; a failed creation is not cached.

    So a later call can succeed once the cause (e.g. a stalled init lock) is gone.
    """

    def __init__(self, config: HostWeightRuntimeConfig, factory: StoreFactory) -> None:
        self._config = config
        self._factory = factory
        self._store: HostWeightStore | None = None
        self._guard = threading.Lock()

    def acquire(self) -> tuple[HostWeightStore | None, HostWeightFailure | None]:
        """Open the store once; a failure is returned (stage DOMAIN) and not cached, so a later call retries."""
        with self._guard:
            if self._store is not None:
                return self._store, None
            try:
                store = self._factory(self._config)
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
                return None, failure_with(
                    ResolutionStage.DOMAIN,
                    FailureCode.STORE_INIT_FAILED,
                    f"the host weight store could not be created: {type(exc).__name__}: {exc}",
                    exception_details(exc),
                )
            self._store = store
            return store, None


def call_store(
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
        return None, failure_with(
            stage,
            FailureCode.UNEXPECTED_STATUS,
            f"the store raised {type(exc).__name__} instead of returning a result: {exc}",
            exception_details(exc),
        )
    if not isinstance(result, StoreResult):
        return None, failure(
            stage,
            FailureCode.UNEXPECTED_STATUS,
            f"the store returned {type(result).__name__}, not a StoreResult",
            result_type=type(result).__name__,
        )
    key = identity.key
    if result.status is StoreStatus.TIMEOUT and result.failure is not None and result.lease is None:
        return None, result.failure  # a timed-out wait is a failure like any other: its retryability decides
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
            details.update({"lease_close_" + name: value for name, value in exception_details(exc).items()})
    return None, failure_with(stage, FailureCode.UNEXPECTED_STATUS, problem, details)


def publication_id_of(result: StoreResult, lease: HostWeightLease) -> str:
    """The store's publication id, or the lease's when the store left it out."""
    return result.publication_id if result.publication_id is not None else lease.publication_id

"""HostWeightRuntime policy: R01-R10 and S24, against the real filesystem store.

Every test uses a real `FilesystemHostWeightStore` under `tmp_path` and the real
`SyntheticProducer`. Where a behaviour needs a store that misbehaves (a lease whose
close fails, a status the contract forbids, a failure code the real store cannot be
driven to from here), the test uses a `ForwardingStore`: a seam through our own
`HostWeightStore` protocol that forwards to a real store and alters one result.
"""

from __future__ import annotations

import copy
import errno
import fcntl
import logging
import os
import pickle
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from host_weight_runtime._faults import Fault, FaultAction, armed
from host_weight_runtime.config import CapacityPolicy, HostWeightRuntimeConfig, RuntimeMode
from host_weight_runtime.failures import FailureCode, HostWeightError, HostWeightFailure, ResolutionStage, failure
from host_weight_runtime.filesystem.store import FilesystemHostWeightStore
from host_weight_runtime.identity import WeightArtifactIdentity
from host_weight_runtime.lease import HostWeightLease, HostWeightLeaseCarrier
from host_weight_runtime.outcomes import (
    AttemptAction,
    AttemptResult,
    CleanupStatus,
    PostLoadPublicationReport,
    PostLoadPublicationStatus,
    ResolutionOutcome,
    ResolutionReport,
    StoreResult,
    StoreStatus,
)
from host_weight_runtime.protocols import (
    BuildRequest,
    CoordinationScope,
    HostWeightStore,
    LookupPhase,
    ProductionSourceMode,
    WeightProducer,
)
from host_weight_runtime.runtime import ALWAYS_FATAL, HostWeightRuntime, may_fall_back
from host_weight_runtime.tensors import ValidationLevel

from .support import SyntheticProducer, make_identity, make_tensors

Report = ResolutionReport | PostLoadPublicationReport
PREFERRED = RuntimeMode.PREFERRED
REQUIRED = RuntimeMode.REQUIRED
DISABLED = RuntimeMode.DISABLED


# --------------------------------------------------------------------------- helpers


def config_for(root: Path, mode: RuntimeMode = PREFERRED, **overrides: object) -> HostWeightRuntimeConfig:
    values: dict[str, object] = {"mode": mode, "root": root, "lock_timeout_s": 60.0}
    values.update(overrides)
    return HostWeightRuntimeConfig(**values)  # type: ignore[arg-type]


def runtime_for(
    root: Path,
    mode: RuntimeMode = PREFERRED,
    *,
    reports: list[Report] | None = None,
    store_factory: Callable[[HostWeightRuntimeConfig], HostWeightStore] | None = None,
    **overrides: object,
) -> HostWeightRuntime:
    observers = () if reports is None else (reports.append,)
    return HostWeightRuntime(config_for(root, mode, **overrides), store_factory=store_factory, observers=observers)


def pre_load_producer(identity: WeightArtifactIdentity, seed: int = 0, **kwargs: object) -> SyntheticProducer:
    return SyntheticProducer(identity, make_tensors(seed), **kwargs)  # type: ignore[arg-type]


def post_load_producer(identity: WeightArtifactIdentity, seed: int = 0, **kwargs: object) -> SyntheticProducer:
    return SyntheticProducer(
        identity,
        make_tensors(seed),
        lookup_phase=LookupPhase.POST_LOAD_ONLY,
        source_mode=ProductionSourceMode.FINALIZED_MODEL,
        **kwargs,  # type: ignore[arg-type]
    )


def steps(report: ResolutionReport) -> list[tuple[ResolutionStage, AttemptResult, AttemptAction]]:
    return [(attempt.stage, attempt.result, attempt.action) for attempt in report.attempts]


def assert_same_tensors(lease: HostWeightLease, expected: dict[str, torch.Tensor]) -> None:
    assert sorted(lease.tensors) == sorted(expected)
    for name, tensor in expected.items():
        got = lease.tensors[name]
        assert got.dtype == tensor.dtype and tuple(got.shape) == tuple(tensor.shape), name
        assert torch.equal(got, tensor), name


def real_store(root: Path) -> FilesystemHostWeightStore:
    return FilesystemHostWeightStore(root)


def hold_init_lock(root: Path) -> int:
    """Take the domain-init lock the way a stalled holder in another process would (own open file)."""
    (root / "locks").mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(root, 0o700)
    fd = os.open(root / "locks" / "domain-init.lock", os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return fd


class ForwardingStore:
    """A seam through our own HostWeightStore protocol: forwards to a real store, records, and may alter.

    `alter_build` sees each real `get_or_build` result and returns what the runtime gets.
    `fake_build`, when set, answers `get_or_build` without calling the real store.
    """

    def __init__(
        self,
        inner: FilesystemHostWeightStore,
        *,
        alter_build: Callable[[StoreResult], StoreResult] | None = None,
        fake_build: Callable[[WeightArtifactIdentity], StoreResult] | None = None,
    ) -> None:
        self.inner = inner
        self.alter_build = alter_build
        self.fake_build = fake_build
        self.results: list[StoreResult] = []

    def lookup(
        self, identity: WeightArtifactIdentity, *, validation: ValidationLevel, deadline: float | None = None
    ) -> StoreResult:
        result = self.inner.lookup(identity, validation=validation, deadline=deadline)
        self.results.append(result)
        return result

    def get_or_build(
        self, request: BuildRequest, producer: WeightProducer, *, validation: ValidationLevel, deadline: float
    ) -> StoreResult:
        if self.fake_build is not None:
            return self.fake_build(request.identity)
        result = self.inner.get_or_build(request, producer, validation=validation, deadline=deadline)
        self.results.append(result)
        return result if self.alter_build is None else self.alter_build(result)

    def leases(self) -> list[HostWeightLease]:
        return [result.lease for result in self.results if result.lease is not None]


class ReleaseThenRaise:
    """Wraps a real lease lock: releases it (so nothing leaks), then reports an I/O error."""

    def __init__(self, inner: object) -> None:
        self.inner = inner
        self.released = False

    def release(self) -> None:
        self.inner.release()  # type: ignore[attr-defined]
        self.released = True
        raise OSError(5, "injected EIO while releasing the artifact lock")


# --------------------------------------------------------------------------- R01


def test_disabled_never_touches_the_root(tmp_path: Path) -> None:
    """R01: DISABLED never creates (or asks for) the store, never creates the root, returns CANONICAL_DIRECT."""
    root = tmp_path / "not-yet" / "hwr"
    factory_calls: list[HostWeightRuntimeConfig] = []

    def factory(config: HostWeightRuntimeConfig) -> HostWeightStore:
        factory_calls.append(config)
        return FilesystemHostWeightStore.from_config(config)

    reports: list[Report] = []
    identity = make_identity()
    producer = pre_load_producer(identity)
    runtime = runtime_for(root, DISABLED, reports=reports, store_factory=factory)
    resolution = runtime.resolve(identity, producer)

    assert resolution.outcome is ResolutionOutcome.CANONICAL_DIRECT
    assert resolution.lease is None
    assert resolution.report.attempts == ()
    assert resolution.report.failure is None
    assert resolution.report.mode == "disabled"
    assert reports == [resolution.report]
    assert factory_calls == []
    assert producer.calls == 0
    assert not (tmp_path / "not-yet").exists()


def test_disabled_from_env_with_default_factory(tmp_path: Path) -> None:
    """R01: a runtime switched off through HWR_MODE (default store factory) leaves HWR_ROOT absent."""
    root = tmp_path / "env-root"
    runtime = HostWeightRuntime.from_env({"HWR_MODE": "disabled", "HWR_ROOT": str(root)})
    assert runtime.config.mode is DISABLED
    resolution = runtime.resolve(make_identity())
    assert resolution.outcome is ResolutionOutcome.CANONICAL_DIRECT
    assert not root.exists()


# --------------------------------------------------------------------------- R02


def test_miss_without_producer_falls_back_in_preferred(tmp_path: Path) -> None:
    """R02: PREFERRED miss: attempts are lookup MISS/CONTINUE then production SKIPPED/FALL_BACK."""
    reports: list[Report] = []
    resolution = runtime_for(tmp_path / "hwr", PREFERRED, reports=reports).resolve(make_identity())

    assert resolution.outcome is ResolutionOutcome.CANONICAL_FALLBACK
    assert resolution.lease is None
    assert resolution.report.failure is None
    assert steps(resolution.report) == [
        (ResolutionStage.LOOKUP, AttemptResult.MISS, AttemptAction.CONTINUE),
        (ResolutionStage.PRODUCTION, AttemptResult.SKIPPED, AttemptAction.FALL_BACK),
    ]
    assert "no producer" in resolution.report.attempts[1].detail
    assert reports == [resolution.report]


def test_miss_without_producer_fails_in_required(tmp_path: Path) -> None:
    """R02: REQUIRED miss with nothing to build it fails with NOT_FOUND instead of falling back."""
    resolution = runtime_for(tmp_path / "hwr", REQUIRED).resolve(make_identity())

    assert resolution.outcome is ResolutionOutcome.FAILED
    assert resolution.lease is None
    assert resolution.report.failure is not None
    assert resolution.report.failure.code is FailureCode.NOT_FOUND
    assert steps(resolution.report) == [
        (ResolutionStage.LOOKUP, AttemptResult.MISS, AttemptAction.CONTINUE),
        (ResolutionStage.PRODUCTION, AttemptResult.SKIPPED, AttemptAction.FAIL),
    ]


def test_local_build_disabled_skips_the_producer(tmp_path: Path) -> None:
    """R02: allow_local_build=False: the producer is SKIPPED (not run); PREFERRED falls back, REQUIRED fails."""
    identity = make_identity()
    producer = pre_load_producer(identity)
    preferred = runtime_for(tmp_path / "hwr", PREFERRED, allow_local_build=False).resolve(identity, producer)
    required = runtime_for(tmp_path / "hwr", REQUIRED, allow_local_build=False).resolve(identity, producer)

    assert preferred.outcome is ResolutionOutcome.CANONICAL_FALLBACK
    assert required.outcome is ResolutionOutcome.FAILED
    assert steps(preferred.report)[1] == (ResolutionStage.PRODUCTION, AttemptResult.SKIPPED, AttemptAction.FALL_BACK)
    assert "allow_local_build" in preferred.report.attempts[1].detail
    assert producer.calls == 0


# --------------------------------------------------------------------------- R03


def test_production_then_warm_hit_one_report_each(tmp_path: Path) -> None:
    """R03: LOCAL_PRODUCTION then (fresh runtime) LOCAL_HIT, exactly one terminal report per call."""
    root = tmp_path / "hwr"
    identity = make_identity()
    tensors = make_tensors(3)
    producer = SyntheticProducer(identity, tensors)
    reports: list[Report] = []

    first = runtime_for(root, REQUIRED, reports=reports).resolve(identity, producer)
    assert len(reports) == 1 and reports[0] is first.report
    assert first.outcome is ResolutionOutcome.LOCAL_PRODUCTION
    assert steps(first.report) == [
        (ResolutionStage.LOOKUP, AttemptResult.MISS, AttemptAction.CONTINUE),
        (ResolutionStage.PRODUCTION, AttemptResult.BUILT, AttemptAction.USE),
    ]
    assert first.lease is not None
    assert first.report.publication_id == first.lease.publication_id
    assert_same_tensors(first.lease, tensors)
    first.lease.close()

    second = runtime_for(root, REQUIRED, reports=reports).resolve(identity, producer)
    assert len(reports) == 2 and reports[1] is second.report
    assert second.outcome is ResolutionOutcome.LOCAL_HIT
    assert steps(second.report) == [(ResolutionStage.LOOKUP, AttemptResult.HIT, AttemptAction.USE)]
    assert second.lease is not None
    assert second.report.publication_id == first.report.publication_id
    assert_same_tensors(second.lease, tensors)
    second.lease.close()
    assert producer.calls == 1
    assert all(isinstance(report, ResolutionReport) for report in reports)
    assert all(report.failure is None for report in reports)


# --------------------------------------------------------------------------- R04


def test_resolved_lease_carrier_is_taken_once(tmp_path: Path) -> None:
    """R04: a carrier hands the resolved lease to exactly one owner; the second take fails, the lease stays open."""
    identity = make_identity()
    resolution = runtime_for(tmp_path / "hwr").resolve(identity, pre_load_producer(identity))
    assert resolution.lease is not None
    carrier = HostWeightLeaseCarrier(resolution.lease)

    owned = carrier.take()
    assert owned is resolution.lease
    assert carrier.taken
    with pytest.raises(HostWeightError):
        carrier.take()
    carrier.close()  # nothing left to close: the owner has it
    assert not owned.closed
    owned.close()
    assert owned.closed


@pytest.mark.parametrize("duplicate", [copy.copy, copy.deepcopy, pickle.dumps], ids=["copy", "deepcopy", "pickle"])
def test_lease_carrier_cannot_be_copied_or_pickled(tmp_path: Path, duplicate: Callable[[object], object]) -> None:
    """R04: copying or pickling a carrier is refused with a TypeError, so its lease never gets a second owner."""
    identity = make_identity()
    resolution = runtime_for(tmp_path / "hwr").resolve(identity, pre_load_producer(identity))
    assert resolution.lease is not None
    carrier = HostWeightLeaseCarrier(resolution.lease)

    with pytest.raises(TypeError, match="exactly one owner"):
        duplicate(carrier)
    owned = carrier.take()  # the refused copy took nothing: the original still hands the lease over, once
    assert owned is resolution.lease and not owned.closed
    with pytest.raises(HostWeightError):
        carrier.take()
    owned.close()


# --------------------------------------------------------------------------- R05


def test_raising_observer_cannot_change_the_outcome(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """R05: an observer that raises is logged; later observers still run and the outcome is unchanged."""
    root = tmp_path / "hwr"
    identity = make_identity()
    seen: list[Report] = []

    def explode(report: Report) -> None:
        raise RuntimeError("observer bug")

    runtime = HostWeightRuntime(config_for(root, REQUIRED), observers=(explode,))
    runtime.add_observer(seen.append)
    with caplog.at_level(logging.ERROR, logger="host_weight_runtime"):
        built = runtime.resolve(identity, pre_load_producer(identity))
        published = runtime.publish_after_load(identity, post_load_producer(identity))

    assert built.outcome is ResolutionOutcome.LOCAL_PRODUCTION
    assert built.lease is not None
    built.lease.close()
    assert published.status is PostLoadPublicationStatus.ALREADY_PRESENT
    assert seen == [built.report, published]
    raised = [record for record in caplog.records if record.name == "host_weight_runtime" and record.exc_info]
    assert len(raised) == 2
    assert all("observer" in record.getMessage() for record in raised)


# --------------------------------------------------------------------------- R06


def test_resolve_never_runs_a_post_load_only_producer(tmp_path: Path) -> None:
    """R06: resolve records the POST_LOAD_ONLY producer as SKIPPED and never calls it."""
    identity = make_identity()
    producer = post_load_producer(identity)
    preferred = runtime_for(tmp_path / "hwr", PREFERRED).resolve(identity, producer)
    required = runtime_for(tmp_path / "hwr", REQUIRED).resolve(identity, producer)

    assert producer.calls == 0
    assert preferred.outcome is ResolutionOutcome.CANONICAL_FALLBACK
    assert required.outcome is ResolutionOutcome.FAILED
    skipped = preferred.report.attempts[-1]
    assert (skipped.stage, skipped.result) == (ResolutionStage.PRODUCTION, AttemptResult.SKIPPED)
    assert "POST_LOAD_ONLY" in skipped.detail
    assert real_store(tmp_path / "hwr").lookup(identity, validation=ValidationLevel.MANIFEST_AND_METADATA).status is (
        StoreStatus.MISS
    )


def test_publish_after_load_rejects_a_pre_load_safe_producer(tmp_path: Path) -> None:
    """R06: publish_after_load reports PRODUCER_UNSUPPORTED for a PRE_LOAD_SAFE producer and does not run it."""
    identity = make_identity()
    producer = pre_load_producer(identity)
    reports: list[Report] = []
    report = runtime_for(tmp_path / "hwr", PREFERRED, reports=reports).publish_after_load(identity, producer)

    assert report.status is PostLoadPublicationStatus.FAILED
    assert report.failure is not None
    assert report.failure.code is FailureCode.PRODUCER_UNSUPPORTED
    assert producer.calls == 0
    assert reports == [report]
    assert not (tmp_path / "hwr").exists()  # rejected before the store was needed


# --------------------------------------------------------------------------- R07


def test_post_load_published_then_already_present_then_hit(tmp_path: Path) -> None:
    """R07: PUBLISHED, then ALREADY_PRESENT (producer not called again), then LOCAL_HIT; its leases are closed."""
    root = tmp_path / "hwr"
    identity = make_identity()
    tensors = make_tensors(7)
    producer = SyntheticProducer(
        identity, tensors, lookup_phase=LookupPhase.POST_LOAD_ONLY, source_mode=ProductionSourceMode.FINALIZED_MODEL
    )
    store = ForwardingStore(real_store(root))
    runtime = runtime_for(root, PREFERRED, store_factory=lambda config: store)

    first = runtime.publish_after_load(identity, producer)
    assert first.status is PostLoadPublicationStatus.PUBLISHED
    assert first.failure is None and first.publication_id is not None
    assert producer.calls == 1

    second = runtime.publish_after_load(identity, producer)
    assert second.status is PostLoadPublicationStatus.ALREADY_PRESENT
    assert second.publication_id == first.publication_id
    assert producer.calls == 1

    leases = store.leases()
    assert len(leases) == 2
    assert all(lease.closed for lease in leases)
    # The shared artifact lock is really released: cleanup sees no active lease.
    inspected = real_store(root).cleanup(identity.key, dry_run=True)
    assert inspected.status is not CleanupStatus.ACTIVE_LEASE

    hit = runtime_for(root, REQUIRED).resolve(identity)
    assert hit.outcome is ResolutionOutcome.LOCAL_HIT
    assert hit.lease is not None
    assert hit.report.publication_id == first.publication_id
    assert_same_tensors(hit.lease, tensors)
    hit.lease.close()


# --------------------------------------------------------------------------- R08


def test_post_load_policy_disabled_never_runs_the_producer(tmp_path: Path) -> None:
    """R08: allow_post_load_publish=False reports POLICY_DISABLED, never runs the producer, never opens the store."""
    root = tmp_path / "hwr"
    identity = make_identity()
    producer = post_load_producer(identity)
    opened: list[HostWeightRuntimeConfig] = []

    def factory(config: HostWeightRuntimeConfig) -> HostWeightStore:
        opened.append(config)
        return FilesystemHostWeightStore.from_config(config)

    runtime = runtime_for(root, REQUIRED, store_factory=factory, allow_post_load_publish=False)
    report = runtime.publish_after_load(identity, producer)
    assert report.status is PostLoadPublicationStatus.POLICY_DISABLED
    assert report.failure is None
    assert producer.calls == 0
    assert opened == []
    assert not root.exists()


def test_post_load_in_disabled_mode_never_probes_the_root(tmp_path: Path) -> None:
    """R08: DISABLED reports RUNTIME_DISABLED without running the producer or creating the root."""
    root = tmp_path / "absent" / "hwr"
    identity = make_identity()
    producer = post_load_producer(identity)
    reports: list[Report] = []
    report = runtime_for(root, DISABLED, reports=reports).publish_after_load(identity, producer)

    assert report.status is PostLoadPublicationStatus.RUNTIME_DISABLED
    assert producer.calls == 0
    assert reports == [report]
    assert not (tmp_path / "absent").exists()


# --------------------------------------------------------------------------- R09


def test_post_load_store_failure_is_reported(tmp_path: Path) -> None:
    """R09: a producer that raises inside the store is a FAILED report (PRODUCER_FAILED), never an exception."""
    identity = make_identity()

    def boom() -> None:
        raise RuntimeError("producer exploded")

    producer = post_load_producer(identity, before_write=boom)
    report = runtime_for(tmp_path / "hwr", PREFERRED).publish_after_load(identity, producer)
    assert report.status is PostLoadPublicationStatus.FAILED
    assert report.failure is not None
    assert report.failure.code is FailureCode.PRODUCER_FAILED
    assert producer.calls == 1


def test_post_load_capacity_failure_is_reported(tmp_path: Path) -> None:
    """R09: a retryable store failure (artifact larger than the policy allows) is a FAILED report."""
    identity = make_identity()
    runtime = runtime_for(tmp_path / "hwr", PREFERRED, capacity=CapacityPolicy(max_artifact_bytes=64))
    report = runtime.publish_after_load(identity, post_load_producer(identity))
    assert report.status is PostLoadPublicationStatus.FAILED
    assert report.failure is not None
    assert report.failure.code is FailureCode.ARTIFACT_TOO_LARGE
    assert report.failure.retryable


def test_post_load_store_init_failure_is_reported(tmp_path: Path) -> None:
    """R09: a store that cannot be opened (world-writable root) is a FAILED report with stage DOMAIN."""
    root = tmp_path / "hwr"
    root.mkdir(mode=0o700)
    os.chmod(root, 0o777)
    identity = make_identity()
    producer = post_load_producer(identity)
    report = runtime_for(root, PREFERRED).publish_after_load(identity, producer)
    assert report.status is PostLoadPublicationStatus.FAILED
    assert report.failure is not None
    assert report.failure.code is FailureCode.UNSAFE_PERMISSIONS
    assert report.failure.stage is ResolutionStage.DOMAIN
    assert producer.calls == 0


def test_post_load_unexpected_factory_error_is_reported(tmp_path: Path) -> None:
    """R09: a store factory that raises something untyped is STORE_INIT_FAILED naming the exception type."""

    def broken_factory(config: HostWeightRuntimeConfig) -> HostWeightStore:
        raise RuntimeError("factory bug")

    identity = make_identity()
    report = runtime_for(tmp_path / "hwr", PREFERRED, store_factory=broken_factory).publish_after_load(
        identity, post_load_producer(identity)
    )
    assert report.status is PostLoadPublicationStatus.FAILED
    assert report.failure is not None
    assert report.failure.code is FailureCode.STORE_INIT_FAILED
    details = report.failure.details.to_value()
    assert isinstance(details, dict) and details["exception_type"] == "builtins.RuntimeError"


def test_post_load_lease_close_failure_is_reported(tmp_path: Path) -> None:
    """R09: a lease whose close fails gives LEASE_CLOSE_FAILED (ForwardingStore seam wraps the real lock)."""
    root = tmp_path / "hwr"
    identity = make_identity()
    wrapped: list[ReleaseThenRaise] = []

    def break_close(result: StoreResult) -> StoreResult:
        assert result.lease is not None
        lock = ReleaseThenRaise(result.lease._lock)
        result.lease._lock = lock
        wrapped.append(lock)
        return result

    store = ForwardingStore(real_store(root), alter_build=break_close)
    report = runtime_for(root, PREFERRED, store_factory=lambda config: store).publish_after_load(
        identity, post_load_producer(identity)
    )
    assert report.status is PostLoadPublicationStatus.FAILED
    assert report.failure is not None
    assert report.failure.code is FailureCode.LEASE_CLOSE_FAILED
    details = report.failure.details.to_value()
    assert isinstance(details, dict) and details["publication_status"] == "published"
    assert report.publication_id is not None
    assert len(wrapped) == 1 and wrapped[0].released
    assert all(lease.closed for lease in store.leases())


def test_post_load_unexpected_status_is_reported(tmp_path: Path) -> None:
    """R09: get_or_build answering MISS (ForwardingStore seam) is UNEXPECTED_STATUS, reported not raised."""
    root = tmp_path / "hwr"
    identity = make_identity()

    def to_miss(result: StoreResult) -> StoreResult:
        assert result.lease is not None
        result.lease.close()
        return StoreResult(StoreStatus.MISS, result.identity)

    store = ForwardingStore(real_store(root), alter_build=to_miss)
    report = runtime_for(root, PREFERRED, store_factory=lambda config: store).publish_after_load(
        identity, post_load_producer(identity)
    )
    assert report.status is PostLoadPublicationStatus.FAILED
    assert report.failure is not None
    assert report.failure.code is FailureCode.UNEXPECTED_STATUS


def test_store_that_raises_is_reported_by_both_entry_points(tmp_path: Path) -> None:
    """R09: a store call that raises instead of returning becomes UNEXPECTED_STATUS in both reports."""
    root = tmp_path / "hwr"
    identity = make_identity()

    def explode(identity: WeightArtifactIdentity) -> StoreResult:
        raise RuntimeError("store bug")

    store = ForwardingStore(real_store(root), fake_build=explode)
    runtime = runtime_for(root, PREFERRED, store_factory=lambda config: store)
    report = runtime.publish_after_load(identity, post_load_producer(identity))
    assert report.status is PostLoadPublicationStatus.FAILED
    assert report.failure is not None and report.failure.code is FailureCode.UNEXPECTED_STATUS
    resolution = runtime.resolve(identity, pre_load_producer(identity))
    assert resolution.outcome is ResolutionOutcome.FAILED  # a broken store is not a miss
    assert resolution.report.failure is not None
    assert resolution.report.failure.code is FailureCode.UNEXPECTED_STATUS


# --------------------------------------------------------------------------- R10


@pytest.mark.parametrize("mode", [PREFERRED, REQUIRED])
def test_producer_failure_fails_in_both_modes(tmp_path: Path, mode: RuntimeMode) -> None:
    """R10: PRODUCER_FAILED (a producer that raises) fails even in PREFERRED."""
    identity = make_identity()

    def boom() -> None:
        raise RuntimeError("producer exploded")

    resolution = runtime_for(tmp_path / "hwr", mode).resolve(identity, pre_load_producer(identity, before_write=boom))
    assert resolution.outcome is ResolutionOutcome.FAILED
    assert resolution.lease is None
    assert resolution.report.failure is not None
    assert resolution.report.failure.code is FailureCode.PRODUCER_FAILED
    assert steps(resolution.report)[-1] == (ResolutionStage.PRODUCTION, AttemptResult.FAILED, AttemptAction.FAIL)


@pytest.mark.parametrize(
    "code", [FailureCode.PRODUCER_UNSUPPORTED, FailureCode.IDENTITY_COLLISION, FailureCode.PUBLICATION_FAILED]
)
def test_fatal_codes_fail_in_preferred_even_if_marked_retryable(tmp_path: Path, code: FailureCode) -> None:
    """R10: these codes fail in PREFERRED even when a store marks them retryable (ForwardingStore seam)."""
    root = tmp_path / "hwr"
    identity = make_identity()

    def fail_with(identity: WeightArtifactIdentity) -> StoreResult:
        return StoreResult(
            StoreStatus.FAILED,
            identity,
            failure=failure(ResolutionStage.PUBLICATION, code, "injected through the protocol seam", retryable=True),
        )

    store = ForwardingStore(real_store(root), fake_build=fail_with)
    resolution = runtime_for(root, PREFERRED, store_factory=lambda config: store).resolve(
        identity, pre_load_producer(identity)
    )
    assert resolution.outcome is ResolutionOutcome.FAILED
    assert resolution.report.failure is not None and resolution.report.failure.code is code
    assert code in ALWAYS_FATAL
    assert not may_fall_back(resolution.report.failure)


@pytest.mark.parametrize("mode", [PREFERRED, REQUIRED])
def test_configuration_errors_fail_in_both_modes(tmp_path: Path, mode: RuntimeMode) -> None:
    """R10: a configuration error (world-writable root: UNSAFE_PERMISSIONS) fails even in PREFERRED."""
    root = tmp_path / "hwr"
    root.mkdir(mode=0o700)
    os.chmod(root, 0o777)
    identity = make_identity()
    producer = pre_load_producer(identity)
    resolution = runtime_for(root, mode).resolve(identity, producer)
    assert resolution.outcome is ResolutionOutcome.FAILED
    assert resolution.report.failure is not None
    assert resolution.report.failure.code is FailureCode.UNSAFE_PERMISSIONS
    assert steps(resolution.report) == [(ResolutionStage.DOMAIN, AttemptResult.FAILED, AttemptAction.FAIL)]
    assert producer.calls == 0


def _unopenable_root(tmp_path: Path, how: str) -> Path:
    """A domain root that cannot be opened: a regular file, or under one (missing and not creatable)."""
    blocker = tmp_path / "blocker"
    blocker.write_bytes(b"not a directory")
    return blocker if how == "root_is_a_file" else blocker / "hwr"


@pytest.mark.parametrize("how", ["root_is_a_file", "parent_is_a_file", "unreachable"])
@pytest.mark.parametrize("mode", [PREFERRED, REQUIRED])
def test_domain_that_cannot_be_opened_falls_back_in_preferred(tmp_path: Path, mode: RuntimeMode, how: str) -> None:
    """R11: a root that cannot be opened is DOMAIN_UNAVAILABLE and retryable: PREFERRED loads canonically
    with the failure in its report, REQUIRED fails; nothing is created and the producer never runs."""
    identity = make_identity()
    producer = pre_load_producer(identity)
    if how == "unreachable":  # a mount that went away under the root (ENOTCONN), through the domain's seam
        root = tmp_path / "hwr"
        with armed("domain.open_root", Fault(FaultAction.RAISE_OSERROR, errno=errno.ENOTCONN)):
            resolution = runtime_for(root, mode).resolve(identity, producer)
        assert not root.exists()
    else:
        root = _unopenable_root(tmp_path, how)
        resolution = runtime_for(root, mode).resolve(identity, producer)
        assert (tmp_path / "blocker").read_bytes() == b"not a directory"
    report = resolution.report
    assert report.failure is not None
    assert report.failure.code is FailureCode.DOMAIN_UNAVAILABLE, report.failure
    assert report.failure.stage is ResolutionStage.DOMAIN and report.failure.retryable
    assert may_fall_back(report.failure) and FailureCode.DOMAIN_UNAVAILABLE not in ALWAYS_FATAL
    assert resolution.lease is None and producer.calls == 0
    if mode is PREFERRED:
        assert resolution.outcome is ResolutionOutcome.CANONICAL_FALLBACK
        assert steps(report) == [(ResolutionStage.DOMAIN, AttemptResult.FAILED, AttemptAction.FALL_BACK)]
    else:
        assert resolution.outcome is ResolutionOutcome.FAILED
        assert steps(report) == [(ResolutionStage.DOMAIN, AttemptResult.FAILED, AttemptAction.FAIL)]


def test_refused_domain_is_not_unavailable(tmp_path: Path) -> None:
    """R11, S19: a root refused by policy (group-writable) stays a configuration error even in PREFERRED:
    only a root that cannot be opened falls back."""
    root = tmp_path / "hwr"
    root.mkdir(mode=0o700)
    os.chmod(root, 0o770)
    identity = make_identity()
    resolution = runtime_for(root, PREFERRED).resolve(identity, pre_load_producer(identity))
    assert resolution.outcome is ResolutionOutcome.FAILED
    assert resolution.report.failure is not None
    assert resolution.report.failure.code is FailureCode.UNSAFE_PERMISSIONS


@pytest.mark.parametrize("mode", [PREFERRED, REQUIRED])
def test_producer_for_another_identity_fails_in_both_modes(tmp_path: Path, mode: RuntimeMode) -> None:
    """R10: a producer whose outputs lack the identity is INVALID_CONFIGURATION, never run, in both modes."""
    identity = make_identity(tag="wanted")
    producer = pre_load_producer(make_identity(tag="other"))
    resolution = runtime_for(tmp_path / "hwr", mode).resolve(identity, producer)
    assert resolution.outcome is ResolutionOutcome.FAILED
    assert resolution.report.failure is not None
    assert resolution.report.failure.code is FailureCode.INVALID_CONFIGURATION
    assert producer.calls == 0


def test_retryable_failure_falls_back_in_preferred_fails_in_required(tmp_path: Path) -> None:
    """R10: a retryable failure (ARTIFACT_TOO_LARGE) falls back in PREFERRED and fails in REQUIRED."""
    identity = make_identity()
    capacity = CapacityPolicy(max_artifact_bytes=64)
    preferred = runtime_for(tmp_path / "hwr", PREFERRED, capacity=capacity).resolve(
        identity, pre_load_producer(identity)
    )
    required = runtime_for(tmp_path / "hwr", REQUIRED, capacity=capacity).resolve(identity, pre_load_producer(identity))

    assert preferred.outcome is ResolutionOutcome.CANONICAL_FALLBACK
    assert preferred.lease is None
    assert preferred.report.failure is not None
    assert preferred.report.failure.code is FailureCode.ARTIFACT_TOO_LARGE
    assert steps(preferred.report)[-1] == (ResolutionStage.PRODUCTION, AttemptResult.FAILED, AttemptAction.FALL_BACK)
    assert required.outcome is ResolutionOutcome.FAILED
    assert required.report.failure is not None
    assert required.report.failure.code is FailureCode.ARTIFACT_TOO_LARGE


def test_store_init_lock_timeout_falls_back_then_recovers(tmp_path: Path) -> None:
    """R10: a stalled domain-init lock is a retryable DOMAIN failure (PREFERRED falls back, REQUIRED fails);
    the failed store is not cached, so once the lock is released the same runtime builds and a fresh one hits."""
    root = tmp_path / "hwr"
    identity = make_identity()
    producer = pre_load_producer(identity)
    preferred = runtime_for(root, PREFERRED, lock_timeout_s=0.0)
    required = runtime_for(root, REQUIRED, lock_timeout_s=0.0)
    fd = hold_init_lock(root)
    try:
        fell_back = preferred.resolve(identity, producer)
        failed = required.resolve(identity, producer)
    finally:
        os.close(fd)

    assert fell_back.outcome is ResolutionOutcome.CANONICAL_FALLBACK
    assert steps(fell_back.report) == [(ResolutionStage.DOMAIN, AttemptResult.FAILED, AttemptAction.FALL_BACK)]
    assert fell_back.report.failure is not None
    assert fell_back.report.failure.code is FailureCode.LOCK_TIMEOUT
    assert fell_back.report.failure.retryable
    assert failed.outcome is ResolutionOutcome.FAILED
    assert failed.report.failure is not None and failed.report.failure.code is FailureCode.LOCK_TIMEOUT
    assert producer.calls == 0

    built = preferred.resolve(identity, producer)
    assert built.outcome is ResolutionOutcome.LOCAL_PRODUCTION
    assert built.lease is not None
    built.lease.close()
    hit = runtime_for(root, REQUIRED).resolve(identity)
    assert hit.outcome is ResolutionOutcome.LOCAL_HIT
    assert hit.lease is not None
    hit.lease.close()


def _corrupt_payload(root: Path, identity: WeightArtifactIdentity) -> None:
    """Flip one payload byte of a published artifact, restoring the published permissions afterwards."""
    artifact = real_store(root).layout.artifact_dir(identity.key)
    payload = sorted(artifact.glob("*.safetensors"))[0]
    os.chmod(artifact, 0o755)
    os.chmod(payload, 0o644)
    data = bytearray(payload.read_bytes())
    data[-1] ^= 0xFF
    payload.write_bytes(bytes(data))
    os.chmod(payload, 0o444)
    os.chmod(artifact, 0o555)


def test_invalid_artifact_is_rebuilt_or_falls_back(tmp_path: Path) -> None:
    """R10: an invalid artifact may fall back in PREFERRED, fails in REQUIRED, and with a producer is rebuilt."""
    root = tmp_path / "hwr"
    identity = make_identity()
    tensors = make_tensors(11)
    producer = SyntheticProducer(identity, tensors)
    full = ValidationLevel.FULL_CHECKSUM
    first = runtime_for(root, REQUIRED, validation=full).resolve(identity, producer)
    assert first.lease is not None
    first.lease.close()
    _corrupt_payload(root, identity)

    fell_back = runtime_for(root, PREFERRED, validation=full).resolve(identity)
    assert fell_back.outcome is ResolutionOutcome.CANONICAL_FALLBACK
    assert steps(fell_back.report) == [
        (ResolutionStage.LOOKUP, AttemptResult.INVALID, AttemptAction.CONTINUE),
        (ResolutionStage.PRODUCTION, AttemptResult.SKIPPED, AttemptAction.FALL_BACK),
    ]
    assert fell_back.report.failure is not None
    assert fell_back.report.failure.code is FailureCode.CHECKSUM_MISMATCH

    failed = runtime_for(root, REQUIRED).resolve(identity)  # the deny marker now answers any level
    assert failed.outcome is ResolutionOutcome.FAILED
    assert failed.report.failure is not None
    assert failed.report.failure.code is FailureCode.ARTIFACT_DENIED

    rebuilt = runtime_for(root, REQUIRED, validation=full).resolve(identity, producer)
    assert rebuilt.outcome is ResolutionOutcome.LOCAL_PRODUCTION
    assert steps(rebuilt.report) == [
        (ResolutionStage.LOOKUP, AttemptResult.INVALID, AttemptAction.CONTINUE),
        (ResolutionStage.PRODUCTION, AttemptResult.BUILT, AttemptAction.USE),
    ]
    assert rebuilt.lease is not None
    assert rebuilt.report.publication_id != first.report.publication_id
    assert_same_tensors(rebuilt.lease, tensors)
    rebuilt.lease.close()
    assert producer.calls == 2


def test_decision_table() -> None:
    """R10: the mode-independent table: miss and invalid may fall back; retryable may; fatal codes never."""
    retryable_timeout = failure(ResolutionStage.LOOKUP, FailureCode.LOCK_TIMEOUT, "t", retryable=True)
    checksum = failure(ResolutionStage.LOOKUP, FailureCode.CHECKSUM_MISMATCH, "c")
    io_fatal = failure(ResolutionStage.LOOKUP, FailureCode.IO_ERROR, "io")
    assert may_fall_back(None)
    assert may_fall_back(retryable_timeout)
    assert may_fall_back(checksum, invalid_artifact=True)
    assert not may_fall_back(checksum)
    assert not may_fall_back(io_fatal)
    for code in ALWAYS_FATAL:
        marked = HostWeightFailure(ResolutionStage.PRODUCTION, code, True, "m")
        assert not may_fall_back(marked, invalid_artifact=True), code


# --------------------------------------------------------------------------- S24


@pytest.mark.parametrize("scope", [CoordinationScope.GROUP_COHORT, CoordinationScope.ARTIFACT_BUNDLE])
@pytest.mark.parametrize("mode", [PREFERRED, REQUIRED])
def test_unimplemented_coordination_scope_is_unsupported(
    tmp_path: Path, scope: CoordinationScope, mode: RuntimeMode
) -> None:
    """S24: cohort and bundle producers are a typed UNSUPPORTED failure in both modes, never silently run."""
    identity = make_identity()
    producer = pre_load_producer(identity, scope=scope)
    resolution = runtime_for(tmp_path / "hwr", mode).resolve(identity, producer)
    assert resolution.outcome is ResolutionOutcome.FAILED
    assert resolution.report.failure is not None
    assert resolution.report.failure.code is FailureCode.UNSUPPORTED
    assert not resolution.report.failure.retryable
    assert steps(resolution.report)[-1] == (ResolutionStage.PRODUCTION, AttemptResult.FAILED, AttemptAction.FAIL)
    assert producer.calls == 0

    post_load = post_load_producer(identity, scope=scope)
    report = runtime_for(tmp_path / "hwr", mode).publish_after_load(identity, post_load)
    assert report.status is PostLoadPublicationStatus.FAILED
    assert report.failure is not None and report.failure.code is FailureCode.UNSUPPORTED
    assert post_load.calls == 0


class _NotAProvider:
    """Has an id but neither probe nor fetch: not a RemoteArtifactProvider."""

    provider_id = "not-a-provider"


def test_objects_that_are_not_remote_providers_are_refused(tmp_path: Path) -> None:
    """Remote providers are implemented; an object without probe/fetch is refused, never ignored."""
    root = tmp_path / "hwr"
    with pytest.raises(TypeError, match="RemoteArtifactProvider"):
        HostWeightRuntime(HostWeightRuntimeConfig(root=root), remote_providers=[_NotAProvider()])  # type: ignore[list-item]
    assert not root.exists()


# --------------------------------------------------------------------------- misc contract


def test_from_env_passes_keyword_arguments(tmp_path: Path) -> None:
    """DESIGN 7 (from_env): forwards observers (and other keyword arguments) to the constructor."""
    reports: list[Report] = []
    runtime = HostWeightRuntime.from_env(
        {"HWR_MODE": "required", "HWR_ROOT": str(tmp_path / "hwr"), "HWR_ALLOW_LOCAL_BUILD": "false"},
        observers=(reports.append,),
    )
    assert runtime.config.mode is REQUIRED
    assert not runtime.config.allow_local_build
    resolution = runtime.resolve(make_identity())
    assert reports == [resolution.report]


def test_programming_errors_raise() -> None:
    """DESIGN 7 (programming errors): a wrong identity or producer argument raises TypeError, not a report."""
    runtime = HostWeightRuntime(HostWeightRuntimeConfig(mode=DISABLED))
    with pytest.raises(TypeError):
        runtime.resolve("not an identity")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        runtime.publish_after_load(make_identity(), object())  # type: ignore[arg-type]

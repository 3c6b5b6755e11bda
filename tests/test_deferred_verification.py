"""A load finishes before the artifacts it leased are re-hashed beside it (S08, X01).

A background verification takes the interpreter lock between its reads, and the loading thread would wait for
it; so a lease taken inside `deferred_verifications` (what `load_component` and `load_pipeline` run in) starts
its verification only when the block ends. Real files, flocks and threads; synchronised by events and the named
seams `verify.claimed` and `verify.release_held`.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from host_weight_runtime import BuildRequest, FilesystemHostWeightStore, StoreStatus, ValidationLevel
from host_weight_runtime._faults import Fault, FaultAction, armed
from host_weight_runtime.diffusion import load_pipeline, prewarm_pipeline
from host_weight_runtime.filesystem._verify import BackgroundVerification, BackgroundVerifyMode, VerificationLedger
from host_weight_runtime.lease import HostWeightLease, VerificationState, deferred_verifications
from hwr_tools.synthetic_pipelines import pipeline_kind, save_tiny_pipeline

from ._pipelines import runtime_at
from .support import SyntheticProducer, make_identity, make_tensors

META = ValidationLevel.MANIFEST_AND_METADATA
WAIT_S = 60.0


def _published(root: Path) -> FilesystemHostWeightStore:
    """The standard test artifact, published and not yet verified on this node."""
    store = FilesystemHostWeightStore(root, background_verify=BackgroundVerifyMode.ONCE)
    identity = make_identity()
    built = store.get_or_build(
        BuildRequest(identity),
        SyntheticProducer(identity, make_tensors(), files=2),
        validation=META,
        deadline=time.monotonic() + WAIT_S,
    )
    assert built.status is StoreStatus.BUILT and built.lease is not None
    built.lease.close()
    return store


def _hit(store: FilesystemHostWeightStore) -> tuple[HostWeightLease, BackgroundVerification]:
    result = store.lookup(make_identity(), validation=META)
    assert result.status is StoreStatus.HIT and result.lease is not None
    verification = result.lease.verification
    assert isinstance(verification, BackgroundVerification)
    return result.lease, verification


def _verifiers() -> list[threading.Thread]:
    return [thread for thread in threading.enumerate() if thread.name == "hwr-verify"]


def test_a_verification_taken_inside_the_block_starts_when_the_block_ends(tmp_path: Path) -> None:
    """S08: inside the block a hit's lease is served with its verification held (not started, RUNNING, no
    verifier thread, nothing recorded); an inner block's end starts nothing; the outermost block's end starts
    it, and it verifies and records the publication."""
    store = _published(tmp_path / "hwr")
    ledger = VerificationLedger(store.layout)
    with deferred_verifications():
        with deferred_verifications():
            lease, verification = _hit(store)
        assert not verification.started and verification.state is VerificationState.RUNNING
        assert _verifiers() == [] and not verification.wait(0.0)
        assert lease.tensors  # the lease is served meanwhile
        assert ledger.read(make_identity().key) is None
    assert verification.started
    assert verification.wait(WAIT_S) and verification.state is VerificationState.VERIFIED
    assert ledger.is_verified(make_identity().key, lease.provenance.publication_id)
    lease.close()


def test_a_lease_closed_while_its_verification_is_held_abandons_it(tmp_path: Path) -> None:
    """S08, S21: a lease closed inside the block ends its held verification ABANDONED; the block's end does not
    start it and nothing is recorded, so the next hit verifies."""
    store = _published(tmp_path / "hwr")
    with deferred_verifications():
        lease, verification = _hit(store)
        lease.close()
        assert verification.wait(0.0) and verification.state is VerificationState.ABANDONED
    assert not verification.started and _verifiers() == []
    assert VerificationLedger(store.layout).read(make_identity().key) is None
    again, next_verification = _hit(store)
    assert next_verification.wait(WAIT_S) and next_verification.state is VerificationState.VERIFIED
    again.close()


def test_waiting_for_a_held_verification_starts_it(tmp_path: Path) -> None:
    """S08: a caller inside the block that waits for its lease's verification does not wait for the block: the
    wait starts it, and the block's end does not start it twice."""
    store = _published(tmp_path / "hwr")
    with deferred_verifications():
        lease, verification = _hit(store)
        assert verification.wait(WAIT_S) and verification.state is VerificationState.VERIFIED
    assert verification.state is VerificationState.VERIFIED
    lease.close()


def test_a_warm_pipeline_is_assembled_before_any_of_its_artifacts_is_verified(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """X01, S08: a warm `load_pipeline` over four freshly published, unverified artifacts starts no verifier
    while it loads (each would be held at its claim until the load returned, so any started during the load
    would still be alive when the load releases them); once it has returned, every component's verification
    runs and records its publication."""
    folder = save_tiny_pipeline(tmp_path / "flux", "flux")
    store = tmp_path / "domain"
    dtype = pipeline_kind("flux").torch_dtype
    prewarm_pipeline(folder, torch_dtype=dtype, runtime=runtime_at(store))
    monkeypatch.setenv("HWR_BACKGROUND_VERIFY", "once")  # the suite runs with it off (conftest.py)
    returned = threading.Event()
    verifiers_at_release: list[int] = []

    def at_release(point: str) -> None:
        del point
        verifiers_at_release.append(len(_verifiers()))

    def at_claim(point: str) -> None:
        del point
        returned.wait(WAIT_S)

    with (
        armed("verify.release_held", Fault(FaultAction.PAUSE, hook=at_release, times=10)),
        armed("verify.claimed", Fault(FaultAction.PAUSE, hook=at_claim, times=10)),
    ):
        loaded = load_pipeline(folder, torch_dtype=dtype, runtime=runtime_at(store))
        returned.set()
        try:
            assert verifiers_at_release == [0]  # one outermost block, released with no verifier running
            assert set(loaded.outcomes.values()) == {loaded.outcomes["transformer"]}
            assert loaded.outcomes["transformer"].value == "local_hit" and len(loaded.components) == 4
            for name, component in loaded.components.items():
                assert component.lease is not None, name
                verification = component.lease.verification
                assert verification is not None, name
                assert verification.wait(WAIT_S) and verification.state is VerificationState.VERIFIED, name
        finally:
            loaded.close()

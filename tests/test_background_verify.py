"""Background full verification once per publication per node (HWR_BACKGROUND_VERIFY).

The default lookup does not hash payloads, so the first lease of a tampered artifact is served
(documented). Its background verification then denies the artifact, so the next resolve falls back
and the next build quarantines and rebuilds (S08). One process verifies a publication; the record
lives outside the artifact. Real files, flocks and spawned children; synchronised by pipes, events
and the named seams `verify.claimed` and `verify.read`.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path

import pytest
import torch

from host_weight_runtime import BuildRequest, FilesystemHostWeightStore, StoreStatus, ValidationLevel, _telemetry
from host_weight_runtime._digest import DigestAlgorithm
from host_weight_runtime._faults import Fault, FaultAction, arm, armed
from host_weight_runtime.cli import main as hwr
from host_weight_runtime.config import HostWeightRuntimeConfig, RuntimeMode
from host_weight_runtime.failures import FailureCode
from host_weight_runtime.filesystem._verify import (
    VERIFIER_NICE_RAISE,
    BackgroundVerifyMode,
    VerificationLedger,
    background_verify_mode,
)
from host_weight_runtime.filesystem.locks import try_lock
from host_weight_runtime.lease import VerificationState
from host_weight_runtime.outcomes import ResolutionOutcome
from host_weight_runtime.runtime import HostWeightRuntime

from ._hostile import assert_served_exactly, manifest_value, writable
from .support import SPAWN, SyntheticProducer, make_identity, make_tensors, reaped_children, recv_within

META = ValidationLevel.MANIFEST_AND_METADATA
FULL = ValidationLevel.FULL_CHECKSUM
ONCE = BackgroundVerifyMode.ONCE
WAIT_S = 60.0


def soon() -> float:
    return time.monotonic() + WAIT_S


def publish(root: Path, mode: BackgroundVerifyMode = ONCE) -> FilesystemHostWeightStore:
    """Publish the standard test artifact (two payload files) and close the builder's lease."""
    store = FilesystemHostWeightStore(root, background_verify=mode)
    identity = make_identity()
    built = store.get_or_build(
        BuildRequest(identity), SyntheticProducer(identity, make_tensors(), files=2), validation=META, deadline=soon()
    )
    assert built.status is StoreStatus.BUILT and built.lease is not None
    assert built.lease.verification is None  # the builder hashed every byte it wrote
    built.lease.close()
    return store


def flip_payload_byte(store: FilesystemHostWeightStore) -> None:
    """What a same-uid co-tenant can do: flip the last byte of the first payload (tensor data)."""
    directory = store.layout.artifact_dir(make_identity().key)
    files = manifest_value(directory)["files"]
    assert isinstance(files, list)
    with writable(directory):
        path = directory / files[0]["name"]
        data = bytearray(path.read_bytes())
        data[-1] ^= 0x01
        path.write_bytes(bytes(data))


def test_flipped_byte_is_served_once_then_denied_by_the_background_verification_and_rebuilt(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """S08: a metadata lookup of a tampered artifact still hits (documented), its background verification
    denies it (a warning and a telemetry event say so; the lease keeps serving), the next resolve falls back
    and the next build quarantines and rebuilds exactly once."""
    store = publish(tmp_path / "hwr")
    key = make_identity().key
    flip_payload_byte(store)
    events: list[_telemetry.TelemetryEvent] = []
    _telemetry.add_listener(events.append)
    try:
        with caplog.at_level(logging.WARNING, logger="host_weight_runtime"):
            first = store.lookup(make_identity(), validation=META)
            assert first.status is StoreStatus.HIT and first.lease is not None
            verification = first.lease.verification
            assert verification is not None
            assert verification.wait(WAIT_S)
    finally:
        _telemetry.remove_listener(events.append)
    assert verification.state is VerificationState.DENIED
    assert verification.failure is not None and verification.failure.code is FailureCode.CHECKSUM_MISMATCH
    assert store.layout.deny_marker(key).exists()
    assert not store.layout.verified_marker(key).exists()
    assert any("failed its digests" in record.getMessage() for record in caplog.records)
    assert [(e.kind, e.ok) for e in events if e.kind is _telemetry.TelemetryKind.VERIFIED] == [
        (_telemetry.TelemetryKind.VERIFIED, False)
    ]
    assert len(first.lease.tensors) == len(make_tensors())  # the worker that got it is not crashed
    first.lease.close()

    config = HostWeightRuntimeConfig(mode=RuntimeMode.PREFERRED, root=store.root)
    resolution = HostWeightRuntime(config).resolve(make_identity())
    assert resolution.report.outcome is ResolutionOutcome.CANONICAL_FALLBACK
    assert resolution.report.failure is not None
    assert resolution.report.failure.code is FailureCode.ARTIFACT_DENIED

    counter = tmp_path / "count"
    producer = SyntheticProducer(make_identity(), make_tensors(), files=2, counter_path=counter)
    rebuilt = store.get_or_build(BuildRequest(make_identity()), producer, validation=META, deadline=soon())
    assert rebuilt.status is StoreStatus.BUILT and rebuilt.lease is not None
    rebuilt.lease.close()
    assert len(counter.read_text().splitlines()) == 1
    assert len(store.layout.quarantined_dirs(key)) == 1
    again = store.lookup(make_identity(), validation=META)
    assert again.status is StoreStatus.HIT and again.lease is not None
    assert again.lease.verification is not None and again.lease.verification.wait(WAIT_S)
    assert again.lease.verification.state is VerificationState.VERIFIED
    assert_served_exactly(again.lease.tensors, make_tensors())
    assert VerificationLedger(store.layout).is_verified(key, again.lease.publication_id)
    again.lease.close()


def test_the_record_lives_outside_the_artifact_and_survives_new_processes(tmp_path: Path) -> None:
    """S03: verification writes only `verified/<key>.json` (the artifact is untouched); later leases, in a
    new store and in another process, start no verification; a FULL_CHECKSUM lease records it too."""
    store = publish(tmp_path / "hwr")
    key = make_identity().key
    directory = store.layout.artifact_dir(key)
    before = {path.name: path.stat() for path in directory.iterdir()}
    first = store.lookup(make_identity(), validation=META)
    assert first.lease is not None and first.lease.verification is not None
    assert first.lease.verification.wait(WAIT_S)
    assert first.lease.verification.state is VerificationState.VERIFIED
    first.lease.close()
    after = {path.name: path.stat() for path in directory.iterdir()}
    assert {name: (s.st_mtime_ns, s.st_size, s.st_mode) for name, s in before.items()} == {
        name: (s.st_mtime_ns, s.st_size, s.st_mode) for name, s in after.items()
    }
    record = json.loads(store.layout.verified_marker(key).read_bytes())
    assert record["key"] == key and record["publication_id"] == first.publication_id

    fresh = FilesystemHostWeightStore(store.root, background_verify=ONCE)
    later = fresh.lookup(make_identity(), validation=META)
    assert later.lease is not None and later.lease.verification is None
    later.lease.close()
    report, child_report = SPAWN.Pipe(duplex=False)
    with reaped_children() as children:
        child = SPAWN.Process(target=lookup_child, args=(str(store.root), None, child_report))
        child.start()
        children.append(child)
        assert recv_within(report) == {"status": "hit", "verification": None}
        child.join(WAIT_S)
    assert child.exitcode == 0

    os.unlink(store.layout.verified_marker(key))
    strong = fresh.lookup(make_identity(), validation=FULL)
    assert strong.lease is not None and strong.lease.verification is None
    strong.lease.close()
    assert VerificationLedger(store.layout).is_verified(key, strong.publication_id or "")


def lookup_child(root: str, pause_at: str | None, report: Connection, control: Connection | None = None) -> None:
    """Child: a metadata lookup with HWR_BACKGROUND_VERIFY=once; report the verification's end state.

    With `pause_at`, the verifier stops there first: the child reports "paused" and waits for "go".
    """
    os.environ["HWR_BACKGROUND_VERIFY"] = "once"
    if pause_at is not None:

        def hook(_point: str) -> None:
            report.send("paused")
            assert control is not None
            control.recv()

        arm(pause_at, Fault(FaultAction.PAUSE, hook=hook))
    store = FilesystemHostWeightStore(Path(root))
    result = store.lookup(make_identity(), validation=META)
    assert result.lease is not None
    verification = result.lease.verification
    if verification is not None:
        verification.wait()
    report.send(
        {"status": result.status.value, "verification": None if verification is None else verification.state.value}
    )
    result.lease.close()


def test_two_processes_leasing_at_once_verify_once(tmp_path: Path) -> None:
    """S14: while one process holds the verify claim, a second first lease skips (nothing is hashed twice);
    the first records the publication, and later leases start nothing."""
    store = publish(tmp_path / "hwr")
    key = make_identity().key
    first_report, first_child_report = SPAWN.Pipe(duplex=False)
    first_child_control, first_control = SPAWN.Pipe(duplex=False)
    second_report, second_child_report = SPAWN.Pipe(duplex=False)
    with reaped_children() as children:
        first = SPAWN.Process(
            target=lookup_child,
            args=(str(store.root), "verify.claimed", first_child_report, first_child_control),
        )
        first.start()
        children.append(first)
        assert recv_within(first_report) == "paused"  # holds the claim, has hashed nothing yet
        second = SPAWN.Process(target=lookup_child, args=(str(store.root), None, second_child_report))
        second.start()
        children.append(second)
        assert recv_within(second_report) == {"status": "hit", "verification": "skipped"}
        second.join(WAIT_S)
        assert not store.layout.verified_marker(key).exists()
        first_control.send("go")
        assert recv_within(first_report) == {"status": "hit", "verification": "verified"}
        first.join(WAIT_S)
    assert first.exitcode == 0 and second.exitcode == 0
    assert VerificationLedger(store.layout).read(key) is not None
    later = store.lookup(make_identity(), validation=META)
    assert later.lease is not None and later.lease.verification is None
    later.lease.close()


def test_a_verifier_killed_mid_way_leaves_no_claim_and_no_record(tmp_path: Path) -> None:
    """S16: a worker killed while verifying (as at interpreter exit, the thread is a daemon) leaves neither a
    held claim nor a record; the next first lease verifies."""
    store = publish(tmp_path / "hwr")
    key = make_identity().key
    report, child_report = SPAWN.Pipe(duplex=False)
    child_control, control = SPAWN.Pipe(duplex=False)
    with reaped_children() as children:
        child = SPAWN.Process(target=lookup_child, args=(str(store.root), "verify.read", child_report, child_control))
        child.start()
        children.append(child)
        assert recv_within(report) == "paused"
        assert try_lock(store.layout.verify_lock(key), exclusive=True) is None  # the child holds the claim
        child.kill()
        child.join(WAIT_S)
    control.close()
    assert not store.layout.verified_marker(key).exists()
    claim = try_lock(store.layout.verify_lock(key), exclusive=True)
    assert claim is not None
    claim.release()
    lease = store.lookup(make_identity(), validation=META).lease
    assert lease is not None and lease.verification is not None and lease.verification.wait(WAIT_S)
    assert lease.verification.state is VerificationState.VERIFIED
    lease.close()


def test_closing_the_lease_abandons_the_verification_without_a_record(tmp_path: Path) -> None:
    """S21: close() stops the verifier at its next chunk, before the lease's lock goes; nothing is recorded,
    the claim is free, and the next first lease verifies."""
    store = publish(tmp_path / "hwr")
    key = make_identity().key
    reached = threading.Event()
    proceed = threading.Event()

    def hook(_point: str) -> None:
        reached.set()
        proceed.wait()

    with armed("verify.read", Fault(FaultAction.PAUSE, hook=hook)):
        lease = store.lookup(make_identity(), validation=META).lease
        assert lease is not None and lease.verification is not None
        assert reached.wait(WAIT_S)
        closer = threading.Thread(target=lease.close)
        closer.start()
        proceed.set()
        closer.join(WAIT_S)
    assert lease.closed
    assert lease.verification.state is VerificationState.ABANDONED
    assert not store.layout.verified_marker(key).exists()
    claim = try_lock(store.layout.verify_lock(key), exclusive=True)
    assert claim is not None
    claim.release()


@pytest.mark.parametrize("raised_by", [0, 15])
def test_the_verifier_runs_ten_nice_levels_below_the_leasing_thread(tmp_path: Path, raised_by: int) -> None:
    """S08: the background verification raises its own thread's nice by VERIFIER_NICE_RAISE (capped at 19)
    relative to the thread that took the lease, as the background publication does; the caller keeps its own."""
    store = publish(tmp_path / "hwr")
    seen: list[int] = []
    caller: list[int] = []

    def record(_point: str) -> None:  # runs on the verifier's thread
        seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))

    def lease_at_caller_nice() -> None:
        thread_id = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, thread_id, caller_nice)  # this thread only; raising nice needs no privilege
        lease = store.lookup(make_identity(), validation=META).lease
        assert lease is not None and lease.verification is not None
        assert lease.verification.wait(WAIT_S)
        caller.append(os.getpriority(os.PRIO_PROCESS, thread_id))
        lease.close()

    caller_nice = min(19, os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) + raised_by)
    with armed("verify.claimed", Fault(FaultAction.PAUSE, hook=record)):
        leaser = threading.Thread(target=lease_at_caller_nice)
        leaser.start()
        leaser.join(WAIT_S)
    assert seen == [min(19, caller_nice + VERIFIER_NICE_RAISE)]
    assert caller == [caller_nice]


def test_off_disables_and_the_setting_is_strict(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """R10: HWR_BACKGROUND_VERIFY=off starts nothing and records nothing; unset means once; any other value is
    a ValueError that says what to set."""
    store = publish(tmp_path / "hwr", mode=BackgroundVerifyMode.OFF)
    flip_payload_byte(store)
    hit = store.lookup(make_identity(), validation=META)
    assert hit.lease is not None and hit.lease.verification is None
    hit.lease.close()
    assert not store.layout.verified_marker(make_identity().key).exists()
    assert not store.layout.deny_marker(make_identity().key).exists()
    monkeypatch.setenv("HWR_BACKGROUND_VERIFY", "off")
    off = FilesystemHostWeightStore(store.root).lookup(make_identity(), validation=META)
    assert off.lease is not None and off.lease.verification is None
    off.lease.close()
    assert background_verify_mode({}) is ONCE
    assert background_verify_mode({"HWR_BACKGROUND_VERIFY": " OFF "}) is BackgroundVerifyMode.OFF
    with pytest.raises(ValueError, match="'once'"):
        background_verify_mode({"HWR_BACKGROUND_VERIFY": "sometimes"})
    monkeypatch.setenv("HWR_BACKGROUND_VERIFY", "sometimes")
    with pytest.raises(ValueError, match="HWR_BACKGROUND_VERIFY"):
        FilesystemHostWeightStore(store.root)


def test_hwr_verify_says_whether_payloads_were_hashed_on_this_node(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """S08: `hwr verify` (metadata) reports whether a background verification hashed this publication."""
    store = publish(tmp_path / "hwr")
    key = make_identity().key
    assert hwr(["verify", key, "--root", str(store.root), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["background_verified"] is False
    lease = store.lookup(make_identity(), validation=META).lease
    assert lease is not None and lease.verification is not None and lease.verification.wait(WAIT_S)
    lease.close()
    assert hwr(["verify", key, "--root", str(store.root), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["background_verified"] is True and report["verified"] is True
    assert hwr(["verify", key, "--root", str(store.root)]) == 0
    assert "hashed on this node by a background verification" in capsys.readouterr().out.replace("\n", " ")


def test_served_bytes_of_a_verified_lease_are_the_published_tensors(tmp_path: Path) -> None:
    """S05: verification reads through pread and never writes through the lease's mappings."""
    store = publish(tmp_path / "hwr")
    lease = store.lookup(make_identity(), validation=META).lease
    assert lease is not None and lease.verification is not None and lease.verification.wait(WAIT_S)
    assert lease.verification.state is VerificationState.VERIFIED
    expected = make_tensors()
    assert_served_exactly(lease.tensors, expected)
    assert all(torch.equal(lease.tensors[name], tensor) for name, tensor in expected.items())
    lease.close()


@pytest.mark.parametrize("algorithm", list(DigestAlgorithm))
def test_the_verifier_hashes_with_the_algorithm_the_manifest_names(tmp_path: Path, algorithm: DigestAlgorithm) -> None:
    """S08: an intact artifact of either payload digest format verifies (no false denial of blake3-tree-v1
    artifacts), and a flipped byte in one is denied, whichever format it was published with."""
    store = FilesystemHostWeightStore(tmp_path / "hwr", background_verify=ONCE)
    identity = make_identity()
    producer = SyntheticProducer(identity, make_tensors(), files=2, digest_algorithm=algorithm)
    built = store.get_or_build(BuildRequest(identity), producer, validation=META, deadline=soon())
    assert built.status is StoreStatus.BUILT and built.lease is not None
    built.lease.close()
    assert manifest_value(store.layout.artifact_dir(identity.key))["digest_algorithm"] == algorithm.value

    intact = store.lookup(identity, validation=META)
    assert intact.lease is not None and intact.lease.verification is not None
    assert intact.lease.verification.wait(WAIT_S)
    assert intact.lease.verification.state is VerificationState.VERIFIED
    intact.lease.close()

    os.unlink(store.layout.verified_marker(identity.key))
    flip_payload_byte(store)
    tampered = store.lookup(identity, validation=META)
    assert tampered.lease is not None and tampered.lease.verification is not None
    assert tampered.lease.verification.wait(WAIT_S)
    assert tampered.lease.verification.state is VerificationState.DENIED
    tampered.lease.close()
    assert store.lookup(identity, validation=META).status is not StoreStatus.HIT

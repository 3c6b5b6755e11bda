"""A stateful model check of the filesystem store (S02, S03, S08, S18, S21).

Hypothesis drives one `FilesystemHostWeightStore` (a fresh tmpfs directory per
example) through publish / rebuild / lookup / keep and close leases / corrupt /
cleanup over three keys and three seeds, and compares every answer with a plain model:

    key -> (seed, state)   state in {absent, ready, corrupt, denied}
    open leases, each with its key and a copy of the bytes it read when it was opened

`corrupt` is what an outside writer does to a published artifact nobody has leased
(make it writable, flip one payload byte, restore 0444/0555): a metadata lookup
cannot see it and still hits (with that one byte different); a FULL_CHECKSUM lookup
turns it into `denied`. Quarantining a denied artifact needs the exclusive artifact
lock, so a get_or_build while that key has open leases must be a retryable
LOCK_TIMEOUT that changes nothing (it gets an already expired deadline, so it never
waits); with the leases closed first it quarantines and rebuilds exactly once, or
leaves the key absent when the producer fails.

Invariants after every step: metadata lookups of every key agree with the model;
FULL inspection of every key agrees and never denies; every open lease still reads
the bytes it was given; tmp/ is empty; no artifact directory or file is writable;
artifacts/, deny/ and quarantine/ hold exactly what the model says.
"""

from __future__ import annotations

import enum
import json
import os
import stat
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from hypothesis import HealthCheck, Phase, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from host_weight_runtime import (
    ArtifactState,
    BuildRequest,
    CleanupStatus,
    FailureCode,
    FilesystemHostWeightStore,
    HostWeightLease,
    StoreResult,
    StoreStatus,
    ValidationLevel,
)
from host_weight_runtime.filesystem._fsutil import remove_tree
from host_weight_runtime.identity import WeightArtifactIdentity

from .support import SyntheticProducer, make_identity, make_tensors

META = ValidationLevel.MANIFEST_AND_METADATA
FULL = ValidationLevel.FULL_CHECKSUM
KEYS = 3
SEEDS = (0, 1, 2)
WAIT_S = 60.0
SHM = Path("/dev/shm")

IDENTITIES: tuple[WeightArtifactIdentity, ...] = tuple(make_identity(tag=f"stateful-{index}") for index in range(KEYS))
EXPECTED: dict[int, dict[str, torch.Tensor]] = {seed: make_tensors(seed) for seed in SEEDS}

keys = st.integers(min_value=0, max_value=KEYS - 1)
seeds = st.sampled_from(SEEDS)
levels = st.sampled_from([META, FULL])
# Most producers succeed; one in four raises, so builds and failures both happen often.
failures = st.integers(min_value=0, max_value=3).map(lambda draw: draw == 0)


class State(str, enum.Enum):
    ABSENT = "absent"
    READY = "ready"
    CORRUPT = "corrupt"
    DENIED = "denied"


@dataclass
class Entry:
    seed: int = 0
    state: State = State.ABSENT


@dataclass
class OpenLease:
    key: int
    lease: HostWeightLease
    copies: dict[str, torch.Tensor]


class _ProducerBrokeError(RuntimeError):
    pass


def _raise_producer_broke() -> None:
    raise _ProducerBrokeError("the stateful test's producer was told to fail")


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def differing_bytes(actual: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor]) -> int:
    """How many bytes differ between two state dicts of equal names, dtypes and shapes."""
    assert set(actual) == set(expected)
    total = 0
    for name, tensor in expected.items():
        assert actual[name].dtype == tensor.dtype and actual[name].shape == tensor.shape, name
        total += int((as_bytes(actual[name]) != as_bytes(tensor)).sum())
    return total


def flip_first_tensor_byte(payload: Path) -> None:
    """Flip the first data byte of the first non-empty tensor of a safetensors file, in place."""
    with payload.open("r+b") as handle:
        header_length = int.from_bytes(handle.read(8), "little")
        header = json.loads(handle.read(header_length))
        begins = sorted(
            info["data_offsets"][0]
            for name, info in header.items()
            if name != "__metadata__" and info["data_offsets"][1] > info["data_offsets"][0]
        )
        offset = 8 + header_length + begins[0]
        handle.seek(offset)
        value = handle.read(1)[0]
        handle.seek(offset)
        handle.write(bytes([value ^ 0xFF]))


def snapshot(directory: Path) -> dict[str, tuple[int, int, int, int, bytes]]:
    """Every file of a directory: inode, mtime, size, mode and contents."""
    result: dict[str, tuple[int, int, int, int, bytes]] = {}
    for path in sorted(directory.iterdir()):
        info = path.lstat()
        result[path.name] = (info.st_ino, info.st_mtime_ns, info.st_size, info.st_mode, path.read_bytes())
    return result


def remove_domain(path: Path) -> None:
    """Remove a test domain, read-only (0555) published directories included."""
    remove_tree(path)


class StoreMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        parent = str(SHM) if SHM.is_dir() and os.access(SHM, os.W_OK) else None
        self.base = Path(tempfile.mkdtemp(prefix="hwr-stateful-", dir=parent))
        self.store = FilesystemHostWeightStore(self.base / "domain")
        self.layout = self.store.layout
        self.model: dict[int, Entry] = {index: Entry() for index in range(KEYS)}
        self.leases: list[OpenLease] = []
        self.quarantined: dict[int, int] = dict.fromkeys(range(KEYS), 0)

    # ------------------------------------------------------------------ helpers

    def open_count(self, key: int) -> int:
        return sum(1 for held in self.leases if held.key == key)

    def close_leases_of(self, key: int) -> None:
        for held in [held for held in self.leases if held.key == key]:
            self.leases.remove(held)
            held.lease.close()
            assert held.lease.closed

    def keep(self, key: int, lease: HostWeightLease) -> None:
        copies = {name: tensor.clone() for name, tensor in lease.tensors.items()}
        self.leases.append(OpenLease(key, lease, copies))

    def check_hit(self, result: StoreResult, key: int, *, corrupt: bool) -> HostWeightLease:
        assert result.status in (StoreStatus.HIT, StoreStatus.BUILT), (result.status, result.failure)
        assert result.lease is not None and result.publication_id == result.lease.publication_id
        entry = self.model[key]
        differing = differing_bytes(result.lease.tensors, EXPECTED[entry.seed])
        assert differing == (1 if corrupt else 0), differing
        return result.lease

    def expected_paths(self, key: int) -> int:
        """How many paths cleanup removes for a key: artifact, deny marker, quarantined copies."""
        state = self.model[key].state
        return (state is not State.ABSENT) + (state is State.DENIED) + self.quarantined[key]

    def finish(self, key: int, result: StoreResult, keep: bool) -> None:
        if result.lease is None:
            return
        if keep:
            self.keep(key, result.lease)
        else:
            result.lease.close()

    def check_lookup(self, key: int, result: StoreResult, validation: ValidationLevel) -> None:
        """Check a lookup against the model and advance the model (a FULL lookup denies a corrupt copy)."""
        entry = self.model[key]
        if entry.state is State.ABSENT:
            assert result.status is StoreStatus.MISS and result.lease is None and result.failure is None
        elif entry.state is State.READY:
            self.check_hit(result, key, corrupt=False)
        elif entry.state is State.CORRUPT and validation is META:
            self.check_hit(result, key, corrupt=True)
        elif entry.state is State.CORRUPT:
            assert result.status is StoreStatus.INVALID and result.lease is None, result.status
            assert result.failure is not None and result.failure.code is FailureCode.CHECKSUM_MISMATCH
            entry.state = State.DENIED
        else:
            assert result.status is StoreStatus.INVALID and result.lease is None, result.status
            assert result.failure is not None and result.failure.code is FailureCode.ARTIFACT_DENIED

    # ------------------------------------------------------------------ rules

    @initialize(published=st.lists(st.sampled_from(SEEDS) | st.none(), min_size=KEYS, max_size=KEYS))
    def publish_some(self, published: list[int | None]) -> None:
        """Start from a store where some keys are already published (seed) and others absent (None)."""
        for key, seed in enumerate(published):
            if seed is not None:
                self.publish(key, seed, META, fail=False, close_first=False, keep=False, files=1 + key % 2)

    @rule(
        key=keys,
        seed=seeds,
        validation=levels,
        fail=failures,
        close_first=st.booleans(),
        keep=st.booleans(),
        files=st.integers(min_value=1, max_value=2),
    )
    def publish(
        self, key: int, seed: int, validation: ValidationLevel, *, fail: bool, close_first: bool, keep: bool, files: int
    ) -> None:
        """get_or_build: HIT when published, BUILT when absent, quarantine-and-rebuild when denied."""
        if close_first:
            self.close_leases_of(key)
        identity = IDENTITIES[key]
        producer = SyntheticProducer(
            identity, EXPECTED[seed], files=files, before_write=_raise_producer_broke if fail else None
        )
        contended = self.open_count(key) > 0
        # An already expired deadline never waits: an uncontended lock is still taken on the first try.
        deadline = time.monotonic() if contended else time.monotonic() + WAIT_S
        result = self.store.get_or_build(BuildRequest(identity), producer, validation=validation, deadline=deadline)
        assert result.identity == identity
        entry = self.model[key]
        event(f"publish: {entry.state.value}, {validation.value}, {'leased' if contended else 'free'}, fail={fail}")
        if entry.state is State.CORRUPT and validation is FULL:
            entry.state = State.DENIED  # the first lookup inside get_or_build denies it
        if entry.state is State.READY or entry.state is State.CORRUPT:
            self.check_hit(result, key, corrupt=entry.state is State.CORRUPT)
            assert result.status is StoreStatus.HIT and producer.calls == 0
        elif entry.state is State.DENIED and contended:
            assert result.status is StoreStatus.FAILED and result.lease is None, result.status
            assert result.failure is not None and result.failure.code is FailureCode.LOCK_TIMEOUT
            assert result.failure.retryable and producer.calls == 0
        else:
            if entry.state is State.DENIED:
                self.quarantined[key] += 1
                entry.state = State.ABSENT
            assert producer.calls == 1
            if fail:
                assert result.status is StoreStatus.FAILED and result.lease is None, result.status
                assert result.failure is not None and result.failure.code is FailureCode.PRODUCER_FAILED
                assert not result.failure.retryable
            else:
                assert result.status is StoreStatus.BUILT, (result.status, result.failure)
                entry.seed, entry.state = seed, State.READY
                self.check_hit(result, key, corrupt=False)
        self.finish(key, result, keep)

    @rule(key=keys, validation=levels, keep=st.booleans())
    def lookup(self, key: int, validation: ValidationLevel, keep: bool) -> None:
        """lookup never builds; FULL_CHECKSUM denies a corrupt copy (S08)."""
        result = self.store.lookup(IDENTITIES[key], validation=validation, deadline=time.monotonic() + WAIT_S)
        assert result.identity == IDENTITIES[key]
        event(f"lookup: {self.model[key].state.value}, {validation.value}")
        self.check_lookup(key, result, validation)
        self.finish(key, result, keep)

    @precondition(lambda self: bool(self.leases))
    @rule(pick=st.integers(min_value=0, max_value=1_000_000))
    def close_lease(self, pick: int) -> None:
        """close() is idempotent (S21)."""
        held = self.leases.pop(pick % len(self.leases))
        held.lease.close()
        held.lease.close()
        assert held.lease.closed

    @precondition(lambda self: any(e.state is State.READY and self.open_count(k) == 0 for k, e in self.model.items()))
    @rule(data=st.data(), lease_first=st.booleans(), deny=st.booleans())
    def corrupt(self, data: st.DataObject, lease_first: bool, deny: bool) -> None:
        """An outside writer flips one payload byte of a ready artifact nobody has leased.

        Optionally a metadata reader then leases the corrupt copy (it cannot tell), and
        optionally a FULL_CHECKSUM lookup then denies it (S08): the denied-but-leased
        state that makes a rebuild wait for the exclusive lock.
        """
        eligible = [k for k, e in self.model.items() if e.state is State.READY and self.open_count(k) == 0]
        key = data.draw(st.sampled_from(eligible), label="key")
        directory = self.layout.artifact_dir(IDENTITIES[key].key)
        payload = sorted(directory.glob("*.safetensors"))[0]
        os.chmod(directory, 0o755)
        os.chmod(payload, 0o644)
        try:
            flip_first_tensor_byte(payload)
        finally:
            os.chmod(payload, 0o444)
            os.chmod(directory, 0o555)
        self.model[key].state = State.CORRUPT
        if lease_first:
            self.lookup(key, META, keep=True)
        if deny:
            self.lookup(key, FULL, keep=False)
            assert self.model[key].state is State.DENIED
            assert self.layout.deny_marker(IDENTITIES[key].key).exists()

    @precondition(lambda self: any(e.state in (State.CORRUPT, State.DENIED) for e in self.model.values()))
    @rule(data=st.data(), seed=seeds, fail=failures, close_first=st.booleans(), keep=st.booleans())
    def rebuild(self, data: st.DataObject, seed: int, fail: bool, close_first: bool, keep: bool) -> None:
        """get_or_build(FULL) of a corrupt or denied key: deny, quarantine and rebuild exactly once (S08).

        With that key's leases still open the quarantine cannot take the exclusive lock:
        a retryable LOCK_TIMEOUT that changes nothing. A failing producer leaves the key absent.
        """
        eligible = [k for k, e in self.model.items() if e.state in (State.CORRUPT, State.DENIED)]
        key = data.draw(st.sampled_from(eligible), label="key")
        self.publish(key, seed, FULL, fail=fail, close_first=close_first, keep=keep, files=1 + seed % 2)

    @rule(key=keys, dry_run=st.booleans())
    def cleanup(self, key: int, dry_run: bool) -> None:
        """Cleanup refuses while a lease is open and changes nothing (S02); otherwise it removes everything.

        Everything is the artifact, its deny marker and the key's quarantined copies; a dry
        run only plans (PLANNED) and removes nothing.
        """
        ident = IDENTITIES[key].key
        entry = self.model[key]
        directory = self.layout.artifact_dir(ident)
        before = snapshot(directory) if directory.exists() else None
        denied_before = self.layout.deny_marker(ident).exists()
        result = self.store.cleanup(ident, dry_run=dry_run)
        event(f"cleanup: {entry.state.value}, {'leased' if self.open_count(key) else 'free'}, dry_run={dry_run}")
        assert result.key == ident
        if self.open_count(key) > 0:
            assert result.status is CleanupStatus.ACTIVE_LEASE, result.status
            assert result.failure is not None and result.failure.code is FailureCode.ACTIVE_LEASE
            assert result.failure.retryable and result.removed_paths == ()
            assert before is not None and snapshot(directory) == before
            assert self.layout.deny_marker(ident).exists() == denied_before
        elif entry.state is State.ABSENT and self.quarantined[key] == 0:
            assert result.status is CleanupStatus.NOT_PRESENT, (result.status, result.removed_paths)
        elif dry_run:
            assert result.status is CleanupStatus.PLANNED and result.dry_run, result.status
            assert len(result.removed_paths) == self.expected_paths(key)
            assert (snapshot(directory) if directory.exists() else None) == before
            assert self.layout.deny_marker(ident).exists() == denied_before
        else:
            assert result.status is CleanupStatus.REMOVED and not result.dry_run, result.status
            assert result.removed_bytes > 0 and len(result.removed_paths) == self.expected_paths(key)
            if entry.state is not State.ABSENT:
                assert str(directory) in result.removed_paths
            assert not os.path.lexists(directory)
            entry.state = State.ABSENT
            self.quarantined[key] = 0

    # ------------------------------------------------------------------ invariants

    @invariant()
    def open_leases_read_what_they_were_given(self) -> None:
        for held in self.leases:
            assert not held.lease.closed
            assert differing_bytes(held.lease.tensors, held.copies) == 0, held.key

    @invariant()
    def metadata_lookups_agree_with_the_model(self) -> None:
        for key in range(KEYS):
            result = self.store.lookup(IDENTITIES[key], validation=META, deadline=time.monotonic() + WAIT_S)
            self.check_lookup(key, result, META)
            self.finish(key, result, keep=False)

    @invariant()
    def directories_hold_what_the_model_says(self) -> None:
        assert os.listdir(self.layout.tmp) == []
        present = {IDENTITIES[k].key for k, e in self.model.items() if e.state is not State.ABSENT}
        denied = {f"{IDENTITIES[k].key}.json" for k, e in self.model.items() if e.state is State.DENIED}
        assert set(os.listdir(self.layout.artifacts)) == present
        assert set(os.listdir(self.layout.deny)) == denied
        quarantined = {k: len(self.layout.quarantined_dirs(IDENTITIES[k].key)) for k in range(KEYS)}
        assert quarantined == self.quarantined
        assert len(os.listdir(self.layout.quarantine)) == sum(self.quarantined.values())

    @invariant()
    def no_artifact_is_writable(self) -> None:
        """S03: every published directory is 0555 and every file in it 0444."""
        for name in os.listdir(self.layout.artifacts):
            directory = self.layout.artifacts / name
            assert stat.S_IMODE(directory.lstat().st_mode) == 0o555, name
            for path in directory.iterdir():
                assert stat.S_IMODE(path.lstat().st_mode) == 0o444, path

    @invariant()
    def inspection_reports_without_denying(self) -> None:
        """inspect_artifact(FULL) sees what the model says and never denies or quarantines (S08)."""
        denied = sorted(os.listdir(self.layout.deny))
        for key, entry in self.model.items():
            report = self.store.inspect_artifact(IDENTITIES[key].key, validation=FULL)
            expected = {
                State.ABSENT: ArtifactState.MISSING,
                State.READY: ArtifactState.READY,
                State.CORRUPT: ArtifactState.INVALID,
                State.DENIED: ArtifactState.DENIED,
            }[entry.state]
            assert report.state is expected, (key, report.state, entry.state)
            assert report.locks.lease_active == (self.open_count(key) > 0)
            assert not report.locks.build_active
            if entry.state is State.CORRUPT:
                assert report.problem is not None and report.problem.code is FailureCode.CHECKSUM_MISMATCH
        assert sorted(os.listdir(self.layout.deny)) == denied

    def teardown(self) -> None:
        leases, self.leases = self.leases, []
        try:
            for held in leases:
                held.lease.close()
        finally:
            remove_domain(self.base)


StoreMachine.TestCase.settings = settings(
    max_examples=50,
    stateful_step_count=25,
    deadline=None,
    database=None,
    # No explain phase: on a failure it replays hundreds of examples (minutes) to annotate lines.
    phases=(Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink),
    suppress_health_check=[HealthCheck.too_slow],
)
TestStoreStateMachine = StoreMachine.TestCase


# --------------------------------------------------------------------------- cases the machine found


def _fresh_store(tmp_path: Path) -> FilesystemHostWeightStore:
    return FilesystemHostWeightStore(tmp_path / "domain")


def test_cleanup_removes_quarantined_copies_when_no_artifact_is_left(tmp_path: Path) -> None:
    """S02, S08: corrupt -> FULL deny -> a rebuild whose producer fails leaves only a quarantined copy;
    cleanup must remove it (and report what it really removed).

    Found by the state machine: cleanup skipped the first existing target whenever the
    artifact directory itself was absent, yet listed it in removed_paths.
    """
    store = _fresh_store(tmp_path)
    identity = IDENTITIES[0]
    built = store.get_or_build(
        BuildRequest(identity),
        SyntheticProducer(identity, EXPECTED[0]),
        validation=META,
        deadline=time.monotonic() + WAIT_S,
    )
    assert built.lease is not None
    built.lease.close()
    directory = store.layout.artifact_dir(identity.key)
    payload = sorted(directory.glob("*.safetensors"))[0]
    os.chmod(directory, 0o755)
    os.chmod(payload, 0o644)
    flip_first_tensor_byte(payload)
    os.chmod(payload, 0o444)
    os.chmod(directory, 0o555)
    failing = SyntheticProducer(identity, EXPECTED[0], before_write=_raise_producer_broke)
    result = store.get_or_build(BuildRequest(identity), failing, validation=FULL, deadline=time.monotonic() + WAIT_S)
    assert result.failure is not None and result.failure.code is FailureCode.PRODUCER_FAILED
    assert not directory.exists() and len(store.layout.quarantined_dirs(identity.key)) == 1
    removed = store.cleanup(identity.key)
    assert removed.status is CleanupStatus.REMOVED
    assert store.layout.quarantined_dirs(identity.key) == [], removed.removed_paths
    assert store.cleanup(identity.key).status is CleanupStatus.NOT_PRESENT


def test_cleanup_removes_an_orphan_deny_marker(tmp_path: Path) -> None:
    """S02, S07: a deny marker without an artifact is removed by cleanup, not just reported as removed."""
    store = _fresh_store(tmp_path)
    key = IDENTITIES[1].key
    marker = store.layout.deny_marker(key)
    marker.write_text("{}")
    removed = store.cleanup(key)
    assert removed.status is CleanupStatus.REMOVED and removed.removed_paths == (str(marker),)
    assert not marker.exists()
    assert store.cleanup(key).status is CleanupStatus.NOT_PRESENT

"""Reliability under adversarial input: a hostile or broken co-tenant edits the domain.

Every planted defect must end as a typed INVALID artifact (denied, then quarantined and rebuilt by
the next build), never as a raw exception, a crash, or a hit. Real files, real child processes; the
only fault seam used is `reader.after_validate`.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path

import pytest
import torch

from host_weight_runtime import BuildRequest, FilesystemHostWeightStore, StoreStatus, ValidationLevel
from host_weight_runtime._faults import Fault, FaultAction, arm
from host_weight_runtime.canonical_json import MAX_JSON_DEPTH, CanonicalJson, decode_json, encode_canonical
from host_weight_runtime.config import HostWeightRuntimeConfig, RuntimeMode
from host_weight_runtime.failures import FailureCode, ResolutionStage
from host_weight_runtime.filesystem.inspection import ArtifactState
from host_weight_runtime.manifest import MANIFEST_FILE_NAME, WeightManifest
from host_weight_runtime.outcomes import AttemptAction, AttemptResult, ResolutionOutcome
from host_weight_runtime.runtime import HostWeightRuntime

from ._hostile import (
    assert_served_exactly,
    manifest_value,
    padded,
    plant_header,
    plant_manifest_text,
    reseal,
    split_payload,
    writable,
)
from .support import SPAWN, SyntheticProducer, make_identity, make_tensors, reaped_children, recv_within
from .test_manifest import small_manifest

META = ValidationLevel.MANIFEST_AND_METADATA
FULL = ValidationLevel.FULL_CHECKSUM
WAIT_S = 60.0
DEEP = 100_000


def soon() -> float:
    return time.monotonic() + WAIT_S


def publish(root: Path, *, files: int = 2) -> tuple[FilesystemHostWeightStore, Path]:
    """Publish the standard test artifact and return the store and its directory."""
    store = FilesystemHostWeightStore(root)
    identity = make_identity()
    result = store.get_or_build(
        BuildRequest(identity),
        SyntheticProducer(identity, make_tensors(), files=files),
        validation=META,
        deadline=soon(),
    )
    assert result.status is StoreStatus.BUILT and result.lease is not None, result.failure
    result.lease.close()
    return store, store.layout.artifact_dir(identity.key)


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def plant_deep_format_metadata(directory: Path, depth: int) -> None:
    """Set the manifest's format_metadata to {"x": [[[...]]]} nested `depth` levels, READY re-hashed to match."""
    text = (directory / MANIFEST_FILE_NAME).read_bytes()
    marker = b'"format_metadata":{}'
    assert text.count(marker) == 1
    plant_manifest_text(directory, text.replace(marker, b'"format_metadata":{"x":' + nested(depth).encode() + b"}"))


# --------------------------------------------------------------------------- finding 1: deep manifests


def test_deeply_nested_manifest_is_denied_quarantined_and_rebuilt(tmp_path: Path) -> None:
    """S10 C06: a manifest whose format_metadata nests 100,000 levels (READY re-hashed) is MANIFEST_INVALID:
    PREFERRED falls back with an invalid-artifact attempt, a deny marker is written, inspection reports it
    without raising, and the next resolve with a producer quarantines it and rebuilds."""
    root = tmp_path / "hwr"
    identity = make_identity()
    tensors = make_tensors(3)
    producer = SyntheticProducer(identity, tensors)
    runtime = HostWeightRuntime(HostWeightRuntimeConfig(mode=RuntimeMode.PREFERRED, root=root, lock_timeout_s=60.0))
    first = runtime.resolve(identity, producer)
    assert first.outcome is ResolutionOutcome.LOCAL_PRODUCTION and first.lease is not None
    first.lease.close()
    store = FilesystemHostWeightStore(root)
    plant_deep_format_metadata(store.layout.artifact_dir(identity.key), DEEP)

    fell_back = runtime.resolve(identity)
    assert fell_back.outcome is ResolutionOutcome.CANONICAL_FALLBACK
    assert [(a.stage, a.result, a.action) for a in fell_back.report.attempts] == [
        (ResolutionStage.LOOKUP, AttemptResult.INVALID, AttemptAction.CONTINUE),
        (ResolutionStage.PRODUCTION, AttemptResult.SKIPPED, AttemptAction.FALL_BACK),
    ]
    assert fell_back.report.failure is not None
    assert fell_back.report.failure.code is FailureCode.MANIFEST_INVALID
    assert store.layout.deny_marker(identity.key).exists()

    inspected = store.inspect_artifact(identity.key)
    assert inspected.state is ArtifactState.DENIED and inspected.problem is not None
    assert inspected.problem.code is FailureCode.MANIFEST_INVALID

    rebuilt = runtime.resolve(identity, producer)
    assert rebuilt.outcome is ResolutionOutcome.LOCAL_PRODUCTION and rebuilt.lease is not None
    assert rebuilt.report.publication_id != first.report.publication_id
    assert_served_exactly(rebuilt.lease.tensors, tensors)
    rebuilt.lease.close()
    assert producer.calls == 2
    assert len(store.layout.quarantined_dirs(identity.key)) == 1
    assert not store.layout.deny_marker(identity.key).exists()
    hit = runtime.resolve(identity)
    assert hit.outcome is ResolutionOutcome.LOCAL_HIT and hit.lease is not None
    hit.lease.close()


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH, 500, 5_000, DEEP])
def test_manifest_nesting_at_every_scale_is_typed_invalid(tmp_path: Path, depth: int) -> None:
    """S10 C06: format_metadata nested past the limit (below and above the parser's recursion guard) is
    MANIFEST_INVALID at both validation levels, never a RecursionError."""
    store, directory = publish(tmp_path / "hwr")
    plant_deep_format_metadata(directory, depth)
    for level in (META, FULL):
        result = store.lookup(make_identity(), validation=level)
        assert result.status is StoreStatus.INVALID and result.failure is not None
        assert result.failure.code in {FailureCode.MANIFEST_INVALID, FailureCode.ARTIFACT_DENIED}
    assert store.layout.deny_marker(make_identity().key).exists()


def test_deep_manifest_cli_verify_and_inspect_report_cleanly(tmp_path: Path) -> None:
    """S10: `hwr verify` and `hwr inspect` report a 100,000-level manifest as invalid, with no traceback."""
    root = tmp_path / "hwr"
    store, directory = publish(root)
    plant_deep_format_metadata(directory, DEEP)
    environment = {name: value for name, value in os.environ.items() if not name.startswith("HWR_")}
    key = make_identity().key
    for args in (("verify", key, "--json"), ("verify", key, "--full"), ("inspect", "--json")):
        ran = subprocess.run(
            [sys.executable, "-m", "host_weight_runtime.cli", *args, "--root", str(root)],
            capture_output=True,
            text=True,
            timeout=120,
            env=environment,
            check=False,
        )
        assert "Traceback" not in ran.stderr and "RecursionError" not in ran.stderr, ran.stderr
        assert ran.returncode in (0, 1), (args, ran.returncode, ran.stderr)
        if args[0] == "verify":
            assert ran.returncode == 1
    assert not store.layout.deny_marker(key).exists()  # verify and inspect never deny


def test_canonical_json_bounds_depth_consistently() -> None:
    """C02: encoding and decoding agree on the nesting limit, and nothing deeper raises anything but ValueError."""
    at_limit = nested(MAX_JSON_DEPTH).encode()
    assert CanonicalJson(at_limit).data == at_limit
    assert CanonicalJson.from_value(decode_json(at_limit)).data == at_limit
    for depth in (MAX_JSON_DEPTH + 1, 2_000, DEEP):
        with pytest.raises(ValueError, match="nest"):
            CanonicalJson(nested(depth).encode())
        value: list[object] = []
        for _ in range(min(depth, 5_000) - 1):
            value = [value]
        with pytest.raises(ValueError, match="nest"):
            encode_canonical(value)
    with pytest.raises(ValueError, match="limit"):
        decode_json(b"[" + b"0," * 100 + b"0]", max_bytes=64)
    with pytest.raises(ValueError, match="finite"):
        decode_json(b"[1e400]")


# --------------------------------------------------------------------------- finding 4: forged headers


def _first_payload(directory: Path) -> tuple[str, dict[str, object]]:
    files = manifest_value(directory)["files"]
    assert isinstance(files, list)
    name = files[0]["name"]
    header, _data = split_payload(directory / name)
    value = json.loads(header)
    assert isinstance(value, dict)
    return name, value


def _forge_consistently(directory: Path, change: dict[str, dict[str, object]]) -> None:
    """Change tensor entries in both the manifest and the payload header, re-sealing everything else."""
    name, header = _first_payload(directory)
    manifest = manifest_value(directory)
    tensors = manifest["tensors"]
    assert isinstance(tensors, list)
    for entry in tensors:
        if entry["name"] in change:
            entry.update(change[entry["name"]])
    with writable(directory):
        reseal(directory, encode_canonical(manifest))
    for tensor, fields in change.items():
        described = dict(header[tensor])  # type: ignore[call-overload]
        described.update({k: v for k, v in fields.items() if k in ("dtype", "shape", "data_offsets")})
        header[tensor] = described
    plant_header(directory, name, padded(json.dumps(header, separators=(",", ":")).encode()))


def _tensors_of_first_payload(directory: Path) -> list[dict[str, object]]:
    name, _header = _first_payload(directory)
    tensors = manifest_value(directory)["tensors"]
    assert isinstance(tensors, list)
    return sorted((t for t in tensors if t["file"] == name), key=lambda t: t["data_offsets"])


def _header_case(directory: Path, case: str) -> None:
    name, header = _first_payload(directory)
    raw = json.dumps(header, separators=(",", ":")).encode()
    tensors = _tensors_of_first_payload(directory)
    first, last = tensors[0], tensors[-1]
    size = last["data_offsets"][1]  # type: ignore[index]
    if case == "offsets_past_eof":
        nbytes = last["data_offsets"][1] - last["data_offsets"][0]  # type: ignore[index,operator]
        _forge_consistently(directory, {str(last["name"]): {"data_offsets": [size, size + nbytes]}})  # type: ignore[operator]
    elif case == "overlapping_offsets":
        begin = first["data_offsets"][0]  # type: ignore[index]
        nbytes = last["data_offsets"][1] - last["data_offsets"][0]  # type: ignore[index,operator]
        _forge_consistently(directory, {str(last["name"]): {"data_offsets": [begin, begin + nbytes]}})
    elif case == "dtype_disagrees_with_bytes":
        other = "F64" if first["dtype"] != "F64" else "U8"
        _forge_consistently(directory, {str(first["name"]): {"dtype": other}})
    elif case == "shape_disagrees_with_bytes":
        shape = [*first["shape"], 2]  # type: ignore[misc]
        strides = [*(2 * stride for stride in first["strides"]), 1]  # type: ignore[attr-defined]
        _forge_consistently(directory, {str(first["name"]): {"shape": shape, "strides": strides}})
    elif case == "duplicate_names":
        entry = json.dumps(header[str(first["name"])], separators=(",", ":")).encode()
        duplicate = b'"' + str(first["name"]).encode() + b'":' + entry
        plant_header(directory, name, padded(raw[:-1] + b"," + duplicate + b"}"))
    elif case in ("nul_in_name", "dotdot_in_name"):
        renamed = str(first["name"]) + ("\x00" if case == "nul_in_name" else "/../../etc")
        header[renamed] = header.pop(str(first["name"]))
        plant_header(directory, name, padded(json.dumps(header, separators=(",", ":")).encode()))
    elif case == "non_utf8_name":
        plant_header(directory, name, padded(raw.replace(str(first["name"]).encode(), b"\xff\xfe", 1)))
    elif case == "huge_nesting":
        plant_header(directory, name, padded(raw[:-1] + b',"__metadata__x":' + nested(DEEP).encode() + b"}"))
    elif case == "header_length_past_eof":
        plant_header(directory, name, padded(raw), length_prefix=(directory / name).stat().st_size * 4)
    elif case == "header_length_huge":
        plant_header(directory, name, padded(raw), length_prefix=2**64 - 1)
    elif case == "float_shape":
        header[str(first["name"])]["shape"] = [float(d) for d in first["shape"]]  # type: ignore[index,attr-defined]
        plant_header(directory, name, padded(json.dumps(header, separators=(",", ":")).encode()))
    elif case == "bool_offsets":
        entry_value = header[str(first["name"])]
        assert entry_value["data_offsets"][0] == 0  # type: ignore[index]
        entry_value["data_offsets"][0] = False  # type: ignore[index]  # Python's False == 0, JSON's false is not
        plant_header(directory, name, padded(json.dumps(header, separators=(",", ":")).encode()))
    elif case == "metadata_not_strings":
        header["__metadata__"] = {"format": ["pt"]}
        plant_header(directory, name, padded(json.dumps(header, separators=(",", ":")).encode()))
    else:
        raise AssertionError(case)


HEADER_CASES = [
    "offsets_past_eof",
    "overlapping_offsets",
    "dtype_disagrees_with_bytes",
    "shape_disagrees_with_bytes",
    "duplicate_names",
    "nul_in_name",
    "dotdot_in_name",
    "non_utf8_name",
    "huge_nesting",
    "header_length_past_eof",
    "header_length_huge",
    "float_shape",
    "bool_offsets",
    "metadata_not_strings",
]


@pytest.mark.parametrize("case", HEADER_CASES)
def test_forged_payload_headers_are_typed_invalid(tmp_path: Path, case: str) -> None:
    """S10: a payload header (forged together with the manifest where that is what keeps the rest consistent)
    with offsets past EOF, overlapping offsets, dtype or shape disagreeing with the bytes, duplicate, NUL, '..'
    or non-UTF-8 names, huge nesting, a bad length or loosely typed numbers is typed INVALID at both levels."""
    store, directory = publish(tmp_path / "hwr")
    _header_case(directory, case)
    key = make_identity().key
    for level in (FULL, META):
        result = store.lookup(make_identity(), validation=level)
        assert result.status is StoreStatus.INVALID, (level, result.status)
        assert result.lease is None and result.failure is not None
        assert result.failure.code in {FailureCode.PAYLOAD_INVALID, FailureCode.MANIFEST_INVALID}
        store.layout.deny_marker(key).unlink()


def test_hostile_names_in_a_manifest_are_refused() -> None:
    """C06: a manifest whose tensor names carry control characters is refused by the parser."""
    value = json.loads(small_manifest().to_bytes())
    value["tensors"][0]["name"] = "w\x00eight"
    value["files"][0]["tensors"] = [value["tensors"][0]["name"], *value["files"][0]["tensors"][1:]]
    with pytest.raises(ValueError, match="control"):
        WeightManifest.from_bytes(encode_canonical(value))


# --------------------------------------------------------------------------- finding 4: HWR_ROOT


@pytest.mark.parametrize(
    "root",
    [
        "/proc/self/cwd",
        "/proc",
        "/sys/kernel",
        "/dev/null",
        "/dev/disk/hwr",
        "relative/hwr",
        "/",
        "/dev/shm/../../proc",
    ],
)
def test_hwr_root_on_kernel_filesystems_is_refused_by_from_env(root: str) -> None:
    """HWR_ROOT under /proc, /sys or /dev (other than /dev/shm), relative, '/' or spelled with '..' is a
    ValueError from from_env that names the variable and says what to do."""
    with pytest.raises(ValueError) as caught:
        HostWeightRuntimeConfig.from_env({"HWR_ROOT": root})
    message = str(caught.value)
    assert "HWR_ROOT" in message and "fix or unset" in message


def test_hwr_root_on_dev_shm_and_disk_is_accepted(tmp_path: Path) -> None:
    """/dev/shm and ordinary absolute directories stay valid roots."""
    for root in ("/dev/shm/hwr-test", str(tmp_path / "hwr")):
        assert HostWeightRuntimeConfig.from_env({"HWR_ROOT": root}).root == Path(root)


# --------------------------------------------------------------------------- finding 2: live truncation


def lookup_pausing(root: str, point: str, times: int, report: Connection, control: Connection) -> None:
    """Child: look up the standard identity, pausing `times` times at `point`; touch every served byte."""

    def hook(reached: str) -> None:
        report.send(reached)
        control.recv()

    arm(point, Fault(FaultAction.PAUSE, hook=hook, times=times))
    lookup_once(root, report)


def lookup_once(root: str, report: Connection) -> None:
    """Child: look up the standard identity; touch every served byte; report the outcome."""
    store = FilesystemHostWeightStore(Path(root))
    result = store.lookup(make_identity(), validation=META)
    touched = None
    if result.lease is not None:
        touched = sum(int(t.reshape(-1).view(torch.uint8).sum()) for t in result.lease.tensors.values())
        result.lease.close()
    report.send(
        {
            "status": result.status.value,
            "code": None if result.failure is None else result.failure.code.value,
            "message": None if result.failure is None else result.failure.message,
            "touched": touched,
        }
    )


def hold_lease(root: str, report: Connection, control: Connection) -> None:
    """Child: take a lease and report; then on "touch" read every byte, on "close" close it."""
    store = FilesystemHostWeightStore(Path(root))
    result = store.lookup(make_identity(), validation=META)
    assert result.lease is not None
    report.send(result.status.value)
    while True:
        command = control.recv()
        if command == "touch":
            total = sum(int(t.reshape(-1).view(torch.uint8).sum()) for t in result.lease.tensors.values())
            report.send(total)
        elif command == "close":
            result.lease.close()
            report.send("closed")
            return


def _truncate(path: Path, size: int) -> None:
    """What a same-uid process can do to a published payload: chmod it writable, truncate, chmod back."""
    os.chmod(path.parent, 0o755)
    os.chmod(path, 0o644)
    os.truncate(path, size)
    os.chmod(path, 0o444)
    os.chmod(path.parent, 0o555)


def _replace(path: Path) -> None:
    """Rename an identical copy over a published payload (same bytes and size, another inode)."""
    os.chmod(path.parent, 0o755)
    copy = path.parent.parent.parent / "tmp" / "replacement"
    shutil.copyfile(path, copy)
    os.chmod(copy, 0o444)
    os.rename(copy, path)
    os.chmod(path.parent, 0o555)


@pytest.mark.parametrize("when", ["before_mapping", "after_mapping", "replaced_after_mapping"])
def test_payload_changed_between_validation_and_lease_is_typed_invalid(tmp_path: Path, when: str) -> None:
    """S10: a payload truncated (or renamed over) after a child validated it, before the lease is returned,
    is a typed PAYLOAD_INVALID and a deny marker, and the child exits normally (no SIGBUS)."""
    store, directory = publish(tmp_path / "hwr", files=2)
    files = manifest_value(directory)["files"]
    assert isinstance(files, list)
    first = directory / files[0]["name"]
    header_size = files[0]["header_size"]
    report, child_report = SPAWN.Pipe(duplex=False)
    child_control, control = SPAWN.Pipe(duplex=False)
    with reaped_children() as children:
        child = SPAWN.Process(
            target=lookup_pausing, args=(str(store.root), "reader.after_validate", 2, child_report, child_control)
        )
        child.start()
        children.append(child)
        assert recv_within(report) == "reader.after_validate"  # the first payload is validated, not mapped
        if when == "before_mapping":
            _truncate(first, header_size)
        control.send("go")
        if when != "before_mapping":
            assert recv_within(report) == "reader.after_validate"  # the first payload is mapped, the second not
            if when == "after_mapping":
                _truncate(first, header_size)
            else:
                _replace(first)
            control.send("go")
        outcome = recv_within(report)
        child.join(WAIT_S)
    assert child.exitcode == 0
    assert isinstance(outcome, dict)
    assert outcome["status"] == "invalid" and outcome["code"] == FailureCode.PAYLOAD_INVALID.value, outcome
    assert outcome["touched"] is None
    assert store.layout.deny_marker(make_identity().key).exists()


def test_truncation_under_a_live_lease_is_caught_at_the_next_lease(tmp_path: Path) -> None:
    """S10: what a same-uid process truncating a leased payload does. The next lease (another child) is a
    typed PAYLOAD_INVALID and a deny marker, never served; the holder of the old lease takes SIGBUS when it
    reads the vanished pages, which is the documented limit (README, Reliability)."""
    store, directory = publish(tmp_path / "hwr", files=2)
    files = manifest_value(directory)["files"]
    assert isinstance(files, list)
    first = directory / files[0]["name"]
    report, child_report = SPAWN.Pipe(duplex=False)
    child_control, control = SPAWN.Pipe(duplex=False)
    later_report, later_child_report = SPAWN.Pipe(duplex=False)
    with reaped_children() as children:
        holder = SPAWN.Process(target=hold_lease, args=(str(store.root), child_report, child_control))
        holder.start()
        children.append(holder)
        assert recv_within(report) == "hit"
        control.send("touch")
        assert isinstance(recv_within(report), int)
        _truncate(first, files[0]["header_size"])

        later = SPAWN.Process(target=lookup_once, args=(str(store.root), later_child_report))
        later.start()
        children.append(later)
        outcome = recv_within(later_report)
        later.join(WAIT_S)
        assert later.exitcode == 0
        assert isinstance(outcome, dict)
        assert outcome["status"] == "invalid" and outcome["code"] == FailureCode.PAYLOAD_INVALID.value, outcome
        assert store.layout.deny_marker(make_identity().key).exists()

        control.send("touch")
        holder.join(WAIT_S)
    assert holder.exitcode == -signal.SIGBUS


def test_offsets_past_eof_with_a_consistent_total_bytes_are_typed_invalid(tmp_path: Path) -> None:
    """S10: a tensor's data_offsets moved past EOF in the payload header and the manifest
    alike, with every size and `total_bytes` consistent with the files on disk (so no size check catches it), is
    typed INVALID at both levels, never a hit or a read past the mapping; PREFERRED falls back, then it is rebuilt."""
    store, directory = publish(tmp_path / "hwr")
    _header_case(directory, "offsets_past_eof")
    manifest = manifest_value(directory)
    files = manifest["files"]
    assert isinstance(files, list)
    on_disk = {entry["name"]: (directory / entry["name"]).stat().st_size for entry in files}
    assert all(entry["size"] == on_disk[entry["name"]] for entry in files)
    assert manifest["total_bytes"] == sum(on_disk.values())
    name, header = _first_payload(directory)
    data_bytes = on_disk[name] - 8 - len(split_payload(directory / name)[0])
    assert max(entry["data_offsets"][1] for key, entry in header.items() if key != "__metadata__") > data_bytes  # type: ignore[index]
    for level in (FULL, META):
        result = store.lookup(make_identity(), validation=level)
        assert result.status is StoreStatus.INVALID and result.lease is None, (level, result.status)
        assert result.failure is not None and result.failure.code in {
            FailureCode.PAYLOAD_INVALID,
            FailureCode.MANIFEST_INVALID,
            FailureCode.ARTIFACT_DENIED,
        }
    runtime = HostWeightRuntime(HostWeightRuntimeConfig(mode=RuntimeMode.PREFERRED, root=tmp_path / "hwr"))
    resolution = runtime.resolve(make_identity())
    assert resolution.outcome is ResolutionOutcome.CANONICAL_FALLBACK and resolution.lease is None
    rebuilt = store.get_or_build(
        BuildRequest(make_identity()),
        SyntheticProducer(make_identity(), make_tensors(), files=2),
        validation=FULL,
        deadline=soon(),
    )
    assert rebuilt.status is StoreStatus.BUILT and rebuilt.lease is not None, rebuilt.failure
    rebuilt.lease.close()

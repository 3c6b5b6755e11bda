"""The `hwr` command, run as a real subprocess against a real domain under tmp_path.

Every test publishes through `FilesystemHostWeightStore` and the real `SyntheticProducer`,
then runs `python -m host_weight_runtime.cli ...` and checks the exit status, the output
and what is (or is not) left on disk.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from host_weight_runtime import FilesystemHostWeightStore, ValidationLevel

from .support import make_identity, make_tensors, publish_standard_artifact

RUN_TIMEOUT_S = 120.0


def hwr(
    *args: str, env: dict[str, str] | None = None, stdin: int | None = subprocess.DEVNULL
) -> subprocess.CompletedProcess[str]:
    """Run the real CLI in a fresh interpreter; stdin is not a terminal unless a test passes one."""
    environment = {name: value for name, value in os.environ.items() if not name.startswith("HWR_")}
    environment.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "host_weight_runtime.cli", *args],
        stdin=stdin,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
        env=environment,
        check=False,
    )


def as_json(result: subprocess.CompletedProcess[str]) -> Any:
    return json.loads(result.stdout)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "domain"


@pytest.fixture
def store(root: Path) -> FilesystemHostWeightStore:
    return FilesystemHostWeightStore(root)


@pytest.fixture
def key(store: FilesystemHostWeightStore) -> str:
    """Publish the standard test artifact (two payload files) and return its key."""
    return publish_standard_artifact(store)


def flip_one_payload_byte(directory: Path) -> None:
    """Flip one data byte of the first payload, restoring the published modes (0444 files, 0555 dir)."""
    payload = sorted(directory.glob("*.safetensors"))[0]
    os.chmod(directory, 0o755)
    os.chmod(payload, 0o644)
    try:
        header_length = int.from_bytes(payload.read_bytes()[:8], "little")
        with payload.open("r+b") as handle:
            handle.seek(8 + header_length + 3)
            value = handle.read(1)[0]
            handle.seek(8 + header_length + 3)
            handle.write(bytes([value ^ 0xFF]))
    finally:
        os.chmod(payload, 0o444)
        os.chmod(directory, 0o555)


# --------------------------------------------------------------------------- inspect


def test_inspect_json_lists_the_ready_artifact(root: Path, key: str) -> None:
    """`hwr inspect --json` prints the domain snapshot with the published artifact READY, its model and tensor count."""
    result = hwr("inspect", "--root", str(root), "--json")
    assert result.returncode == 0, result.stderr
    snapshot = as_json(result)
    assert snapshot["root"] == str(root)
    assert {"domain_id", "fs_type", "storage_class", "huge_pages", "capacity", "artifacts"} <= set(snapshot)
    assert {"total_bytes", "free_bytes", "store_bytes", "is_memory", "max_artifact_bytes"} <= set(snapshot["capacity"])
    [entry] = snapshot["artifacts"]
    assert entry["key"] == key and entry["state"] == "ready"
    assert entry["model_id"] == "test-org/test-model" and entry["tensor_count"] == len(make_tensors())
    assert entry["size_bytes"] > 0 and entry["problem"] is None
    assert entry["locks"] == {"build_active": False, "lease_active": False}


def test_inspect_table_for_people(root: Path, key: str) -> None:
    """Without --json, inspect prints the domain facts (huge_pages among them) and the inventory row of the key."""
    result = hwr("inspect", "--root", str(root))
    assert result.returncode == 0, result.stderr
    assert "huge_pages" in result.stdout and "capacity" in result.stdout
    assert key[:12] in result.stdout and "ready" in result.stdout


def test_inspect_reads_hwr_root(root: Path, key: str) -> None:
    """Without --root, the domain comes from HWR_ROOT."""
    result = hwr("inspect", "--json", env={"HWR_ROOT": str(root)})
    assert result.returncode == 0, result.stderr
    assert [entry["key"] for entry in as_json(result)["artifacts"]] == [key]


def test_inspect_missing_root_exits_1_without_creating_it(tmp_path: Path) -> None:
    """Inspecting a root that does not exist says "no domain at ROOT", exits 1 and creates nothing."""
    missing = tmp_path / "nowhere"
    result = hwr("inspect", "--root", str(missing))
    assert result.returncode == 1
    assert f"no domain at {missing}" in result.stderr
    assert "Traceback" not in result.stderr
    assert not missing.exists()


# --------------------------------------------------------------------------- verify


def test_verify_full_passes_on_a_good_artifact(root: Path, key: str) -> None:
    """`hwr verify KEY --full` re-hashes every payload and exits 0 on an intact artifact."""
    result = hwr("verify", key, "--full", "--root", str(root), "--json")
    assert result.returncode == 0, result.stderr
    report = as_json(result)
    assert report["verified"] is True and report["state"] == "ready"
    assert report["validation"] == "full_checksum"


def test_verify_full_detects_a_flipped_byte_and_denies_nothing(root: Path, key: str) -> None:
    """One flipped payload byte: verify --full exits 1 with checksum_mismatch, the metadata-only verify
    cannot see it (exit 0), and neither writes a deny marker."""
    store = FilesystemHostWeightStore(root)
    flip_one_payload_byte(store.layout.artifact_dir(key))
    full = hwr("verify", key, "--full", "--root", str(root), "--json")
    assert full.returncode == 1
    report = as_json(full)
    assert report["verified"] is False and report["state"] == "invalid"
    assert report["problem"]["code"] == "checksum_mismatch"
    metadata_only = hwr("verify", key, "--root", str(root))
    assert metadata_only.returncode == 0, metadata_only.stderr
    assert list(store.layout.deny.iterdir()) == []
    human = hwr("verify", key, "--full", "--root", str(root))
    assert human.returncode == 1 and "checksum_mismatch" in human.stderr


def test_verify_accepts_a_unique_key_prefix(root: Path, key: str) -> None:
    """The short key `hwr inspect` shows is enough for verify."""
    result = hwr("verify", key[:12], "--root", str(root), "--json")
    assert result.returncode == 0, result.stderr
    assert as_json(result)["key"] == key


def test_verify_missing_artifact_exits_1(root: Path, key: str) -> None:
    """A well-formed key with nothing stored under it is reported missing with exit 1."""
    absent = "f" * 64 if key != "f" * 64 else "e" * 64
    result = hwr("verify", absent, "--root", str(root), "--json")
    assert result.returncode == 1
    assert as_json(result)["state"] == "missing"


def test_verify_bad_key_is_a_usage_error(root: Path, key: str) -> None:
    """A key that is not hex is a usage error (exit 2) with a one-line message, not a traceback."""
    result = hwr("verify", "not-a-key", "--root", str(root))
    assert result.returncode == 2
    assert "hwr inspect" in result.stderr and "Traceback" not in result.stderr


# --------------------------------------------------------------------------- cleanup


def test_cleanup_dry_run_removes_nothing(root: Path, key: str) -> None:
    """--dry-run prints the plan (the artifact directory and its size, as planned_*: nothing was removed)
    and leaves everything in place."""
    store = FilesystemHostWeightStore(root)
    result = hwr("cleanup", key, "--dry-run", "--root", str(root), "--json")
    assert result.returncode == 0, result.stderr
    plan = as_json(result)
    assert plan["dry_run"] is True and plan["planned_bytes"] > 0
    assert "removed_bytes" not in plan and "removed_paths" not in plan
    assert str(store.layout.artifact_dir(key)) in plan["planned_paths"]
    assert store.layout.artifact_dir(key).is_dir()


def test_cleanup_yes_removes_the_artifact(root: Path, key: str) -> None:
    """--yes removes the artifact without asking; inspect then lists nothing."""
    store = FilesystemHostWeightStore(root)
    result = hwr("cleanup", key, "--yes", "--root", str(root), "--json")
    assert result.returncode == 0, result.stderr
    assert as_json(result)["status"] == "removed"
    assert not store.layout.artifact_dir(key).exists()
    assert as_json(hwr("inspect", "--root", str(root), "--json"))["artifacts"] == []


def test_cleanup_without_yes_and_without_a_terminal_exits_2(root: Path, key: str) -> None:
    """Unattended cleanup without --yes is refused (exit 2) with a message naming --yes and --dry-run."""
    store = FilesystemHostWeightStore(root)
    result = hwr("cleanup", key, "--root", str(root))
    assert result.returncode == 2
    assert "--yes" in result.stderr and "--dry-run" in result.stderr
    assert store.layout.artifact_dir(key).is_dir()


def test_cleanup_refuses_while_a_lease_is_held(root: Path, key: str) -> None:
    """While this test process holds a lease, cleanup --yes exits 1 with active_lease and removes nothing."""
    store = FilesystemHostWeightStore(root)
    found = store.lookup(make_identity(), validation=ValidationLevel.MANIFEST_AND_METADATA)
    assert found.lease is not None
    with found.lease:
        result = hwr("cleanup", key, "--yes", "--root", str(root), "--json")
        assert result.returncode == 1
        report = as_json(result)
        assert report["status"] == "active_lease"
        assert report["failure"]["code"] == "active_lease"
        human = hwr("cleanup", key, "--yes", "--root", str(root))
        assert human.returncode == 1 and "active_lease" in human.stderr
    assert store.layout.artifact_dir(key).is_dir()


@pytest.mark.parametrize(("answer", "removed"), [("y", True), ("n", False)])
def test_cleanup_on_a_terminal_asks_first(root: Path, key: str, answer: str, removed: bool) -> None:
    """On a terminal, cleanup shows the plan and removes only after a yes (a no exits 1, removing nothing)."""
    store = FilesystemHostWeightStore(root)
    controller, terminal = os.openpty()
    try:
        os.write(controller, f"{answer}\n".encode())
        result = hwr("cleanup", key, "--root", str(root), stdin=terminal)
    finally:
        os.close(terminal)
        os.close(controller)
    assert "would remove" in result.stdout
    assert result.returncode == (0 if removed else 1), result.stderr
    assert store.layout.artifact_dir(key).exists() is not removed

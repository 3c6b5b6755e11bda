"""`hwr` against hostile input: key prefixes that try to leave the domain, and hostile domain states.

Every command runs as a real subprocess (`python -m host_weight_runtime.cli`). Whatever it is given, it must
answer with one line on stderr (`hwr COMMAND: ...`), the documented exit code (2 for a usage error, 1 for a
failure it reports), with `--json` one JSON object whose `error.code` is the failure code, never a Python
traceback, and it must touch nothing outside the domain (nor, for a refused key, inside it).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from host_weight_runtime import FilesystemHostWeightStore, cli
from host_weight_runtime.failures import FailureCode

from ._hostile import writable
from .support import publish_standard_artifact
from .test_reliability import DEEP, plant_deep_format_metadata

RUN_TIMEOUT_S = 120.0
EXIT_FAILURE = 1
EXIT_USAGE = 2


def hwr(*args: str) -> subprocess.CompletedProcess[str]:
    environment = {name: value for name, value in os.environ.items() if not name.startswith("HWR_")}
    return subprocess.run(
        [sys.executable, "-m", "host_weight_runtime.cli", *args],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
        env=environment,
        check=False,
    )


def publish(root: Path) -> str:
    return publish_standard_artifact(FilesystemHostWeightStore(root))


def tree(top: Path) -> dict[str, tuple[int, int, int]]:
    """Every path under `top` with its mode, size and mtime, without following links: a change detector."""
    found: dict[str, tuple[int, int, int]] = {}
    for directory, subdirs, files in os.walk(top):
        for name in (*subdirs, *files):
            path = Path(directory, name)
            info = os.lstat(path)
            found[str(path.relative_to(top))] = (info.st_mode, info.st_size, info.st_mtime_ns)
    return found


def assert_clean_error(ran: subprocess.CompletedProcess[str], command: str, exit_code: int) -> dict[str, Any]:
    """One `hwr COMMAND:` line on stderr, no traceback, the exit code, and the `--json` error object."""
    assert "Traceback" not in ran.stderr and "Error:" not in ran.stderr.split(":", 1)[0], ran.stderr
    lines = ran.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"hwr {command}: "), ran.stderr
    assert ran.returncode == exit_code, (ran.returncode, ran.stderr)
    document = json.loads(ran.stdout)
    assert isinstance(document, dict) and set(document) == {"error"}, ran.stdout
    error = document["error"]
    assert error["command"] == command and error["exit_code"] == exit_code
    assert isinstance(error["code"], str) and error["message"]
    return dict(error)


# --------------------------------------------------------------------------- hostile key prefixes

HOSTILE_KEYS = [
    "../",
    "../../../etc/passwd",
    "/etc/passwd",
    "..",
    "3881/../..",
    "*",
    "38[0-9a-f]*",
    "3881?",
    "~root",
    "$HOME",
    "a" * 5000,
    "\uff21\uff22\uff23\uff24",  # full-width letters that lower() does not make hex
]


@pytest.mark.parametrize("key", HOSTILE_KEYS, ids=[repr(key[:16]) for key in HOSTILE_KEYS])
def test_hostile_key_prefixes_are_refused_by_every_key_command(tmp_path: Path, key: str) -> None:
    """S12: `../`, absolute paths, globs, very long and non-hex key prefixes make verify, cleanup and push
    refuse with one line and exit 2 (`--json`: error code invalid_configuration); nothing in the domain or next to
    it changes."""
    root = tmp_path / "hwr"
    publish(root)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "victim").write_text("untouched")
    before = tree(tmp_path)
    remote = f"file://{tmp_path / 'remote'}"
    for command, extra in (("verify", ["--full"]), ("cleanup", ["--yes"]), ("push", ["--to", remote])):
        ran = hwr(command, key, *extra, "--root", str(root), "--json")
        error = assert_clean_error(ran, command, EXIT_USAGE)
        assert error["code"] == FailureCode.INVALID_CONFIGURATION.value
        assert len(ran.stderr) < 1000, "a hostile argument is echoed bounded"
    assert tree(tmp_path) == before
    assert not (tmp_path / "remote").exists()


def test_a_nul_in_a_key_or_root_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """S12: argv cannot carry NUL, so `cli.main` gets it directly: a usage error (exit 2), never a raw
    ValueError about an embedded null byte."""
    root = tmp_path / "hwr"
    publish(root)
    before = tree(tmp_path)
    for argv in (["verify", "3881\x00/..", "--root", str(root)], ["inspect", "--root", f"{root}\x00/etc", "--json"]):
        assert cli.main(argv) == EXIT_USAGE
        captured = capsys.readouterr()
        assert "Traceback" not in captured.err and captured.err.startswith(f"hwr {argv[0]}: ")
    assert tree(tmp_path) == before


def test_prewarm_and_cleanup_model_paths_that_leave_the_domain_touch_nothing(tmp_path: Path) -> None:
    """S12: `hwr prewarm ../..` (a folder that is no model) and `hwr cleanup --model ../..` fail in one
    line and build or remove nothing."""
    root = tmp_path / "hwr"
    publish(root)
    before = tree(tmp_path)
    ran = hwr("prewarm", "../../..", "--root", str(root), "--json")
    assert_clean_error(ran, "prewarm", EXIT_USAGE if "config.json" in ran.stderr else EXIT_FAILURE)
    ran = hwr("cleanup", "--model", "../../..", "--yes", "--root", str(root), "--json")
    assert assert_clean_error(ran, "cleanup", EXIT_FAILURE)["code"] == FailureCode.NOT_FOUND.value
    assert tree(tmp_path) == before


# --------------------------------------------------------------------------- hostile domain states


def _deep_manifest(store: FilesystemHostWeightStore, key: str) -> None:
    plant_deep_format_metadata(store.layout.artifact_dir(key), DEEP)


def _ready_not_utf8(store: FilesystemHostWeightStore, key: str) -> None:
    directory = store.layout.artifact_dir(key)
    with writable(directory):
        (directory / "READY.json").write_bytes(b"\xff\xfe{}")


def _manifest_symlink(store: FilesystemHostWeightStore, key: str) -> None:
    directory = store.layout.artifact_dir(key)
    copy = store.root.parent / "manifest-copy.json"
    with writable(directory):
        shutil.copyfile(directory / "manifest.json", copy)
        (directory / "manifest.json").unlink()
        (directory / "manifest.json").symlink_to(copy)


def _artifact_dir_unreadable(store: FilesystemHostWeightStore, key: str) -> None:
    os.chmod(store.layout.artifact_dir(key), 0o000)


def _root_writable_by_others(store: FilesystemHostWeightStore, key: str) -> None:
    del key
    os.chmod(store.root, 0o777)


def _artifacts_of_another_uid(store: FilesystemHostWeightStore, key: str) -> None:
    del key
    if os.geteuid() != 0:
        pytest.skip("planting a directory owned by another uid needs root")
    os.chown(store.layout.artifacts, 54321, 54321)


def _tmp_symlink(store: FilesystemHostWeightStore, key: str) -> None:
    del key
    os.rmdir(store.layout.tmp)
    os.symlink(store.root.parent, store.layout.tmp)


def _domain_file_garbage(store: FilesystemHostWeightStore, key: str) -> None:
    del key
    path = store.layout.domain_file
    os.chmod(path, 0o600)
    path.write_bytes(b"\xff" * 16)


def _locks_a_file(store: FilesystemHostWeightStore, key: str) -> None:
    del key
    shutil.rmtree(store.layout.locks)
    store.layout.locks.write_text("not a directory")
    os.chmod(store.layout.locks, 0o600)


INVALID_CODES = {
    FailureCode.MANIFEST_INVALID.value,
    FailureCode.PAYLOAD_INVALID.value,
    FailureCode.ARTIFACT_DENIED.value,
    FailureCode.UNSAFE_PERMISSIONS.value,
}

# (state, plant, whether the domain itself is refused (every command exits 1) or only the artifact is bad)
STATES: list[tuple[str, Callable[[FilesystemHostWeightStore, str], None], bool]] = [
    ("deep_manifest", _deep_manifest, False),
    ("ready_not_utf8", _ready_not_utf8, False),
    ("manifest_symlink", _manifest_symlink, False),
    ("artifact_dir_mode_0", _artifact_dir_unreadable, False),
    ("root_writable_by_others", _root_writable_by_others, True),
    ("artifacts_of_another_uid", _artifacts_of_another_uid, True),
    ("tmp_a_symlink", _tmp_symlink, True),
    ("domain_json_garbage", _domain_file_garbage, True),
    ("locks_a_file", _locks_a_file, True),
]


@pytest.mark.parametrize(("state", "plant", "domain_refused"), STATES, ids=[state[0] for state in STATES])
def test_every_command_reports_a_hostile_domain_cleanly(
    tmp_path: Path, state: str, plant: Callable[[FilesystemHostWeightStore, str], None], domain_refused: bool
) -> None:
    """S10 S12: against a deeply nested manifest, a non-UTF-8 READY, planted symlinks, a mode-0 artifact,
    a root or subdirectory of the wrong owner or mode, a garbage domain.json, every hwr command exits with its
    documented code and one typed line (`--json`: an error object with the failure code), never a traceback."""
    del state
    root = tmp_path / "hwr"
    key = publish(root)
    plant(FilesystemHostWeightStore(root), key)
    remote = f"file://{tmp_path / 'remote'}"
    commands: list[tuple[str, list[str], int]] = [
        # (command, arguments, exit code when only the artifact is bad)
        ("inspect", [], 0),
        ("verify", [key[:12]], EXIT_FAILURE),
        ("verify", [key, "--full"], EXIT_FAILURE),
        ("cleanup", [key[:12], "--dry-run"], 0),
        ("gc", ["--dry-run"], 0),
        ("push", [key[:12], "--to", remote], EXIT_FAILURE),
    ]
    for command, arguments, artifact_exit in commands:
        ran = hwr(command, *arguments, "--root", str(root), "--json")
        assert "Traceback" not in ran.stderr and "RecursionError" not in ran.stderr, ran.stderr
        expected = EXIT_FAILURE if domain_refused else artifact_exit
        assert ran.returncode == expected, (command, arguments, ran.returncode, ran.stderr, ran.stdout[:500])
        document = json.loads(ran.stdout)
        assert isinstance(document, dict)
        if domain_refused:
            error = assert_clean_error(ran, command, EXIT_FAILURE)
            assert error["code"] in (
                FailureCode.UNSAFE_PERMISSIONS.value,
                FailureCode.DOMAIN_INVALID.value,
                FailureCode.STORE_INIT_FAILED.value,
            ), error
        elif command == "push":  # push --json reports its own failure document (status failed, the failure)
            assert document["status"] == "failed" and document["failure"]["code"] in INVALID_CODES, document

"""Remote URLs are checked before anything is written, and `hwr push --all` seeds a remote (E05, E08, E09, E11).

Every `hwr` call is a real subprocess; S3 is moto's threaded server on loopback, spoken to
over HTTP. A URL that cannot work (an unsupported scheme, a file:// folder that does not
exist, a bucket that does not exist) is a usage error: exit 2, one line on stderr, the
`{"error": {...}}` object with `--json`, never a traceback, never a folder created by a typo,
never marked retryable. At runtime the same remote is a non-retryable remote_failed attempt
and PREFERRED goes on to the local build.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from host_weight_runtime import (
    FailureCode,
    HostWeightRuntime,
    HostWeightRuntimeConfig,
    ResolutionOutcome,
    RuntimeMode,
)

from .remote_support import SECRET_KEY, MotoEndpoint, Node, make_remote, moto_endpoint, use_aws_environment
from .support import SyntheticProducer, make_identity, make_tensors

RUN_TIMEOUT_S = 120.0


@pytest.fixture(scope="module")
def moto() -> Iterator[MotoEndpoint]:
    with moto_endpoint() as endpoint:
        yield endpoint


@pytest.fixture
def hwr(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, moto: MotoEndpoint) -> Any:
    use_aws_environment(monkeypatch, tmp_path)
    environment = {name: value for name, value in os.environ.items() if not name.startswith("HWR_")}
    environment["HWR_REMOTE_ENDPOINT_URL"] = moto.url
    environment["COLUMNS"] = "240"

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(
            [sys.executable, "-m", "host_weight_runtime.cli", *args],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=RUN_TIMEOUT_S,
            env=environment,
            check=False,
        )
        assert "Traceback" not in done.stderr, done.stderr
        assert SECRET_KEY not in done.stdout + done.stderr
        return done

    return run


@pytest.fixture
def node_a(tmp_path: Path) -> Node:
    return Node(tmp_path / "node-a")


def usage_error_object(done: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    """The `--json` error object of a usage error, checked for its shape."""
    assert done.returncode == 2, (done.stdout, done.stderr)
    error = json.loads(done.stdout)["error"]
    assert set(error) >= {"code", "message", "exit_code", "failure"}
    assert error["exit_code"] == 2 and error["code"] == "invalid_configuration"
    assert error["failure"] is not None and error["failure"]["retryable"] is False
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("hwr ")
    return error


def test_an_unsupported_scheme_is_a_usage_error_before_any_connection(hwr: Any, node_a: Node) -> None:
    """E05: ftp:// (and other schemes no backend here is tested on) exit 2 for ls and push, with and without
    --json, naming the schemes that work; nothing is resolved or connected."""
    key = node_a.build().key
    for url in ("ftp://x/y", "sftp://host/path", "memory://bucket/x"):
        for args in (("remote", "ls", url), ("push", key, "--to", url, "--root", str(node_a.root))):
            error = usage_error_object(hwr(*args, "--json"))
            assert "not supported" in error["message"] and "s3://" in error["message"]
            plain = hwr(*args)
            assert plain.returncode == 2 and "not supported" in plain.stderr and plain.stdout == ""


def test_a_missing_file_folder_is_refused_and_never_created(hwr: Any, node_a: Node, tmp_path: Path) -> None:
    """E08, E09: push to a file:// folder whose parent is missing exits 2 and creates nothing; ls of a mistyped
    folder exits 2 instead of printing an empty remote; a relative file:// URL is refused; a new last folder
    under an existing parent is created by the push."""
    key = node_a.build().key
    missing = tmp_path / "nonexistent" / "dir" / "x"
    error = usage_error_object(hwr("push", key, "--to", f"file://{missing}", "--root", str(node_a.root), "--json"))
    assert str(missing.parent) in error["message"]
    assert not (tmp_path / "nonexistent").exists()
    assert usage_error_object(hwr("remote", "ls", f"file://{tmp_path / 'typo'}", "--json"))["failure"]["details"][
        "missing_root"
    ]
    assert not (tmp_path / "typo").exists()
    relative = hwr("push", key, "--to", "file://shared/hwr", "--root", str(node_a.root), "--json")
    assert "absolute path" in usage_error_object(relative)["message"]
    a_file = tmp_path / "a-file"
    a_file.write_bytes(b"")
    assert "not a folder" in usage_error_object(hwr("remote", "ls", f"file://{a_file}", "--json"))["message"]

    fresh = tmp_path / "fresh"
    pushed = hwr("push", key, "--to", f"file://{fresh}", "--root", str(node_a.root), "--json")
    assert pushed.returncode == 0, pushed.stderr
    assert json.loads(pushed.stdout)["status"] == "uploaded" and (fresh / key / "DESCRIPTOR.json").is_file()
    listed = hwr("remote", "ls", f"file://{fresh}", "--json")
    assert [entry["key"] for entry in json.loads(listed.stdout)["artifacts"]] == [key]


def test_a_missing_bucket_is_a_usage_error_not_a_retry(hwr: Any, node_a: Node, moto: MotoEndpoint) -> None:
    """E04, E05: NoSuchBucket on push and ls exits 2 as a non-retryable usage error naming the bucket; an
    existing bucket with an empty prefix lists as empty (exit 0)."""
    key = node_a.build().key
    url = "s3://hwr-no-such-bucket-4d1e/fleet"
    for args in (("push", key, "--to", url, "--root", str(node_a.root)), ("remote", "ls", url)):
        error = usage_error_object(hwr(*args, "--json"))
        assert "hwr-no-such-bucket-4d1e" in error["message"] and "does not exist" in error["message"]
    bucket = moto.new_bucket()
    empty = hwr("remote", "ls", f"s3://{bucket}/nothing-yet", "--json")
    assert empty.returncode == 0 and json.loads(empty.stdout)["artifacts"] == []


@pytest.mark.parametrize("kind", ["s3", "file"])
def test_push_all_pushes_what_the_remote_lacks_and_is_idempotent(
    hwr: Any, node_a: Node, moto: MotoEndpoint, tmp_path: Path, kind: str
) -> None:
    """E08: --all uploads every complete local artifact the remote lacks, reports already_present for the rest,
    records a corrupt local copy as that key's failure (exit 1) without stopping the others (the copy is then
    denied and left out), and a second run uploads nothing."""
    keys = sorted(node_a.build(make_identity(tag=f"model-{index}")).key for index in range(3))
    with make_remote(kind, tmp_path, moto) as remote:
        first = hwr("push", keys[0], "--to", remote.push_url, "--root", str(node_a.root))
        assert first.returncode == 0, first.stderr
        everything = hwr("push", "--all", "--to", remote.push_url, "--root", str(node_a.root), "--json")
        assert everything.returncode == 0, everything.stderr
        statuses = {item["key"]: item["status"] for item in json.loads(everything.stdout)["artifacts"]}
        assert statuses == {keys[0]: "already_present", keys[1]: "uploaded", keys[2]: "uploaded"}
        again = hwr("push", "--all", "--to", remote.push_url, "--root", str(node_a.root), "--json")
        assert {item["status"] for item in json.loads(again.stdout)["artifacts"]} == {"already_present"}

        corrupt = node_a.build(make_identity(tag="corrupt"))
        payload = next(node_a.store.layout.artifact_dir(corrupt.key).glob("*.safetensors"))
        os.chmod(payload, 0o644)
        data = bytearray(payload.read_bytes())
        data[-1] ^= 0xFF
        payload.write_bytes(bytes(data))
        os.chmod(payload, 0o444)
        mixed = hwr("push", "--all", "--to", remote.push_url, "--root", str(node_a.root), "--json")
        assert mixed.returncode == 1
        report = {item["key"]: item for item in json.loads(mixed.stdout)["artifacts"]}
        assert report[corrupt.key]["failure"]["code"] == "checksum_mismatch"
        assert {report[key]["status"] for key in keys} == {"already_present"}
        # The failed FULL_CHECKSUM denied the copy: it is no longer complete, so the next run leaves it out.
        table = hwr("push", "--all", "--to", remote.push_url, "--root", str(node_a.root))
        assert table.returncode == 0 and "already_present" in table.stdout and corrupt.key not in table.stdout
        listed = json.loads(hwr("remote", "ls", remote.push_url, "--json").stdout)
        assert sorted(entry["key"] for entry in listed["artifacts"]) == keys


def test_push_needs_a_key_or_all(hwr: Any, node_a: Node, tmp_path: Path) -> None:
    """E08: neither a key nor --all, or both, is a usage error."""
    key = node_a.build().key
    share = f"file://{tmp_path}"
    assert hwr("push", "--to", share, "--root", str(node_a.root)).returncode == 2
    assert hwr("push", key, "--all", "--to", share, "--root", str(node_a.root)).returncode == 2


def test_a_mistyped_remote_at_runtime_is_a_failed_attempt_and_preferred_builds_locally(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, moto: MotoEndpoint
) -> None:
    """E11, R02: HWR_REMOTE naming a missing folder or bucket records a non-retryable remote_failed attempt;
    PREFERRED goes on to the local build, REQUIRED fails with that failure; nothing is created remotely."""
    use_aws_environment(monkeypatch, tmp_path)
    identity = make_identity()
    for index, url in enumerate((f"file://{tmp_path / 'no-such-share'}", "s3://hwr-no-such-bucket-77aa/fleet")):
        config = HostWeightRuntimeConfig(
            root=tmp_path / f"node-{index}", remote=(url,), remote_endpoint_url=moto.url, mode=RuntimeMode.PREFERRED
        )
        resolved = HostWeightRuntime(config).resolve(identity, SyntheticProducer(identity, make_tensors(), files=1))
        assert resolved.outcome is ResolutionOutcome.LOCAL_PRODUCTION and resolved.lease is not None
        resolved.lease.close()
        [remote_attempt] = [a for a in resolved.report.attempts if a.stage.value == "remote"]
        assert remote_attempt.failure is not None and remote_attempt.failure.code is FailureCode.REMOTE_FAILED
        assert remote_attempt.failure.retryable is False and "does not exist" in remote_attempt.failure.message
    assert not (tmp_path / "no-such-share").exists()

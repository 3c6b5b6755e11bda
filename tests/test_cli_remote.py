"""`hwr push` and `hwr remote ls`, run as real subprocesses against moto's S3 server and file:// remotes.

Credentials reach the CLI only through AWS_* variables (the secret key is a marker); no
stdout or stderr of any run may contain it or the access key id (E05). Exit codes: 0
success, 1 a failure the command reports, 2 a usage error (E08, E09).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from host_weight_runtime import (
    FilesystemHostWeightStore,
    HostWeightRuntime,
    HostWeightRuntimeConfig,
    ResolutionOutcome,
)

from .remote_support import (
    ACCESS_KEY,
    SECRET_KEY,
    MotoEndpoint,
    Remote,
    closed_endpoint,
    make_remote,
    moto_endpoint,
    use_aws_environment,
)
from .support import make_identity, publish_standard_artifact

RUN_TIMEOUT_S = 120.0


@pytest.fixture(scope="module")
def moto() -> Iterator[MotoEndpoint]:
    with moto_endpoint() as endpoint:
        yield endpoint


@dataclass
class Cli:
    """Runs `hwr` in a fresh interpreter with an operator's environment and keeps every output it printed."""

    environment: dict[str, str]
    outputs: list[str] = field(default_factory=list)

    def __call__(self, *args: str, **extra: str) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(
            [sys.executable, "-m", "host_weight_runtime.cli", *args],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=RUN_TIMEOUT_S,
            env={**self.environment, **extra},
            check=False,
        )
        self.outputs += [done.stdout, done.stderr]
        return done

    def assert_secret_free(self) -> None:
        assert self.outputs
        for text in self.outputs:
            assert SECRET_KEY not in text and ACCESS_KEY not in text


@pytest.fixture
def cli(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, moto: MotoEndpoint) -> Iterator[Cli]:
    use_aws_environment(monkeypatch, tmp_path)
    environment = {name: value for name, value in os.environ.items() if not name.startswith("HWR_")}
    environment["HWR_REMOTE_ENDPOINT_URL"] = moto.url
    environment["COLUMNS"] = "240"  # tables print whole lines
    runner = Cli(environment)
    yield runner
    runner.assert_secret_free()


@pytest.fixture(params=["s3", "file"])
def remote(request: pytest.FixtureRequest, tmp_path: Path, moto: MotoEndpoint) -> Iterator[Remote]:
    with make_remote(request.param, tmp_path, moto) as value:
        yield value


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "node-a"


@pytest.fixture
def key(root: Path) -> str:
    """The standard test artifact (two payload files), published on node A."""
    return publish_standard_artifact(FilesystemHostWeightStore(root))


def as_json(done: subprocess.CompletedProcess[str]) -> Any:
    return json.loads(done.stdout)


def test_push_then_list_then_import_end_to_end(cli: Cli, remote: Remote, root: Path, key: str, tmp_path: Path) -> None:
    """E08, E09, E05: push by key prefix uploads (JSON), a second push finds the same bytes, ls shows the key
    complete (JSON and table), node B imports what was pushed; no output names a credential."""
    pushed = cli("push", key[:12], "--to", remote.push_url, "--root", str(root), "--json")
    assert pushed.returncode == 0, pushed.stderr
    result = as_json(pushed)
    assert result["key"] == key and result["status"] == "uploaded" and result["remote"] == remote.push_url
    assert result["bytes_uploaded"] > result["total_bytes"] > 0

    again = cli("push", key, "--to", remote.push_url, "--root", str(root))
    assert again.returncode == 0, again.stderr
    assert "already_present" in again.stdout and key in again.stdout

    listed = cli("remote", "ls", remote.push_url, "--json")
    assert listed.returncode == 0, listed.stderr
    listing = as_json(listed)
    assert listing["remote"] == remote.push_url
    [entry] = listing["artifacts"]
    assert entry["key"] == key and entry["state"] == "complete" and entry["problem"] is None
    assert entry["manifest_sha256"] == result["manifest_sha256"] and entry["file_count"] == 2
    table = cli("remote", "ls", remote.push_url)
    assert table.returncode == 0 and key[:12] in table.stdout and "complete" in table.stdout

    endpoint = cli.environment["HWR_REMOTE_ENDPOINT_URL"] if remote.kind == "s3" else None
    config = HostWeightRuntimeConfig(root=tmp_path / "node-b", remote=(remote.push_url,), remote_endpoint_url=endpoint)
    imported = HostWeightRuntime(config).resolve(make_identity())
    assert imported.outcome is ResolutionOutcome.REMOTE_IMPORT and imported.lease is not None
    imported.lease.close()


def test_listing_shows_an_upload_without_descriptor_as_incomplete(
    cli: Cli, remote: Remote, root: Path, key: str
) -> None:
    """E09: the objects of an upload that died before its descriptor are listed INCOMPLETE, never offered."""
    assert cli("push", key, "--to", remote.push_url, "--root", str(root)).returncode == 0
    remote.remove(key, "DESCRIPTOR.json")
    listed = cli("remote", "ls", remote.push_url, "--json")
    assert listed.returncode == 0
    assert [(entry["key"], entry["state"]) for entry in as_json(listed)["artifacts"]] == [(key, "incomplete")]
    table = cli("remote", "ls", remote.push_url)
    assert "incomplete" in table.stdout and "hwr push" in table.stdout


def test_bad_command_lines_are_usage_errors_that_echo_no_secret(cli: Cli, root: Path, key: str, tmp_path: Path) -> None:
    """E05, E08, E09: a URL carrying credentials or a signature, a read-only http(s) target, a malformed key and
    a bad HWR_REMOTE_TIMEOUT_S exit 2, never echoing the secret; an unknown key prefix exits 1."""
    share = f"file://{tmp_path / 'share'}"
    for url in ("s3://AKIDEXAMPLE:hunter2@bucket/fleet", "https://host/fleet?X-Amz-Signature=hunter2"):
        for args in (("push", key, "--to", url, "--root", str(root)), ("remote", "ls", url)):
            refused = cli(*args)
            assert refused.returncode == 2, refused.stderr
            assert "hunter2" not in refused.stdout + refused.stderr
    read_only = cli("push", key, "--to", "https://mirror.example/fleet", "--root", str(root))
    assert read_only.returncode == 2 and "read-only" in read_only.stderr
    unlistable = cli("remote", "ls", "https://mirror.example/fleet")
    assert unlistable.returncode == 2 and "cannot be listed" in unlistable.stderr
    assert cli("push", "not-a-key", "--to", share, "--root", str(root)).returncode == 2
    unknown = "0000" if not key.startswith("0000") else "ffff"
    assert cli("push", unknown, "--to", share, "--root", str(root)).returncode == 1
    bad_timeout = cli("remote", "ls", share, HWR_REMOTE_TIMEOUT_S="never")
    assert bad_timeout.returncode == 2 and "HWR_REMOTE_TIMEOUT_S" in bad_timeout.stderr
    assert cli("push", key, "--to", share, "--root", str(root), "--timeout", "0").returncode == 2


def test_remote_failures_exit_1_with_a_typed_json_failure(cli: Cli, root: Path, key: str, moto: MotoEndpoint) -> None:
    """E04, E05: an endpoint that is down is a retryable remote_failed; a key the endpoint does not know is
    access denied (not retryable); both exit 1, with the failure in --json, and name no credential."""
    bucket = moto.new_bucket()
    down = closed_endpoint()
    refused = cli("push", key, "--to", f"s3://{bucket}/fleet", "--root", str(root), "--endpoint-url", down, "--json")
    assert refused.returncode == 1
    failure = as_json(refused)["failure"]
    assert failure["code"] == "remote_failed" and failure["retryable"] is True and failure["stage"] == "remote"
    listing = cli("remote", "ls", f"s3://{bucket}/fleet", "--endpoint-url", down, "--timeout", "5", "--json")
    assert listing.returncode == 1 and as_json(listing)["failure"]["code"] == "remote_failed"

    moto.set_iam_enforced(True)
    try:
        denied = cli("push", key, "--to", f"s3://{bucket}/fleet", "--root", str(root))
        denied_listing = cli("remote", "ls", f"s3://{bucket}/fleet", "--json")
    finally:
        moto.set_iam_enforced(False)
    assert denied.returncode == 1 and "access denied" in denied.stderr and "remote_failed" in denied.stderr
    assert denied_listing.returncode == 1
    assert as_json(denied_listing)["failure"]["retryable"] is False

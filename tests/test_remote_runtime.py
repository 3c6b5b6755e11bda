"""The runtime's REMOTE stage and HWR_REMOTE*: node A builds and pushes, node B imports (R02, R10, E01-E08).

Real parts only: moto's S3 server on loopback spoken to over HTTP by s3fs with credentials
from AWS_* variables, and file:// remotes in a temporary folder; two domains play two
nodes. The decision table's remote row: with every remote missing or failing, PREFERRED
goes on to the local build and then canonical; REQUIRED fails.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import pytest

from host_weight_runtime import (
    ArtifactWriter,
    AttemptAction,
    AttemptResult,
    FailureCode,
    FsspecArtifactProvider,
    HostWeightError,
    HostWeightRuntime,
    HostWeightRuntimeConfig,
    LeaseSource,
    LookupPhase,
    PostLoadPublicationStatus,
    ProductionMetadata,
    PushResult,
    PushStatus,
    RemoteArtifactDescriptor,
    RemoteArtifactState,
    ResolutionOutcome,
    ResolutionReport,
    ResolutionStage,
    RuntimeMode,
    list_remote,
    push_artifact,
)
from host_weight_runtime._resolution.decisions import StageVerdict, stage_action
from host_weight_runtime.failures import HostWeightFailure, failure
from host_weight_runtime.identity import WeightArtifactIdentity

from .remote_support import (
    ACCESS_KEY,
    SECRET_KEY,
    WAIT_S,
    MotoEndpoint,
    Node,
    Remote,
    assert_bitwise_equal,
    closed_endpoint,
    make_remote,
    moto_endpoint,
    use_aws_environment,
)
from .support import SyntheticProducer, make_identity, make_tensors, recv_within, spawned_child

PREFERRED = RuntimeMode.PREFERRED
REQUIRED = RuntimeMode.REQUIRED
LOOKUP, REMOTE, PRODUCTION = ResolutionStage.LOOKUP, ResolutionStage.REMOTE, ResolutionStage.PRODUCTION
MISS, BUILT, HIT, FAILED, SKIPPED = (
    AttemptResult.MISS,
    AttemptResult.BUILT,
    AttemptResult.HIT,
    AttemptResult.FAILED,
    AttemptResult.SKIPPED,
)
USE, CONTINUE, FALL_BACK, FAIL = AttemptAction.USE, AttemptAction.CONTINUE, AttemptAction.FALL_BACK, AttemptAction.FAIL


@pytest.fixture(scope="module")
def moto() -> Iterator[MotoEndpoint]:
    with moto_endpoint() as endpoint:
        yield endpoint


@pytest.fixture(autouse=True)
def _aws(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Every test runs with the operator-style AWS environment, no HWR_* setting leaking in."""
    use_aws_environment(monkeypatch, tmp_path)
    for name in ("HWR_REMOTE", "HWR_REMOTE_ENDPOINT_URL", "HWR_REMOTE_TIMEOUT_S", "HWR_REMOTE_PUBLISH"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(params=["s3", "file"])
def remote(request: pytest.FixtureRequest, tmp_path: Path, moto: MotoEndpoint) -> Iterator[Remote]:
    with make_remote(request.param, tmp_path, moto) as value:
        yield value


def config_for(
    remote: Remote, moto: MotoEndpoint, root: Path, mode: RuntimeMode = PREFERRED, **extra: Any
) -> HostWeightRuntimeConfig:
    """What an operator sets: HWR_REMOTE (and, for S3, HWR_REMOTE_ENDPOINT_URL); credentials from AWS_*."""
    endpoint = moto.url if remote.kind == "s3" else None
    return HostWeightRuntimeConfig(
        mode=mode, root=root, remote=(remote.push_url,), remote_endpoint_url=endpoint, **extra
    )


def steps(report: ResolutionReport) -> list[tuple[ResolutionStage, AttemptResult, AttemptAction]]:
    return [(attempt.stage, attempt.result, attempt.action) for attempt in report.attempts]


def producer_for(identity: WeightArtifactIdentity, **kwargs: Any) -> SyntheticProducer:
    return SyntheticProducer(identity, make_tensors(), files=2, **kwargs)


def flip_payload_byte(remote: Remote, key: str) -> None:
    """One flipped byte inside a tensor: every size still matches, only the hashes can tell."""
    name = "model-00001-of-00002.safetensors"
    data = bytearray(remote.read(key, name))
    header = 8 + int.from_bytes(data[:8], "little")
    data[header + 5] ^= 0xFF
    remote.write(key, name, bytes(data))


def only_pushes(outcomes: tuple[PushResult | HostWeightFailure, ...]) -> list[PushResult]:
    assert all(isinstance(outcome, PushResult) for outcome in outcomes), outcomes
    return [outcome for outcome in outcomes if isinstance(outcome, PushResult)]


def complete_keys(remote: Remote, moto: MotoEndpoint) -> set[str]:
    options = {"endpoint_url": moto.url} if remote.kind == "s3" else {}
    return {
        item.key
        for item in list_remote(remote.read_url, storage_options=options)
        if item.state is RemoteArtifactState.COMPLETE
    }


def nothing_left(root: Path) -> bool:
    return all(not any((root / room).iterdir()) for room in ("artifacts", "tmp"))


# --------------------------------------------------------------------------- two nodes


def test_node_a_pushes_what_it_builds_and_node_b_imports_it_then_hits(
    remote: Remote, moto: MotoEndpoint, tmp_path: Path
) -> None:
    """E01, E08, R02: A builds (HWR_REMOTE_PUBLISH pushes it off the request path); B's first resolve is
    REMOTE_IMPORT with a REMOTE_IMPORT lease of bit-identical tensors, its second a LOCAL_HIT."""
    identity = make_identity()
    node_a = HostWeightRuntime(config_for(remote, moto, tmp_path / "node-a", remote_publish=True))
    built = node_a.resolve(identity, producer_for(identity))
    assert built.outcome is ResolutionOutcome.LOCAL_PRODUCTION, built.report.failure
    assert steps(built.report) == [(LOOKUP, MISS, CONTINUE), (REMOTE, MISS, CONTINUE), (PRODUCTION, BUILT, USE)]
    assert built.lease is not None
    built.lease.close()
    (pushed,) = only_pushes(node_a.wait_for_remote_pushes(WAIT_S))
    assert pushed.key == identity.key and pushed.status is PushStatus.UPLOADED
    assert complete_keys(remote, moto) == {identity.key}

    node_b = HostWeightRuntime(config_for(remote, moto, tmp_path / "node-b"))
    imported = node_b.resolve(identity)
    assert imported.outcome is ResolutionOutcome.REMOTE_IMPORT, imported.report.failure
    assert steps(imported.report) == [(LOOKUP, MISS, CONTINUE), (REMOTE, BUILT, USE)]
    assert imported.report.publication_id is not None
    lease = imported.lease
    assert lease is not None and lease.provenance.source is LeaseSource.REMOTE_IMPORT
    for name, tensor in make_tensors().items():
        assert_bitwise_equal(lease.tensors[name], tensor)
    lease.close()

    again = node_b.resolve(identity)
    assert again.outcome is ResolutionOutcome.LOCAL_HIT
    assert steps(again.report) == [(LOOKUP, HIT, USE)]
    assert again.lease is not None and again.lease.provenance.source is LeaseSource.LOCAL_HIT
    again.lease.close()
    assert node_b.wait_for_remote_pushes(WAIT_S) == ()  # B publishes nothing: an import is not pushed back


def test_a_post_load_publication_is_pushed(remote: Remote, moto: MotoEndpoint, tmp_path: Path) -> None:
    """E08: what publish_after_load publishes goes to the remote too; a second publication pushes nothing."""
    identity = make_identity()
    runtime = HostWeightRuntime(config_for(remote, moto, tmp_path / "node-a", remote_publish=True))
    post_load = producer_for(identity, lookup_phase=LookupPhase.POST_LOAD_ONLY)
    assert runtime.publish_after_load(identity, post_load).status is PostLoadPublicationStatus.PUBLISHED
    (pushed,) = only_pushes(runtime.wait_for_remote_pushes(WAIT_S))
    assert pushed.status is PushStatus.UPLOADED
    assert runtime.publish_after_load(identity, post_load).status is PostLoadPublicationStatus.ALREADY_PRESENT
    assert len(runtime.wait_for_remote_pushes(WAIT_S)) == 1
    assert complete_keys(remote, moto) == {identity.key}


def _build_and_exit(root: str, url: str, conn: Connection) -> None:
    """A worker that builds with HWR_REMOTE_PUBLISH and returns at once: its exit must wait for the upload."""
    runtime = HostWeightRuntime.from_env({"HWR_ROOT": root, "HWR_REMOTE": url, "HWR_REMOTE_PUBLISH": "true"})
    identity = make_identity()
    resolution = runtime.resolve(identity, producer_for(identity))
    if resolution.lease is not None:
        resolution.lease.close()
    conn.send(resolution.outcome.value)


def test_a_process_that_exits_right_after_building_still_completes_its_push(tmp_path: Path) -> None:
    """E08: the push runs off the request path, and interpreter exit waits for it (no descriptor-less upload)."""
    folder = tmp_path / "remote"
    folder.mkdir()
    url = f"file://{folder}"
    with spawned_child(_build_and_exit, str(tmp_path / "node-a"), url) as conn:
        assert recv_within(conn) == ResolutionOutcome.LOCAL_PRODUCTION.value
    listing = list_remote(url)
    assert [(item.key, item.state) for item in listing] == [(make_identity().key, RemoteArtifactState.COMPLETE)]


# --------------------------------------------------------------------------- misses and the decision table


def test_without_a_remote_no_remote_attempt_is_recorded(tmp_path: Path) -> None:
    """R02: with no remote configured the stage is not tried: lookup miss, producer skipped, fall back."""
    runtime = HostWeightRuntime(HostWeightRuntimeConfig(root=tmp_path / "node"))
    assert runtime.remote_providers == ()
    resolution = runtime.resolve(make_identity())
    assert steps(resolution.report) == [(LOOKUP, MISS, CONTINUE), (PRODUCTION, SKIPPED, FALL_BACK)]


def test_a_remote_without_the_artifact_is_a_recorded_miss(remote: Remote, moto: MotoEndpoint, tmp_path: Path) -> None:
    """E02, R02: an empty remote is a clean miss; PREFERRED falls back, REQUIRED fails NOT_FOUND."""
    identity = make_identity()
    preferred = HostWeightRuntime(config_for(remote, moto, tmp_path / "node-b")).resolve(identity)
    assert preferred.outcome is ResolutionOutcome.CANONICAL_FALLBACK and preferred.report.failure is None
    assert steps(preferred.report) == [
        (LOOKUP, MISS, CONTINUE),
        (REMOTE, MISS, CONTINUE),
        (PRODUCTION, SKIPPED, FALL_BACK),
    ]
    required = HostWeightRuntime(config_for(remote, moto, tmp_path / "node-c", REQUIRED)).resolve(identity)
    assert required.outcome is ResolutionOutcome.FAILED
    assert required.report.failure is not None and required.report.failure.code is FailureCode.NOT_FOUND


def test_a_corrupt_remote_never_stops_a_good_local_build_in_preferred(
    remote: Remote, moto: MotoEndpoint, tmp_path: Path
) -> None:
    """R10, E03: a flipped byte on the remote is a non-retryable REMOTE_FAILED attempt; PREFERRED still builds
    locally (or falls back to canonical without a producer), REQUIRED fails typed; nothing partial is left."""
    identity = make_identity()
    node_a = Node(tmp_path / "node-a")
    node_a.build(identity)
    remote.push(node_a, identity)
    flip_payload_byte(remote, identity.key)

    local = producer_for(identity)
    built = HostWeightRuntime(config_for(remote, moto, tmp_path / "node-b")).resolve(identity, local)
    assert built.outcome is ResolutionOutcome.LOCAL_PRODUCTION and local.calls == 1
    assert steps(built.report) == [(LOOKUP, MISS, CONTINUE), (REMOTE, FAILED, CONTINUE), (PRODUCTION, BUILT, USE)]
    remote_attempt = built.report.attempts[1]
    assert remote_attempt.failure is not None and remote_attempt.failure.code is FailureCode.REMOTE_FAILED
    assert not remote_attempt.failure.retryable and remote_attempt.failure.stage is REMOTE
    assert built.report.failure is None
    assert built.lease is not None and built.lease.provenance.source is LeaseSource.BUILT
    for name, tensor in make_tensors().items():
        assert_bitwise_equal(built.lease.tensors[name], tensor)
    built.lease.close()

    canonical = HostWeightRuntime(config_for(remote, moto, tmp_path / "node-c")).resolve(identity)
    assert canonical.outcome is ResolutionOutcome.CANONICAL_FALLBACK
    assert steps(canonical.report) == [
        (LOOKUP, MISS, CONTINUE),
        (REMOTE, FAILED, CONTINUE),
        (PRODUCTION, SKIPPED, FALL_BACK),
    ]
    assert canonical.report.failure is not None and canonical.report.failure.code is FailureCode.REMOTE_FAILED
    assert nothing_left(tmp_path / "node-c")

    refused = producer_for(identity)
    failed = HostWeightRuntime(config_for(remote, moto, tmp_path / "node-d", REQUIRED)).resolve(identity, refused)
    assert failed.outcome is ResolutionOutcome.FAILED and failed.lease is None
    assert steps(failed.report) == [(LOOKUP, MISS, CONTINUE), (REMOTE, FAILED, FAIL)]
    problem = failed.report.failure
    assert problem is not None and problem.code is FailureCode.REMOTE_FAILED and problem.stage is REMOTE
    assert refused.calls == 0
    assert nothing_left(tmp_path / "node-d")


def test_remotes_are_tried_in_order_past_one_that_is_down(moto: MotoEndpoint, tmp_path: Path) -> None:
    """E04, R02: an endpoint that refuses connections is a retryable failure; the next remote still serves the
    import in both modes. With only the dead one, PREFERRED falls back and REQUIRED fails."""
    identity = make_identity()
    node_a = Node(tmp_path / "node-a")
    node_a.build(identity)
    good_url = f"file://{tmp_path / 'remote'}"
    push_artifact(node_a.store, identity, good_url)
    down = f"{closed_endpoint()}/fleet"
    for mode, name in ((PREFERRED, "node-b"), (REQUIRED, "node-c")):
        config = HostWeightRuntimeConfig(mode=mode, root=tmp_path / name, remote=(down, good_url), remote_timeout_s=5)
        runtime = HostWeightRuntime(config)
        assert [provider.provider_id for provider in runtime.remote_providers] == [down, good_url]
        resolution = runtime.resolve(identity)
        assert resolution.outcome is ResolutionOutcome.REMOTE_IMPORT, resolution.report.failure
        assert resolution.lease is not None
        resolution.lease.close()

    only_down = (down,)
    preferred = HostWeightRuntime(HostWeightRuntimeConfig(root=tmp_path / "node-d", remote=only_down)).resolve(identity)
    assert preferred.outcome is ResolutionOutcome.CANONICAL_FALLBACK
    assert steps(preferred.report)[1] == (REMOTE, FAILED, CONTINUE)
    assert preferred.report.failure is not None and preferred.report.failure.retryable
    required = HostWeightRuntime(
        HostWeightRuntimeConfig(mode=REQUIRED, root=tmp_path / "node-e", remote=only_down)
    ).resolve(identity, producer_for(identity))
    assert required.outcome is ResolutionOutcome.FAILED
    assert required.report.failure is not None and required.report.failure.code is FailureCode.REMOTE_FAILED
    assert nothing_left(tmp_path / "node-d") and nothing_left(tmp_path / "node-e")


def test_explicit_providers_replace_the_configured_urls(moto: MotoEndpoint, tmp_path: Path) -> None:
    """E01: `remote_providers` (any RemoteArtifactProvider) are what resolve probes, in the order given."""
    identity = make_identity()
    node_a = Node(tmp_path / "node-a")
    node_a.build(identity)
    with make_remote("s3", tmp_path, moto) as s3:
        s3.push(node_a, identity)
        provider = FsspecArtifactProvider(s3.read_url, storage_options=moto.storage_options())
        config = HostWeightRuntimeConfig(root=tmp_path / "node-b", remote=(f"file://{tmp_path / 'elsewhere'}",))
        runtime = HostWeightRuntime(config, remote_providers=[provider])
        assert runtime.remote_providers == (provider,)
        resolution = runtime.resolve(identity)
    assert resolution.outcome is ResolutionOutcome.REMOTE_IMPORT
    assert resolution.lease is not None
    resolution.lease.close()


# --------------------------------------------------------------------------- credentials and configuration


def test_reports_logs_and_push_outcomes_never_carry_credentials(
    moto: MotoEndpoint, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """E05: with the secret key in AWS_SECRET_ACCESS_KEY, no report, failure, push outcome or log line of the
    runtime contains it or the access key id, whether the remote works or refuses the credentials."""
    caplog.set_level(logging.DEBUG, logger="host_weight_runtime")
    identity = make_identity()
    said: list[str] = []
    with make_remote("s3", tmp_path, moto) as s3:
        config = HostWeightRuntimeConfig(
            root=tmp_path / "node-a", remote=(s3.push_url,), remote_endpoint_url=moto.url, remote_publish=True
        )
        node_a = HostWeightRuntime(config, observers=[lambda made: said.append(json.dumps(made.to_dict()))])
        built = node_a.resolve(identity, producer_for(identity))
        assert built.lease is not None
        built.lease.close()
        outcomes = node_a.wait_for_remote_pushes(WAIT_S)
        imported = HostWeightRuntime(
            HostWeightRuntimeConfig(root=tmp_path / "node-b", remote=(s3.push_url,), remote_endpoint_url=moto.url),
            observers=[lambda made: said.append(json.dumps(made.to_dict()))],
        ).resolve(identity)
        assert imported.outcome is ResolutionOutcome.REMOTE_IMPORT and imported.lease is not None
        imported.lease.close()
        moto.set_iam_enforced(True)  # the key in the environment is unknown to IAM: access denied
        try:
            refused = HostWeightRuntime(
                HostWeightRuntimeConfig(
                    mode=REQUIRED, root=tmp_path / "node-c", remote=(s3.push_url,), remote_endpoint_url=moto.url
                ),
                observers=[lambda made: said.append(json.dumps(made.to_dict()))],
            ).resolve(identity)
        finally:
            moto.set_iam_enforced(False)
    assert refused.outcome is ResolutionOutcome.FAILED
    assert refused.report.failure is not None and refused.report.failure.code is FailureCode.REMOTE_FAILED
    assert len(said) == 3 and len(outcomes) == 1
    texts = [
        *said,
        json.dumps([outcome.to_dict() for outcome in outcomes]),
        repr(config),
        caplog.text,
        *(record.getMessage() for record in caplog.records),
    ]
    assert any("access denied" in text for text in texts)
    for text in texts:
        assert SECRET_KEY not in text and ACCESS_KEY not in text


def test_hwr_remote_variables_configure_providers_in_order(moto: MotoEndpoint, tmp_path: Path) -> None:
    """HWR_REMOTE lists URLs tried in order; HWR_REMOTE_ENDPOINT_URL and HWR_REMOTE_TIMEOUT_S reach them;
    HWR_REMOTE_PUBLISH pushes to the first writable one; DISABLED builds no provider."""
    environ = {
        "HWR_ROOT": str(tmp_path / "node"),
        "HWR_REMOTE": f" https://mirror.example/fleet , s3://bucket/fleet,file://{tmp_path}/share ",
        "HWR_REMOTE_ENDPOINT_URL": moto.url,
        "HWR_REMOTE_TIMEOUT_S": "7.5",
        "HWR_REMOTE_PUBLISH": "true",
    }
    runtime = HostWeightRuntime.from_env(environ)
    config = runtime.config
    assert config.remote == ("https://mirror.example/fleet", "s3://bucket/fleet", f"file://{tmp_path}/share")
    assert config.remote_push_url == "s3://bucket/fleet" and config.remote_publish
    assert config.remote_endpoint_url == moto.url and config.remote_timeout_s == 7.5
    assert [provider.provider_id for provider in runtime.remote_providers] == list(config.remote)
    disabled = HostWeightRuntime.from_env({**environ, "HWR_MODE": "disabled"})
    assert disabled.remote_providers == () and disabled.wait_for_remote_pushes() == ()
    assert HostWeightRuntimeConfig.from_dict({"remote": ["file:///a", "s3://b/c"]}).remote == ("file:///a", "s3://b/c")


@pytest.mark.parametrize(
    ("environ", "named", "secret"),
    [
        ({"HWR_REMOTE": "s3://AKIDEXAMPLE:hunter2@bucket/fleet"}, "HWR_REMOTE", "hunter2"),
        ({"HWR_REMOTE": "https://host/fleet?X-Amz-Signature=deadbeef"}, "HWR_REMOTE", "deadbeef"),
        ({"HWR_REMOTE": "no-scheme-here"}, "HWR_REMOTE", None),
        ({"HWR_REMOTE_ENDPOINT_URL": "http://user:hunter2@127.0.0.1:9000"}, "HWR_REMOTE_ENDPOINT_URL", "hunter2"),
        ({"HWR_REMOTE_ENDPOINT_URL": "s3://not-an-endpoint"}, "HWR_REMOTE_ENDPOINT_URL", None),
        ({"HWR_REMOTE_TIMEOUT_S": "0"}, "HWR_REMOTE_TIMEOUT_S", None),
        ({"HWR_REMOTE_TIMEOUT_S": "soon"}, "HWR_REMOTE_TIMEOUT_S", None),
        ({"HWR_REMOTE_PUBLISH": "maybe"}, "HWR_REMOTE_PUBLISH", None),
        ({"HWR_REMOTE_PUBLISH": "true"}, "HWR_REMOTE_PUBLISH", None),
        ({"HWR_REMOTE_PUBLISH": "true", "HWR_REMOTE": "https://host/fleet"}, "HWR_REMOTE", None),
    ],
)
def test_invalid_remote_settings_name_the_variable_and_echo_no_secret(
    environ: dict[str, str], named: str, secret: str | None
) -> None:
    """R10: a bad HWR_REMOTE* value is a ValueError naming the variable to fix; a URL is never echoed."""
    with pytest.raises(ValueError, match=named) as refused:
        HostWeightRuntimeConfig.from_env(environ)
    if secret is not None:
        chain = [refused.value, refused.value.__cause__, refused.value.__context__]
        assert all(secret not in str(error) for error in chain if error is not None)


class _MisconfiguredRemote:
    """A real RemoteArtifactProvider whose backend reports a configuration error (e.g. a missing package)."""

    provider_id = "misconfigured://fleet"

    def probe(self, identity: WeightArtifactIdentity) -> None:
        raise HostWeightError(
            failure(ResolutionStage.CONFIGURATION, FailureCode.INVALID_CONFIGURATION, "the backend is not installed")
        )

    def fetch(self, descriptor: RemoteArtifactDescriptor, writer: ArtifactWriter) -> ProductionMetadata:
        raise AssertionError("never fetched: the probe failed")


def test_a_configuration_error_from_a_remote_is_never_disguised_as_a_miss(tmp_path: Path) -> None:
    """R10: a remote that fails with a code in ALWAYS_FATAL (a configuration error) fails the resolve in both
    modes, before any local build; every other remote failure lets PREFERRED go on (the table's remote row)."""
    identity = make_identity()
    for mode in (PREFERRED, REQUIRED):
        local = producer_for(identity)
        runtime = HostWeightRuntime(
            HostWeightRuntimeConfig(mode=mode, root=tmp_path / mode.value), remote_providers=[_MisconfiguredRemote()]
        )
        resolution = runtime.resolve(identity, local)
        assert resolution.outcome is ResolutionOutcome.FAILED and local.calls == 0
        assert steps(resolution.report) == [(LOOKUP, MISS, CONTINUE), (REMOTE, FAILED, FAIL)]
        problem = resolution.report.failure
        assert problem is not None and problem.code is FailureCode.INVALID_CONFIGURATION
        assert problem.stage is ResolutionStage.REMOTE
    remote_failed = failure(ResolutionStage.REMOTE, FailureCode.REMOTE_FAILED, "bad bytes")
    assert stage_action(PREFERRED, StageVerdict.UNAVAILABLE, remote_failed) is CONTINUE
    assert stage_action(REQUIRED, StageVerdict.UNAVAILABLE, remote_failed) is FAIL

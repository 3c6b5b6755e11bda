"""`load_component` with HWR_REMOTE and no code change (D14, R02, R10, E01, E03, E08).

Node A is a fresh process that loads a real tiny diffusers Flux transformer with
HWR_REMOTE_PUBLISH=true and exits at once (its exit waits for the push); node B, another
domain on this machine, loads it with HWR_REMOTE set and gets the remote's exact artifact
(REMOTE_IMPORT), then a LOCAL_HIT, with every weight bit-identical to diffusers'
`from_pretrained(torch_dtype=torch.bfloat16)`. The remote is moto's S3 server over HTTP.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import pytest
import torch

from host_weight_runtime import FailureCode, HostWeightError, LeaseSource, ResolutionOutcome, ResolutionStage
from host_weight_runtime.diffusion import ComponentLoadPath, load_component
from host_weight_runtime.outcomes import AttemptResult, PostLoadPublicationStatus
from hwr_tools.synthetic_models import forward_inputs, run_forward, save_pipeline_folder, tiny_spec

from .remote_support import MotoEndpoint, Remote, assert_bitwise_equal, make_remote, moto_endpoint, use_aws_environment
from .support import recv_within, spawned_child

KIND = "flux"
SUBFOLDER = "transformer"


@pytest.fixture(scope="module")
def moto() -> Iterator[MotoEndpoint]:
    with moto_endpoint() as endpoint:
        yield endpoint


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_pipeline_folder(tmp_path_factory.mktemp("models") / "tiny-flux", KIND, seed=11)


@pytest.fixture(scope="module")
def canonical(pipeline: Path) -> torch.nn.Module:
    """Exactly what diffusers gives: from_pretrained(torch_dtype=torch.bfloat16)."""
    model: torch.nn.Module = (
        tiny_spec(KIND).model_class().from_pretrained(str(pipeline / SUBFOLDER), torch_dtype=torch.bfloat16)
    )
    return model


@dataclass
class Fleet:
    """One S3 remote (a fresh bucket on moto) and the environment a node of the fleet runs with."""

    remote: Remote
    moto: MotoEndpoint
    monkeypatch: pytest.MonkeyPatch

    def environment(self, root: Path, **extra: str) -> dict[str, str]:
        return {
            "HWR_ROOT": str(root),
            "HWR_REMOTE": self.remote.push_url,
            "HWR_REMOTE_ENDPOINT_URL": self.moto.url,
            **extra,
        }

    def become(self, root: Path, **extra: str) -> None:
        """This test process is now the node whose domain is `root` (HWR_* variables only; no code change)."""
        for name, value in self.environment(root, **extra).items():
            self.monkeypatch.setenv(name, value)


@pytest.fixture
def fleet(tmp_path: Path, moto: MotoEndpoint, monkeypatch: pytest.MonkeyPatch) -> Iterator[Fleet]:
    """A fresh bucket; credentials only in AWS_* variables; no HWR_* setting leaking in; the hub offline."""
    use_aws_environment(monkeypatch, tmp_path)
    for name in list(os.environ):
        if name.startswith("HWR_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with make_remote("s3", tmp_path, moto) as remote:
        yield Fleet(remote, moto, monkeypatch)


def assert_same_weights(model: torch.nn.Module, reference: torch.nn.Module) -> None:
    ours, theirs = model.state_dict(), reference.state_dict()
    assert sorted(ours) == sorted(theirs)
    for name, tensor in theirs.items():
        assert_bitwise_equal(ours[name], tensor)
    inputs = forward_inputs(KIND, reference)
    assert torch.equal(run_forward(KIND, model, inputs), run_forward(KIND, reference, inputs))


def _node_a(pipeline: str, environ: dict[str, str], conn: Connection) -> None:
    """A first worker: load with HWR_REMOTE_PUBLISH=true, report, and return at once (exit waits for the push)."""
    os.environ.update(environ)
    with load_component(pipeline, subfolder=SUBFOLDER, publish_in_background=False) as loaded:
        publication = loaded.publication
        conn.send(
            {
                "outcome": None if loaded.outcome is None else loaded.outcome.value,
                "publication": None if publication is None else publication.status.value,
                "key": loaded.identity_key,
            }
        )


def publish_from_node_a(pipeline: Path, root: Path, fleet: Fleet) -> str:
    environ = fleet.environment(root, HWR_REMOTE_PUBLISH="true")
    with spawned_child(_node_a, str(pipeline), environ) as conn:
        said: Any = recv_within(conn)
    assert said["outcome"] == ResolutionOutcome.CANONICAL_FALLBACK.value
    assert said["publication"] == PostLoadPublicationStatus.PUBLISHED.value
    key: str = said["key"]
    assert "DESCRIPTOR.json" in fleet.remote.names(key), "node A's exit must have waited for its push"
    return key


def test_node_b_imports_what_node_a_published_and_then_hits(
    pipeline: Path, canonical: torch.nn.Module, fleet: Fleet, tmp_path: Path
) -> None:
    """E01, E08, D14: B's first load_component is REMOTE_IMPORT (no local build, no canonical load), its
    second a LOCAL_HIT; both models equal canonical from_pretrained bit for bit."""
    key = publish_from_node_a(pipeline, tmp_path / "node-a", fleet)
    fleet.become(tmp_path / "node-b")
    with load_component(pipeline, subfolder=SUBFOLDER, publish_in_background=False) as first:
        assert first.outcome is ResolutionOutcome.REMOTE_IMPORT, first.summary()
        assert first.load_path is ComponentLoadPath.ARTIFACT and first.identity_key == key
        assert first.resolution is not None
        assert [(a.stage, a.result) for a in first.resolution.attempts] == [
            (ResolutionStage.LOOKUP, AttemptResult.MISS),
            (ResolutionStage.REMOTE, AttemptResult.BUILT),
        ]
        assert first.lease is not None and first.lease.provenance.source is LeaseSource.REMOTE_IMPORT
        assert first.publication is None
        assert_same_weights(first.model, canonical)
    with load_component(pipeline, subfolder=SUBFOLDER, publish_in_background=False) as second:
        assert second.outcome is ResolutionOutcome.LOCAL_HIT and second.load_path is ComponentLoadPath.ARTIFACT
        assert_same_weights(second.model, canonical)


def test_a_corrupt_remote_falls_back_in_preferred_and_fails_in_required(
    pipeline: Path, canonical: torch.nn.Module, fleet: Fleet, tmp_path: Path
) -> None:
    """R10, E03: a payload byte flipped on the remote: PREFERRED records the failed REMOTE attempt, loads
    canonically and publishes locally; REQUIRED raises the typed REMOTE_FAILED and leaves nothing behind."""
    key = publish_from_node_a(pipeline, tmp_path / "node-a", fleet)
    remote = fleet.remote
    name = next(item for item in remote.names(key) if item.endswith(".safetensors"))
    data = bytearray(remote.read(key, name))
    data[8 + int.from_bytes(data[:8], "little") + 3] ^= 0xFF
    remote.write(key, name, bytes(data))

    fleet.become(tmp_path / "node-b")
    with load_component(pipeline, subfolder=SUBFOLDER, publish_in_background=False) as loaded:
        assert (
            loaded.outcome is ResolutionOutcome.CANONICAL_FALLBACK and loaded.load_path is ComponentLoadPath.CANONICAL
        )
        assert loaded.resolution is not None
        remote_attempt = loaded.resolution.attempts[1]
        assert remote_attempt.stage is ResolutionStage.REMOTE and remote_attempt.result is AttemptResult.FAILED
        assert remote_attempt.failure is not None and remote_attempt.failure.code is FailureCode.REMOTE_FAILED
        assert loaded.publication is not None and loaded.publication.status is PostLoadPublicationStatus.PUBLISHED
        assert_same_weights(loaded.model, canonical)

    root = tmp_path / "node-c"
    fleet.become(root, HWR_MODE="required")
    with pytest.raises(HostWeightError) as refused:
        load_component(pipeline, subfolder=SUBFOLDER, publish_in_background=False)
    assert refused.value.code is FailureCode.REMOTE_FAILED and refused.value.failure.stage is ResolutionStage.REMOTE
    assert not any((root / "artifacts").iterdir()) and not any((root / "tmp").iterdir())

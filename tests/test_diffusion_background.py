"""`load_component(publish_in_background=True)`: the first worker gets its canonical model at once, the
artifact is built from the checkpoint on a thread, and later workers hit it bit-identically (D14 variant)."""

from __future__ import annotations

import os
import threading
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import pytest
import torch

from host_weight_runtime._faults import Fault, FaultAction, armed
from host_weight_runtime.config import HostWeightRuntimeConfig, RuntimeMode
from host_weight_runtime.diffusion import BackgroundPublication, ComponentLoadPath, load_component
from host_weight_runtime.diffusion.background import BACKGROUND_NICE_INCREMENT
from host_weight_runtime.filesystem.store import FilesystemHostWeightStore
from host_weight_runtime.outcomes import AttemptResult, ResolutionOutcome
from host_weight_runtime.runtime import HostWeightRuntime
from hwr_tools.synthetic_models import save_pipeline_folder

from ._tiny_flux import canonical_flux, flux_forward, isolate_environment
from .support import recv_within, spawned_child

KIND = "flux"
SUBFOLDER = "transformer"
WAIT_S = 120.0


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    isolate_environment(monkeypatch, tmp_path)


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_pipeline_folder(tmp_path_factory.mktemp("models") / "tiny-flux", KIND, seed=11)


@pytest.fixture(scope="module")
def canonical_output(pipeline: Path) -> torch.Tensor:
    return flux_forward(canonical_flux(pipeline))


def _runtime(root: Path, mode: RuntimeMode = RuntimeMode.PREFERRED) -> HostWeightRuntime:
    return HostWeightRuntime(HostWeightRuntimeConfig(mode=mode, root=root))


def _finished(background: BackgroundPublication | None) -> BackgroundPublication:
    assert background is not None
    assert background.wait(WAIT_S)
    assert background.failure is None, background.failure
    assert background.result is not None
    return background


def _load_in_child(root: str, pipeline: str, conn: Connection) -> None:
    """A fresh worker: how did it load, and what does the model compute?"""
    with load_component(pipeline, subfolder=SUBFOLDER, runtime=_runtime(Path(root))) as loaded:
        output = flux_forward(loaded.model)
        conn.send(
            {
                "outcome": None if loaded.outcome is None else loaded.outcome.value,
                "load_path": loaded.load_path.value,
                "output": output.float().reshape(-1).tolist(),
                "shape": list(output.shape),
            }
        )


def _child_output(message: dict[str, Any], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(message["output"], dtype=torch.float32).reshape(message["shape"]).to(like.dtype)


def test_on_a_node_that_never_hashed_the_checkpoint_the_first_load_is_canonical_and_publishes_behind(
    tmp_path: Path, pipeline: Path, canonical_output: torch.Tensor
) -> None:
    """D14: with nothing known about the checkpoint, the model comes back canonically without hashing or
    lookup; the artifact is streamed on a thread, and a fresh process then hits it bit-identically."""
    root = tmp_path / "domain"
    with load_component(pipeline, subfolder=SUBFOLDER, runtime=_runtime(root), publish_in_background=True) as first:
        assert first.load_path is ComponentLoadPath.CANONICAL
        assert first.outcome is ResolutionOutcome.CANONICAL_FALLBACK and first.resolution.identity_key == ""
        assert [attempt.result for attempt in first.resolution.attempts] == [AttemptResult.SKIPPED]
        assert first.publication is None and first.identity_key is None
        assert torch.equal(flux_forward(first.model), canonical_output)
        background = _finished(first.background_publication)
        assert background.result is not None
        assert background.result.resolution.outcome is ResolutionOutcome.LOCAL_PRODUCTION
        assert first.summary()["background_publication"] == background.state()
    with spawned_child(_load_in_child, str(root), str(pipeline)) as conn:
        second = recv_within(conn)
    assert isinstance(second, dict)
    assert second["outcome"] == ResolutionOutcome.LOCAL_HIT.value
    assert torch.equal(_child_output(second, canonical_output), canonical_output)


def test_with_the_checkpoint_hashed_a_miss_looks_up_first_then_publishes_behind(
    tmp_path: Path, pipeline: Path, canonical_output: torch.Tensor
) -> None:
    """D14: once the node knows the checkpoint's digests, a miss is a real lookup (CANONICAL_FALLBACK), the
    publication still runs on the thread, and the next load in this process is LOCAL_HIT."""
    root = tmp_path / "domain"
    runtime = _runtime(root)
    with load_component(pipeline, subfolder=SUBFOLDER, runtime=runtime, publish_in_background=True) as first:
        key = _finished(first.background_publication).result
        assert key is not None
    assert FilesystemHostWeightStore(root).cleanup(key.identity_key).status.value == "removed"
    with load_component(pipeline, subfolder=SUBFOLDER, runtime=runtime, publish_in_background=True) as second:
        assert second.outcome is ResolutionOutcome.CANONICAL_FALLBACK
        assert second.resolution is not None
        assert second.resolution.attempts[0].result is AttemptResult.MISS
        assert second.publication is None
        _finished(second.background_publication)
    with load_component(pipeline, subfolder=SUBFOLDER, runtime=runtime) as third:
        assert third.outcome is ResolutionOutcome.LOCAL_HIT
        assert torch.equal(flux_forward(third.model), canonical_output)


def test_changing_the_served_model_cannot_reach_the_artifact(
    tmp_path: Path, pipeline: Path, canonical_output: torch.Tensor
) -> None:
    """The thread streams the checkpoint, never the serving model: weights zeroed right after the load
    (before the publication ends) leave the artifact equal to canonical."""
    root = tmp_path / "domain"
    with load_component(pipeline, subfolder=SUBFOLDER, runtime=_runtime(root), publish_in_background=True) as first:
        with torch.no_grad():
            for parameter in first.model.parameters():
                parameter.zero_()
        _finished(first.background_publication)
    with load_component(pipeline, subfolder=SUBFOLDER, runtime=_runtime(root)) as later:
        assert later.outcome is ResolutionOutcome.LOCAL_HIT
        assert torch.equal(flux_forward(later.model), canonical_output)


def test_in_required_mode_the_miss_streams_first_and_nothing_runs_behind(tmp_path: Path, pipeline: Path) -> None:
    """REQUIRED already builds the artifact before loading from it, so there is nothing to publish later."""
    runtime = _runtime(tmp_path / "domain", RuntimeMode.REQUIRED)
    with load_component(pipeline, subfolder=SUBFOLDER, runtime=runtime, publish_in_background=True) as loaded:
        assert loaded.outcome is ResolutionOutcome.LOCAL_PRODUCTION
        assert loaded.background_publication is None


def test_a_failed_background_publication_is_recorded_not_raised(tmp_path: Path) -> None:
    """A job that fails leaves `failure` set and the thread finished; nothing raises in the caller."""
    from host_weight_runtime.failures import FailureCode, HostWeightError, ResolutionStage, failure

    def job() -> Any:
        raise HostWeightError(failure(ResolutionStage.PRODUCTION, FailureCode.PRODUCER_FAILED, "boom"))

    background = BackgroundPublication(job)
    assert background.wait(WAIT_S)
    assert background.result is None
    assert background.failure is not None and background.failure.message == "boom"
    assert background.state()["state"] == "failed"


def test_the_publication_and_its_hash_threads_run_at_a_lower_priority_than_the_caller(
    tmp_path: Path, pipeline: Path
) -> None:
    """The background build (and the writer's hash threads it starts) runs nice +10, so the caller's
    own first steps with its model come first on a busy node; the caller's priority is unchanged."""
    caller_nice = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    seen: list[int] = []

    def record(_point: str) -> None:  # runs on a hash thread of the background build
        seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))

    with armed("writer.hash", Fault(FaultAction.PAUSE, hook=record, times=1_000_000)):
        loaded = load_component(
            str(pipeline), subfolder=SUBFOLDER, runtime=_runtime(tmp_path / "domain"), publish_in_background=True
        )
        _finished(loaded.background_publication)
    expected = min(19, caller_nice + BACKGROUND_NICE_INCREMENT)
    assert seen and set(seen) == {expected}
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == caller_nice
    loaded.close()

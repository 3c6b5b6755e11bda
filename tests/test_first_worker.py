"""X02: with default settings the first worker on a node gets its canonical model without waiting for hashing or
publication, a worker arriving meanwhile takes whichever is sooner, and the artifact appears complete or not at all.

The background publication is held at named seams (`background.started`, `build_progress.recorded`,
`publication.before_manifest`) with events and pipes, never sleeps.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
from collections.abc import Iterator
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import pytest
import torch

from host_weight_runtime._faults import Fault, FaultAction, arm, disarm_all
from host_weight_runtime.config import HostWeightRuntimeConfig, RuntimeMode
from host_weight_runtime.diffusion import (
    ComponentLoadPath,
    LoadedComponent,
    load_component,
    load_pipeline,
    prewarm_component,
)
from host_weight_runtime.diffusion._build_progress import (
    ArrivalChoice,
    BuildProgress,
    ProgressRecorder,
    arrival_choice,
    read_progress,
)
from host_weight_runtime.filesystem import DomainLayout
from host_weight_runtime.filesystem.inspection import ArtifactState
from host_weight_runtime.filesystem.locks import try_lock
from host_weight_runtime.filesystem.store import FilesystemHostWeightStore
from host_weight_runtime.outcomes import AttemptResult, PostLoadPublicationStatus, ResolutionOutcome
from host_weight_runtime.runtime import HostWeightRuntime
from host_weight_runtime.tensors import ValidationLevel
from hwr_tools.synthetic_models import save_hub_snapshot, save_pipeline_folder
from hwr_tools.synthetic_pipelines import save_tiny_pipeline

from ._pipelines import artifact_keys, canonical_image, image
from ._tiny_flux import canonical_flux, flux_forward, isolate_environment
from .support import CHILD_TIMEOUT_S, SPAWN, recv_within, spawned_child

KIND = "flux"
SUBFOLDER = "transformer"
REPO_ID = "hwr-test/first-worker"
WAIT_S = 120.0
KEY = "ab" * 32


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    isolate_environment(monkeypatch, tmp_path)
    yield
    disarm_all()


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_pipeline_folder(tmp_path_factory.mktemp("models") / "tiny-flux", KIND, seed=31)


@pytest.fixture(scope="module")
def canonical_output(pipeline: Path) -> torch.Tensor:
    return flux_forward(canonical_flux(pipeline))


def _runtime(root: Path, mode: RuntimeMode = RuntimeMode.PREFERRED) -> HostWeightRuntime:
    return HostWeightRuntime(HostWeightRuntimeConfig(mode=mode, root=root, lock_timeout_s=CHILD_TIMEOUT_S))


def _ready(root: Path) -> list[str]:
    """Every published key, each checked fully (READY, every payload's checksum)."""
    store = FilesystemHostWeightStore(root)
    keys = artifact_keys(root)
    for key in keys:
        state = store.inspect_artifact(key, validation=ValidationLevel.FULL_CHECKSUM)
        assert state.state is ArtifactState.READY, state.problem
    return keys


def _hold(point: str) -> tuple[threading.Event, threading.Event]:
    """Arm `point` in this process once: (reached, release); the thread that reaches it waits for release."""
    reached, release = threading.Event(), threading.Event()

    def hook(_point: str) -> None:
        reached.set()
        assert release.wait(WAIT_S)

    arm(point, Fault(FaultAction.PAUSE, hook=hook))
    return reached, release


def _component_in_child(root: str, pipeline: str, conn: Connection) -> None:
    """A fresh worker with default settings: how did it load, and what does the model compute?"""
    with load_component(pipeline, subfolder=SUBFOLDER, runtime=_runtime(Path(root))) as loaded:
        output = flux_forward(loaded.model)
        conn.send({"outcome": loaded.outcome.value, "output": output.float().reshape(-1).tolist()})


def _child_output(message: Any, like: torch.Tensor) -> torch.Tensor:
    assert isinstance(message, dict)
    return torch.tensor(message["output"], dtype=torch.float32).reshape(like.shape).to(like.dtype)


def _publisher_held_in_child(root: str, pipeline: str, point: str, conn: Connection) -> None:
    """A first worker whose background publication stops at `point`, says so, and goes on when told."""

    def hook(_point: str) -> None:
        conn.send("held")
        conn.recv()

    arm(point, Fault(FaultAction.PAUSE, hook=hook))
    loaded = load_component(pipeline, subfolder=SUBFOLDER, runtime=_runtime(Path(root)))
    assert loaded.background_publication is not None
    assert loaded.background_publication.wait(WAIT_S)
    conn.send(loaded.background_publication.state())


def _publisher_killed_in_child(root: str, pipeline: str, how: str, conn: Connection) -> None:
    """A first worker killed (SIGKILL at the seam, or SIGTERM from the test while held there) mid-publication."""
    if how == "sigkill":
        arm("publication.before_manifest", Fault(FaultAction.CRASH))
    else:

        def hook(_point: str) -> None:
            conn.send("held")
            conn.recv()  # the test's SIGTERM ends the process here

        arm("publication.before_manifest", Fault(FaultAction.PAUSE, hook=hook))
    loaded = load_component(pipeline, subfolder=SUBFOLDER, runtime=_runtime(Path(root)))
    assert loaded.background_publication is not None
    loaded.background_publication.wait(WAIT_S)
    conn.send("not killed")


# ----------------------------------------------------------------------------- the first worker


def test_a_first_load_component_returns_before_hashing_or_publication_starts(
    tmp_path: Path, pipeline: Path, canonical_output: torch.Tensor
) -> None:
    """X02/D14: with default settings, from a local folder this node never hashed, load_component returns the
    canonical model while its background publication is held before it hashes anything; released, the artifact
    appears complete and a fresh process gets a LOCAL_HIT with bit-identical outputs."""
    root = tmp_path / "domain"
    reached, release = _hold("background.started")
    try:
        loaded = load_component(pipeline, subfolder=SUBFOLDER, runtime=_runtime(root))
        assert loaded.load_path is ComponentLoadPath.CANONICAL
        assert loaded.outcome is ResolutionOutcome.CANONICAL_FALLBACK
        assert [attempt.result for attempt in loaded.resolution.attempts] == [AttemptResult.SKIPPED]
        assert torch.equal(flux_forward(loaded.model), canonical_output)
        background = loaded.background_publication
        assert background is not None and not background.done
        assert reached.wait(WAIT_S)
        assert artifact_keys(root) == []
        assert not list((root / "source-digests-v1" / "entries").glob("*.json"))  # nothing hashed yet
    finally:
        release.set()
    assert background.wait(WAIT_S) and background.failure is None, background.failure
    assert len(_ready(root)) == 1
    loaded.close()
    with spawned_child(_component_in_child, str(root), str(pipeline)) as conn:
        later = recv_within(conn)
    assert isinstance(later, dict) and later["outcome"] == ResolutionOutcome.LOCAL_HIT.value
    assert torch.equal(_child_output(later, canonical_output), canonical_output)


def test_a_first_load_pipeline_from_a_hub_cache_returns_before_any_publication(tmp_path: Path) -> None:
    """X02/P01/P02: with default settings, a pipeline from a hub cache snapshot no worker of this node identified
    skips the lookup (its key is free from the blob names, but no artifact can exist) and returns its canonical
    components while the publications, started only once the pipeline is assembled and run one after another, are
    held before they identify anything; released, every artifact appears complete and a fresh process's
    load_pipeline is all LOCAL_HIT with an image bit-identical to diffusers'."""
    folder = save_tiny_pipeline(tmp_path / "flux", "flux", seed=5)
    cache = tmp_path / "hub"
    snapshot = save_hub_snapshot(cache, REPO_ID, folder)
    root = tmp_path / "domain"
    reached, release = _hold("background.started")
    try:
        loaded = load_pipeline(REPO_ID, cache_dir=cache, runtime=_runtime(root))
        assert reached.wait(WAIT_S)
        for name, component in loaded.components.items():
            assert component.load_path is ComponentLoadPath.CANONICAL, name
            assert [attempt.result for attempt in component.resolution.attempts] == [AttemptResult.SKIPPED], name
            assert component.publication is None
            assert component.background_publication is not None and not component.background_publication.done
        assert artifact_keys(root) == []
        assert not list((root / "source-digests-v1" / "seen").glob("*.seen"))  # nothing identified yet
    finally:
        release.set()
    expected = canonical_image(snapshot, "flux")
    assert torch.equal(image(loaded.pipeline, "flux"), expected)
    for component in loaded.components.values():
        background = component.background_publication
        assert background is not None and background.wait(WAIT_S) and background.failure is None
    assert len(_ready(root)) == len(loaded.components)
    loaded.close()
    with spawned_child(_pipeline_in_child, str(root), str(cache), str(tmp_path / "image.pt")) as conn:
        outcomes = recv_within(conn)
    assert isinstance(outcomes, dict) and set(outcomes.values()) == {ResolutionOutcome.LOCAL_HIT.value}
    assert torch.equal(torch.load(tmp_path / "image.pt", weights_only=True), expected)


def test_a_hub_snapshot_prewarmed_here_is_looked_up_and_hit_by_its_first_load(tmp_path: Path, pipeline: Path) -> None:
    """X02/D14: prewarm_component identifies the snapshot's files before it builds (marking them seen), so the
    first load_component of that snapshot looks up and is a LOCAL_HIT; with the marks removed, the same load skips
    the lookup, which shows the marks are what decides."""
    cache = tmp_path / "hub"
    save_hub_snapshot(cache, REPO_ID, pipeline)
    root = tmp_path / "domain"
    prewarm_component(REPO_ID, subfolder=SUBFOLDER, cache_dir=cache, runtime=_runtime(root))
    seen = root / "source-digests-v1" / "seen"
    assert len(list(seen.glob("*.seen"))) == 1
    with load_component(REPO_ID, subfolder=SUBFOLDER, cache_dir=cache, runtime=_runtime(root)) as loaded:
        assert loaded.outcome is ResolutionOutcome.LOCAL_HIT
    for marker in seen.glob("*.seen"):
        marker.unlink()
    with load_component(REPO_ID, subfolder=SUBFOLDER, cache_dir=cache, runtime=_runtime(root)) as skipped:
        assert [attempt.result for attempt in skipped.resolution.attempts] == [AttemptResult.SKIPPED]
        background = skipped.background_publication
        assert background is not None and background.wait(WAIT_S) and background.failure is None
    assert len(_ready(root)) == 1  # the publication behind found the artifact: still one


def test_a_domain_whose_artifacts_predate_the_seen_marks_keeps_looking_up(tmp_path: Path, pipeline: Path) -> None:
    """X02/D14: a domain filled by a version without seen marks (its `seen/` made after an artifact existed) never
    trusts their absence: a first load of files no worker marked still looks up, and hits the artifact there."""
    cache = tmp_path / "hub"
    save_hub_snapshot(cache, REPO_ID, pipeline)
    root = tmp_path / "domain"
    prewarm_component(REPO_ID, subfolder=SUBFOLDER, cache_dir=cache, runtime=_runtime(root))
    seen = root / "source-digests-v1" / "seen"
    assert (seen / "complete").exists()
    shutil.rmtree(seen)  # what a version without marks leaves: an artifact, no seen/
    with load_component(REPO_ID, subfolder=SUBFOLDER, cache_dir=cache, runtime=_runtime(root)) as loaded:
        assert loaded.outcome is ResolutionOutcome.LOCAL_HIT
    assert seen.is_dir() and not (seen / "complete").exists()
    for marker in seen.glob("*.seen"):
        marker.unlink()
    with load_component(REPO_ID, subfolder=SUBFOLDER, cache_dir=cache, runtime=_runtime(root)) as again:
        assert again.outcome is ResolutionOutcome.LOCAL_HIT  # marks incomplete: their absence proves nothing


def test_a_folder_identified_here_makes_a_hub_snapshot_of_the_same_bytes_look_up(
    tmp_path: Path, pipeline: Path, canonical_output: torch.Tensor
) -> None:
    """X02/D05: the seen marks hold content ids as the key spells them, so after a first worker published from a
    plain folder, the first load of a hub snapshot of the same files (a blob name is its SHA-256) looks up and is
    served from that artifact, bit-identical."""
    root = tmp_path / "domain"
    with load_component(pipeline, subfolder=SUBFOLDER, runtime=_runtime(root)) as first:
        background = first.background_publication
        assert background is not None and background.wait(WAIT_S) and background.failure is None
    cache = tmp_path / "hub"
    save_hub_snapshot(cache, REPO_ID, pipeline)
    with load_component(REPO_ID, subfolder=SUBFOLDER, cache_dir=cache, runtime=_runtime(root)) as loaded:
        assert loaded.outcome is ResolutionOutcome.LOCAL_HIT
        assert torch.equal(flux_forward(loaded.model), canonical_output)
    assert len(_ready(root)) == 1


def _pipeline_in_child(root: str, cache: str, out: str, conn: Connection) -> None:
    with load_pipeline(REPO_ID, cache_dir=cache, runtime=_runtime(Path(root))) as loaded:
        torch.save(image(loaded.pipeline, "flux"), out)
        conn.send({name: outcome.value for name, outcome in loaded.outcomes.items()})


def test_publish_in_background_false_still_publishes_before_returning(tmp_path: Path, pipeline: Path) -> None:
    """X02/D14: the explicit opt-out keeps the synchronous path: the first call reports its publication
    (PUBLISHED), starts nothing behind, and the next load is a LOCAL_HIT."""
    runtime = _runtime(tmp_path / "domain")
    with load_component(pipeline, subfolder=SUBFOLDER, runtime=runtime, publish_in_background=False) as first:
        assert first.background_publication is None
        assert first.publication is not None and first.publication.status is PostLoadPublicationStatus.PUBLISHED
    with load_component(pipeline, subfolder=SUBFOLDER, runtime=runtime) as second:
        assert second.outcome is ResolutionOutcome.LOCAL_HIT


def test_a_policy_that_forbids_publishing_keeps_the_worker_from_publishing_behind(
    tmp_path: Path, pipeline: Path
) -> None:
    """X02: the default publishes behind only where the runtime's policy lets workers publish: with
    allow_post_load_publish=False nothing runs behind and no artifact appears."""
    root = tmp_path / "domain"
    config = HostWeightRuntimeConfig(root=root, allow_post_load_publish=False)
    with load_component(pipeline, subfolder=SUBFOLDER, runtime=HostWeightRuntime(config)) as loaded:
        assert loaded.load_path is ComponentLoadPath.CANONICAL
        assert loaded.background_publication is None
    assert artifact_keys(root) == []


def test_required_mode_still_builds_before_returning(tmp_path: Path, pipeline: Path) -> None:
    """X02/D14: REQUIRED keeps its semantics under the new default: the miss streams the artifact first and
    the model is served from it; nothing runs behind."""
    runtime = _runtime(tmp_path / "domain", RuntimeMode.REQUIRED)
    with load_component(pipeline, subfolder=SUBFOLDER, runtime=runtime) as loaded:
        assert loaded.outcome is ResolutionOutcome.LOCAL_PRODUCTION
        assert loaded.load_path is ComponentLoadPath.ARTIFACT
        assert loaded.background_publication is None


def test_a_second_load_in_the_same_process_waits_for_its_own_publication(tmp_path: Path, pipeline: Path) -> None:
    """X02: a load that finds this process's own publication of the checkpoint in flight waits for it (it would
    only compete with it for the same cores) and then hits the artifact."""
    runtime = _runtime(tmp_path / "domain")
    reached, release = _hold("background.started")
    first = load_component(pipeline, subfolder=SUBFOLDER, runtime=runtime)
    assert reached.wait(WAIT_S)
    background = first.background_publication
    assert background is not None and not background.done
    outcome: list[LoadedComponent] = []
    second = threading.Thread(
        target=lambda: outcome.append(load_component(pipeline, subfolder=SUBFOLDER, runtime=runtime))
    )
    second.start()
    release.set()
    second.join(WAIT_S)
    [loaded] = outcome
    assert loaded.outcome is ResolutionOutcome.LOCAL_HIT
    loaded.close()
    first.close()


# ----------------------------------------------------------------------------- a killed publisher


@pytest.mark.parametrize("how", ["sigkill", "sigterm"])
def test_a_publisher_killed_mid_publication_leaves_no_visible_artifact(
    tmp_path: Path, pipeline: Path, canonical_output: torch.Tensor, how: str
) -> None:
    """X02/S-crash: a first worker killed while its background publication writes (SIGKILL at the seam, or a
    SIGTERM while held there) leaves no visible artifact, only an invisible tmp build; the next worker loads
    canonically, publishes behind, removes that tmp, and the artifact it leaves is complete."""
    root = tmp_path / "domain"
    parent, child = SPAWN.Pipe()
    process = SPAWN.Process(target=_publisher_killed_in_child, args=(str(root), str(pipeline), how, child))
    process.start()
    child.close()
    try:
        if how == "sigterm":
            assert recv_within(parent) == "held"
            assert process.pid is not None
            os.kill(process.pid, signal.SIGTERM)
        process.join(CHILD_TIMEOUT_S)
        assert process.exitcode == (-signal.SIGKILL if how == "sigkill" else -signal.SIGTERM)
    finally:
        if process.is_alive():
            process.kill()
            process.join(CHILD_TIMEOUT_S)
    assert artifact_keys(root) == []
    assert list((root / "tmp").iterdir())  # the killed build, invisible to readers
    with load_component(pipeline, subfolder=SUBFOLDER, runtime=_runtime(root)) as later:
        assert later.load_path is ComponentLoadPath.CANONICAL
        assert later.resolution.attempts[0].result is AttemptResult.MISS
        background = later.background_publication
        assert background is not None and background.wait(WAIT_S) and background.failure is None
        assert torch.equal(flux_forward(later.model), canonical_output)
    assert len(_ready(root)) == 1
    assert list((root / "tmp").iterdir()) == []


# ----------------------------------------------------------------------------- a worker arriving meanwhile


def test_a_worker_arriving_before_the_build_streamed_anything_loads_canonically(
    tmp_path: Path, pipeline: Path, canonical_output: torch.Tensor
) -> None:
    """X02 (arrival rule, canonical branch): while another process's publication holds the build lock and its
    record says no byte is streamed yet, an arriving worker loads canonically and publishes nothing itself; the
    publisher then finishes the one artifact."""
    root = tmp_path / "domain"
    with spawned_child(_publisher_held_in_child, str(root), str(pipeline), "build_progress.recorded") as conn:
        assert recv_within(conn) == "held"
        with load_component(pipeline, subfolder=SUBFOLDER, runtime=_runtime(root)) as arriving:
            assert arriving.load_path is ComponentLoadPath.CANONICAL
            assert arriving.resolution.attempts[0].result is AttemptResult.MISS
            assert arriving.background_publication is None and arriving.publication is None
            assert torch.equal(flux_forward(arriving.model), canonical_output)
            key = arriving.resolution.identity_key
            progress = read_progress(root, key)
            assert progress is not None and progress.done_bytes == 0
            assert arrival_choice(root, key) is ArrivalChoice.CANONICAL
        conn.send("go")
        state = recv_within(conn)
    assert isinstance(state, dict) and state["state"] == ResolutionOutcome.LOCAL_PRODUCTION.value
    assert len(_ready(root)) == 1


def test_a_worker_arriving_once_every_byte_is_streamed_waits_for_the_artifact(
    tmp_path: Path, pipeline: Path, canonical_output: torch.Tensor
) -> None:
    """X02 (arrival rule, wait branch): while another process's publication holds the build lock with every byte
    streamed (held before its manifest is written), an arriving worker waits for that build and is served from
    the artifact it publishes, bit-identical to canonical."""
    root = tmp_path / "domain"
    with spawned_child(_publisher_held_in_child, str(root), str(pipeline), "publication.before_manifest") as conn:
        assert recv_within(conn) == "held"
        [key] = [path.stem for path in (root / "publishing-v1").glob("*.json")]
        assert arrival_choice(root, key) is ArrivalChoice.WAIT
        reached, release = _hold("build.waiting_for_lock")
        release.set()  # the arriving worker only reports that it waits for the build lock
        arrived: list[LoadedComponent] = []
        worker = threading.Thread(
            target=lambda: arrived.append(load_component(pipeline, subfolder=SUBFOLDER, runtime=_runtime(root)))
        )
        worker.start()
        try:
            assert reached.wait(WAIT_S)
        finally:
            conn.send("go")
            worker.join(WAIT_S)
        state = recv_within(conn)
    assert isinstance(state, dict) and state["state"] == ResolutionOutcome.LOCAL_PRODUCTION.value
    [loaded] = arrived
    with loaded:
        assert loaded.load_path is ComponentLoadPath.ARTIFACT
        assert loaded.outcome is ResolutionOutcome.LOCAL_PRODUCTION
        assert loaded.background_publication is None
        assert torch.equal(flux_forward(loaded.model), canonical_output)
    assert len(_ready(root)) == 1


def test_the_arrival_rule_compares_the_projected_build_with_the_builders_canonical_load(tmp_path: Path) -> None:
    """X02 (arrival rule): no build lock held is NO_BUILD whatever the record says; held, the worker waits only
    when the bytes left, at the rate so far, stream sooner than the builder's canonical load (or all are
    streamed), and loads canonically without a readable record."""
    root = tmp_path / "domain"
    layout = DomainLayout(root)
    layout.locks.mkdir(parents=True)
    recorder = ProgressRecorder(root, KEY, canonical_s=2.0)
    assert arrival_choice(root, KEY) is ArrivalChoice.NO_BUILD
    lock = try_lock(layout.build_lock(KEY), exclusive=True)
    assert lock is not None
    try:
        assert arrival_choice(root, KEY) is ArrivalChoice.CANONICAL  # held, no record yet
        recorder(0, 800)
        assert arrival_choice(root, KEY) is ArrivalChoice.CANONICAL  # nothing streamed: no rate to project
        assert read_progress(root, KEY) == BuildProgress(0, 800, 0.0, 2.0)
        assert BuildProgress(600, 800, 3.0, 2.0).remaining_s == 1.0  # 200 bytes at 200 B/s
        assert BuildProgress(200, 800, 1.0, 2.0).remaining_s == 3.0
        recorder(800, 800)
        assert arrival_choice(root, KEY) is ArrivalChoice.WAIT  # every byte streamed
    finally:
        lock.release()
    assert arrival_choice(root, KEY) is ArrivalChoice.NO_BUILD
    recorder.close()
    assert read_progress(root, KEY) is None


def test_the_arrival_rule_waits_when_the_projection_is_sooner(tmp_path: Path) -> None:
    """X02 (arrival rule): a held build whose record projects its end before the builder's canonical load is
    WAIT; one projecting it after is CANONICAL."""
    root = tmp_path / "domain"
    layout = DomainLayout(root)
    layout.locks.mkdir(parents=True)
    lock = try_lock(layout.build_lock(KEY), exclusive=True)
    assert lock is not None
    record = root / "publishing-v1" / f"{KEY}.json"
    record.parent.mkdir()
    try:
        for done, expected in ((600, ArrivalChoice.WAIT), (200, ArrivalChoice.CANONICAL)):
            body = {
                "schema": "hwr-build-progress-v1",
                "done_bytes": done,
                "total_bytes": 800,
                "streaming_s": done / 200,
                "canonical_s": 2.0,
            }
            record.write_text(json.dumps(body), encoding="utf-8")
            assert arrival_choice(root, KEY) is expected, done
    finally:
        lock.release()


def test_a_script_with_default_settings_leaves_its_artifact_at_a_plain_exit(tmp_path: Path, pipeline: Path) -> None:
    """X02: a worker process that loads with default settings and just ends waits for its background
    publication at exit, so the artifact is there, complete, once the process is gone."""
    root = tmp_path / "domain"
    process = SPAWN.Process(target=_load_and_end, args=(str(root), str(pipeline)))
    process.start()
    process.join(CHILD_TIMEOUT_S)
    assert process.exitcode == 0
    assert len(_ready(root)) == 1


def _load_and_end(root: str, pipeline: str) -> None:
    loaded = load_component(pipeline, subfolder=SUBFOLDER, runtime=_runtime(Path(root)))
    assert loaded.background_publication is not None  # never waited for here: the process just ends

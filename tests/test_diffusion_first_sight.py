"""A local folder seen for the first time on a node, published before returning (publish_in_background=False;
by default the hashing and the publication move behind the canonical load, X02): its files are hashed on
threads while the load runs.

The canonical load runs beside the hashing only on cores torch leaves free; with none free the files
hash first. The content key stays exact (the SHA-256 of every file, as a hub snapshot names its
blobs), a hit that is found once the hashing is done is still served, and REQUIRED never loads
canonically (D03, D14).
"""

from __future__ import annotations

import os
import shutil
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from host_weight_runtime._faults import Fault, FaultAction, armed
from host_weight_runtime.config import HostWeightRuntimeConfig, RuntimeMode
from host_weight_runtime.diffusion import ComponentLoadPath, load_component, prewarm_component
from host_weight_runtime.diffusion._source_prehash import SourcePrehash, cores_free_beside_load
from host_weight_runtime.outcomes import PostLoadPublicationStatus, ResolutionOutcome
from host_weight_runtime.runtime import HostWeightRuntime
from hwr_tools.synthetic_models import (
    save_hub_snapshot,
    save_pipeline_folder,
)

from ._tiny_flux import canonical_flux, flux_forward, isolate_environment

KIND = "flux"
SUBFOLDER = "transformer"
REPO_ID = "hwr-test/first-sight"
WAIT_S = 120.0
"""How long a seam waits for the other thread before it records that the two did not overlap."""


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    isolate_environment(monkeypatch, tmp_path)


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_pipeline_folder(tmp_path_factory.mktemp("models") / "tiny-flux", KIND, seed=5, max_shard_size="40KB")


@pytest.fixture(scope="module")
def canonical_output(pipeline: Path) -> torch.Tensor:
    return flux_forward(canonical_flux(pipeline))


CORES = len(os.sched_getaffinity(0))


@pytest.fixture
def torch_threads() -> Iterator[Callable[[int], None]]:
    """Set torch's intra-op threads for one test (which decides whether a core is free), restored after."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def _one_core_free(torch_threads: Callable[[int], None]) -> None:
    if CORES < 2:
        pytest.skip("a core free beside a one-thread torch needs two cores")
    torch_threads(CORES - 1)


def _runtime(root: Path, mode: RuntimeMode = RuntimeMode.PREFERRED) -> HostWeightRuntime:
    return HostWeightRuntime(HostWeightRuntimeConfig(mode=mode, root=root))


def _artifact_keys(root: Path) -> list[str]:
    return sorted(path.name for path in (root / "artifacts").iterdir() if path.is_dir())


class _Meeting:
    """Two seams on two threads: `waiter` blocks until `arriver` ran (or WAIT_S passed) and records which."""

    def __init__(self) -> None:
        self.arrived = threading.Event()
        self.met: list[bool] = []

    def arriver(self) -> Callable[[str], None]:
        return lambda _point: self.arrived.set()

    def waiter(self) -> Callable[[str], None]:
        return lambda _point: self.met.append(self.arrived.wait(WAIT_S))


def test_the_canonical_load_runs_while_the_files_hash_and_the_key_is_exact(
    tmp_path: Path,
    pipeline: Path,
    canonical_output: torch.Tensor,
    monkeypatch: pytest.MonkeyPatch,
    torch_threads: Callable[[int], None],
) -> None:
    """D03/D14: on first sight in PREFERRED, with a core that torch leaves free, the first file's hash
    cannot finish before the canonical load began (the seams meet across threads), yet the call still
    publishes, under the key a hub snapshot of the same files gets (blob names are their SHA-256), which
    a fresh load then hits bit-identically."""
    _one_core_free(torch_threads)
    root = tmp_path / "domain"
    meeting = _Meeting()
    with (
        armed("source_digest_cache.before_hash", Fault(FaultAction.PAUSE, hook=meeting.waiter())),
        armed("canonical_step.before_load", Fault(FaultAction.PAUSE, hook=meeting.arriver())),
        load_component(pipeline, subfolder=SUBFOLDER, publish_in_background=False, runtime=_runtime(root)) as first,
    ):
        assert meeting.met == [True]
        assert first.outcome is ResolutionOutcome.CANONICAL_FALLBACK
        assert first.load_path is ComponentLoadPath.CANONICAL
        assert first.publication is not None and first.publication.status is PostLoadPublicationStatus.PUBLISHED
        assert torch.equal(flux_forward(first.model), canonical_output)
        key = first.identity_key
    assert key is not None and _artifact_keys(root) == [key]

    cache = tmp_path / "hub"
    save_hub_snapshot(cache, REPO_ID, pipeline)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    with load_component(
        REPO_ID, subfolder=SUBFOLDER, publish_in_background=False, runtime=_runtime(tmp_path / "other-domain")
    ) as by_blob_names:
        assert by_blob_names.identity_key == key  # nothing hashed there: the blob names are the content ids
    with load_component(pipeline, subfolder=SUBFOLDER, runtime=_runtime(root)) as second:
        assert second.outcome is ResolutionOutcome.LOCAL_HIT and second.identity_key == key
        assert torch.equal(flux_forward(second.model), canonical_output)


@pytest.mark.parametrize("core_free", [True, False], ids=["core-free", "no-core-free"])
def test_a_hit_found_after_the_hashing_is_served_and_nothing_is_published_again(
    tmp_path: Path,
    pipeline: Path,
    canonical_output: torch.Tensor,
    torch_threads: Callable[[int], None],
    core_free: bool,
) -> None:
    """D14: the artifact exists but this node's digest cache does not know the files (removed). With a
    core free the canonical load starts while they hash; with none, they hash first and nothing loads
    canonically. Either way the lookup that follows hits, and the call serves the artifact (LOCAL_HIT, no
    publication, still one artifact), bit-identical to canonical."""
    if core_free:
        _one_core_free(torch_threads)
    else:
        torch_threads(CORES)
    root = tmp_path / "domain"
    built = prewarm_component(pipeline, subfolder=SUBFOLDER, runtime=_runtime(root, RuntimeMode.REQUIRED))
    shutil.rmtree(root / "source-digests-v1")
    canonical_loads: list[str] = []
    with (
        armed("canonical_step.before_load", Fault(FaultAction.PAUSE, hook=canonical_loads.append)),
        load_component(pipeline, subfolder=SUBFOLDER, publish_in_background=False, runtime=_runtime(root)) as loaded,
    ):
        # with a core free it overlapped the hashing, then lost to the hit; with none it never started
        assert canonical_loads == (["canonical_step.before_load"] if core_free else [])
        assert loaded.outcome is ResolutionOutcome.LOCAL_HIT
        assert loaded.load_path is ComponentLoadPath.ARTIFACT
        assert loaded.publication is None and loaded.identity_key == built.identity_key
        assert torch.equal(flux_forward(loaded.model), canonical_output)
    assert _artifact_keys(root) == [built.identity_key]


def test_required_mode_hashes_during_the_skeleton_but_never_loads_canonically(
    tmp_path: Path, pipeline: Path, canonical_output: torch.Tensor
) -> None:
    """D14: in REQUIRED the first load on a node streams the artifact (LOCAL_PRODUCTION) and never runs the
    canonical load, although the files hash on threads from the start."""
    root = tmp_path / "domain"
    canonical_loads: list[str] = []
    with (
        armed("canonical_step.before_load", Fault(FaultAction.PAUSE, hook=canonical_loads.append)),
        load_component(pipeline, subfolder=SUBFOLDER, runtime=_runtime(root, RuntimeMode.REQUIRED)) as loaded,
    ):
        assert canonical_loads == []
        assert loaded.outcome is ResolutionOutcome.LOCAL_PRODUCTION
        assert loaded.load_path is ComponentLoadPath.ARTIFACT
        assert torch.equal(flux_forward(loaded.model), canonical_output)


def test_with_no_core_free_every_file_hashes_before_the_canonical_load(
    tmp_path: Path, pipeline: Path, canonical_output: torch.Tensor, torch_threads: Callable[[int], None]
) -> None:
    """D03/D14: when torch's threads take every core, a hash thread beside the canonical load would slow
    it by more than it gains, so on first sight every file is hashed (on every core) before the canonical
    load starts; the call still publishes under the exact key and serves canonical outputs."""
    torch_threads(CORES)
    assert cores_free_beside_load() == 0
    root = tmp_path / "domain"
    files = sorted((pipeline / SUBFOLDER).glob("*.safetensors"))
    assert len(files) > 1
    steps: list[str] = []
    hashed = Fault(FaultAction.PAUSE, hook=lambda _point: steps.append("hashed"), times=len(files))
    with (
        armed("source_digest.after_hash", hashed),
        armed("canonical_step.before_load", Fault(FaultAction.PAUSE, hook=lambda _point: steps.append("load"))),
        load_component(pipeline, subfolder=SUBFOLDER, publish_in_background=False, runtime=_runtime(root)) as loaded,
    ):
        assert steps == ["hashed"] * len(files) + ["load"]
        assert loaded.outcome is ResolutionOutcome.CANONICAL_FALLBACK
        assert loaded.publication is not None and loaded.publication.status is PostLoadPublicationStatus.PUBLISHED
        assert torch.equal(flux_forward(loaded.model), canonical_output)
        assert _artifact_keys(root) == [loaded.identity_key]


def test_the_cores_free_beside_a_load_are_those_torch_leaves(torch_threads: Callable[[int], None]) -> None:
    """D03: the free cores are this process's cores less torch's intra-op threads, never below zero, and a
    prehash refuses fewer than one thread with a message that says what to pass."""
    torch_threads(CORES)
    assert cores_free_beside_load() == 0
    torch_threads(1)
    assert cores_free_beside_load() == CORES - 1
    torch_threads(CORES + 2)
    assert cores_free_beside_load() == 0
    with pytest.raises(ValueError, match="threads must be at least 1"):
        SourcePrehash(None, None, threads=0)  # type: ignore[arg-type]

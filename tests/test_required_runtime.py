"""A build asks the caller's runtime in REQUIRED mode without losing what the caller gave it (R02, R05, E01, E08).

`prewarm_component` (and every adapter that must build) derives a REQUIRED runtime from the
caller's. These tests give node B a real runtime with an explicit `file://` remote provider,
observers and its own store factory, and check that the REQUIRED build goes through all of them:
it imports node A's pushed artifact from that remote, the observers see the report, the
caller's store factory opens the store, and an HWR_REMOTE_PUBLISH push is one the caller can wait for.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from host_weight_runtime import FilesystemHostWeightStore, HostWeightStore
from host_weight_runtime.config import HostWeightRuntimeConfig, RuntimeMode
from host_weight_runtime.diffusion import prewarm_component
from host_weight_runtime.outcomes import PostLoadPublicationReport, ResolutionOutcome, ResolutionReport
from host_weight_runtime.remote import FsspecArtifactProvider, PushResult, PushStatus, push_all_artifacts
from host_weight_runtime.runtime import HostWeightRuntime

from ._diffusion import DIT, Folder, save_folder

Report = ResolutionReport | PostLoadPublicationReport


@pytest.fixture(scope="module")
def node_a(tmp_path_factory: pytest.TempPathFactory) -> tuple[Folder, Path, str]:
    """A tiny Flux folder and node A's domain holding its prewarmed BF16 artifact."""
    base = tmp_path_factory.mktemp("required-node-a")
    folder = save_folder(base / "tiny-flux", "flux", seed=11)
    root = base / "domain"
    built = prewarm_component(folder.root, subfolder=DIT, runtime=_runtime(root))
    assert built.resolution.outcome is ResolutionOutcome.LOCAL_PRODUCTION
    return folder, root, built.identity_key


def _runtime(root: Path, mode: RuntimeMode = RuntimeMode.PREFERRED, **kwargs: Any) -> HostWeightRuntime:
    return HostWeightRuntime(HostWeightRuntimeConfig(mode=mode, root=root, lock_timeout_s=60.0), **kwargs)


@pytest.fixture
def remote(node_a: tuple[Folder, Path, str], tmp_path: Path) -> str:
    """A real `file://` remote holding node A's artifact (pushed, descriptor last)."""
    _folder, root_a, key = node_a
    folder = tmp_path / "remote"
    folder.mkdir()
    url = f"file://{folder}"
    assert [outcome.key for outcome in push_all_artifacts(FilesystemHostWeightStore(root_a), url)] == [key]
    return url


@pytest.mark.parametrize("mode", [RuntimeMode.PREFERRED, RuntimeMode.REQUIRED])
def test_a_required_build_imports_from_the_callers_remote_and_reports_to_its_observers(
    node_a: tuple[Folder, Path, str], remote: str, tmp_path: Path, mode: RuntimeMode
) -> None:
    """E01/R02/R05: node B's runtime (no HWR_REMOTE; an explicit `file://` provider, two observers, its own store
    factory) prewarms in REQUIRED mode: it imports node A's key from that provider (REMOTE_IMPORT, nothing built),
    the observers given at construction and one added afterwards each get that one report, and the store is the
    one the caller's factory opened."""
    folder, _root_a, key = node_a
    root_b = tmp_path / "node-b"
    given: list[Report] = []
    added: list[Report] = []
    opened: list[Path] = []

    def factory(config: HostWeightRuntimeConfig) -> HostWeightStore:
        opened.append(config.resolved_root)
        return FilesystemHostWeightStore.from_config(config)

    caller = _runtime(
        root_b, mode, remote_providers=[FsspecArtifactProvider(remote)], observers=[given.append], store_factory=factory
    )
    caller.add_observer(added.append)
    result = prewarm_component(folder.root, subfolder=DIT, runtime=caller)
    assert result.resolution.outcome is ResolutionOutcome.REMOTE_IMPORT, result.resolution
    assert result.identity_key == key
    for seen in (given, added):
        assert [
            (report.identity_key, report.mode, report.outcome)
            for report in seen
            if isinstance(report, ResolutionReport)
        ] == [(key, "required", ResolutionOutcome.REMOTE_IMPORT)]
    assert opened == [root_b.resolve()]
    assert sorted(path.name for path in FilesystemHostWeightStore(root_b).layout.artifacts.iterdir()) == [key]


def test_a_required_build_pushes_through_the_callers_publisher(
    node_a: tuple[Folder, Path, str], tmp_path: Path
) -> None:
    """E08: a caller with HWR_REMOTE_PUBLISH (configured remote, PREFERRED) prewarms: the REQUIRED build's push goes
    through the caller's uploader, so `caller.wait_for_remote_pushes()` returns it and the remote then offers the key."""
    folder, _root_a, key = node_a
    target = tmp_path / "remote"
    target.mkdir()
    url = f"file://{target}"
    config = HostWeightRuntimeConfig(
        mode=RuntimeMode.PREFERRED, root=tmp_path / "node-c", lock_timeout_s=60.0, remote=(url,), remote_publish=True
    )
    caller = HostWeightRuntime(config)
    built = prewarm_component(folder.root, subfolder=DIT, runtime=caller)
    assert built.resolution.outcome is ResolutionOutcome.LOCAL_PRODUCTION, built.resolution
    pushes = caller.wait_for_remote_pushes(timeout=120.0)
    assert [(push.key, push.status) for push in pushes if isinstance(push, PushResult)] == [(key, PushStatus.UPLOADED)]
    assert (target / key).is_dir()


def test_with_policy_shares_what_the_caller_gave(tmp_path: Path) -> None:
    """R01/E01: `with_policy` keeps explicit providers and observers; an unchanged policy is the same runtime; a
    DISABLED runtime (which asks no remote) derives a REQUIRED one that asks the configured remotes."""
    folder = tmp_path / "remote"
    folder.mkdir()
    provider = FsspecArtifactProvider(f"file://{folder}")
    seen: list[Report] = []
    caller = _runtime(tmp_path / "a", remote_providers=[provider], observers=[seen.append])
    required = caller.with_policy(RuntimeMode.REQUIRED, allow_local_build=True)
    assert required.config.mode is RuntimeMode.REQUIRED and required.remote_providers == (provider,)
    assert required.with_policy(RuntimeMode.REQUIRED) is required
    assert caller.with_policy(RuntimeMode.PREFERRED) is caller
    disabled = HostWeightRuntime(
        HostWeightRuntimeConfig(mode=RuntimeMode.DISABLED, root=tmp_path / "b", remote=(f"file://{folder}",))
    )
    assert disabled.remote_providers == ()
    enabled = disabled.with_policy(RuntimeMode.REQUIRED)
    assert [p.provider_id for p in enabled.remote_providers] == [f"file://{folder}"]
    assert not (tmp_path / "b").exists()
    with pytest.raises(TypeError):
        caller.with_policy("required")  # type: ignore[arg-type]

"""`load_component` end to end (D14, R01-R03): real tiny diffusers models, real folders, a real domain.

Every test loads the same reduced FluxTransformer2DModel, saved once as a pipeline folder,
and compares forward outputs with what a diffusers user gets from
`from_pretrained(torch_dtype=torch.bfloat16)`. Fresh-process checks run in spawned children
that import everything themselves and talk to the test over pipes.
"""

from __future__ import annotations

import dataclasses
import json
from contextlib import ExitStack
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import pytest
import torch

from host_weight_runtime import cli
from host_weight_runtime.config import HostWeightRuntimeConfig, RuntimeMode
from host_weight_runtime.diffusion import ComponentLoadPath, LoadedComponent, load_component, model_contracts
from host_weight_runtime.diffusion.contracts import FinalLayoutParallelIdentity
from host_weight_runtime.failures import FailureCode, HostWeightError, ResolutionStage
from host_weight_runtime.filesystem.store import FilesystemHostWeightStore
from host_weight_runtime.lease import HostWeightLease
from host_weight_runtime.outcomes import (
    AttemptResult,
    PostLoadPublicationStatus,
    ResolutionOutcome,
)
from host_weight_runtime.runtime import HostWeightRuntime
from hwr_tools.synthetic_models import save_hub_snapshot

from ._tiny_flux import (  # noqa: F401 - fixtures the tests take
    MODEL_CLASS,
    REPO_ID,
    SUBFOLDER,
    flux_forward,
    isolate_environment,
    tiny_flux_canonical_output,
    tiny_flux_pipeline,
)
from .support import CHILD_TIMEOUT_S, artifact_keys, recv_within, spawned_child

Payload = tuple[str, tuple[int, ...], bytes]


# ----------------------------------------------------------------------------- fixtures and helpers


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    isolate_environment(monkeypatch, tmp_path)


def _runtime(root: Path, mode: RuntimeMode = RuntimeMode.PREFERRED) -> HostWeightRuntime:
    return HostWeightRuntime(HostWeightRuntimeConfig(mode=mode, root=root))


def _payload(tensor: torch.Tensor) -> Payload:
    """A tensor as plain bytes, so it crosses a pipe without torch's shared-memory reductions."""
    flat = tensor.detach().contiguous()
    return str(flat.dtype), tuple(flat.shape), flat.reshape(-1).view(torch.uint8).numpy().tobytes()


def _from_payload(payload: Payload) -> torch.Tensor:
    dtype_name, shape, data = payload
    dtype = getattr(torch, dtype_name.removeprefix("torch."))
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).reshape(shape)


def _lease_active(root: Path, key: str) -> bool:
    return FilesystemHostWeightStore(root).inspect_artifact(key).locks.lease_active


def _closed(lease: HostWeightLease) -> bool:
    """Read `closed` through a call, so a type checker does not carry an earlier narrowing past close()."""
    return lease.closed


def _describe(loaded: LoadedComponent) -> dict[str, Any]:
    return {
        "outcome": None if loaded.outcome is None else loaded.outcome.value,
        "load_path": loaded.load_path.value,
        "identity_key": loaded.identity_key,
        "publication": None if loaded.publication is None else loaded.publication.status.value,
        "output": _payload(flux_forward(loaded.model)),
    }


def _load_in_child(root: str, pipeline: str, conn: Connection) -> None:
    """A fresh worker: load the transformer in PREFERRED mode and report how, with its forward output."""
    with load_component(pipeline, subfolder=SUBFOLDER, runtime=_runtime(Path(root))) as loaded:
        conn.send(_describe(loaded))


def _cold_start_in_child(root: str, pipeline: str, conn: Connection) -> None:
    """Import and configure, say ready, then load only when the test says go (so two starters race)."""
    runtime = _runtime(Path(root))
    conn.send("ready")
    if not conn.poll(CHILD_TIMEOUT_S) or conn.recv() != "go":
        raise RuntimeError("the test never said go")
    with load_component(pipeline, subfolder=SUBFOLDER, runtime=runtime, publish_in_background=False) as loaded:
        conn.send(_describe(loaded))


# ----------------------------------------------------------------------------- D14: the three paths


def test_preferred_publishes_then_a_fresh_process_hits_bit_identically(
    tmp_path: Path, pipeline: Path, canonical_output: torch.Tensor
) -> None:
    """D14/R02/R03: the first PREFERRED load with publish_in_background=False (the opt-out of publishing behind,
    X02) misses, loads canonically and publishes before returning; a fresh process then gets LOCAL_HIT from the
    artifact, and both forward outputs equal canonical from_pretrained bit for bit."""
    root = tmp_path / "domain"
    with load_component(pipeline, subfolder=SUBFOLDER, publish_in_background=False, runtime=_runtime(root)) as first:
        assert first.outcome is ResolutionOutcome.CANONICAL_FALLBACK
        assert first.load_path is ComponentLoadPath.CANONICAL
        assert first.publication is not None
        assert first.publication.status is PostLoadPublicationStatus.PUBLISHED
        assert first.publication.failure is None
        assert first.lease is None and first.restore_failure is None and first.identity_failure is None
        assert first.resolution is not None
        assert [(a.stage, a.result) for a in first.resolution.attempts] == [
            (ResolutionStage.LOOKUP, AttemptResult.MISS),
            (ResolutionStage.PRODUCTION, AttemptResult.SKIPPED),
        ]
        assert torch.equal(flux_forward(first.model), canonical_output)
        key = first.identity_key
    assert key is not None
    assert artifact_keys(root) == [key]
    assert not _lease_active(root, key), "publication must close the lease it obtained"

    with spawned_child(_load_in_child, str(root), str(pipeline)) as conn:
        second = recv_within(conn)
    assert isinstance(second, dict)
    assert second["outcome"] == ResolutionOutcome.LOCAL_HIT.value
    assert second["load_path"] == ComponentLoadPath.ARTIFACT.value
    assert second["identity_key"] == key and second["publication"] is None
    restored = _from_payload(second["output"])
    assert restored.dtype == canonical_output.dtype
    assert torch.equal(restored, canonical_output)
    assert artifact_keys(root) == [key]


def test_required_streams_the_checkpoint_into_the_artifact_first(
    tmp_path: Path, pipeline: Path, canonical_output: torch.Tensor
) -> None:
    """D14/R03: REQUIRED uses the PRE_LOAD_SAFE checkpoint-streaming producer, so even the first load is
    LOCAL_PRODUCTION from the artifact, bit-identical to canonical; the next one is LOCAL_HIT."""
    root = tmp_path / "domain"
    runtime = _runtime(root, RuntimeMode.REQUIRED)
    with load_component(pipeline, subfolder=SUBFOLDER, runtime=runtime) as first:
        assert first.outcome is ResolutionOutcome.LOCAL_PRODUCTION
        assert first.load_path is ComponentLoadPath.ARTIFACT
        assert first.publication is None and first.lease is not None
        assert type(first.model).__name__ == MODEL_CLASS
        assert torch.equal(flux_forward(first.model), canonical_output)
    with load_component(pipeline, subfolder=SUBFOLDER, runtime=runtime) as second:
        assert second.outcome is ResolutionOutcome.LOCAL_HIT
        assert second.identity_key == first.identity_key
        assert torch.equal(flux_forward(second.model), canonical_output)
    assert artifact_keys(root) == [first.identity_key]


def test_stream_on_miss_in_preferred_is_local_production(
    tmp_path: Path, pipeline: Path, canonical_output: torch.Tensor
) -> None:
    """D14: stream_on_miss=True makes PREFERRED build from the checkpoint too: LOCAL_PRODUCTION, no post-load
    publication, outputs bit-identical to canonical."""
    root = tmp_path / "domain"
    with load_component(pipeline, subfolder=SUBFOLDER, runtime=_runtime(root), stream_on_miss=True) as loaded:
        assert loaded.outcome is ResolutionOutcome.LOCAL_PRODUCTION
        assert loaded.load_path is ComponentLoadPath.ARTIFACT
        assert loaded.publication is None
        assert torch.equal(flux_forward(loaded.model), canonical_output)
    assert artifact_keys(root) == [loaded.identity_key]


def test_both_producers_build_the_same_key_and_the_same_tensors(tmp_path: Path, pipeline: Path) -> None:
    """D14/D10: the post-load producer (PREFERRED, publish_in_background=False), the streaming producer
    (REQUIRED) and stream_on_miss in PREFERRED give one key, and the artifacts hold the same tensor names,
    dtypes and bytes."""
    canonical_root, required_root, streamed_root = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    with load_component(
        pipeline, subfolder=SUBFOLDER, publish_in_background=False, runtime=_runtime(canonical_root)
    ) as published:
        assert published.publication is not None
        assert published.publication.status is PostLoadPublicationStatus.PUBLISHED
    with ExitStack() as stack:
        from_publication = stack.enter_context(
            load_component(pipeline, subfolder=SUBFOLDER, runtime=_runtime(canonical_root))
        )
        from_required = stack.enter_context(
            load_component(pipeline, subfolder=SUBFOLDER, runtime=_runtime(required_root, RuntimeMode.REQUIRED))
        )
        from_stream = stack.enter_context(
            load_component(pipeline, subfolder=SUBFOLDER, runtime=_runtime(streamed_root), stream_on_miss=True)
        )
        assert from_publication.outcome is ResolutionOutcome.LOCAL_HIT
        assert from_required.outcome is ResolutionOutcome.LOCAL_PRODUCTION
        assert from_stream.outcome is ResolutionOutcome.LOCAL_PRODUCTION
        keys = {
            published.identity_key,
            from_publication.identity_key,
            from_required.identity_key,
            from_stream.identity_key,
        }
        assert len(keys) == 1
        leases = [from_publication.lease, from_required.lease, from_stream.lease]
        assert all(lease is not None for lease in leases)
        reference = dict(leases[0].tensors)  # type: ignore[union-attr]
        assert reference
        for lease in leases[1:]:
            tensors = dict(lease.tensors)  # type: ignore[union-attr]
            assert sorted(tensors) == sorted(reference)
            for name, value in reference.items():
                assert tensors[name].dtype == value.dtype, name
                assert torch.equal(tensors[name], value), name


def test_required_without_a_producer_fails_on_a_miss(tmp_path: Path, pipeline: Path) -> None:
    """R02/D14: REQUIRED with stream_on_miss=False has nothing to build with, so a miss raises
    instead of falling back, and nothing is published."""
    root = tmp_path / "domain"
    runtime = _runtime(root, RuntimeMode.REQUIRED)
    with pytest.raises(HostWeightError) as raised:
        load_component(pipeline, subfolder=SUBFOLDER, runtime=runtime, stream_on_miss=False)
    assert raised.value.failure.code is FailureCode.NOT_FOUND
    assert raised.value.failure.stage is ResolutionStage.LOOKUP
    assert artifact_keys(root) == []


def test_the_key_does_not_depend_on_how_the_folder_is_spelled(
    tmp_path: Path, pipeline: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """D14/D05: the same folder named absolutely, with a trailing slash, or relative to the working directory
    is one source (the source fingerprint already hashes content, never absolute paths), so one key."""
    root = tmp_path / "domain"
    monkeypatch.chdir(pipeline.parent)
    keys = set()
    for spelling in (str(pipeline), f"{pipeline}/", pipeline.name):
        with load_component(
            spelling, subfolder=SUBFOLDER, publish_in_background=False, runtime=_runtime(root)
        ) as loaded:
            keys.add(loaded.identity_key)
    assert len(keys) == 1, keys
    assert len(artifact_keys(root)) == 1


# ----------------------------------------------------------------------------- configuration


def test_runtime_none_reads_hwr_mode_and_root_from_the_environment(
    tmp_path: Path, pipeline: Path, monkeypatch: pytest.MonkeyPatch, canonical_output: torch.Tensor
) -> None:
    """D14/R03: with runtime=None, HWR_MODE and HWR_ROOT decide the mode and where the domain goes."""
    root = tmp_path / "from-env"
    monkeypatch.setenv("HWR_MODE", "required")
    monkeypatch.setenv("HWR_ROOT", str(root))
    with load_component(pipeline, subfolder=SUBFOLDER) as loaded:
        assert loaded.outcome is ResolutionOutcome.LOCAL_PRODUCTION  # REQUIRED streams on a miss
        assert loaded.resolution is not None and loaded.resolution.mode == RuntimeMode.REQUIRED.value
        assert torch.equal(flux_forward(loaded.model), canonical_output)
        assert loaded.domain_root == root and loaded.summary()["domain_root"] == str(root)  # it says where
    assert (root / "domain.json").is_file()
    assert artifact_keys(root) == [loaded.identity_key]

    monkeypatch.setenv("HWR_MODE", "preferred")
    with load_component(pipeline, subfolder=SUBFOLDER) as again:
        assert again.outcome is ResolutionOutcome.LOCAL_HIT
        assert again.resolution is not None and again.resolution.mode == RuntimeMode.PREFERRED.value


def test_disabled_loads_canonically_and_creates_nothing(
    tmp_path: Path, pipeline: Path, canonical_output: torch.Tensor
) -> None:
    """R01/D14: DISABLED loads with diffusers only; no identity, no resolution, the root is never created."""
    root = tmp_path / "domain"
    with load_component(pipeline, subfolder=SUBFOLDER, runtime=_runtime(root, RuntimeMode.DISABLED)) as loaded:
        assert loaded.load_path is ComponentLoadPath.CANONICAL
        assert loaded.outcome in (None, ResolutionOutcome.CANONICAL_DIRECT)
        assert loaded.publication is None and loaded.lease is None and loaded.identity_key is None
        assert loaded.domain_root is None
        assert torch.equal(flux_forward(loaded.model), canonical_output)
    assert not root.exists()


# ----------------------------------------------------------------------------- the Hugging Face cache


def test_repo_id_resolves_through_the_local_hub_cache(
    tmp_path: Path, pipeline: Path, monkeypatch: pytest.MonkeyPatch, canonical_output: torch.Tensor
) -> None:
    """D14: a repo id in the local HF cache (cache_dir=, then HF_HUB_CACHE) publishes once (before returning,
    publish_in_background=False) and then hits, with outputs bit-identical to canonical, all offline."""
    cache = tmp_path / "hub"
    save_hub_snapshot(cache, REPO_ID, pipeline)
    root = tmp_path / "domain"
    with load_component(
        REPO_ID, subfolder=SUBFOLDER, publish_in_background=False, runtime=_runtime(root), cache_dir=cache
    ) as first:
        assert first.outcome is ResolutionOutcome.CANONICAL_FALLBACK
        assert first.publication is not None
        assert first.publication.status is PostLoadPublicationStatus.PUBLISHED
        assert torch.equal(flux_forward(first.model), canonical_output)

    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    with load_component(REPO_ID, subfolder=SUBFOLDER, runtime=_runtime(root)) as second:
        assert second.outcome is ResolutionOutcome.LOCAL_HIT
        assert second.load_path is ComponentLoadPath.ARTIFACT
        assert second.identity_key == first.identity_key
        assert torch.equal(flux_forward(second.model), canonical_output)


def test_repo_id_missing_from_the_cache_is_not_found(tmp_path: Path) -> None:
    """D14: a repo id the local cache lacks raises NOT_FOUND (never a download), even in PREFERRED."""
    cache = tmp_path / "hub"
    cache.mkdir()
    root = tmp_path / "domain"
    with pytest.raises(HostWeightError) as raised:
        load_component("hwr-test/not-cached", subfolder=SUBFOLDER, runtime=_runtime(root), cache_dir=cache)
    assert raised.value.failure.code is FailureCode.NOT_FOUND
    assert list(cache.iterdir()) == []
    assert artifact_keys(root) == []


# ----------------------------------------------------------------------------- restore failures


def _rejecting_contract(monkeypatch: pytest.MonkeyPatch) -> None:
    """Swap the Flux contract's validator for one that always refuses; the contract's identity (and so
    the key) is unchanged, because the validator takes no part in it."""

    def reject(model: torch.nn.Module) -> None:
        raise model_contracts.ModelNotReadyError(f"{type(model).__name__} refused by the test")

    original = model_contracts.FIRST_CLASS_CONTRACTS[MODEL_CLASS]
    monkeypatch.setitem(
        model_contracts.FIRST_CLASS_CONTRACTS,
        MODEL_CLASS,
        dataclasses.replace(original, validator=reject),
    )


def test_restore_failure_in_preferred_falls_back_to_a_working_canonical_model(
    tmp_path: Path, pipeline: Path, monkeypatch: pytest.MonkeyPatch, canonical_output: torch.Tensor
) -> None:
    """D14/D09: when the restored model fails its contract validator, PREFERRED discards it, releases the
    lease and returns a canonical model that works; restore_failure says why, and nothing is republished."""
    root = tmp_path / "domain"
    with load_component(
        pipeline, subfolder=SUBFOLDER, publish_in_background=False, runtime=_runtime(root)
    ) as published:
        key = published.identity_key
    assert key is not None
    _rejecting_contract(monkeypatch)
    with load_component(pipeline, subfolder=SUBFOLDER, runtime=_runtime(root)) as loaded:
        assert loaded.identity_key == key
        assert loaded.outcome is ResolutionOutcome.LOCAL_HIT
        assert loaded.load_path is ComponentLoadPath.CANONICAL
        assert loaded.restore_failure is not None
        assert loaded.restore_failure.code is FailureCode.RESTORE_FAILED
        assert loaded.lease is None and loaded.publication is None
        assert not _lease_active(root, key), "the lease of a failed restore must be closed"
        assert torch.equal(flux_forward(loaded.model), canonical_output)
    assert artifact_keys(root) == [key]


def test_restore_failure_in_required_raises_restore_failed(
    tmp_path: Path, pipeline: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """D14: the same validator failure in REQUIRED raises RESTORE_FAILED and leaves no lease held."""
    root = tmp_path / "domain"
    with load_component(
        pipeline, subfolder=SUBFOLDER, publish_in_background=False, runtime=_runtime(root)
    ) as published:
        key = published.identity_key
    assert key is not None
    _rejecting_contract(monkeypatch)
    with pytest.raises(HostWeightError) as raised:
        load_component(pipeline, subfolder=SUBFOLDER, runtime=_runtime(root, RuntimeMode.REQUIRED))
    assert raised.value.failure.code is FailureCode.RESTORE_FAILED
    assert raised.value.failure.stage is ResolutionStage.RESTORE
    assert not _lease_active(root, key)


# ----------------------------------------------------------------------------- the lease


def test_the_model_keeps_its_lease_until_close(
    tmp_path: Path, pipeline: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """D14/S01: an ARTIFACT load returns an open lease the model holds; inspection (store and `hwr inspect
    --json`) shows the lease lock held; close() releases it and is idempotent."""
    root = tmp_path / "domain"
    load_component(pipeline, subfolder=SUBFOLDER, runtime=_runtime(root)).close()
    loaded = load_component(pipeline, subfolder=SUBFOLDER, runtime=_runtime(root))
    try:
        lease = loaded.lease
        assert loaded.outcome is ResolutionOutcome.LOCAL_HIT and lease is not None
        assert not lease.closed
        model: Any = loaded.model
        assert model._host_weight_lease.lease is lease
        assert loaded.identity_key == lease.identity.key
        assert _lease_active(root, lease.identity.key)
        assert cli.main(["inspect", "--root", str(root), "--json"]) == 0
        [entry] = json.loads(capsys.readouterr().out)["artifacts"]
        assert entry["key"] == loaded.identity_key
        assert entry["locks"] == {"build_active": False, "lease_active": True}
    finally:
        loaded.close()
    assert _closed(lease)
    loaded.close()
    assert _closed(lease)
    assert not _lease_active(root, lease.identity.key)
    assert cli.main(["inspect", "--root", str(root), "--json"]) == 0
    [entry] = json.loads(capsys.readouterr().out)["artifacts"]
    assert entry["locks"] == {"build_active": False, "lease_active": False}


# ----------------------------------------------------------------------------- argument errors


@pytest.mark.parametrize("torch_dtype", [torch.float64, torch.int8, "auto", "half"])
def test_only_served_dtypes(tmp_path: Path, pipeline: Path, torch_dtype: object) -> None:
    """D14/D06/P04: a torch_dtype other than BF16, FP16 or FP32 is a ValueError before anything is touched."""
    root = tmp_path / "domain"
    with pytest.raises(ValueError, match="serves BF16, FP16 and FP32"):
        load_component(pipeline, subfolder=SUBFOLDER, runtime=_runtime(root), torch_dtype=torch_dtype)
    assert not root.exists()


def test_tensor_parallel_is_refused(tmp_path: Path, pipeline: Path) -> None:
    """D14/D06: tensor_parallel_size=2 without torch.distributed initialized is a ValueError before anything is
    touched (the TP path itself is tested in tests/test_diffusion_tp_group.py)."""
    root = tmp_path / "domain"
    parallel = FinalLayoutParallelIdentity(tensor_parallel_size=2, tensor_parallel_rank=1)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        load_component(pipeline, subfolder=SUBFOLDER, runtime=_runtime(root), parallel=parallel)
    assert not root.exists()


def test_folder_without_config_json_is_refused(tmp_path: Path, pipeline: Path) -> None:
    """D14: a pipeline folder without subfolder= (so no config.json) is a ValueError that names the fix."""
    root = tmp_path / "domain"
    with pytest.raises(ValueError, match=r"config\.json") as raised:
        load_component(pipeline, runtime=_runtime(root))
    assert "subfolder" in str(raised.value)
    assert artifact_keys(root) == []


# ----------------------------------------------------------------------------- concurrent cold starts


def test_two_cold_starters_publish_once(tmp_path: Path, pipeline: Path, canonical_output: torch.Tensor) -> None:
    """D14/S14: two fresh processes released together against one empty PREFERRED domain, each publishing
    before it returns (publish_in_background=False), both serve working models; exactly one publishes, the
    other finds it present, joins, or hits; one artifact."""
    root = tmp_path / "domain"
    with ExitStack() as stack:
        conns = [stack.enter_context(spawned_child(_cold_start_in_child, str(root), str(pipeline))) for _ in range(2)]
        assert [recv_within(conn) for conn in conns] == ["ready", "ready"]
        for conn in conns:
            conn.send("go")
        reports: list[dict[str, Any]] = []
        for conn in conns:
            report = recv_within(conn)
            assert isinstance(report, dict)
            reports.append(report)
    keys = {report["identity_key"] for report in reports}
    assert len(keys) == 1
    published = [report for report in reports if report["publication"] == "published"]
    assert len(published) == 1, reports
    [winner] = published
    assert winner["outcome"] == ResolutionOutcome.CANONICAL_FALLBACK.value
    [other] = [report for report in reports if report is not winner]
    assert (other["outcome"], other["publication"]) in {
        (ResolutionOutcome.CANONICAL_FALLBACK.value, PostLoadPublicationStatus.ALREADY_PRESENT.value),
        (ResolutionOutcome.CANONICAL_FALLBACK.value, PostLoadPublicationStatus.JOINED.value),
        (ResolutionOutcome.LOCAL_HIT.value, None),
    }, other
    for report in reports:
        assert torch.equal(_from_payload(report["output"]), canonical_output)
    assert artifact_keys(root) == sorted(keys)
    assert list((root / "tmp").iterdir()) == []

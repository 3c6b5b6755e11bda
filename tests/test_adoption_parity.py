"""A hit is the same module as a miss for what inference code does with it: `requires_grad` as
diffusers gives it, and `copy.deepcopy` yields an independent model that owns plain tensors and holds no lease."""

from __future__ import annotations

import copy
import pickle
from pathlib import Path

import pytest
import torch

from host_weight_runtime.diffusion import ComponentLoadPath, load_component
from host_weight_runtime.filesystem.store import FilesystemHostWeightStore
from host_weight_runtime.lease import HostWeightLease
from host_weight_runtime.outcomes import CleanupStatus, ResolutionOutcome
from hwr_tools.synthetic_models import save_pipeline_folder

from ._adoption import KIND, SUBFOLDER, canonical, forward, isolate_environment
from ._diffusion import all_tensors, runtime_at


@pytest.fixture(autouse=True)
def _isolated(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    isolate_environment(monkeypatch, tmp_path)


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_pipeline_folder(tmp_path_factory.mktemp("models") / "tiny-flux", KIND, seed=41)


def _grad_flags(model: torch.nn.Module) -> dict[str, bool]:
    return {name: parameter.requires_grad for name, parameter in model.named_parameters()}


def _in_lease(tensor: torch.Tensor, lease: HostWeightLease) -> bool:
    """Whether the tensor's storage lies inside one of the lease's mapped payloads."""
    address = tensor.untyped_storage().data_ptr()
    return any(region.address <= address < region.address + region.length for region in lease.mapped_regions)


def test_hit_and_miss_give_requires_grad_as_diffusers_does(tmp_path: Path, pipeline: Path) -> None:
    """D14: from_pretrained, the first load (canonical fallback) and the second (local hit) agree on every
    parameter's requires_grad (True, as diffusers gives it); the hit's parameters still view the lease."""
    runtime = runtime_at(tmp_path / "domain")
    expected = _grad_flags(canonical(pipeline / SUBFOLDER))
    assert expected and all(expected.values())
    with load_component(pipeline, subfolder=SUBFOLDER, runtime=runtime) as miss:
        assert miss.outcome is ResolutionOutcome.CANONICAL_FALLBACK
        assert _grad_flags(miss.model) == expected
    with load_component(pipeline, subfolder=SUBFOLDER, runtime=runtime) as hit:
        assert hit.outcome is ResolutionOutcome.LOCAL_HIT and hit.lease is not None
        assert _grad_flags(hit.model) == expected
        assert all(_in_lease(parameter, hit.lease) for parameter in hit.model.parameters())


def test_a_write_to_a_hit_parameter_stays_in_this_process(tmp_path: Path, pipeline: Path) -> None:
    """Why requires_grad=True is safe on a hit: the lease maps private copy-on-write, so an in-place update (what
    an optimizer step does) changes this model only; the next hit still computes what from_pretrained does."""
    runtime = runtime_at(tmp_path / "domain")
    load_component(pipeline, subfolder=SUBFOLDER, runtime=runtime).close()
    expected = forward(canonical(pipeline / SUBFOLDER))
    with load_component(pipeline, subfolder=SUBFOLDER, runtime=runtime) as written:
        with torch.no_grad():
            for parameter in written.model.parameters():
                parameter.add_(1.0)
        assert not torch.equal(forward(written.model), expected)
        with load_component(pipeline, subfolder=SUBFOLDER, runtime=runtime) as other:
            assert other.outcome is ResolutionOutcome.LOCAL_HIT
            assert torch.equal(forward(other.model), expected)


@pytest.mark.parametrize("kind", ["flux", "sd3"])  # SD3 also has a persistent buffer (its position table)
def test_deepcopy_of_a_hit_is_an_independent_model(tmp_path: Path, kind: str) -> None:
    """D14: copy.deepcopy of a hit model works; the copy computes what the original does, owns compact plain
    tensors outside the lease (a leased buffer does not drag its whole payload file along), holds no lease, and
    is unaffected by closing the lease, dropping the original and removing the artifact."""
    folder = save_pipeline_folder(tmp_path / "models" / kind, kind, seed=42)
    root = tmp_path / "domain"
    runtime = runtime_at(root)
    load_component(folder, subfolder=SUBFOLDER, runtime=runtime).close()
    loaded = load_component(folder, subfolder=SUBFOLDER, runtime=runtime)
    assert loaded.load_path is ComponentLoadPath.ARTIFACT and loaded.lease is not None
    lease, key = loaded.lease, loaded.identity_key
    assert key is not None
    expected = forward(loaded.model, kind)
    assert torch.equal(expected, forward(canonical(folder / SUBFOLDER, kind), kind))

    duplicate = copy.deepcopy(loaded.model)

    assert type(duplicate) is type(loaded.model)
    assert not hasattr(duplicate, "_host_weight_lease")
    assert torch.equal(forward(duplicate, kind), expected)
    assert _grad_flags(duplicate) == _grad_flags(loaded.model)
    for name, tensor in all_tensors(duplicate).items():
        assert not _in_lease(tensor, lease), name
        assert tensor.untyped_storage().nbytes() == tensor.nbytes, f"{name} copied more than itself"
    loaded.close()
    del loaded
    assert FilesystemHostWeightStore(root).cleanup(key).status is CleanupStatus.REMOVED
    assert torch.equal(forward(duplicate, kind), expected)
    assert torch.equal(forward(copy.deepcopy(duplicate), kind), expected)


def test_deepcopy_of_a_pipeline_holding_a_hit_copies_it_through(tmp_path: Path, pipeline: Path) -> None:
    """A container deep-copied as a whole (a pipeline, a list of models) gets the same independent copy."""
    runtime = runtime_at(tmp_path / "domain")
    load_component(pipeline, subfolder=SUBFOLDER, runtime=runtime).close()
    with load_component(pipeline, subfolder=SUBFOLDER, runtime=runtime) as hit:
        assert hit.lease is not None
        holder = torch.nn.ModuleDict({"transformer": hit.model, "again": hit.model})
        duplicate = copy.deepcopy(holder)
        assert duplicate["transformer"] is duplicate["again"], "shared modules stay shared in the copy"
        assert not any(_in_lease(tensor, hit.lease) for tensor in all_tensors(duplicate).values())
        assert torch.equal(forward(duplicate["transformer"]), forward(hit.model))


def test_deepcopy_and_pickle_agree_on_hit_and_miss(tmp_path: Path, pipeline: Path) -> None:
    """Both paths deep-copy and pickle to equal models; an unpickled hit model holds no lease either."""
    runtime = runtime_at(tmp_path / "domain")
    expected = forward(canonical(pipeline / SUBFOLDER))
    for outcome in (ResolutionOutcome.CANONICAL_FALLBACK, ResolutionOutcome.LOCAL_HIT):
        with load_component(pipeline, subfolder=SUBFOLDER, runtime=runtime) as loaded:
            assert loaded.outcome is outcome
            assert torch.equal(forward(copy.deepcopy(loaded.model)), expected)
            restored = pickle.loads(pickle.dumps(loaded.model))
            assert getattr(restored, "_host_weight_lease", None) is None
            assert torch.equal(forward(restored), expected)

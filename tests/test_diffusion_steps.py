"""D05/D14: the named steps `load_component` is composed of, used on their own as a pipeline loader will.

A real tiny Flux folder, a real domain on `tmp_path`: the steps composed by hand reach the same
key and the same tensors as `load_component`, and the model family is the one point where a
second library plugs in (its library versions enter the loader identity, and so the key).
"""

from __future__ import annotations

from pathlib import Path

import torch

from host_weight_runtime.config import RuntimeMode
from host_weight_runtime.diffusion import ComponentLoadPath, load_component
from host_weight_runtime.diffusion._load_options import LoadOptions
from host_weight_runtime.diffusion.canonical_step import load_canonical_for
from host_weight_runtime.diffusion.component_source import ComponentLocation
from host_weight_runtime.diffusion.contracts import FinalLayoutParallelIdentity
from host_weight_runtime.diffusion.family_diffusers import DIFFUSERS_FAMILY, DiffusersFamily
from host_weight_runtime.diffusion.resolve_step import resolve_component
from host_weight_runtime.diffusion.restore_step import restore_or_fall_back
from host_weight_runtime.diffusion.skeleton import identify_component, prepare_skeleton

from ._diffusion import DIT, runtime_at, save_folder


class _PinnedDiffusers(DiffusersFamily):
    """diffusers, reporting another library version: what a second family changes at the identity point."""

    __slots__ = ()

    def library_versions(self) -> dict[str, str]:
        return {**super().library_versions(), "diffusers": "0.0.0-pinned"}


def _location(root: Path) -> ComponentLocation:
    return ComponentLocation(root, subfolder=DIT)


def test_steps_composed_by_hand_restore_what_load_component_publishes(tmp_path: Path) -> None:
    """D14: prepare -> identify -> resolve -> restore, called directly, hit the artifact `load_component` built."""
    folder = save_folder(tmp_path / "model", "flux")
    runtime = runtime_at(tmp_path / "domain", RuntimeMode.REQUIRED)
    with load_component(folder.root, subfolder=DIT, runtime=runtime, stream_on_miss=True) as first:
        assert first.load_path is ComponentLoadPath.ARTIFACT
        skeleton = prepare_skeleton(_location(folder.root), LoadOptions(), FinalLayoutParallelIdentity())
        identified = identify_component(skeleton, runtime)
        assert identified.context.identity.key == first.identity_key
        resolution = resolve_component(identified, runtime, stream=False)
        assert resolution.lease is not None
        restored = restore_or_fall_back(identified, resolution.lease, fp8=False, required=True)
        assert restored.failure is None and restored.model is skeleton.model
        canonical = load_canonical_for(skeleton, fp8=False)
        expected = dict(canonical.state_dict())
        got = dict(skeleton.model.state_dict())
        assert got.keys() == expected.keys()
        assert all(torch.equal(got[name], expected[name]) for name in expected)
        resolution.lease.close()


def test_the_model_family_decides_the_library_versions_in_the_key(tmp_path: Path) -> None:
    """D05: the same files through a family reporting other library versions get another loader identity and key."""
    folder = save_folder(tmp_path / "model", "flux")
    runtime = runtime_at(tmp_path / "domain")
    parallel = FinalLayoutParallelIdentity()
    plain = prepare_skeleton(_location(folder.root), LoadOptions(), parallel, family=DIFFUSERS_FAMILY)
    pinned = prepare_skeleton(_location(folder.root), LoadOptions(), parallel, family=_PinnedDiffusers())
    assert pinned.family is not plain.family and type(pinned.model) is type(plain.model)
    plain_loader = plain.request.loader
    pinned_loader = pinned.request.loader
    assert pinned_loader.model_config_fingerprint == plain_loader.model_config_fingerprint
    assert pinned_loader.implementation.fingerprint != plain_loader.implementation.fingerprint
    plain_key = identify_component(plain, runtime).context.identity.key
    assert identify_component(pinned, runtime).context.identity.key != plain_key

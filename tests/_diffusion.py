"""Helpers for the diffusion restore and model tests: real folders, real identities, real domains.

Everything is built from the public adapter pieces the way `load_component` wires them:
`prepare_weight_source` picks the checkpoint, `build_skeleton` builds the `meta` model,
`build_final_layout_identity` keys it, and a `HostWeightRuntime` on `tmp_path` stores it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch

from host_weight_runtime.config import HostWeightRuntimeConfig, RuntimeMode
from host_weight_runtime.diffusion import (
    FINAL_LAYOUT_BF16_POLICY,
    FinalLayoutBF16Producer,
    FinalLayoutIdentityContext,
    FinalLayoutLoaderIdentity,
    FinalLayoutRequest,
    ImplementationIdentity,
    PreparedWeightSource,
    build_final_layout_identity,
    build_skeleton,
    prepare_weight_source,
)
from host_weight_runtime.outcomes import PostLoadPublicationReport
from host_weight_runtime.runtime import HostWeightRuntime
from hwr_tools.synthetic_models import save_pipeline_folder, tiny_spec

DIT = "transformer"
WEIGHTS_FILE = "diffusion_pytorch_model.safetensors"

_LOADER = ImplementationIdentity(
    implementation_id="tests.diffusion",
    version="1",
    fingerprint=hashlib.sha256(b"tests.diffusion loader v1").hexdigest(),
)


def _seeded_linear() -> torch.nn.Linear:
    linear = torch.nn.Linear(8, 4)
    generator = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(4, 8, generator=generator))
        linear.bias.copy_(torch.randn(4, generator=generator))
    return linear


class Pipeline(torch.nn.Module):
    """A pipeline-shaped holder: the DiT next to another component the restorer must leave alone."""

    def __init__(self, transformer: torch.nn.Module) -> None:
        super().__init__()
        self.transformer = transformer
        self.text_proj = _seeded_linear()


class OtherPipeline(torch.nn.Module):
    """A different pipeline class (not a subclass of Pipeline) holding the same kind of DiT."""

    def __init__(self, transformer: torch.nn.Module) -> None:
        super().__init__()
        self.transformer = transformer
        self.text_proj = _seeded_linear()


@dataclass(frozen=True)
class Folder:
    """A saved pipeline folder of one synthetic kind."""

    kind: str
    root: Path

    @property
    def model_folder(self) -> Path:
        return self.root / DIT

    @property
    def weights(self) -> Path:
        return self.model_folder / WEIGHTS_FILE

    def source(self) -> PreparedWeightSource:
        return prepare_weight_source(self.root, subfolder=DIT, prefix=f"{DIT}.")

    def model_class(self) -> Any:
        return tiny_spec(self.kind).model_class()

    def canonical(self) -> Any:
        """What a diffusers user gets: `from_pretrained(torch_dtype=torch.bfloat16)`."""
        return self.model_class().from_pretrained(str(self.model_folder), torch_dtype=torch.bfloat16)

    def skeleton(self) -> Any:
        """A fresh `meta` skeleton, built as `load_component` builds it."""
        return build_skeleton(self.model_class(), self.model_folder, str(self.root))


def save_folder(base: Path, kind: str, *, seed: int = 0, **kwargs: Any) -> Folder:
    return Folder(kind, save_pipeline_folder(base, kind, seed=seed, **kwargs))


def identity_context(
    holder: torch.nn.Module, source: PreparedWeightSource, *, model_id: str = "tests/tiny"
) -> FinalLayoutIdentityContext:
    """The final-layout identity of the holder's `transformer`, keyed to `source`."""
    model = holder.get_submodule(DIT)
    values = cast(Mapping[str, Any], model.config)
    public = {key: value for key, value in values.items() if not key.startswith("_")}
    config = json.dumps({"class": type(model).__name__, **public}, sort_keys=True, default=str)
    request = FinalLayoutRequest(
        model_id=model_id,
        loader=FinalLayoutLoaderIdentity(
            implementation=_LOADER,
            model_config_fingerprint=hashlib.sha256(config.encode()).hexdigest(),
            weight_transform_fingerprint=hashlib.sha256(b"bf16, identity key mapping").hexdigest(),
        ),
    )
    return build_final_layout_identity(
        holder,
        dit_modules=[(DIT, model)],
        prepared_sources=[source],
        request=request,
        policy=FINAL_LAYOUT_BF16_POLICY,
    )


def runtime_at(root: Path, mode: RuntimeMode = RuntimeMode.PREFERRED) -> HostWeightRuntime:
    return HostWeightRuntime(HostWeightRuntimeConfig(mode=mode, root=root, lock_timeout_s=60.0))


def publish_canonical(
    runtime: HostWeightRuntime, context: FinalLayoutIdentityContext, model: torch.nn.Module, **kwargs: Any
) -> PostLoadPublicationReport:
    """Post-load publication of a loaded canonical model through the runtime."""
    return runtime.publish_after_load(context.identity, FinalLayoutBF16Producer(context, [(DIT, model)], **kwargs))


def all_tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer (persistent or not), by name, as the objects the module holds."""
    found: dict[str, torch.Tensor] = dict(module.named_parameters(remove_duplicate=False))
    found.update(module.named_buffers(remove_duplicate=False))
    return found


@dataclass(frozen=True)
class TensorSnapshot:
    """What a module holds: the tensor objects, a copy of every host value, and the grad flags."""

    objects: dict[str, torch.Tensor]
    values: dict[str, torch.Tensor | None]
    data_ptrs: dict[str, int | None]
    requires_grad: dict[str, bool]

    @classmethod
    def of(cls, module: torch.nn.Module) -> TensorSnapshot:
        objects = all_tensors(module)
        return cls(
            objects=objects,
            values={name: None if t.is_meta else t.detach().clone() for name, t in objects.items()},
            data_ptrs={name: None if t.is_meta else t.data_ptr() for name, t in objects.items()},
            requires_grad={name: t.requires_grad for name, t in objects.items()},
        )

    def assert_unchanged(self, module: torch.nn.Module) -> None:
        """Same objects, same devices, same storage, bit-equal values, same grad flags."""
        now = all_tensors(module)
        assert now.keys() == self.objects.keys()
        replaced = sorted(name for name, tensor in now.items() if tensor is not self.objects[name])
        assert not replaced, f"tensors replaced: {replaced[:5]}"
        for name, tensor in now.items():
            before = self.values[name]
            if before is None:
                assert tensor.is_meta, name
                continue
            assert tensor.data_ptr() == self.data_ptrs[name], name
            assert tensor.dtype == before.dtype and torch.equal(tensor.detach(), before), name
            assert tensor.requires_grad == self.requires_grad[name], name

"""The spawned rank of tests/test_diffusion_tp_forward.py (module level, so spawn can import it).

One gloo group serves every model kind in turn: for each, a cold load in REQUIRED mode
(one bundle build) and a warm load in PREFERRED mode, each followed by the same forward.
"""

from __future__ import annotations

import datetime
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

from host_weight_runtime.config import HostWeightRuntimeConfig, RuntimeMode
from host_weight_runtime.diffusion import FinalLayoutParallelIdentity, load_component
from host_weight_runtime.runtime import HostWeightRuntime
from hwr_tools.synthetic_models import forward_inputs, run_forward

from ._diffusion import DIT


def local_bits(tensor: torch.Tensor) -> Any:
    """A rank's local part of a (DTensor or plain) tensor as raw bytes in numpy, for bit-exact comparison."""
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.detach().contiguous().view(torch.uint8).numpy().copy()


def _attention_facts(model: torch.nn.Module) -> dict[str, Any]:
    """Per split attention module: its head count on this rank and the class of each q/k norm."""
    facts: dict[str, Any] = {}
    for name, module in model.named_modules():
        if hasattr(module, "_hwr_full_heads"):
            norms = {
                n: type(getattr(module, n)).__name__ for n in ("norm_q", "norm_k", "norm_added_k") if hasattr(module, n)
            }
            facts[name] = {"heads": module.heads, "full_heads": module._hwr_full_heads, "norms": norms}
    return facts


def forward_group_child(rank: int, setup: dict[str, Any], report: Connection) -> None:
    """Load each kind cold then warm at TP=`world`; send path, outcome, plan, output, weights and attention facts."""
    import torch.distributed as dist

    world = setup["world"]
    dist.init_process_group(
        "gloo", init_method=setup["rendezvous"], rank=rank, world_size=world, timeout=datetime.timedelta(seconds=180)
    )
    try:
        for kind, folder in setup["folders"]:
            for mode in ("required", "preferred"):
                runtime = HostWeightRuntime(
                    HostWeightRuntimeConfig(mode=RuntimeMode(mode), root=Path(setup["domain"]), lock_timeout_s=120.0)
                )
                loaded = load_component(
                    folder,
                    subfolder=DIT,
                    runtime=runtime,
                    parallel=FinalLayoutParallelIdentity(tensor_parallel_size=world, tensor_parallel_rank=rank),
                    process_group=dist.group.WORLD,
                )
                model = loaded.model
                output = run_forward(kind, model, forward_inputs(kind, model, seed=5))
                report.send(
                    {
                        "kind": kind,
                        "mode": mode,
                        "path": loaded.load_path.value,
                        "outcome": None if loaded.outcome is None else loaded.outcome.value,
                        "plan": loaded.tensor_parallel_plan,
                        "output": output.detach().float().numpy(),  # BF16 -> FP32 is exact
                        "weights": {name: local_bits(p) for name, p in model.named_parameters()},
                        "attention": _attention_facts(model),
                    }
                )
                loaded.close()
    finally:
        dist.destroy_process_group()

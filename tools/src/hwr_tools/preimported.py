"""Child processes forked from a server that imported torch once, so each starts in milliseconds, not seconds.

A "spawn" child is a fresh interpreter that imports torch and our library again (several seconds
of CPU each). A child of this context is forked from multiprocessing's fork server, which imported
PRELOADED_MODULES once before it forked anything: the child is still a separate process with its
own memory, files and exit status, and nothing was loaded in it but modules (no weights, no store
state, no armed faults). Only modules that read no environment variable a caller may change are
preloaded: huggingface_hub (and diffusers, transformers, peft, which import it) copies HF_HUB_CACHE,
HF_HOME and HF_HUB_OFFLINE into constants at import, so the child imports those itself.

The fork server keeps the environment it started with; each child gets its parent's environment as
it was at `start()` instead, so a variable set just before starting a child reaches it as with spawn.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.context
import os

__all__ = ["PRELOADED_MODULES", "PreimportedProcess", "preimported_context"]

PRELOADED_MODULES = (
    "numpy",
    "torch",
    "torch._dynamo",  # what diffusers.utils.torch_utils imports: about as long as torch itself
    "torch.distributed",
    "safetensors.torch",
    "host_weight_runtime",
    "host_weight_runtime.diffusion",
)


class PreimportedProcess(multiprocessing.context.ForkServerProcess):
    """A fork-server child that runs with the environment its parent had when it started the child."""

    _environment: dict[str, str]

    def start(self) -> None:
        self._environment = dict(os.environ)
        super().start()

    def run(self) -> None:
        os.environ.clear()
        os.environ.update(self._environment)
        super().run()


class _PreimportedContext(multiprocessing.context.ForkServerContext):
    """The fork-server context whose processes take their parent's environment (Pool workers too)."""

    Process = PreimportedProcess


_CONTEXT = _PreimportedContext()


def preimported_context() -> multiprocessing.context.ForkServerContext:
    """The context (its Process, Pipe, Queue, Pool...) whose children fork from a server that preloaded
    PRELOADED_MODULES; the server starts with the first child and lives as long as this process."""
    _CONTEXT.set_forkserver_preload(list(PRELOADED_MODULES))
    return _CONTEXT

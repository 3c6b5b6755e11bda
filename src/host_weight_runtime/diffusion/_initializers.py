"""transformers' copy of torch's initializers, repaired where the process's import history broke it.

transformers copies `torch.nn.init`'s functions into `transformers.initialization.TORCH_INIT_FUNCTIONS`
once, when that module is first imported, and initializes through the copy. Imported inside diffusers'
`no_init_weights()` (which swaps those functions for no-ops while it builds a model), transformers keeps
the no-ops for the life of the process: every later `from_pretrained`, and the finalization a hit runs,
then leaves the non-persistent buffers it initializes (Gemma2's `embed_scale`) as uninitialized memory.
So the table is checked before every transformers load, and after every diffusers build (whose window
could be where transformers was first imported), and set back to torch's own functions.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch

from ..failures import usage_error

__all__ = ["repair_transformers_initializers"]

_TRANSFORMERS_TABLE_MODULE = "transformers.initialization"


def _is_torch_own(function: object, name: str) -> bool:
    """torch's initializer itself, not a stand-in (diffusers' and transformers' no-ops are defined elsewhere)."""
    return callable(function) and (
        getattr(function, "__module__", None) == "torch.nn.init" and getattr(function, "__name__", None) == name
    )


def repair_transformers_initializers(*, required: bool = True) -> None:
    """Set every entry of transformers' initializer table that is not torch's own function back to torch's.

    Does nothing before transformers is imported (its first import copies whatever is current). When an
    entry is broken and torch's own function is swapped out right now too (a load called inside
    `no_init_weights()`), nothing could initialize as transformers does: a usage error where a transformers
    load follows (`required`), else the entry is left for that load to refuse.
    """
    module = sys.modules.get(_TRANSFORMERS_TABLE_MODULE)
    table = getattr(module, "TORCH_INIT_FUNCTIONS", None)
    if not isinstance(table, dict):
        return
    for name, function in list(table.items()):
        if not isinstance(name, str) or _is_torch_own(function, name):
            continue
        genuine: Callable[..., object] | None = getattr(torch.nn.init, name, None)
        if not _is_torch_own(genuine, name):
            if not required:
                continue
            raise usage_error(
                f"transformers recorded a stand-in for torch.nn.init.{name} (it was first imported inside a "
                "no_init_weights() context) and torch's own function is swapped out now as well, so no model "
                "could be initialized as transformers does; call the load outside no_init_weights()",
                initializer=name,
            )
        table[name] = genuine

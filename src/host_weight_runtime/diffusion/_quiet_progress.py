"""transformers' "Loading weights" bar stays off while a hit binds the artifact's tensors.

Finishing a restored encoder runs transformers' own state-dict load, which draws a progress bar
over tensors that are already in place; on a hit that is noise on every worker's stderr.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["quiet_transformers_progress"]


@contextmanager
def quiet_transformers_progress() -> Iterator[None]:
    """transformers' (and huggingface_hub's) progress bars off for the block, as they were afterwards."""
    transformers_logging: Any = importlib.import_module("transformers.utils.logging")
    hub: Any = importlib.import_module("huggingface_hub.utils")  # transformers switches its bars too
    if not transformers_logging.is_progress_bar_enabled():
        yield
        return
    hub_was_off = hub.are_progress_bars_disabled()
    transformers_logging.disable_progress_bar()
    try:
        yield
    finally:
        transformers_logging.enable_progress_bar()
        if hub_was_off:
            hub.disable_progress_bars()

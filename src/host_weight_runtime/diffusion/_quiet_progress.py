"""transformers' "Loading weights" bar stays off while a hit binds the artifact's tensors.

Finishing a restored encoder runs transformers' own state-dict load, which draws a progress bar
over tensors that are already in place; on a hit that is noise on every worker's stderr.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["quiet_transformers_progress"]


@contextmanager
def quiet_transformers_progress() -> Iterator[None]:
    """transformers' (and huggingface_hub's) progress bars off for the block, as they were afterwards."""
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars
    from transformers.utils import logging as transformers_logging

    if not transformers_logging.is_progress_bar_enabled():
        yield
        return
    hub_was_off = are_progress_bars_disabled()
    transformers_logging.disable_progress_bar()
    try:
        yield
    finally:
        transformers_logging.enable_progress_bar()
        if hub_was_off:
            disable_progress_bars()

"""Diffusion Host Weight Runtime producers."""

from .checkpoint_stream import FinalLayoutBF16CheckpointProducer
from .finalized import FinalLayoutBF16Producer

__all__ = ["FinalLayoutBF16CheckpointProducer", "FinalLayoutBF16Producer"]

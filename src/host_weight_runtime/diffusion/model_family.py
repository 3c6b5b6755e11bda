"""A model family: the library whose classes a component is (diffusers today), as the load steps need it.

Every step of a component load is the same for any family except four points, which a family
supplies: which class a folder's config names, how a `meta` skeleton is built, which library
versions enter the loader identity, and how the canonical load reads the checkpoint.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

import torch

from ._load_options import LoadOptions
from .source_identity import PreparedWeightSource

__all__ = ["ImportClock", "ModelFamily", "default_dtype"]

_default_dtype_guard = threading.Lock()


class ImportClock:
    """Seconds one call spends importing the family's library and the model's module, kept out of `elapsed_s`."""

    __slots__ = ("seconds",)

    def __init__(self) -> None:
        self.seconds = 0.0

    @contextmanager
    def measure(self) -> Iterator[None]:
        started = time.monotonic()
        try:
            yield
        finally:
            self.seconds += time.monotonic() - started


@contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Libraries construct models under `torch_dtype` as the default dtype; so must a skeleton (one at a time)."""
    with _default_dtype_guard:
        previous = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            yield
        finally:
            torch.set_default_dtype(previous)


class ModelFamily(Protocol):
    """What the load steps ask of the library a component's class belongs to."""

    def import_up_front(self, clock: ImportClock) -> None:
        """Import what every load of this family needs, timed on `clock` when something is not imported yet."""
        ...

    def model_class(self, config: Mapping[str, Any], config_path: Path, clock: ImportClock | None) -> type[Any]:
        """The class the folder's config names; a config that names none of this family's is a usage error."""
        ...

    def model_config(self, model_class: type[Any], resolved_root: Path) -> dict[str, Any]:
        """The config the class is built from, as the library reads it (it enters the loader identity)."""
        ...

    def build_skeleton(self, model_class: type[Any], resolved_root: Path, name_or_path: str) -> torch.nn.Module:
        """The model built as the library's canonical load builds it, with parameters on `meta`."""
        ...

    def library_versions(self) -> dict[str, str]:
        """The versions whose change may change the loaded tensors (they enter the loader identity)."""
        ...

    def load_canonical(
        self, model_class: type[Any], source: PreparedWeightSource, name_or_path: str, options: LoadOptions
    ) -> torch.nn.Module:
        """Exactly what a user of the library gets from its own BF16 load of the folder, from local files only."""
        ...

"""A model family: the library whose classes a component is (diffusers today), as the load steps need it.

Every step of a component load is the same for any family except a few points, which a family
supplies: which class a folder's config names, how a `meta` skeleton is built, which library
versions enter the loader identity, which checkpoint key feeds each model tensor and which
names are tied, and how the canonical load reads the checkpoint. diffusers (`family_diffusers.py`)
and transformers (`family_transformers.py`) are the two families; `component_source.family_for_config`
picks one from a folder's config.json.
"""

from __future__ import annotations

import importlib
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

import torch

from ..failures import FailureCode, HostWeightError, ResolutionStage, raise_failure, usage_error
from ._load_options import LoadOptions
from .dtype_policies import ModelFamilyName
from .source_identity import NodeSourceDigestCache, PreparedWeightSource

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

    def import_modules(self, names: tuple[str, ...]) -> None:
        """Import `names`, timed on this clock only when one of them is not imported yet."""
        if all(name in sys.modules for name in names):
            return
        with self.measure():
            for name in names:
                importlib.import_module(name)


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

    @property
    def family_name(self) -> ModelFamilyName:
        """Which library's rules decide the bytes (it picks the dtype policy, so the representation)."""
        ...

    def import_up_front(self, clock: ImportClock) -> None:
        """Import what every load of this family needs, timed on `clock` when something is not imported yet."""
        ...

    def model_class(self, config: Mapping[str, Any], config_path: Path, clock: ImportClock | None) -> type[Any]:
        """The class the folder's config names; a config that names none of this family's is a usage error."""
        ...

    def model_config(self, model_class: type[Any], resolved_root: Path) -> dict[str, Any]:
        """The config the class is built from, as the library reads it (it enters the loader identity)."""
        ...

    def build_skeleton(
        self, model_class: type[Any], resolved_root: Path, name_or_path: str, dtype: torch.dtype = torch.bfloat16
    ) -> torch.nn.Module:
        """The model built as the library's canonical load at `dtype` builds it, with parameters on `meta`."""
        ...

    def checkpoint_bindings(
        self, model: torch.nn.Module, source: PreparedWeightSource, records: NodeSourceDigestCache | None = None
    ) -> tuple[dict[str, str], dict[str, str]]:
        """(model tensor -> checkpoint key where the two differ, alias -> owner of each tie), in local names.

        `records`: the node's cache, where a family may keep what it derived for the node's next worker."""
        ...

    def library_versions(self) -> dict[str, str]:
        """The versions whose change may change the loaded tensors (they enter the loader identity)."""
        ...

    def load_canonical(
        self, model_class: type[Any], source: PreparedWeightSource, name_or_path: str, options: LoadOptions
    ) -> torch.nn.Module:
        """Exactly what a user of the library gets from its own load at `options.dtype`, from local files only."""
        ...


@contextmanager
def canonical_load_errors(library: str, root: Path, broken_config: tuple[type[BaseException], ...]) -> Iterator[None]:
    """Around a library's `from_pretrained`: what it raises about the folder leaves typed (an OS error as
    CANONICAL_SOURCE_FAILED, a checkpoint that does not match its config as a usage error).

    A failed load leaves torch's default dtype as it found it: diffusers sets it to `torch_dtype` before
    it builds the model and restores it only when the build succeeds, so a config it cannot build would
    leave every later model of the process in BF16.
    """
    previous = torch.get_default_dtype()
    try:
        try:
            yield
        except HostWeightError:
            raise
        except OSError as exc:
            raise raise_failure(
                ResolutionStage.CANONICAL,
                FailureCode.CANONICAL_SOURCE_FAILED,
                f"{library} could not read the checkpoint in {root}: {exc}; check the files "
                "(re-download a damaged one) and that they are readable",
                exception=type(exc).__name__,
            ) from exc
        except broken_config as exc:
            raise usage_error(
                f"{library} could not load {root} ({type(exc).__name__}: {exc}); the checkpoint does "
                "not match its config.json: fix or re-download the model folder",
                code=FailureCode.CANONICAL_SOURCE_FAILED,
            ) from exc
    except BaseException:
        torch.set_default_dtype(previous)
        raise

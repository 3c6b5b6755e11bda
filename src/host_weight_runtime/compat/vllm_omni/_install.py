"""`install()`: make `vllm_omni.host_weight_runtime` this runtime in the calling process.

Every public module of the reference is an alias (the same module object) of its compat module here,
so `from vllm_omni.host_weight_runtime import X` gives this runtime's X. When vLLM is not installed,
the `vllm_omni` package itself is a stand-in that never runs the real package's `__init__` (which needs
vLLM) but finds its other subpackages on disk, so vLLM-Omni's diffusion adapters import unchanged.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import threading
import types
from collections.abc import Sequence

__all__ = ["ALIASES", "install", "installed"]

_PACKAGE = "vllm_omni"
_RUNTIME = f"{_PACKAGE}.host_weight_runtime"
_HERE = __name__.rsplit(".", 1)[0]  # host_weight_runtime.compat.vllm_omni

# The reference's public modules and the compat module each one is.
ALIASES: dict[str, str] = {
    _RUNTIME + suffix: _HERE + suffix
    for suffix in (
        "",
        ".config",
        ".errors",
        ".identity",
        ".inspection",
        ".lease",
        ".manifest",
        ".outcomes",
        ".protocols",
        ".runtime",
        ".filesystem",
        ".filesystem.locks",
        ".filesystem.store",
    )
}

_guard = threading.Lock()


class _RuntimeFinder(importlib.abc.MetaPathFinder):
    """Refuses the reference's other (private) modules, so its own code never mixes with this runtime."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname.startswith(_RUNTIME + ".") and fullname not in ALIASES:
            raise ModuleNotFoundError(
                f"{fullname} is a private module of vLLM-Omni's reference runtime; after "
                "host_weight_runtime.compat.vllm_omni.install() only its public modules exist "
                f"({', '.join(sorted(ALIASES))})",
                name=fullname,
            )
        return None


def installed() -> bool:
    """Whether `install()` has run in this process."""
    return any(isinstance(finder, _RuntimeFinder) for finder in sys.meta_path)


def install() -> None:
    """Make `vllm_omni.host_weight_runtime` (and its public submodules) this runtime; idempotent.

    Call it before anything imports `vllm_omni.host_weight_runtime`: a process that already holds the
    reference's objects would mix two runtimes, so that is refused with RuntimeError.
    """
    with _guard:
        if installed():
            return
        already = sorted(name for name in ALIASES if name in sys.modules)
        if already:
            raise RuntimeError(
                f"{already[0]} was imported before host_weight_runtime.compat.vllm_omni.install(); "
                "call install() first (at the very start of the process) so only one runtime is loaded"
            )
        with_vllm = importlib.util.find_spec("vllm") is not None
        if _PACKAGE not in sys.modules and not with_vllm:
            sys.modules[_PACKAGE] = _stand_in_package()
        for alias, target in ALIASES.items():
            sys.modules[alias] = importlib.import_module(target)
        importlib.import_module(_PACKAGE)  # the real package, with vLLM: it finds the aliases already there
        for alias in sorted(ALIASES, key=len):  # parents first: `import a.b.c` binds b on a, c on b
            parent, _, child = alias.rpartition(".")
            setattr(sys.modules[parent], child, sys.modules[alias])
        sys.meta_path.insert(0, _RuntimeFinder())


def _stand_in_package() -> types.ModuleType:
    """A `vllm_omni` package over the installed files (if any) whose own `__init__` (it needs vLLM) never runs."""
    found = importlib.machinery.PathFinder.find_spec(_PACKAGE)
    locations = list(found.submodule_search_locations or []) if found is not None else []
    spec = importlib.machinery.ModuleSpec(_PACKAGE, None, is_package=True)
    spec.submodule_search_locations = locations
    module = importlib.util.module_from_spec(spec)
    module.__doc__ = (
        "A stand-in for the vllm_omni package made by host_weight_runtime.compat.vllm_omni.install() where "
        "vLLM is not installed: its subpackages import from the installed files; its own __init__ never runs."
    )
    return module

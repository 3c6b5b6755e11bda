"""Which runtime a load asks: the caller's, or one from `HWR_*`; a build asks it in REQUIRED mode."""

from __future__ import annotations

import logging

from ..config import RuntimeMode
from ..runtime import HostWeightRuntime

__all__ = ["announce_runtime", "required_runtime", "runtime_for_load"]

_LOG = logging.getLogger(__name__)
_announced_roots: set[str] = set()


def announce_runtime(runtime: HostWeightRuntime) -> None:
    """Log the mode and domain root once per root and process, so a worker's log says where artifacts live."""
    root = str(runtime.config.resolved_root)
    if root not in _announced_roots:
        _announced_roots.add(root)
        _LOG.info("host-weight-runtime: mode %s, domain root %s", runtime.config.mode.value, root)


def runtime_for_load(runtime: HostWeightRuntime | None) -> HostWeightRuntime:
    """The caller's runtime, or one read from the environment; announced either way."""
    chosen = runtime if runtime is not None else HostWeightRuntime.from_env()
    announce_runtime(chosen)
    return chosen


def required_runtime(runtime: HostWeightRuntime) -> HostWeightRuntime:
    """The same runtime in REQUIRED mode with local builds allowed: building is the point, a failure must show.

    Derived with `with_policy`, so it keeps the caller's remote providers, observers and store.
    """
    return runtime.with_policy(RuntimeMode.REQUIRED, allow_local_build=True)

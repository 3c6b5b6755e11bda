"""Named fault-injection seams for tests.

Library code calls `fault_point("publication.after_manifest")` at the places where a
crash or an I/O error matters. Unarmed, a point does nothing. Tests arm a point in the
process that should fail (a spawned child for crashes) and the next pass through it
either kills the process with SIGKILL, raises an OSError with the chosen errno, or
calls a hook (which may report over a pipe and block) so a test can hold a process
at an exact step.
"""

from __future__ import annotations

import enum
import errno as errno_module
import os
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass


class FaultAction(str, enum.Enum):
    CRASH = "crash"
    RAISE_OSERROR = "raise_oserror"
    PAUSE = "pause"


@dataclass(frozen=True, slots=True)
class Fault:
    """What an armed point does: crash, raise `errno`, or call `hook(point)` (PAUSE)."""

    action: FaultAction
    errno: int = errno_module.EIO
    hook: Callable[[str], None] | None = None
    times: int = 1


_armed: dict[str, list[Fault]] = {}
_guard = threading.Lock()


def arm(point: str, fault: Fault) -> None:
    """Arm `point` in this process; it fires `fault.times` times, then disarms."""
    with _guard:
        _armed.setdefault(point, []).extend([fault] * fault.times)


def disarm_all() -> None:
    with _guard:
        _armed.clear()


@contextmanager
def armed(point: str, fault: Fault) -> Iterator[None]:
    arm(point, fault)
    try:
        yield
    finally:
        with _guard:
            _armed.pop(point, None)


def fault_point(point: str) -> None:
    """A seam: does nothing unless a test armed `point` in this process."""
    if not _armed:
        return
    with _guard:
        faults = _armed.get(point)
        if not faults:
            return
        fault = faults.pop(0)
        if not faults:
            del _armed[point]
    if fault.action is FaultAction.CRASH:
        os.kill(os.getpid(), signal.SIGKILL)
    elif fault.action is FaultAction.RAISE_OSERROR:
        raise OSError(fault.errno, f"{os.strerror(fault.errno)} (injected at {point})")
    elif fault.action is FaultAction.PAUSE and fault.hook is not None:
        fault.hook(point)

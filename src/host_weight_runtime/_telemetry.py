"""Process-local events from the store and adapters, for whoever listens (the metrics module).

The store cannot see the runtime's reports, and the runtime cannot see bytes evicted or
leases closed; both publish here. Nothing is recorded and nothing is imported when no
listener is registered, so the hot path pays one list check. The live-lease count is a
plain process-local number kept exact by the lease's own open and close: it is what a
multiprocess gauge sums across live workers.
"""

from __future__ import annotations

import enum
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

__all__ = [
    "TelemetryEvent",
    "TelemetryKind",
    "add_listener",
    "emit",
    "lease_closed",
    "lease_opened",
    "live_leases",
    "remove_listener",
]

_LOG = logging.getLogger("host_weight_runtime")


class TelemetryKind(str, enum.Enum):
    PUBLISHED = "published"
    EVICTED = "evicted"
    LEASE_OPENED = "lease_opened"
    LEASE_CLOSED = "lease_closed"
    RESTORED = "restored"
    VERIFIED = "verified"  # a background full verification ended: ok, or the artifact was denied


@dataclass(frozen=True, slots=True)
class TelemetryEvent:
    """One event; `storage_class` is "tmpfs"/"disk" for store events, "" where it does not apply."""

    kind: TelemetryKind
    storage_class: str = ""
    nbytes: int = 0
    seconds: float = 0.0
    ok: bool = True


Listener = Callable[[TelemetryEvent], None]

_listeners: list[Listener] = []
_guard = threading.Lock()
_leases = [0]  # one mutable cell, guarded by _guard: this process's open leases


def add_listener(listener: Listener) -> None:
    with _guard:
        if listener not in _listeners:
            _listeners.append(listener)


def remove_listener(listener: Listener) -> None:
    with _guard:
        if listener in _listeners:
            _listeners.remove(listener)


def emit(event: TelemetryEvent) -> None:
    """Deliver `event` to every listener; a listener's exception is logged and changes nothing."""
    if not _listeners:
        return
    with _guard:
        listeners = tuple(_listeners)
    for listener in listeners:
        try:
            listener(event)
        except Exception:
            _LOG.exception("host weight telemetry listener %r raised; ignored", listener)


def lease_opened(storage_class: str) -> None:
    with _guard:
        _leases[0] += 1
    emit(TelemetryEvent(TelemetryKind.LEASE_OPENED, storage_class))


def lease_closed(storage_class: str) -> None:
    with _guard:
        _leases[0] -= 1
    emit(TelemetryEvent(TelemetryKind.LEASE_CLOSED, storage_class))


def live_leases() -> int:
    """Leases this process holds open right now."""
    with _guard:
        return _leases[0]

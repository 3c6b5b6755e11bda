"""Background publication: the artifact of a canonically loaded model, built off the request path."""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import threading
import time
from collections.abc import Callable, Hashable, Iterator

from .._exit_wait import wait_at_exit
from .._faults import fault_point
from ..failures import FailureCode, HostWeightError, HostWeightFailure, ResolutionStage, failure
from .load_reports import PrewarmResult

__all__ = ["BACKGROUND_NICE_INCREMENT", "BackgroundPublication", "deferred_publications", "in_flight"]

_LOG = logging.getLogger(__name__)

BACKGROUND_NICE_INCREMENT = 10
"""How much nicer than the thread that loaded the model the background publication runs."""
_LOWEST_PRIORITY = 19

_in_flight: dict[Hashable, BackgroundPublication] = {}
_in_flight_guard = threading.Lock()
_deferred: contextvars.ContextVar[list[BackgroundPublication] | None] = contextvars.ContextVar(
    "hwr_deferred_publications", default=None
)


class BackgroundPublication:
    """The artifact of a canonically loaded model, built from its checkpoint on a thread of its own.

    The thread streams the checkpoint (it never reads the serving model, so nothing the
    caller does to the model can reach the artifact). It runs at nice +10, and so do the hash
    threads it starts, so the caller's first steps with its model come first on a busy node.
    A process that ends waits for it at exit, before thread pools stop taking work, so the
    first worker on a node always leaves an artifact behind. Failures are logged and kept in `failure`;
    they never raise here.
    """

    __slots__ = ("__weakref__", "_after", "_done", "_job", "_source", "_thread", "elapsed_s", "failure", "result")

    def __init__(self, job: Callable[[], PrewarmResult], *, source: Hashable | None = None) -> None:
        """`source` names the checkpoint in this process (see `in_flight`); inside `deferred_publications()`
        the thread starts when that block ends, after the publication started before it in the block."""
        self._job = job
        self._source = source
        self._after: BackgroundPublication | None = None
        self._done = threading.Event()
        self.result: PrewarmResult | None = None
        self.failure: HostWeightFailure | None = None
        self.elapsed_s: float | None = None
        self._thread = threading.Thread(target=self._run, name="hwr-background-publish", daemon=False)
        if source is not None:
            with _in_flight_guard:
                _in_flight[source] = self
        deferred = _deferred.get()
        if deferred is not None:
            self._after = deferred[-1] if deferred else None
            deferred.append(self)
            return
        self._start()

    def _start(self) -> None:
        wait_at_exit(self._thread)
        self._thread.start()

    def _run(self) -> None:
        if self._after is not None:
            self._after.wait()  # one checkpoint streams at a time: publications of one pipeline run in order
        started = time.monotonic()
        try:
            _lower_this_thread_priority()
            fault_point("background.started")
            self.result = self._job()
        except HostWeightError as exc:
            self.failure = exc.failure
            _LOG.warning("background publication failed: [%s] %s", exc.failure.code.value, exc.failure.message)
        except Exception as exc:  # a bug must not kill the serving process; it is recorded instead
            self.failure = failure(
                ResolutionStage.PUBLICATION, FailureCode.PRODUCER_FAILED, f"{type(exc).__name__}: {exc}"
            )
            _LOG.exception("background publication failed")
        finally:
            self.elapsed_s = time.monotonic() - started
            self._job = _finished_job
            if self._source is not None:
                with _in_flight_guard:
                    if _in_flight.get(self._source) is self:
                        del _in_flight[self._source]
            self._done.set()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until the publication finished (built, found, or failed); True when it did."""
        return self._done.wait(timeout)

    def state(self) -> dict[str, object]:
        """A JSON-friendly account: running, or how it ended."""
        if not self.done:
            return {"state": "running"}
        if self.failure is not None:
            return {"state": "failed", "failure": self.failure.to_dict(), "elapsed_s": self.elapsed_s}
        assert self.result is not None
        return {
            "state": self.result.resolution.outcome.value,
            "identity_key": self.result.identity_key,
            "elapsed_s": self.elapsed_s,
        }


def in_flight(source: Hashable) -> BackgroundPublication | None:
    """This process's started, unfinished publication of the checkpoint `source` names, if any.

    One still held by `deferred_publications()` is not returned: a load inside that block waiting
    for it would wait for the block's own end.
    """
    with _in_flight_guard:
        publication = _in_flight.get(source)
    if publication is None or publication.done or publication._thread.ident is None:
        return None
    return publication


@contextlib.contextmanager
def deferred_publications() -> Iterator[None]:
    """Hold the publications started inside the block until it ends, then run them one after another.

    A pipeline's first worker loads every component before any checkpoint streams behind it, so
    no publication competes with the loads that follow it for cores and disk.
    """
    held: list[BackgroundPublication] = []
    token = _deferred.set(held)
    try:
        yield
    finally:
        _deferred.reset(token)
        for publication in held:
            publication._start()


def _lower_this_thread_priority() -> None:
    """Raise this thread's nice (Linux nice is per thread); threads it starts inherit it."""
    try:
        thread_id = threading.get_native_id()
        nice = os.getpriority(os.PRIO_PROCESS, thread_id)
        os.setpriority(os.PRIO_PROCESS, thread_id, min(_LOWEST_PRIORITY, nice + BACKGROUND_NICE_INCREMENT))
    except OSError as exc:
        _LOG.debug("background publication keeps its priority: %s", exc)


def _finished_job() -> PrewarmResult:
    raise RuntimeError("this background publication already ran")

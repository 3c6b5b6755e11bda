"""A small per-process map, least recently used first out, of what a load derives once per kind of skeleton.

The ownership plans and the transformers bindings are both kept this way: under a key of everything they
depend on, counted as hits and misses so tests can tell a kept plan from a fresh one. A value is kept only
when it was computed without raising, and it must be immutable (every later load shares it).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

__all__ = ["KeptPlans"]

_V = TypeVar("_V")

_KEPT = 32


class KeptPlans(Generic[_V]):
    """Per-process values by key; `hits` counts the kept ones handed out, `misses` the ones computed."""

    __slots__ = ("_guard", "_kept", "_limit", "hits", "misses")

    def __init__(self, limit: int = _KEPT) -> None:
        self._limit = limit
        self._kept: OrderedDict[Hashable, _V] = OrderedDict()
        self._guard = threading.Lock()
        self.hits = 0
        self.misses = 0

    def plan(self, key: Hashable, compute: Callable[[], _V]) -> _V:
        """The kept value for `key`, or `compute()`'s (kept only when it returns)."""
        with self._guard:
            found = self._kept.get(key)
            if found is not None:
                self._kept.move_to_end(key)
                self.hits += 1
                return found
        computed = compute()
        with self._guard:
            self.misses += 1
            self._kept[key] = computed
            while len(self._kept) > self._limit:
                self._kept.popitem(last=False)
        return computed

    def clear(self) -> None:
        with self._guard:
            self._kept.clear()

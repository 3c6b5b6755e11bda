"""Median, min and max of one figure over a benchmark's runs."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from ..common import JsonValue

__all__ = ["Stats"]


@dataclass(frozen=True, slots=True)
class Stats:
    """Median, min and max of one figure over the runs, with the samples."""

    median: float
    minimum: float
    maximum: float
    samples: tuple[float, ...]

    @classmethod
    def of(cls, samples: Sequence[float]) -> Stats:
        return cls(statistics.median(samples), min(samples), max(samples), tuple(samples))

    def to_dict(self) -> dict[str, JsonValue]:
        return {"median": self.median, "min": self.minimum, "max": self.maximum, "samples": list(self.samples)}

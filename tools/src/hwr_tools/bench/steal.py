"""Hypervisor steal during a timed run: read it from /proc/stat, decide whether the run was disturbed, re-run it.

On a virtual machine the host may take the vCPUs away mid-run; the guest sees that time as
`steal` in /proc/stat, and the run's wall time grows by it although our code did no more work.
A benchmark records the steal seen during each timed run and re-runs (a bounded number of times)
one that the host disturbed, so a ratio compares our code, not the neighbours' load.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

__all__ = [
    "DISTURBED_FRACTION",
    "EXTRA_ATTEMPTS",
    "QUIET_TICKS",
    "Attempts",
    "StealSample",
    "cpu_line",
    "online_cpus",
    "run_undisturbed",
    "steal_summary",
    "steal_ticks",
    "user_hz",
    "was_disturbed",
]

PROC_STAT = "/proc/stat"
DISTURBED_FRACTION = 0.05  # steal above this share of the run's CPU time (wall x CPUs) disturbs it
QUIET_TICKS = 2  # a quiet run sees 0 to 2 ticks: at or below this, tick rounding, never a disturbance
EXTRA_ATTEMPTS = 3  # a disturbed sample is run again at most this many times, then kept and flagged
_STEAL_FIELD = 8  # `cpu  user nice system idle iowait irq softirq steal ...`: the 8th value

_Result = TypeVar("_Result")


def cpu_line(path: str = PROC_STAT) -> str:
    """The aggregate `cpu` line of /proc/stat, as it is now (cheap enough to read around a timed run)."""
    with open(path) as stat:
        line = stat.readline()
    if not line.startswith("cpu "):
        raise ValueError(f"{path}: the first line is not the aggregate cpu line: {line!r}")
    return line


def steal_ticks(line: str) -> int:
    """The steal column of an aggregate `cpu` line of /proc/stat, in USER_HZ ticks since boot.

    A kernel without the column (before 2.6.11) reads as 0 steal."""
    fields = line.split()
    if not fields or fields[0] != "cpu":
        raise ValueError(f"not an aggregate cpu line of /proc/stat: {line!r}")
    if len(fields) <= _STEAL_FIELD:
        return 0
    return int(fields[_STEAL_FIELD])


def user_hz() -> int:
    """Ticks per second of /proc/stat's counters."""
    return int(os.sysconf("SC_CLK_TCK"))


def online_cpus() -> int:
    """CPUs the aggregate line sums over (steal is counted per CPU, then added)."""
    return os.cpu_count() or 1


@dataclass(frozen=True, slots=True)
class StealSample:
    """The steal seen during one timed run, with what it is judged against."""

    steal_ticks: int  # /proc/stat steal after the run minus before it
    wall_s: float  # the run's timed wall time
    cpus: int  # CPUs the steal column sums over
    hz: int = 100  # USER_HZ

    @classmethod
    def between(cls, before: str, after: str, wall_s: float) -> StealSample:
        """The sample of a run whose /proc/stat cpu lines were `before` and `after` it."""
        return cls(steal_ticks(after) - steal_ticks(before), wall_s, online_cpus(), user_hz())

    @property
    def steal_s(self) -> float:
        return self.steal_ticks / self.hz


def was_disturbed(sample: StealSample, *, fraction: float = DISTURBED_FRACTION, quiet_ticks: int = QUIET_TICKS) -> bool:
    """Whether the host took enough of the CPUs during the run to distort its time."""
    if sample.steal_ticks <= quiet_ticks:
        return False
    return sample.steal_s > fraction * sample.wall_s * sample.cpus


@dataclass(frozen=True, slots=True)
class Attempts:
    """How many times a sample was run and the steal each attempt saw; the last attempt is the one kept."""

    steal: tuple[StealSample, ...]

    @property
    def reruns(self) -> int:
        return len(self.steal) - 1

    @property
    def disturbed(self) -> bool:
        """The kept attempt was disturbed too (the attempts ran out)."""
        return was_disturbed(self.steal[-1])


def run_undisturbed(
    run: Callable[[], _Result], steal_of: Callable[[_Result], StealSample], *, extra_attempts: int = EXTRA_ATTEMPTS
) -> tuple[_Result, Attempts]:
    """Run once; while the host disturbed the run, run again (at most `extra_attempts` more times)."""
    seen: list[StealSample] = []
    while True:
        result = run()
        seen.append(steal_of(result))
        if not was_disturbed(seen[-1]) or len(seen) > extra_attempts:
            return result, Attempts(tuple(seen))


def steal_summary(attempts: list[Attempts]) -> str:
    """One report line: how many samples were re-run, how many stayed disturbed, the most steal any attempt saw."""
    if not attempts:
        return "steal: no timed runs"
    reruns = sum(item.reruns for item in attempts)
    rerun_samples = sum(1 for item in attempts if item.reruns)
    kept = sum(1 for item in attempts if item.disturbed)
    worst = max((sample for item in attempts for sample in item.steal), key=lambda sample: sample.steal_ticks)
    return (
        f"steal: {rerun_samples} of {len(attempts)} samples re-run ({reruns} extra runs), {kept} kept disturbed; "
        f"most steal in one run {worst.steal_ticks} ticks ({worst.steal_s * 1e3:.0f} ms of {worst.cpus} CPUs "
        f"over {worst.wall_s * 1e3:.0f} ms)"
    )

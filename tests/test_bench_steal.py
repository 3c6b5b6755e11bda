"""The benchmarks' steal guard: /proc/stat's steal column read right, a disturbed run told apart, re-run boundedly."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from hwr_tools.bench.steal import (
    EXTRA_ATTEMPTS,
    QUIET_TICKS,
    Attempts,
    StealSample,
    cpu_line,
    run_undisturbed,
    steal_summary,
    steal_ticks,
    was_disturbed,
)

_LINE = "cpu  7035489 7502 1138599 1825220 18431 0 13570 156101 0 0\n"


def test_steal_is_the_eighth_value_of_a_crafted_cpu_line() -> None:
    assert steal_ticks(_LINE) == 156101
    assert steal_ticks("cpu  1 2 3 4 5 6 7 8 9 10") == 8


def test_a_kernel_without_the_steal_column_reads_as_no_steal() -> None:
    assert steal_ticks("cpu  1 2 3 4 5 6 7") == 0


def test_a_per_cpu_or_other_line_is_refused() -> None:
    with pytest.raises(ValueError, match="aggregate cpu line"):
        steal_ticks("cpu0 1 2 3 4 5 6 7 8 9 10")
    with pytest.raises(ValueError, match="aggregate cpu line"):
        steal_ticks("")


def test_the_real_proc_stat_gives_the_same_steal_as_its_columns() -> None:
    line = cpu_line()
    with open("/proc/stat") as stat:
        first = stat.readline().split()
    assert first[0] == "cpu"
    assert steal_ticks(line) >= 0
    # steal only grows: the line read first is never ahead of the one read after it
    assert steal_ticks(line) <= int(first[8])
    assert len(line.split()) == len(first)


def test_a_file_that_does_not_start_with_the_cpu_line_is_refused(tmp_path: Path) -> None:
    fake = tmp_path / "stat"
    fake.write_text("intr 1 2 3\n" + _LINE)
    with pytest.raises(ValueError, match="not the aggregate cpu line"):
        cpu_line(str(fake))
    fake.write_text(_LINE + "cpu0 1 2 3 4 5 6 7 8\n")
    assert steal_ticks(cpu_line(str(fake))) == 156101


def test_a_sample_between_two_lines_counts_their_difference_over_this_machine() -> None:
    before = "cpu  1 0 0 0 0 0 0 100 0 0"
    after = "cpu  9 0 0 0 0 0 0 155 0 0"
    sample = StealSample.between(before, after, 0.856)
    assert sample.steal_ticks == 55
    assert sample.cpus == os.cpu_count()
    assert sample.hz == os.sysconf("SC_CLK_TCK")


def test_the_measured_disturbance_is_flagged_and_a_quiet_run_is_not() -> None:
    # 55 ticks (550 ms) over an 856 ms run of 2 vCPUs: a third of the CPU time taken by the host
    assert was_disturbed(StealSample(55, 0.856, 2))
    assert not was_disturbed(StealSample(2, 0.470, 2))
    assert not was_disturbed(StealSample(0, 0.470, 2))


def test_tick_rounding_on_a_short_run_is_not_a_disturbance() -> None:
    # 2 ticks over a 20 ms warm load would be 50 % of its CPU time, but that is the counter's granularity
    assert not was_disturbed(StealSample(QUIET_TICKS, 0.020, 2))
    assert was_disturbed(StealSample(QUIET_TICKS + 1, 0.020, 2))


def test_the_threshold_is_a_share_of_wall_time_times_cpus() -> None:
    # 10 ticks = 100 ms; 5 % of 1 s x 2 CPUs = 100 ms: at the line is not above it
    assert not was_disturbed(StealSample(10, 1.0, 2))
    assert was_disturbed(StealSample(11, 1.0, 2))
    assert not was_disturbed(StealSample(11, 1.0, 4))
    assert was_disturbed(StealSample(11, 1.0, 4), fraction=0.02)


def test_a_quiet_run_is_kept_at_once() -> None:
    calls: list[int] = []

    def run() -> int:
        calls.append(1)
        return len(calls)

    result, attempts = run_undisturbed(run, lambda _: StealSample(1, 0.5, 2))
    assert (result, attempts.reruns, attempts.disturbed) == (1, 0, False)


def test_a_disturbed_run_is_run_again_until_quiet() -> None:
    steal_per_attempt = [60, 40, 0]
    results = iter(range(10))
    result, attempts = run_undisturbed(
        lambda: next(results), lambda attempt: StealSample(steal_per_attempt[attempt], 0.5, 2)
    )
    assert result == 2
    assert attempts.reruns == 2
    assert not attempts.disturbed
    assert [sample.steal_ticks for sample in attempts.steal] == [60, 40, 0]


def test_attempts_are_bounded_and_the_last_is_kept_flagged() -> None:
    results = iter(range(100))
    result, attempts = run_undisturbed(lambda: next(results), lambda _: StealSample(90, 0.5, 2))
    assert result == EXTRA_ATTEMPTS
    assert attempts.reruns == EXTRA_ATTEMPTS
    assert attempts.disturbed


def test_the_summary_counts_reruns_and_names_the_worst_steal() -> None:
    quiet = Attempts((StealSample(0, 0.5, 2),))
    rerun = Attempts((StealSample(55, 0.856, 2), StealSample(1, 0.47, 2)))
    stuck = Attempts(tuple(StealSample(30, 0.5, 2) for _ in range(4)))
    line = steal_summary([quiet, rerun, stuck])
    assert "2 of 3 samples re-run (4 extra runs), 1 kept disturbed" in line
    assert "55 ticks (550 ms of 2 CPUs over 856 ms)" in line
    assert steal_summary([]) == "steal: no timed runs"


def test_hwr_bench_judges_a_kept_run_by_its_recorded_steal_and_time_to_ready() -> None:
    from hwr_tools.bench.measurements import _disturbed

    cpus, hz = os.cpu_count() or 1, os.sysconf("SC_CLK_TCK")
    # steal of a third of the run's CPU time, in this machine's ticks
    heavy = max(QUIET_TICKS + 1, round(0.856 * cpus * hz / 3))
    assert _disturbed({"steal_ticks": heavy, "time_to_ready_ms": 856.0})
    assert not _disturbed({"steal_ticks": QUIET_TICKS, "time_to_ready_ms": 856.0})
    assert not _disturbed({"time_to_ready_ms": 856.0})  # a worker of a tree that records no steal


def test_the_hwr_bench_report_counts_reruns_and_disturbed_runs_over_hot_and_cold() -> None:
    from hwr_tools.bench.report import _steal_line

    rows = {
        "canonical": {"hot": {"steal_ticks": [0, 1], "reruns": 0, "disturbed_runs": 0}},
        "stream": {
            "hot": {"steal_ticks": [2, 7], "reruns": 2, "disturbed_runs": 1},
            "cold": {"steal_ticks": [3], "reruns": 1, "disturbed_runs": 0},
        },
        "old": {"hot": {}},  # a report written before steal was recorded
    }
    assert _steal_line(rows) == (
        "Hypervisor steal (/proc/stat) during the timed runs: at most 7 ticks in a kept run; "
        "3 runs re-run because steal disturbed them, 1 kept still disturbed."
    )


def _heavy_ticks() -> int:
    """Steal of a third of an 856 ms run's CPU time, in this machine's ticks."""
    return max(QUIET_TICKS + 1, round(0.856 * (os.cpu_count() or 1) * os.sysconf("SC_CLK_TCK") / 3))


def test_hwr_bench_reruns_a_disturbed_solo_run_in_a_new_worker_until_quiet_and_bounded(tmp_path: Path) -> None:
    from hwr_tools.bench.measure import LoadKind, RowSpec
    from hwr_tools.bench.measurements import Measurements
    from hwr_tools.bench.options import BenchOptions
    from hwr_tools.bench.rows import BenchRow

    class Scripted(Measurements):
        """Measurements whose new-worker run (the seam) returns scripted steal instead of spawning a worker."""

        def __init__(self, steal: list[int]) -> None:
            with (tmp_path / "log").open("wb") as log:
                super().__init__(BenchOptions(), tmp_path, log, lambda _line: None)
            self.steal = steal

        def _run_again(self, row: BenchRow, cache: str) -> dict[str, object]:
            return {"time_to_ready_ms": 856.0, "steal_ticks": self.steal.pop(0), "attempt": "again"}

    row = BenchRow(RowSpec("stream", LoadKind.HWR, "p", "transformer", root="r"), "a row", ())
    first = {"time_to_ready_ms": 856.0, "steal_ticks": _heavy_ticks(), "attempt": "first"}
    quiet_second = Scripted([0, _heavy_ticks()])
    kept = quiet_second._while_disturbed(row, "hot", first)
    assert (kept["attempt"], kept["reruns"], kept["steal_ticks"]) == ("again", 1, 0)
    assert quiet_second.steal == [_heavy_ticks()]  # no run after the quiet one
    stuck = Scripted([_heavy_ticks()] * (EXTRA_ATTEMPTS + 2))
    kept = stuck._while_disturbed(row, "hot", first)
    assert kept["reruns"] == EXTRA_ATTEMPTS and len(stuck.steal) == 2
    quiet = Scripted([])
    assert quiet._while_disturbed(row, "hot", {**first, "steal_ticks": 0})["reruns"] == 0

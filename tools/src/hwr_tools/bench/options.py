"""What `hwr bench` measures and how often: the options of one run."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

__all__ = ["BenchOptions"]


@dataclass(frozen=True, slots=True)
class BenchOptions:
    """What to measure and how often; `quick` is a smaller model, the same rows."""

    size_gib: float = 1.0
    runs: int = 5
    workers: int = 4
    cold_starters: int = 8
    cold_cache: bool = True
    huge_pages: bool = True
    workdir: Path | None = None
    timeout_s: float = 600.0
    all_memory_groups: bool = True  # False: the 4-worker PSS groups only for canonical, warm and bare views
    cold_starter_runs: int | None = None  # None: `runs`
    memory_runs: int | None = None  # None: `runs`
    remote_runs: int | None = None  # remote import vs plain copy runs; None: `runs`
    remote_s3_row: bool = True  # False: node B's time to ready over file:// only (S3 throughput still measured)
    tensor_parallel_sizes: tuple[int, ...] = (2, 4)  # TP rows; () measures none
    tensor_parallel_runs: int = 3  # per TP size: bundle builds and groups of 2 replicas x N fresh ranks
    pipeline_rows: bool = True  # whole-pipeline rows (pipeline_rows.py), transformer of size_gib FP32
    preimported_workers: bool = False  # workers forked from a server that imported torch once (batch.py)

    def __post_init__(self) -> None:
        if not 0 < self.size_gib <= 64:
            raise ValueError(f"--size must be between 0 and 64 GiB of BF16 weights, got {self.size_gib}")
        if self.runs < 1:
            raise ValueError(f"--runs must be at least 1, got {self.runs}")
        if self.workers < 1 or self.cold_starters < 1:
            raise ValueError("--workers and --cold-starters must be at least 1")
        if self.tensor_parallel_runs < 1:
            raise ValueError(f"tensor_parallel_runs must be at least 1, got {self.tensor_parallel_runs}")
        if any(type(size) is not int or size < 2 for size in self.tensor_parallel_sizes):
            raise ValueError(f"--tp sizes must be integers of at least 2, got {list(self.tensor_parallel_sizes)}")

    @classmethod
    def quick(cls) -> BenchOptions:
        """About 4 minutes: 0.25 GiB, 3 runs per time, one run per memory group (goal rows only) and per TP
        group, hot cache."""
        return cls(
            size_gib=0.25,
            runs=3,
            cold_cache=False,
            all_memory_groups=False,
            cold_starter_runs=1,
            memory_runs=1,
            remote_runs=2,
            remote_s3_row=False,
            tensor_parallel_runs=1,
        )

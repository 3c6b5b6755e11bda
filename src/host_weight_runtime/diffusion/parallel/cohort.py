"""GROUP_COHORT: the ranks of a `torch.distributed` group decide together, with bounded waits.

Each step is one all-gather of a small status vector over the group, waited on with
`HWR_LOCK_TIMEOUT_S`; a peer that died (connection closed) or never arrives becomes a typed
failure on every surviving rank, never a hang. A rank's own failure is broadcast as its
status, so the others raise the same typed failure instead of waiting.
"""

from __future__ import annotations

import datetime
import enum
from dataclasses import dataclass
from typing import Any

import torch

from ...canonical_json import CanonicalJson
from ...failures import FailureCode, HostWeightError, HostWeightFailure, ResolutionStage

__all__ = ["CohortStatus", "RankReport", "TorchCohort"]

_CODES = tuple(FailureCode)


class CohortStatus(enum.IntEnum):
    """What one rank reports at a cohort step."""

    HIT = 0
    MISS = 1
    FAILED = 2


@dataclass(frozen=True, slots=True)
class RankReport:
    """One rank's status at a step, and its failure code when it failed."""

    rank: int
    status: CohortStatus
    code: FailureCode | None = None


def cohort_failure(message: str, code: FailureCode = FailureCode.LOCK_TIMEOUT, **details: Any) -> HostWeightError:
    return HostWeightError(
        HostWeightFailure(
            ResolutionStage.LOOKUP, code, code is FailureCode.LOCK_TIMEOUT, message, CanonicalJson.from_value(details)
        )
    )


class TorchCohort:
    """All-gathers of rank reports over a gloo (or any CPU-capable) process group, each with a deadline."""

    def __init__(self, group: Any, *, timeout_s: float) -> None:
        import torch.distributed as dist

        if not dist.is_initialized():
            raise ValueError("a group cohort needs torch.distributed.init_process_group() first")
        self._dist = dist
        self._group = group
        self._timeout = datetime.timedelta(seconds=timeout_s)
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)

    def _gather(self, step: str, mine: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's `mine` (same shape on all ranks); a dead or silent peer is a typed LOCK_TIMEOUT."""
        gathered = [torch.zeros_like(mine) for _ in range(self.size)]
        try:
            work = self._dist.all_gather(gathered, mine, group=self._group, async_op=True)
            if work is None or not work.wait(timeout=self._timeout):
                raise RuntimeError("timed out")
        except RuntimeError as exc:
            raise cohort_failure(
                f"the group cohort could not complete step {step!r} within {self._timeout.total_seconds():.0f} s "
                f"(a rank died or stopped answering: {exc}); restart the group",
                step=step,
            ) from exc
        return gathered

    def exchange(self, step: str, status: CohortStatus, code: FailureCode | None = None) -> tuple[RankReport, ...]:
        """Every rank's report for `step`; a dead or silent peer is a typed LOCK_TIMEOUT on this rank."""
        mine = torch.tensor([int(status), -1 if code is None else _CODES.index(code)], dtype=torch.int64)
        gathered = self._gather(step, mine)
        return tuple(
            RankReport(rank, CohortStatus(int(row[0])), None if int(row[1]) < 0 else _CODES[int(row[1])])
            for rank, row in enumerate(gathered)
        )

    def agree(self, step: str, key: str) -> None:
        """Every rank must name the same 64-hex-digit `key`; else every rank raises INVALID_CONFIGURATION.

        Runs before any rank reads or writes the store, so ranks built from different plans,
        checkpoints or representations fail together instead of combining their layouts.
        """
        mine = torch.tensor(
            [int.from_bytes(bytes.fromhex(key[start : start + 16]), "big", signed=True) for start in range(0, 64, 16)],
            dtype=torch.int64,
        )
        gathered = self._gather(step, mine)
        differing = [rank for rank, row in enumerate(gathered) if not torch.equal(row, mine)]
        if differing:
            raise cohort_failure(
                f"ranks {differing} of the group name another tensor-parallel layout at step {step!r} than rank "
                f"{self.rank} (a different plan or plan version, checkpoint, representation or TP size); every rank "
                "must load the same model with the same plan",
                code=FailureCode.INVALID_CONFIGURATION,
                step=step,
                differing_ranks=differing,
            )

    @staticmethod
    def group_failure(step: str, reports: tuple[RankReport, ...], hint: str = "") -> HostWeightError | None:
        """The lowest failing rank's code as every rank's failure (None when no rank failed)."""
        failed = [report for report in reports if report.status is CohortStatus.FAILED]
        if not failed:
            return None
        first = failed[0]
        code = first.code if first.code is not None else FailureCode.UNEXPECTED_STATUS
        return cohort_failure(
            f"rank {first.rank} of the group failed at step {step!r} ({code.value}){hint}; the whole group fails "
            "together",
            code=code,
            step=step,
            failed_ranks=[report.rank for report in failed],
        )

    @staticmethod
    def raise_if_any_failed(step: str, reports: tuple[RankReport, ...]) -> None:
        """The lowest failing rank's code, raised on every rank alike."""
        failure = TorchCohort.group_failure(step, reports)
        if failure is not None:
            raise failure

"""The report step: a loaded model with the reports that explain how it was loaded."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..failures import HostWeightFailure
from ..lease import HostWeightLease
from ..outcomes import PostLoadPublicationReport, ResolutionOutcome, ResolutionReport
from .background import BackgroundPublication
from .load_reports import ComponentLoadPath
from .model_family import ImportClock

__all__ = ["LoadStopwatch", "LoadedComponent"]


class LoadedComponent:
    """A loaded diffusers model with the reports that explain how it was loaded.

    `outcome` is always set: the runtime's answer, or, where the loader did not ask the runtime,
    CANONICAL_DIRECT (runtime DISABLED) or CANONICAL_FALLBACK with one attempt saying why (the
    lookup was skipped, or no identity could be built); then `resolution.identity_key` is "".
    `elapsed_s` is the load itself; `import_s` is what this call spent importing diffusers and the
    model's module (0 once they are imported), so the call took `import_s + elapsed_s`.
    On the ARTIFACT path the model's tensors are views of a lease; the model keeps that lease
    alive, and `close()` releases it once the model is no longer served.
    `domain_root` says where the runtime keeps artifacts (None when it is DISABLED).
    `tensor_parallel_plan` names the plan that split a TP rank's model (None without TP).
    """

    __slots__ = (
        "_lease",
        "background_publication",
        "domain_root",
        "elapsed_s",
        "identity_failure",
        "identity_key",
        "import_s",
        "load_path",
        "model",
        "publication",
        "resolution",
        "restore_failure",
        "tensor_parallel_plan",
    )

    def __init__(
        self,
        model: torch.nn.Module,
        load_path: ComponentLoadPath,
        *,
        elapsed_s: float,
        resolution: ResolutionReport,
        import_s: float = 0.0,
        domain_root: Path | None = None,
        identity_key: str | None = None,
        publication: PostLoadPublicationReport | None = None,
        identity_failure: HostWeightFailure | None = None,
        restore_failure: HostWeightFailure | None = None,
        lease: HostWeightLease | None = None,
        background_publication: BackgroundPublication | None = None,
        tensor_parallel_plan: str | None = None,
    ) -> None:
        self.model = model
        self.background_publication = background_publication
        self.load_path = load_path
        self.elapsed_s = elapsed_s
        self.import_s = import_s
        self.domain_root = domain_root
        self.identity_key = identity_key
        self.resolution = resolution
        self.publication = publication
        self.identity_failure = identity_failure
        self.restore_failure = restore_failure
        self._lease = lease
        self.tensor_parallel_plan = tensor_parallel_plan

    @property
    def outcome(self) -> ResolutionOutcome:
        return self.resolution.outcome

    @property
    def lease(self) -> HostWeightLease | None:
        return self._lease

    def close(self) -> None:
        """Release the lease (idempotent); the model must not be used for inference afterwards."""
        if self._lease is not None:
            self._lease.close()

    def __enter__(self) -> LoadedComponent:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def summary(self) -> dict[str, object]:
        """A JSON-friendly account of the load, for logs and `--json` output."""
        return {
            "load_path": self.load_path.value,
            "outcome": self.outcome.value,
            "identity_key": self.identity_key,
            "domain_root": None if self.domain_root is None else str(self.domain_root),
            "elapsed_s": self.elapsed_s,
            "import_s": self.import_s,
            "publication": None if self.publication is None else self.publication.status.value,
            "background_publication": None
            if self.background_publication is None
            else self.background_publication.state(),
            "identity_failure": None if self.identity_failure is None else self.identity_failure.to_dict(),
            "restore_failure": None if self.restore_failure is None else self.restore_failure.to_dict(),
            "tensor_parallel_plan": self.tensor_parallel_plan,
        }


@dataclass(frozen=True, slots=True)
class LoadStopwatch:
    """When a load began, what it spent importing, and where its runtime keeps artifacts: what every report needs."""

    started: float
    clock: ImportClock
    domain_root: Path | None

    def finish(
        self, model: torch.nn.Module, load_path: ComponentLoadPath, report: ResolutionReport, **reports: Any
    ) -> LoadedComponent:
        """The loaded component, timed now: import time is reported apart from the load itself."""
        return LoadedComponent(
            model,
            load_path,
            elapsed_s=time.monotonic() - self.started - self.clock.seconds,
            import_s=self.clock.seconds,
            domain_root=self.domain_root,
            resolution=report,
            **reports,
        )

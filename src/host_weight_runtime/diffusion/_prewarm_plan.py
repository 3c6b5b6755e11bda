"""A pipeline prewarm that would build nothing, or miss a requested variant, fails before it starts.

`hwr prewarm PIPELINE --variant fp16` on a pipeline without fp16 files used to build nothing and
exit 0; a DaemonSet that prewarms with it would then report a warm node that is not.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ..failures import FailureCode, usage_error

__all__ = ["check_something_to_prewarm"]


def check_something_to_prewarm(
    root: Path, variant: str | None, *, unbuilt: Sequence[tuple[str, str | None]], served: int
) -> None:
    """HostWeightUsageError (NOT_FOUND) naming each weighted component that will not be built, and why.

    `unbuilt`: (name, reason) of the weighted torch components the plan leaves to diffusers;
    `served`: how many components the plan builds.
    """
    reasons = "; ".join(f"{name}: {reason}" for name, reason in unbuilt)
    if variant is not None and unbuilt:
        raise usage_error(
            f"variant {variant!r} is missing for {len(unbuilt)} weighted component(s) of {root} ({reasons}); "
            "prewarm without --variant, or with the variant those folders hold",
            code=FailureCode.NOT_FOUND,
            argument="variant",
            components=[name for name, _reason in unbuilt],
        )
    if not served:
        why = reasons or "model_index.json names no weighted diffusers or transformers component"
        raise usage_error(
            f"prewarm of {root} would build nothing: {why}",
            code=FailureCode.NOT_FOUND,
            components=[name for name, _reason in unbuilt],
        )

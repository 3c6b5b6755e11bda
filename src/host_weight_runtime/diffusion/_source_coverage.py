"""Binding every DiT tensor to exactly one weight source by the longest matching prefix (D02)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from ..canonical_json import JsonValue
from ..failures import FailureCode, HostWeightError, ResolutionStage, raise_failure
from ._weight_source import MAX_LISTED, PreparedWeightSource


def _coverage_error(message: str, **details: JsonValue) -> HostWeightError:
    return raise_failure(
        ResolutionStage.CONFIGURATION, FailureCode.INVALID_CONFIGURATION, message, retryable=False, **details
    )


def bind_tensors_to_sources(
    tensor_names: Iterable[str], sources: Sequence[PreparedWeightSource]
) -> dict[str, tuple[int, str]]:
    """Map each DiT tensor to (source index, checkpoint key) by the longest matching prefix (D02)."""
    sources = tuple(sources)
    bindings: dict[str, tuple[int, str]] = {}
    uncovered: list[str] = []
    ties: list[str] = []
    for name in tensor_names:
        best_length = -1
        best: list[int] = []
        for index, source in enumerate(sources):
            length = len(source.prefix)
            if len(name) <= length or not name.startswith(source.prefix) or length < best_length:
                continue
            if length > best_length:
                best_length, best = length, []
            best.append(index)
        if not best:
            uncovered.append(name)
        elif len(best) > 1:
            ties.append(name)
        else:
            bindings[name] = (best[0], name[best_length:])
    prefixes = list[JsonValue]([source.prefix for source in sources])
    if ties:
        ties.sort()
        raise _coverage_error(
            f"{len(ties)} DiT tensor(s) match the same longest prefix in more than one weight source "
            f"(e.g. {ties[:MAX_LISTED]}); give every source a distinct prefix so each tensor has exactly one owner",
            ambiguous=list[JsonValue](ties[:MAX_LISTED]),
            ambiguous_count=len(ties),
            prefixes=prefixes,
        )
    if uncovered:
        uncovered.sort()
        raise _coverage_error(
            f"{len(uncovered)} DiT tensor(s) are not supplied by any weight source: {uncovered[:MAX_LISTED]}"
            f"{' ...' if len(uncovered) > MAX_LISTED else ''}; add a source whose prefix covers them "
            f"(source prefixes: {[source.prefix for source in sources]})",
            uncovered=list[JsonValue](uncovered[:MAX_LISTED]),
            uncovered_count=len(uncovered),
            prefixes=prefixes,
        )
    return bindings

"""A rank's lease over its two parts: resolved together, checked to be one build's bytes, restored as one layout.

`resolve_parts` resolves the shard part first (with a bundle producer, its build writes every
missing part in one pass), then the replicated part. Both present: each part's bundle record
must name the other's content digest (when it records one), else the rank is refused with a
typed MANIFEST_INCOMPATIBLE and neither part is used. The rank lease then lists both parts'
files and tensors under the rank's own identity, so the restorer checks the rank's whole
layout exactly as it checked a one-artifact rank, and the content digest equals that
artifact's. Closing it closes both part leases.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..._digest import content_digest
from ...canonical_json import CanonicalJson
from ...failures import FailureCode, HostWeightFailure, ResolutionStage, failure
from ...filesystem.bundle_record import bundle_outputs
from ...lease import HostWeightLease
from ...manifest import WeightManifest
from ...outcomes import HostWeightResolution, ResolutionOutcome
from ...protocols import WeightBundleProducer
from ...runtime import HostWeightRuntime
from .parts import RankParts

__all__ = ["PartsResolution", "check_one_build", "rank_lease", "resolve_parts"]


@dataclass(frozen=True, slots=True)
class PartsResolution:
    """Both parts' resolutions; the rank lease when both were found and belong together, else why not."""

    shard: HostWeightResolution
    replicated: HostWeightResolution
    lease: HostWeightLease | None
    failure: HostWeightFailure | None

    @property
    def failed(self) -> bool:
        return self.failure is not None

    @property
    def missing_parts(self) -> tuple[str, ...]:
        """'replicated' and/or 'shard': the parts that were neither found nor built."""
        found = (("replicated", self.replicated), ("shard", self.shard))
        return tuple(name for name, resolution in found if resolution.lease is None)


def check_one_build(parts: RankParts, replicated: HostWeightLease, shard: HostWeightLease) -> HostWeightFailure | None:
    """None when the two parts can serve the rank together; a typed refusal when they hold two builds' bytes."""
    one, other = replicated.manifest, shard.manifest
    for this, that in ((one, other), (other, one)):
        recorded = bundle_outputs(this).get(that.identity_key)
        if recorded is not None and recorded != that.content_digest:
            return _mismatch(parts, f"{this.identity_key} was built beside content {recorded}, but "
                             f"{that.identity_key} now holds {that.content_digest}")
    if (one.digest_algorithm, one.digest_chunk_bytes, one.restorer_schema, one.producer_schema) != (
        other.digest_algorithm,
        other.digest_chunk_bytes,
        other.restorer_schema,
        other.producer_schema,
    ):
        return _mismatch(parts, "the parts were written by producers of different schemas or digest formats")
    return None


def _mismatch(parts: RankParts, why: str) -> HostWeightFailure:
    return failure(
        ResolutionStage.LOOKUP,
        FailureCode.MANIFEST_INCOMPATIBLE,
        f"rank {parts.rank_index}'s replicated and shard parts are not one build's bytes ({why}); a rank is "
        "never restored from two builds: remove both parts (hwr cleanup KEY) so that they are built again",
        replicated=parts.replicated.identity.key,
        shard=parts.shard.identity.key,
    )


class _BothParts:
    """The rank lease's lock: releasing it closes the shard's and the replicated part's leases."""

    __slots__ = ("_leases",)

    def __init__(self, shard: HostWeightLease, replicated: HostWeightLease) -> None:
        self._leases = (shard, replicated)

    def release(self) -> None:
        try:
            self._leases[0].close()
        finally:
            self._leases[1].close()


def rank_lease(parts: RankParts, replicated: HostWeightLease, shard: HostWeightLease) -> HostWeightLease:
    """One lease for the rank's whole layout over its two part leases (which it then owns)."""
    one, other = replicated.manifest, shard.manifest
    tensors = one.tensors + other.tensors
    manifest = WeightManifest(
        identity=parts.rank.identity,
        producer_schema=other.producer_schema,
        restorer_schema=other.restorer_schema,
        digest_algorithm=other.digest_algorithm,
        digest_chunk_bytes=other.digest_chunk_bytes,
        files=one.files + other.files,
        tensors=tensors,
        content_digest=content_digest((t.name, t.dtype, t.shape, t.digest) for t in tensors),
        format_metadata=CanonicalJson.from_value(
            {"parts": {"replicated": one.identity_key, "shard": other.identity_key}}
        ),
    )
    return HostWeightLease(
        identity=parts.rank.identity,
        manifest=manifest,
        tensors={**replicated.tensors, **shard.tensors},
        regions=replicated.mapped_regions + shard.mapped_regions,
        provenance=replace(shard.provenance, publication_id=f"{replicated.publication_id}+{shard.publication_id}"),
        mappings=(),
        lock=_BothParts(shard, replicated),
    )


def resolve_parts(
    runtime: HostWeightRuntime, parts: RankParts, producer: WeightBundleProducer | None = None
) -> PartsResolution:
    """The shard part, then the replicated part, through `runtime`; see the module docstring."""
    shard = runtime.resolve(parts.shard.identity, producer)
    replicated = runtime.resolve(parts.replicated.identity, producer)
    if shard.lease is not None and replicated.lease is not None:
        problem = check_one_build(parts, replicated.lease, shard.lease)
        if problem is None:
            return PartsResolution(shard, replicated, rank_lease(parts, replicated.lease, shard.lease), None)
    else:
        reports = (shard.report, replicated.report)
        problem = next((report.failure for report in reports if report.outcome is ResolutionOutcome.FAILED), None)
    for resolution in (shard, replicated):
        if resolution.lease is not None:
            resolution.lease.close()
    return PartsResolution(shard, replicated, None, problem)

"""The bundle record: what an ARTIFACT_BUNDLE build writes into each output's manifest about its siblings.

`format_metadata["bundle_outputs"]` maps the key of every output of the bundle pass (built by
that pass or found already published) to that output's content digest. Two artifacts built
to be used together can then prove they hold the bytes of one build: each records the
other's content digest, and a reader compares it with the other's manifest.
"""

from __future__ import annotations

from collections.abc import Mapping

from ..canonical_json import CanonicalJson, JsonValue
from ..manifest import WeightManifest

__all__ = ["BUNDLE_OUTPUTS_FIELD", "bundle_outputs", "with_bundle_outputs"]

BUNDLE_OUTPUTS_FIELD = "bundle_outputs"


def bundle_outputs(manifest: WeightManifest) -> Mapping[str, str]:
    """Key -> content digest of every output of the bundle pass that wrote `manifest` (empty if none)."""
    value = manifest.format_metadata.to_value()
    record = value.get(BUNDLE_OUTPUTS_FIELD) if isinstance(value, dict) else None
    if not isinstance(record, dict):
        return {}
    return {key: digest for key, digest in record.items() if isinstance(digest, str)}


def with_bundle_outputs(format_metadata: CanonicalJson, outputs: Mapping[str, str]) -> CanonicalJson:
    """The producer's format metadata plus the bundle record; metadata that is not a JSON object is kept inside."""
    value = format_metadata.to_value()
    base: dict[str, JsonValue] = dict(value) if isinstance(value, dict) else {"producer": value}
    base[BUNDLE_OUTPUTS_FIELD] = dict(sorted(outputs.items()))
    return CanonicalJson.from_value(base)

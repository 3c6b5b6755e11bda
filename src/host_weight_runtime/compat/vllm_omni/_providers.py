"""The reference's remote providers: fsspec URLs are this runtime's remotes; any other id is modeled only.

vLLM-Omni 0.30.0 names providers by id and reports every remote as UNSUPPORTED. Here a provider that
is a URL (`scheme://...`) is a real remote; one that is not (such as "mooncake") has no translation,
so it keeps the reference's meaning: tried after a local miss, it fails UNSUPPORTED (fatal in every
mode, before any local build), exactly as the reference reports it.
"""

from __future__ import annotations

from ...failures import FailureCode, HostWeightError, ResolutionStage, failure
from ...identity import WeightArtifactIdentity
from ...protocols import ArtifactWriter, ProductionMetadata, RemoteArtifactDescriptor, RemoteArtifactProvider
from .config import HostWeightRuntimeConfig, RemoteOnMiss, is_url

__all__ = ["ModeledProvider", "remote_providers"]


class ModeledProvider:
    """A provider id with no implementation here: probing it is a typed UNSUPPORTED failure."""

    def __init__(self, provider_id: str) -> None:
        self._provider_id = provider_id

    @property
    def provider_id(self) -> str:
        return self._provider_id

    def _unsupported(self) -> HostWeightError:
        message = (
            f"remote provider {self._provider_id!r} is a provider id, not a URL: this runtime imports "
            "from fsspec URLs (s3://, gs://, file://, ...); give one in RemoteImportPolicy.providers"
        )
        return HostWeightError(failure(ResolutionStage.REMOTE, FailureCode.UNSUPPORTED, message))

    def probe(self, identity: WeightArtifactIdentity) -> RemoteArtifactDescriptor | None:
        raise self._unsupported()

    def fetch(self, descriptor: RemoteArtifactDescriptor, writer: ArtifactWriter) -> ProductionMetadata:
        raise self._unsupported()


def remote_providers(config: HostWeightRuntimeConfig) -> tuple[RemoteArtifactProvider, ...]:
    """The providers to hand this runtime, in order; () when all are URLs (its configuration carries those)."""
    providers = config.remote.providers
    if config.remote.on_local_miss is RemoteOnMiss.DISABLED or all(map(is_url, providers)):
        return ()
    made: list[RemoteArtifactProvider] = []
    for provider in providers:
        if is_url(provider):
            from ...remote import providers_from_urls  # fsspec only when a URL is configured

            made.extend(providers_from_urls((provider,)))
        else:
            made.append(ModeledProvider(provider))
    return tuple(made)

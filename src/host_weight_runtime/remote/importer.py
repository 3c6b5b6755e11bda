"""Import one remote artifact as an ordinary local build: the runtime's REMOTE stage calls this.

`import_remote_artifact` probes a provider; when the remote offers the exact identity
it hands the store a producer whose `produce` is the provider's `fetch`, so the import
runs in tmp/ under the key's build lock, other processes join it, and publication is
the store's atomic rename. After the build, the published manifest must hash to the
descriptor's `manifest_sha256` and carry its `content_sha256`; otherwise the copy is
removed through the store's public `cleanup` before the failure is returned.
"""

from __future__ import annotations

import time

from ..failures import (
    FailureCode,
    HostWeightError,
    HostWeightFailure,
    HostWeightUsageError,
    ResolutionStage,
    failure,
)
from ..filesystem.store import FilesystemHostWeightStore
from ..identity import WeightArtifactIdentity
from ..lease import LeaseSource
from ..manifest import manifest_sha256
from ..outcomes import CleanupStatus, StoreResult, StoreStatus
from ..protocols import (
    ArtifactWriter,
    BuildRequest,
    CoordinationScope,
    HostWeightStore,
    LookupPhase,
    ProductionMetadata,
    ProductionSourceMode,
    RemoteArtifactDescriptor,
    RemoteArtifactProvider,
    WeightProductionSpec,
)
from ..tensors import ValidationLevel

__all__ = ["RemoteImportProducer", "import_remote_artifact", "verify_imported"]


class RemoteImportProducer:
    """A `WeightProducer` whose production is one provider fetch of one descriptor."""

    __slots__ = ("_descriptor", "_provider", "_spec", "fetches")

    def __init__(self, provider: RemoteArtifactProvider, descriptor: RemoteArtifactDescriptor) -> None:
        self._provider = provider
        self._descriptor = descriptor
        self._spec = WeightProductionSpec(
            producer_id=f"remote-import:{provider.provider_id}",
            outputs=(descriptor.identity,),
            source_mode=ProductionSourceMode.CHECKPOINT_STREAM,
            lookup_phase=LookupPhase.PRE_LOAD_SAFE,
            coordination_scope=CoordinationScope.SINGLE_PROCESS,
        )
        self.fetches = 0

    @property
    def spec(self) -> WeightProductionSpec:
        return self._spec

    @property
    def descriptor(self) -> RemoteArtifactDescriptor:
        return self._descriptor

    def produce(self, writer: ArtifactWriter) -> ProductionMetadata:
        self.fetches += 1
        return self._provider.fetch(self._descriptor, writer)


def _remote_stage(problem: HostWeightFailure) -> HostWeightFailure:
    """Failures of an import belong to the REMOTE stage; a writer misuse there means the remote is unusable."""
    if problem.code is FailureCode.PRODUCER_FAILED:
        return HostWeightFailure(
            ResolutionStage.REMOTE,
            FailureCode.REMOTE_FAILED,
            False,
            f"the remote artifact does not fit this store's writer: {problem.message}",
            problem.details,
        )
    return problem.with_stage(ResolutionStage.REMOTE)


def _failed(identity: WeightArtifactIdentity, problem: HostWeightFailure, started: float) -> StoreResult:
    return StoreResult(StoreStatus.FAILED, identity, failure=problem, elapsed_s=time.monotonic() - started)


def import_remote_artifact(
    store: HostWeightStore,
    identity: WeightArtifactIdentity,
    provider: RemoteArtifactProvider,
    *,
    validation: ValidationLevel,
    deadline: float,
) -> StoreResult | None:
    """None when the remote does not offer `identity`; else the store's result of importing it.

    BUILT: this process fetched and published it (on the filesystem store its lease's
    provenance is `LeaseSource.REMOTE_IMPORT`). JOINED: another process on this node
    was importing (or building) it and this one waited. HIT: it was published locally
    meanwhile. FAILED: a typed failure at the REMOTE stage; nothing partial is visible.
    """
    started = time.monotonic()
    try:
        descriptor = provider.probe(identity)
    except HostWeightUsageError as exc:  # a mistyped URL or a missing bucket: this remote is unusable, not fatal
        refused = exc.failure
        return _failed(
            identity,
            HostWeightFailure(
                ResolutionStage.REMOTE, FailureCode.REMOTE_FAILED, False, refused.message, refused.details
            ),
            started,
        )
    except HostWeightError as exc:
        return _failed(identity, _remote_stage(exc.failure), started)
    except Exception as exc:  # a provider outside this package that raised untyped
        return _failed(
            identity,
            failure(
                ResolutionStage.REMOTE,
                FailureCode.REMOTE_FAILED,
                f"provider {provider.provider_id} failed to probe with {type(exc).__name__}; retry",
                retryable=True,
                provider_id=str(provider.provider_id),
                exception=type(exc).__name__,
            ),
            started,
        )
    if descriptor is None:
        return None
    if descriptor.identity != identity:
        return _failed(
            identity,
            failure(
                ResolutionStage.REMOTE,
                FailureCode.REMOTE_FAILED,
                f"provider {provider.provider_id} offered another identity than the one requested; ignoring it",
                provider_id=str(provider.provider_id),
            ),
            started,
        )
    producer = RemoteImportProducer(provider, descriptor)
    request = BuildRequest(identity)
    if isinstance(store, FilesystemHostWeightStore):
        result = store.get_or_build(
            request, producer, validation=validation, deadline=deadline, lease_source=LeaseSource.REMOTE_IMPORT
        )
    else:  # the protocol's get_or_build knows no provenance; the lease says BUILT
        result = store.get_or_build(request, producer, validation=validation, deadline=deadline)
    if result.status is StoreStatus.BUILT:
        problem = verify_imported(store, result, descriptor)
        if problem is not None:
            return _failed(identity, problem, started)
    if result.failure is not None and result.lease is None:
        return _failed(identity, _remote_stage(result.failure), started)
    return result


def verify_imported(
    store: HostWeightStore, result: StoreResult, descriptor: RemoteArtifactDescriptor
) -> HostWeightFailure | None:
    """Check a just-imported artifact against its descriptor; on a mismatch close the lease and remove the copy.

    The provider already compared every tensor and file digest before publication, so
    this only fails if the store composed a manifest the remote did not have. Removal
    goes through `FilesystemHostWeightStore.cleanup`, which refuses (and this reports)
    when another process already holds a lease on the copy.
    """
    lease = result.lease
    if lease is None:
        return None
    manifest = lease.manifest
    if (
        manifest.identity == descriptor.identity
        and manifest.content_digest == descriptor.content_sha256
        and manifest_sha256(manifest.to_bytes()) == descriptor.manifest_sha256
    ):
        return None
    key = descriptor.identity.key
    lease.close()
    local_copy = "kept: the store offers no cleanup"
    if isinstance(store, FilesystemHostWeightStore):
        cleanup = store.cleanup(key)
        local_copy = "removed" if cleanup.status is CleanupStatus.REMOVED else f"kept: {cleanup.status.value}"
    return failure(
        ResolutionStage.REMOTE,
        FailureCode.REMOTE_FAILED,
        f"the artifact imported from {descriptor.provider_id} does not match its descriptor's digests (local copy "
        f"{local_copy}); push it again from a verified node",
        provider_id=descriptor.provider_id,
        key=key,
        local_copy=local_copy,
    )

"""Maintenance of a domain: removing one key's files (cleanup) and reporting what the domain holds (inspection).

Neither denies nor quarantines anything; cleanup never waits for a lock.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable, Iterable

from ..canonical_json import JsonValue
from ..failures import FailureCode, HostWeightError, ResolutionStage, failure
from ..identity import WeightArtifactIdentity
from ..manifest import WeightManifest
from ..outcomes import CleanupResult, CleanupStatus
from ..tensors import ValidationLevel
from ._deny import DenyMarkers
from ._fsutil import failure_from_os_error, fsync_dir, list_names, remove_tree, tree_bytes
from ._layout import EVICTING_PREFIX, DomainLayout, check_key, is_key
from ._lookup import artifact_lock
from ._publication import PRIVATE_DIR_MODE
from ._usage import LockTable, inode_id, last_used_ns
from .capacity import CapacityGuard
from .domain import DomainInfo
from .inspection import ArtifactInspection, ArtifactState, DomainInspection, DomainUsage, LockActivity
from .locks import UnsafeLockFileError, lock_in_use, try_lock
from .reader import ArtifactReadError, InvalidArtifactError, open_artifact

__all__ = ["DomainMaintenance"]


class DomainMaintenance:
    """Cleanup and inspection of one domain, for `hwr cleanup` / `hwr inspect` and the store's API."""

    __slots__ = ("_capacity", "_deny", "_domain", "_hash_threads", "_layout")

    def __init__(
        self,
        domain: DomainInfo,
        layout: DomainLayout,
        capacity: CapacityGuard,
        deny: DenyMarkers,
        hash_threads: int | None,
    ) -> None:
        self._domain = domain
        self._layout = layout
        self._capacity = capacity
        self._deny = deny
        self._hash_threads = hash_threads

    # ------------------------------------------------------------------ cleanup

    def cleanup(self, key: str, *, dry_run: bool = False) -> CleanupResult:
        """Remove one key's artifact, deny marker, temporaries and quarantined copies; never waits for a lock.

        With `dry_run` nothing is removed and the result (status PLANNED) lists what would be.
        """
        check_key(key)
        try:
            return self._cleanup_unlocked(key, dry_run=dry_run)
        except UnsafeLockFileError as exc:
            return CleanupResult(
                key,
                CleanupStatus.FAILED,
                failure=failure(ResolutionStage.CLEANUP, FailureCode.UNSAFE_PERMISSIONS, str(exc), retryable=False),
            )

    def _cleanup_unlocked(self, key: str, *, dry_run: bool) -> CleanupResult:
        """Cleanup under the key's build and artifact locks, each taken without waiting."""
        build_lock = try_lock(self._layout.build_lock(key), exclusive=True)
        if build_lock is None:
            return CleanupResult(
                key,
                CleanupStatus.ACTIVE_BUILD,
                failure=failure(
                    ResolutionStage.CLEANUP,
                    FailureCode.ACTIVE_BUILD,
                    "a build of this artifact is in progress; nothing was removed, try again after it finishes",
                    retryable=True,
                ),
            )
        try:
            artifact_lock_held = try_lock(self._layout.artifact_lock(key), exclusive=True)
            if artifact_lock_held is None:
                return CleanupResult(
                    key,
                    CleanupStatus.ACTIVE_LEASE,
                    failure=failure(
                        ResolutionStage.CLEANUP,
                        FailureCode.ACTIVE_LEASE,
                        "a live lease holds this artifact; nothing was removed, close the workers using it first",
                        retryable=True,
                    ),
                )
            try:
                return self._cleanup_locked(key, dry_run=dry_run)
            finally:
                artifact_lock_held.release()
        finally:
            build_lock.release()

    def _cleanup_locked(self, key: str, *, dry_run: bool) -> CleanupResult:
        targets = [
            path
            for path in (
                self._layout.artifact_dir(key),
                self._layout.deny_marker(key),
                *self._layout.staging_dirs(key),
                *self._layout.quarantined_dirs(key),
            )
            if os.path.lexists(path)
        ]
        if not targets:
            return CleanupResult(key, CleanupStatus.NOT_PRESENT)
        size = sum(
            tree_bytes(path) if path.is_dir() and not path.is_symlink() else path.lstat().st_size for path in targets
        )
        if dry_run:
            return CleanupResult(key, CleanupStatus.PLANNED, size, tuple(str(path) for path in targets), dry_run=True)
        try:
            artifact_dir = self._layout.artifact_dir(key)
            if os.path.lexists(artifact_dir):
                # Disappear atomically first, then delete at leisure.
                doomed = self._layout.tmp / f"{key}.removing.{uuid.uuid4().hex[:12]}"
                if not artifact_dir.is_symlink():  # a planted link goes as it is; its target is never touched
                    os.chmod(artifact_dir, PRIVATE_DIR_MODE)
                os.rename(artifact_dir, doomed)
                fsync_dir(self._layout.artifacts)
                remove_tree(doomed)
            for path in targets:
                if path == artifact_dir:
                    continue
                remove_tree(path)
        except OSError as exc:
            return CleanupResult(
                key,
                CleanupStatus.FAILED,
                failure=failure_from_os_error(exc, stage=ResolutionStage.CLEANUP, what="removing the artifact"),
            )
        return CleanupResult(key, CleanupStatus.REMOVED, size, tuple(str(path) for path in targets))

    # ------------------------------------------------------------------ inspection

    def _lock_activity(self, key: str) -> LockActivity:
        return LockActivity(
            build_active=lock_in_use(self._layout.build_lock(key)),
            lease_active=lock_in_use(self._layout.artifact_lock(key)),
        )

    def inspect_artifact(
        self,
        key: str | WeightArtifactIdentity,
        *,
        validation: ValidationLevel = ValidationLevel.MANIFEST_AND_METADATA,
        deadline: float | None = None,
        progress: Callable[[int], None] | None = None,
        lock_table: LockTable | None = None,
    ) -> ArtifactInspection:
        """Validate one artifact read-only; reports problems but never denies or quarantines."""
        identity = key if isinstance(key, WeightArtifactIdentity) else None
        key = check_key(key.key if isinstance(key, WeightArtifactIdentity) else key)
        artifact_dir = self._layout.artifact_dir(key)
        activity = self._lock_activity(key)
        # Counted before our own shared lock below, which is not a lease.
        leases = (lock_table or LockTable.read()).live_leases(self._layout.artifact_lock(key))
        used = last_used_ns(self._layout, key)
        if not os.path.lexists(artifact_dir):
            staging = self._layout.staging_dirs(key)
            if staging:
                return ArtifactInspection(
                    key, ArtifactState.TEMPORARY, str(staging[0]), sum(tree_bytes(p) for p in staging), activity
                )
            return ArtifactInspection(key, ArtifactState.MISSING, str(artifact_dir), 0, activity)
        size = tree_bytes(artifact_dir)
        try:
            lock = artifact_lock(
                self._layout,
                key,
                exclusive=False,
                deadline=deadline,
                stage=ResolutionStage.LOOKUP,
                what="the artifact lock",
            )
        except HostWeightError as exc:
            return ArtifactInspection(
                key,
                ArtifactState.UNVERIFIED,
                str(artifact_dir),
                size,
                activity,
                problem=exc.failure,
                last_used_ns=used,
                live_leases=leases,
            )
        try:
            validated = open_artifact(
                artifact_dir,
                key,
                identity=identity,
                validation=validation,
                hash_threads=self._hash_threads,
                progress=progress,
            )
        except (InvalidArtifactError, ArtifactReadError) as exc:
            state = ArtifactState.DENIED if self._deny.present(key) else ArtifactState.INVALID
            return ArtifactInspection(
                key,
                state,
                str(artifact_dir),
                size,
                activity,
                problem=exc.failure,
                last_used_ns=used,
                live_leases=leases,
            )
        finally:
            lock.release()
        manifest = validated.manifest
        denied = self._deny.present(key)
        sources = _built_from_sources(manifest)
        return ArtifactInspection(
            key,
            ArtifactState.DENIED if denied else ArtifactState.READY,
            str(artifact_dir),
            size,
            activity,
            publication_id=validated.marker.publication_id,
            model_id=_display_model_id(manifest),
            tensor_count=len(manifest.tensors),
            problem=self._deny.failure(key) if denied else None,
            last_used_ns=used,
            live_leases=leases,
            component=_component(manifest, sources),
            revision=_joined(source.get("revision") for source in sources),
            dtype=manifest.identity.representation.dtype.removeprefix("torch."),
            tensor_bytes=sum(end - begin for begin, end in (entry.data_offsets for entry in manifest.tensors)),
            created_at_ns=validated.marker.published_at_ns,
            source_paths=tuple(path for path in (source.get("path") for source in sources) if isinstance(path, str)),
        )

    def inspect_domain(self) -> DomainInspection:
        """Inventory of ready, denied, quarantined and temporary artifacts, with capacity."""
        entries: list[ArtifactInspection] = []
        lock_table = LockTable.read()
        for name in sorted(list_names(self._layout.artifacts)):
            try:
                entries.append(self.inspect_artifact(name, deadline=time.monotonic() + 5.0, lock_table=lock_table))
            except ValueError:
                entries.append(
                    ArtifactInspection(
                        name, ArtifactState.INVALID, str(self._layout.artifacts / name), 0, LockActivity(False, False)
                    )
                )
        for name in sorted(list_names(self._layout.deny)):
            key = name.removesuffix(".json")
            if not name.endswith(".json") or not is_key(key):
                continue  # a crashed atomic write's temporary, not a marker
            if not os.path.lexists(self._layout.artifacts / key):
                entries.append(
                    ArtifactInspection(
                        key, ArtifactState.DENIED, str(self._layout.deny / name), 0, LockActivity(False, False)
                    )
                )
        for name in sorted(list_names(self._layout.quarantine)):
            path = self._layout.quarantine / name
            entries.append(
                ArtifactInspection(
                    name.split(".", 1)[0],
                    ArtifactState.QUARANTINED,
                    str(path),
                    tree_bytes(path),
                    LockActivity(False, False),
                )
            )
        for name in sorted(list_names(self._layout.tmp)):
            path = self._layout.tmp / name
            if name.startswith(EVICTING_PREFIX):
                entries.append(
                    ArtifactInspection(
                        name[len(EVICTING_PREFIX) :].split(".", 1)[0],
                        ArtifactState.EVICTING,
                        str(path),
                        tree_bytes(path),
                        LockActivity(False, False),
                    )
                )
                continue
            key = name.split(".", 1)[0]
            if os.path.lexists(self._layout.artifacts / key):
                continue
            entries.append(
                ArtifactInspection(
                    key,
                    ArtifactState.TEMPORARY,
                    str(path),
                    tree_bytes(path),
                    self._lock_activity(key) if is_key(key) else LockActivity(False, False),
                )
            )
        return DomainInspection(
            root=str(self._domain.root),
            domain_id=self._domain.domain_id,
            scope=self._domain.scope.value,
            storage_class=self._domain.storage_class.value,
            fs_type=self._domain.fs_type,
            huge_pages=self._domain.huge_pages,
            mount_point=self._domain.mount_point,
            capacity=self._capacity.snapshot(),
            artifacts=tuple(entries),
        )

    def usage(self) -> DomainUsage:
        """A cheap summary: counts from one directory listing and one read of the kernel's lock table."""
        lock_table = LockTable.read()
        artifacts = leased = leases = 0
        for name in list_names(self._layout.artifacts):
            if not is_key(name):
                continue
            artifacts += 1
            holders = lock_table.holders.get(inode_id(self._layout.artifact_lock(name)), 0)
            leased += holders > 0
            leases += holders
        snapshot = self._capacity.snapshot()
        return DomainUsage(
            storage_class=self._domain.storage_class.value,
            artifacts=artifacts,
            leased_artifacts=leased,
            live_leases=leases,
            store_bytes=snapshot.store_bytes,
            free_bytes=snapshot.free_bytes,
            total_bytes=snapshot.total_bytes,
            max_store_bytes=snapshot.policy.max_store_bytes,
            min_free_bytes=snapshot.policy.min_free_bytes,
        )


def _display_model_id(manifest: WeightManifest) -> str:
    """The model the artifact was built from: `format_metadata.built_from.model_id` when the producer
    recorded one (a content-keyed identity holds no repo id or path), else the identity's model_id."""
    metadata = manifest.format_metadata.to_value()
    built_from = metadata.get("built_from") if isinstance(metadata, dict) else None
    model_id = built_from.get("model_id") if isinstance(built_from, dict) else None
    return model_id if isinstance(model_id, str) and model_id else manifest.identity.source.model_id


def _built_from_sources(manifest: WeightManifest) -> list[dict[str, JsonValue]]:
    """The `format_metadata.built_from.sources` records (where the checkpoint was read), or none."""
    metadata = manifest.format_metadata.to_value()
    built_from = metadata.get("built_from") if isinstance(metadata, dict) else None
    sources = built_from.get("sources") if isinstance(built_from, dict) else None
    return [source for source in sources if isinstance(source, dict)] if isinstance(sources, list) else []


def _joined(values: Iterable[JsonValue]) -> str | None:
    """Distinct non-empty strings in first-seen order, joined by '+' (an artifact built from several sources)."""
    seen = dict.fromkeys(value for value in values if isinstance(value, str) and value)
    return "+".join(seen) or None


def _component(manifest: WeightManifest, sources: list[dict[str, JsonValue]]) -> str:
    """The component folder(s) the artifact holds (`transformer`), else the producer's component names."""
    subfolders = _joined(source.get("subfolder") for source in sources)
    if subfolders is not None:
        return subfolders
    component = manifest.identity.component
    metadata = component.metadata.to_value()
    dits = metadata.get("dits") if isinstance(metadata, dict) else None
    names = _joined(dit.get("name") for dit in dits if isinstance(dit, dict)) if isinstance(dits, list) else None
    return names or component.name

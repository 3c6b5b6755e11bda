"""vLLM-Omni's nested runtime policy, translated into this runtime's flat configuration."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from pathlib import Path

from ... import config as native
from ...config import RuntimeMode, StorageClass
from ...tensors import ValidationLevel as NativeValidationLevel

__all__ = [
    "CapacityPolicy",
    "HostWeightRuntimeConfig",
    "IntegrityPolicy",
    "ProductionPolicy",
    "RemoteImportPolicy",
    "RemoteOnMiss",
    "RuntimeMode",
    "StorageClass",
    "StorageDomainPolicy",
    "StorageScope",
    "ValidationLevel",
    "WaitPolicy",
    "is_url",
    "native_config",
]


class StorageScope(str, enum.Enum):
    """Who shares a domain: the node (the only scope this runtime serves) or one NUMA node."""

    NODE = "node"
    NUMA = "numa"


class ValidationLevel(str, enum.Enum):
    """The reference's levels; equal by value to this runtime's (FS_VERITY is refused as unsupported)."""

    MANIFEST_AND_METADATA = "manifest_and_metadata"
    FULL_CHECKSUM = "full_checksum"
    FS_VERITY = "fs_verity"


class RemoteOnMiss(str, enum.Enum):
    DISABLED = "disabled"
    TRY = "try"
    REQUIRE = "require"


def _is_bool(*values: object) -> bool:
    return all(isinstance(value, bool) for value in values)


@dataclass(frozen=True)
class StorageDomainPolicy:
    """Where the domain lives; `domain_id` is a label (this runtime's domain id is the one in domain.json)."""

    root: Path
    scope: StorageScope = StorageScope.NODE
    domain_id: str = "node"
    storage_class: StorageClass = StorageClass.DISK
    numa_prefault: bool = False
    verify_numa_residency: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.root, Path) or not str(self.root):
            raise ValueError("host weight store root must not be empty")
        if not isinstance(self.scope, StorageScope) or not isinstance(self.storage_class, StorageClass):
            raise ValueError("storage scope and class must use their typed enum values")
        if not isinstance(self.domain_id, str) or not self.domain_id:
            raise ValueError("host weight store domain_id must not be empty")
        if not _is_bool(self.numa_prefault, self.verify_numa_residency):
            raise ValueError("NUMA placement options must be booleans")
        if self.scope is StorageScope.NODE and (self.numa_prefault or self.verify_numa_residency):
            raise ValueError("NUMA placement options require scope='numa'")


@dataclass(frozen=True)
class CapacityPolicy:
    """Byte limits; `eviction="none"` as in the reference (this runtime also offers LRU natively)."""

    max_artifact_bytes: int | None = None
    max_store_bytes: int | None = None
    min_free_bytes: int = 0
    eviction: str = "none"

    def __post_init__(self) -> None:
        for name in ("max_artifact_bytes", "max_store_bytes"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
                raise ValueError(f"{name} must be positive when configured")
        if isinstance(self.min_free_bytes, bool) or not isinstance(self.min_free_bytes, int) or self.min_free_bytes < 0:
            raise ValueError("min_free_bytes must not be negative")
        if self.eviction not in ("none", "lru"):
            raise ValueError(f"eviction must be 'none' or 'lru', got {self.eviction!r}")

    def native(self) -> native.CapacityPolicy:
        return native.CapacityPolicy(self.max_artifact_bytes, self.max_store_bytes, self.min_free_bytes)


@dataclass(frozen=True)
class IntegrityPolicy:
    local_lookup: ValidationLevel = ValidationLevel.MANIFEST_AND_METADATA
    require_trusted_permissions: bool = True
    background_scrub: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.local_lookup, ValidationLevel):
            raise ValueError("local lookup validation must use ValidationLevel")
        if not _is_bool(self.require_trusted_permissions, self.background_scrub):
            raise ValueError("integrity switches must be booleans")


@dataclass(frozen=True)
class RemoteImportPolicy:
    """Remote import: a provider that is a URL is one of this runtime's remotes; any other id is modeled only."""

    on_local_miss: RemoteOnMiss = RemoteOnMiss.DISABLED
    providers: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.on_local_miss, RemoteOnMiss):
            raise ValueError("remote on-miss policy must use RemoteOnMiss")
        if not isinstance(self.providers, tuple):
            raise ValueError("remote providers must be an immutable tuple")
        if self.on_local_miss is not RemoteOnMiss.DISABLED and not self.providers:
            raise ValueError("remote providers are required when remote import is enabled")
        if any(not isinstance(provider, str) or not provider for provider in self.providers):
            raise ValueError("remote provider identifiers must not be empty")


@dataclass(frozen=True)
class ProductionPolicy:
    allow_local_build: bool = True
    allow_post_load_publish: bool = False

    def __post_init__(self) -> None:
        if not _is_bool(self.allow_local_build, self.allow_post_load_publish):
            raise ValueError("production switches must be booleans")


@dataclass(frozen=True)
class WaitPolicy:
    coordination_timeout_seconds: float = 600.0

    def __post_init__(self) -> None:
        timeout = self.coordination_timeout_seconds
        if (
            isinstance(timeout, bool)
            or not isinstance(timeout, int | float)
            or not math.isfinite(timeout)
            or timeout <= 0
        ):
            raise ValueError("coordination_timeout_seconds must be positive")


@dataclass(frozen=True)
class HostWeightRuntimeConfig:
    mode: RuntimeMode = RuntimeMode.DISABLED
    domain: StorageDomainPolicy | None = None
    remote: RemoteImportPolicy = field(default_factory=RemoteImportPolicy)
    production: ProductionPolicy = field(default_factory=ProductionPolicy)
    capacity: CapacityPolicy = field(default_factory=CapacityPolicy)
    wait: WaitPolicy = field(default_factory=WaitPolicy)
    integrity: IntegrityPolicy = field(default_factory=IntegrityPolicy)
    schema_version: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.schema_version, bool) or self.schema_version != 1:
            raise ValueError("only Host Weight Runtime config schema_version=1 is supported")
        if not isinstance(self.mode, RuntimeMode):
            raise ValueError("runtime mode must use RuntimeMode")
        if self.domain is not None and not isinstance(self.domain, StorageDomainPolicy):
            raise ValueError("runtime domain must use StorageDomainPolicy")
        for name, expected in (
            ("remote", RemoteImportPolicy),
            ("production", ProductionPolicy),
            ("capacity", CapacityPolicy),
            ("wait", WaitPolicy),
            ("integrity", IntegrityPolicy),
        ):
            if not isinstance(getattr(self, name), expected):
                raise ValueError(f"runtime {name} policy has the wrong type")
        if self.mode is not RuntimeMode.DISABLED and self.domain is None:
            raise ValueError("enabled Host Weight Runtime requires a storage domain")


def is_url(provider: str) -> bool:
    """Whether a remote provider entry is a URL (one of this runtime's remotes) rather than a provider id."""
    return "://" in provider


def native_validation(level: ValidationLevel) -> NativeValidationLevel:
    """This runtime's level for a reference level; FS_VERITY has none (callers refuse it first)."""
    return NativeValidationLevel(level.value)


def native_config(config: HostWeightRuntimeConfig) -> native.HostWeightRuntimeConfig:
    """The one configuration this runtime runs on, with the same meaning."""
    domain = config.domain
    remote_on = config.remote.on_local_miss is not RemoteOnMiss.DISABLED
    validation = config.integrity.local_lookup
    return native.HostWeightRuntimeConfig(
        mode=config.mode,
        root=None if domain is None else domain.root.expanduser().resolve(),
        validation=NativeValidationLevel.MANIFEST_AND_METADATA
        if validation is ValidationLevel.FS_VERITY
        else native_validation(validation),
        storage_class=StorageClass.AUTO if domain is None else domain.storage_class,
        allow_local_build=config.production.allow_local_build,
        allow_post_load_publish=config.production.allow_post_load_publish,
        lock_timeout_s=float(config.wait.coordination_timeout_seconds),
        capacity=config.capacity.native(),
        eviction=native.EvictionPolicy(config.capacity.eviction),
        remote=config.remote.providers if remote_on and all(map(is_url, config.remote.providers)) else (),
    )

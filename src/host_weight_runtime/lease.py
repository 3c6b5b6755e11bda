"""Leases: memory-mapped, read-only-in-effect CPU tensors over a published artifact.

A lease holds the artifact lock shared for its whole life, so cleanup can never
remove an artifact under a live reader. Mappings are private copy-on-write: a
consumer that writes to a tensor gets its own page and the artifact never changes.
Closing drops the lease's references; a mapping is unmapped when the last tensor
that views it is gone, so closing can never leave a dangling tensor.
"""

from __future__ import annotations

import contextlib
import contextvars
import enum
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from types import MappingProxyType, TracebackType
from typing import TYPE_CHECKING, NoReturn, Protocol

from ._faults import fault_point
from .canonical_json import JsonValue, canonical_sha256
from .failures import FailureCode, HostWeightFailure, ResolutionStage, raise_failure
from .identity import WeightArtifactIdentity
from .manifest import WeightManifest
from .tensors import ValidationLevel

if TYPE_CHECKING:
    import torch


class LeaseSource(str, enum.Enum):
    """How a lease was obtained."""

    LOCAL_HIT = "local_hit"
    BUILT = "built"
    JOINED = "joined"
    REMOTE_IMPORT = "remote_import"


@dataclass(frozen=True, slots=True)
class LeaseProvenance:
    """Where a lease's bytes came from and how they were checked."""

    source: LeaseSource
    domain_id: str
    artifact_dir: str
    publication_id: str
    validation: ValidationLevel
    pid: int
    acquired_at_ns: int
    backing_fingerprint: str = ""
    """SHA-256 of the exact files this lease maps (name, device, inode, size) with the domain and publication:
    two leases share pages exactly when their fingerprints match. Empty for a lease built outside a store."""

    @property
    def domain_uuid(self) -> str:
        """`domain_id` under vLLM-Omni's name for it (the domain's own id, from domain.json)."""
        return self.domain_id

    @property
    def origin(self) -> str:
        """Where the artifact's bytes came from: `remote` for an import, else `producer`."""
        return "remote" if self.source is LeaseSource.REMOTE_IMPORT else "producer"

    def to_dict(self) -> dict[str, JsonValue]:
        return {
            "source": self.source.value,
            "domain_id": self.domain_id,
            "artifact_dir": self.artifact_dir,
            "publication_id": self.publication_id,
            "validation": self.validation.value,
            "pid": self.pid,
            "acquired_at_ns": self.acquired_at_ns,
            "backing_fingerprint": self.backing_fingerprint,
        }


def backing_fingerprint(domain_id: str, publication_id: str, regions: tuple[MappedHostRegion, ...]) -> str:
    """The `LeaseProvenance.backing_fingerprint` of a lease mapping `regions` of one publication."""
    return canonical_sha256(
        {
            "domain_id": domain_id,
            "publication_id": publication_id,
            "regions": [[region.file, region.device, region.inode, region.length] for region in regions],
        }
    )


@dataclass(frozen=True, slots=True)
class MappedHostRegion:
    """One mapped payload file: what a transport needs to register host memory."""

    file: str
    address: int
    length: int
    device: int
    inode: int

    @property
    def file_name(self) -> str:
        """The payload file's name inside the artifact (vLLM-Omni's name for `file`)."""
        return self.file

    @property
    def read_only(self) -> bool:
        """Always True: the mapping is private copy-on-write, so a write never reaches the artifact."""
        return True


class LeaseBackgroundWork(Protocol):
    """Work a store prepared for a lease (such as prefaulting its pages): started when the lease's tensors or
    regions are first asked for, ended when the lease closes."""

    def start(self) -> None: ...

    def stop(self) -> None: ...


class VerificationState(str, enum.Enum):
    """Where a lease's background full verification stands (HWR_BACKGROUND_VERIFY)."""

    RUNNING = "running"
    VERIFIED = "verified"  # every payload byte hashed and matched; the domain records it once
    DENIED = "denied"  # a payload did not match: the artifact is denied for every later lookup
    SKIPPED = "skipped"  # another process was verifying it, or finished first
    ABANDONED = "abandoned"  # the lease closed first; nothing recorded, a later lease tries again
    FAILED = "failed"  # an I/O error judged nothing; nothing recorded, a later lease tries again


_held_verifications: contextvars.ContextVar[list[Callable[[], None]] | None] = contextvars.ContextVar(
    "hwr_held_verifications", default=None
)


@contextlib.contextmanager
def deferred_verifications() -> Iterator[None]:
    """Hold the background verifications that leases start inside the block until it ends, then start them.

    A load that maps several artifacts and then restores its models (a pipeline) finishes before any
    artifact is re-hashed beside it: a verifier takes the interpreter lock between its reads, which the
    loading thread would wait for. Nested blocks hold until the outermost one ends; the lease is served
    either way, and waiting for a held verification starts it.
    """
    if _held_verifications.get() is not None:
        yield
        return
    held: list[Callable[[], None]] = []
    token = _held_verifications.set(held)
    try:
        yield
    finally:
        _held_verifications.reset(token)
        fault_point("verify.release_held")
        for start in held:
            start()


def start_or_defer(start: Callable[[], None]) -> bool:
    """Call `start` now, or at the end of the enclosing `deferred_verifications` block; True when deferred."""
    held = _held_verifications.get()
    if held is None:
        start()
        return False
    held.append(start)
    return True


class LeaseVerification(Protocol):
    """A background full verification a store started for a lease; it never closes or alters the lease."""

    @property
    def state(self) -> VerificationState: ...

    @property
    def failure(self) -> HostWeightFailure | None: ...

    @property
    def elapsed_s(self) -> float | None:
        """Seconds the verification ran, once it ended (None while it runs)."""
        ...

    def wait(self, timeout: float | None = None) -> bool: ...

    def stop(self) -> None: ...


class LeaseLock(Protocol):
    """The shared artifact lock a lease holds; released exactly once by `close`."""

    def release(self) -> None: ...


class HostWeightLease:
    """Validated, mapped tensors of one artifact; close it (or use `with`) when done."""

    __slots__ = (
        "__weakref__",
        "_background",
        "_close_guard",
        "_closed",
        "_identity",
        "_lock",
        "_manifest",
        "_mappings",
        "_provenance",
        "_regions",
        "_tensors",
        "_verification",
    )

    def __init__(
        self,
        *,
        identity: WeightArtifactIdentity,
        manifest: WeightManifest,
        tensors: Mapping[str, torch.Tensor],
        regions: tuple[MappedHostRegion, ...],
        provenance: LeaseProvenance,
        mappings: tuple[object, ...],
        lock: LeaseLock,
        background: LeaseBackgroundWork | None = None,
        verification: LeaseVerification | None = None,
    ) -> None:
        self._identity = identity
        self._verification = verification
        self._background = background
        self._manifest = manifest
        self._tensors: Mapping[str, torch.Tensor] | None = MappingProxyType(dict(tensors))
        self._regions = regions
        self._provenance = provenance
        self._mappings: tuple[object, ...] = mappings
        self._lock: LeaseLock | None = lock
        self._closed = False
        self._close_guard = threading.Lock()

    @property
    def identity(self) -> WeightArtifactIdentity:
        return self._identity

    @property
    def manifest(self) -> WeightManifest:
        return self._manifest

    @property
    def tensors(self) -> Mapping[str, torch.Tensor]:
        """Read-only name -> CPU tensor mapping viewing the mapped payloads (the first call starts the prefault)."""
        tensors = self._tensors
        if tensors is None:
            raise raise_failure(
                ResolutionStage.LEASE,
                FailureCode.INVALID_CONFIGURATION,
                "this lease is closed; obtain a new one from the store",
            )
        self._start_background()
        return tensors

    @property
    def mapped_regions(self) -> tuple[MappedHostRegion, ...]:
        """The mapped payload files (the first call starts the prefault: a transport registers what it reads)."""
        self._start_background()
        return self._regions

    def _start_background(self) -> None:
        background = self._background
        if background is not None:
            background.start()  # idempotent; a stopped one never starts

    @property
    def provenance(self) -> LeaseProvenance:
        return self._provenance

    @property
    def publication_id(self) -> str:
        return self._provenance.publication_id

    @property
    def verification(self) -> LeaseVerification | None:
        """The background full verification this lease started, if any (see HWR_BACKGROUND_VERIFY).

        None when none was needed: already verified on this node, checked with FULL_CHECKSUM,
        just built or imported by this process, or switched off. A DENIED state means the bytes
        this lease maps failed their digests; later lookups fall back, this lease keeps serving.
        """
        return self._verification

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Release the shared lock and the lease's references; idempotent and thread-safe."""
        fault_point("lease.close_enter")
        with self._close_guard:
            if self._closed:
                return
            fault_point("lease.teardown")
            background, self._background = self._background, None
            if background is not None:
                background.stop()
            verification = self._verification
            if verification is not None:
                verification.stop()  # before the lock goes: the verifier reads under this lease's lock
            lock = self._lock
            self._tensors = None
            self._mappings = ()
            self._lock = None
            try:
                if lock is not None:
                    lock.release()
            finally:
                self._closed = True

    def __enter__(self) -> HostWeightLease:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def __reduce__(self) -> NoReturn:
        raise TypeError(
            "HostWeightLease cannot be pickled: it is process-local, owning mappings and a lock of this process; "
            "send the identity and look it up in the other process"
        )

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return (
            f"HostWeightLease(key={self._identity.key[:12]}..., tensors={len(self._manifest.tensors)}, "
            f"source={self._provenance.source.value}, {state})"
        )


class HostWeightLeaseCarrier:
    """Hands one lease to exactly one new owner; a second `take` fails."""

    __slots__ = ("_guard", "_lease")

    def __init__(self, lease: HostWeightLease) -> None:
        self._lease: HostWeightLease | None = lease
        self._guard = threading.Lock()

    @property
    def taken(self) -> bool:
        return self._lease is None

    def take(self) -> HostWeightLease:
        with self._guard:
            lease = self._lease
            if lease is None:
                raise raise_failure(
                    ResolutionStage.LEASE,
                    FailureCode.INVALID_CONFIGURATION,
                    "this lease carrier was already taken; a lease has exactly one owner",
                )
            self._lease = None
            return lease

    def close(self) -> None:
        """Close the lease if nobody took it."""
        with self._guard:
            lease, self._lease = self._lease, None
        if lease is not None:
            lease.close()

    def __copy__(self) -> NoReturn:
        raise TypeError(_CARRIER_NOT_COPYABLE)

    def __deepcopy__(self, memo: object) -> NoReturn:
        raise TypeError(_CARRIER_NOT_COPYABLE)

    def __reduce_ex__(self, protocol: object) -> NoReturn:
        raise TypeError(_CARRIER_NOT_COPYABLE)

    def __reduce__(self) -> NoReturn:
        raise TypeError(_CARRIER_NOT_COPYABLE)


_CARRIER_NOT_COPYABLE = (
    "HostWeightLeaseCarrier cannot be serialized, copied or pickled: it hands its lease to exactly one owner; "
    "pass the carrier itself, or send the identity and look it up in the other process"
)

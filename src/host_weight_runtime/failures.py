"""Typed failures: a stable code, the stage it happened in, and whether a retry can help."""

from __future__ import annotations

import enum
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar

from ._records import Boolean, EnumValue, Field, Json, RecordSpec, Text
from .canonical_json import CanonicalJson, JsonValue


class ResolutionStage(str, enum.Enum):
    """Where in the life of a lookup, build or load a failure happened."""

    CONFIGURATION = "configuration"
    DOMAIN = "domain"
    LOOKUP = "lookup"
    REMOTE = "remote"
    PRODUCTION = "production"
    PUBLICATION = "publication"
    RESTORE = "restore"
    CANONICAL = "canonical"
    POST_LOAD_PUBLICATION = "post_load_publication"
    LEASE = "lease"
    CLEANUP = "cleanup"

    # vLLM-Omni's reference names for the same stages (aliases: same members, never listed or reported).
    VALIDATION = "lookup"
    CAPACITY = "publication"
    RESTORATION = "restore"
    LIFECYCLE = "lease"
    CANONICAL_LOADING = "canonical"


class FailureCode(str, enum.Enum):
    """Stable, programmatic failure codes; never match on message text."""

    INVALID_CONFIGURATION = "invalid_configuration"
    UNSUPPORTED = "unsupported"
    PRODUCER_UNSUPPORTED = "producer_unsupported"
    UNSUPPORTED_FILESYSTEM = "unsupported_filesystem"
    STORAGE_CLASS_MISMATCH = "storage_class_mismatch"
    UNSAFE_PERMISSIONS = "unsafe_permissions"
    DOMAIN_POLICY_CONFLICT = "domain_policy_conflict"
    DOMAIN_INVALID = "domain_invalid"
    DOMAIN_UNAVAILABLE = "domain_unavailable"  # the root cannot be opened (missing, a file, unreachable): retryable
    STORE_INIT_FAILED = "store_init_failed"
    LOCK_TIMEOUT = "lock_timeout"
    IO_ERROR = "io_error"
    MANIFEST_INVALID = "manifest_invalid"
    MANIFEST_INCOMPATIBLE = "manifest_incompatible"
    PAYLOAD_INVALID = "payload_invalid"
    CHECKSUM_MISMATCH = "checksum_mismatch"
    ARTIFACT_DENIED = "artifact_denied"
    IDENTITY_COLLISION = "identity_collision"
    PRODUCER_FAILED = "producer_failed"
    PUBLICATION_FAILED = "publication_failed"
    ARTIFACT_TOO_LARGE = "artifact_too_large"
    STORE_LIMIT_EXCEEDED = "store_limit_exceeded"
    INSUFFICIENT_CAPACITY = "insufficient_capacity"
    NO_SPACE = "no_space"
    QUOTA_EXCEEDED = "quota_exceeded"
    ACTIVE_BUILD = "active_build"
    ACTIVE_LEASE = "active_lease"
    LEASE_CLOSE_FAILED = "lease_close_failed"
    UNEXPECTED_STATUS = "unexpected_status"
    CANONICAL_SOURCE_FAILED = "canonical_source_failed"
    RESTORE_FAILED = "restore_failed"
    REMOTE_FAILED = "remote_failed"
    NOT_FOUND = "not_found"

    # vLLM-Omni's reference names, as aliases of the code this runtime reports in the same case: code written
    # for the reference compares against them unchanged. Never listed, never reported (`.value` is ours).
    INVALID_CONFIG = "invalid_configuration"
    COHORT_POLICY_MISMATCH = "invalid_configuration"
    DOMAIN_POLICY_MISMATCH = "domain_policy_conflict"
    NUMA_PLACEMENT_INVALID = "unsupported"
    LOCAL_MISS = "not_found"
    ACTIVE_BUILD_TIMEOUT = "lock_timeout"
    MANIFEST_CORRUPT = "manifest_invalid"
    REMOTE_MISS = "remote_failed"
    REMOTE_UNAVAILABLE = "remote_failed"
    REMOTE_AUTH_FAILED = "remote_failed"
    REMOTE_TIMEOUT = "remote_failed"
    REMOTE_ARTIFACT_INVALID = "remote_failed"
    PRODUCER_UNAVAILABLE = "not_found"
    PRODUCTION_TIMEOUT = "lock_timeout"
    ENOSPC = "no_space"
    RESTORER_UNAVAILABLE = "restore_failed"
    RESTORE_PREFLIGHT_FAILED = "restore_failed"
    RESTORE_COMMIT_FAILED = "restore_failed"
    QUARANTINE_FAILED = "io_error"


@dataclass(frozen=True, slots=True)
class HostWeightFailure:
    """A failure as a value: code, stage, retryability, a message that says what to do, details."""

    SPEC: ClassVar[RecordSpec] = RecordSpec(
        "HostWeightFailure",
        "failure",
        (
            Field("stage", EnumValue(ResolutionStage)),
            Field("code", EnumValue(FailureCode)),
            Field("retryable", Boolean()),
            Field("message", Text(allow_empty=True)),
            Field("details", Json()),
        ),
    )

    stage: ResolutionStage
    code: FailureCode
    retryable: bool
    message: str
    details: CanonicalJson = field(default_factory=CanonicalJson.empty)

    def __post_init__(self) -> None:
        self.SPEC.check(self)

    def to_dict(self) -> dict[str, JsonValue]:
        return self.SPEC.encode(self)

    @classmethod
    def from_dict(cls, value: object) -> HostWeightFailure:
        return cls(**cls.SPEC.decode(value))

    def with_stage(self, stage: ResolutionStage) -> HostWeightFailure:
        return HostWeightFailure(stage, self.code, self.retryable, self.message, self.details)


def failure(
    stage: ResolutionStage,
    code: FailureCode,
    message: str,
    *,
    retryable: bool = False,
    **details: JsonValue,
) -> HostWeightFailure:
    """Shorthand used inside the library to build a failure value."""
    return HostWeightFailure(stage, code, retryable, message, CanonicalJson.from_value(details))


class HostWeightError(RuntimeError):
    """The exception form of a `HostWeightFailure`, used inside the library and by callers of REQUIRED."""

    def __init__(self, failure: HostWeightFailure) -> None:
        super().__init__(f"[{failure.code.value}] {failure.message}")
        self.failure = failure

    @property
    def code(self) -> FailureCode:
        return self.failure.code

    @property
    def retryable(self) -> bool:
        return self.failure.retryable

    def __reduce__(self) -> tuple[type[HostWeightError], tuple[HostWeightFailure]]:
        return (type(self), (self.failure,))


@dataclass(frozen=True, slots=True)
class ArgumentHint:
    """The change to a call that fixes a failure, kept as data so each front end says it in its own syntax:
    Python keywords (`subfolder='transformer'`) in the library's message, options (`--subfolder transformer`)
    in `hwr`. A value of None stands for one the caller chooses."""

    use: tuple[tuple[str, str | None], ...] = ()
    drop: tuple[tuple[str, str], ...] = ()
    lead: str = ""
    """Words before the hint, such as 'or, for another cache,'."""

    def __post_init__(self) -> None:
        if not self.use and not self.drop:
            raise ValueError("ArgumentHint needs an argument to use or to drop")

    def render(self, spell: Callable[[str, str | None], str]) -> str:
        """The hint with each argument spelled by `spell(name, value)`: 'pass A or B; drop C'."""
        parts: list[str] = []
        if self.use:
            parts.append("pass " + " or ".join(spell(name, value) for name, value in self.use))
        if self.drop:
            parts.append("drop " + " and ".join(spell(name, value) for name, value in self.drop))
        text = "; ".join(parts)
        return f"{self.lead} {text}" if self.lead else text

    def as_python(self) -> str:
        """The hint as keyword arguments, quoted the way diffusers' own examples quote them."""
        return self.render(lambda name, value: f"{name}=..." if value is None else f"{name}={json.dumps(value)}")

    def to_value(self) -> JsonValue:
        return {
            "use": [[name, value] for name, value in self.use],
            "drop": [list(pair) for pair in self.drop],
            "lead": self.lead,
        }

    @classmethod
    def of(cls, failure: HostWeightFailure) -> tuple[str, ArgumentHint] | None:
        """The problem (the message without its hint) and the hint of a failure that carries one, else None."""
        details = failure.details.to_value()
        if not isinstance(details, dict):
            return None
        problem, hint = details.get("problem"), details.get("hint")
        if not isinstance(problem, str) or not isinstance(hint, dict):
            return None
        try:
            use = tuple(_pair(item) for item in _items(hint.get("use")))
            drop = tuple(_named_value(_pair(item)) for item in _items(hint.get("drop")))
            lead = hint.get("lead", "")
            return problem, cls(use, drop, lead if isinstance(lead, str) else "")
        except ValueError:
            return None


def _items(value: JsonValue) -> list[JsonValue]:
    if not isinstance(value, list):
        raise ValueError("not a list")
    return value


def _pair(item: JsonValue) -> tuple[str, str | None]:
    if not isinstance(item, list) or len(item) != 2 or not isinstance(item[0], str):
        raise ValueError("not a [name, value] pair")
    name, value = item[0], item[1]
    if value is not None and not isinstance(value, str):
        raise ValueError("not a [name, value] pair")
    return name, value


def _named_value(pair: tuple[str, str | None]) -> tuple[str, str]:
    name, value = pair
    if value is None:
        raise ValueError("a dropped argument has a value")
    return name, value


def _with_hint(message: str, hint: ArgumentHint | None, details: dict[str, JsonValue]) -> str:
    """The message with the hint in Python syntax appended; records both parts in `details`."""
    if hint is None:
        return message
    details["problem"] = message
    details["hint"] = hint.to_value()
    return f"{message}; {hint.as_python()}"


class HostWeightUsageError(HostWeightError, ValueError):
    """A bad argument or input, said with what to fix; nothing was touched when it is raised.

    It is both a `HostWeightError` (stage CONFIGURATION, a stable code) and a `ValueError`,
    so `except HostWeightError` and existing `except ValueError` code both catch it.
    """


def usage_error(
    message: str,
    *,
    code: FailureCode = FailureCode.INVALID_CONFIGURATION,
    hint: ArgumentHint | None = None,
    **details: JsonValue,
) -> HostWeightUsageError:
    """Build the exception for a caller's mistake (callers write `raise usage_error(...)`).

    A `hint` is appended to the message in Python syntax and kept in the details for `hwr` to render.
    """
    message = _with_hint(message, hint, details)
    return HostWeightUsageError(
        HostWeightFailure(ResolutionStage.CONFIGURATION, code, False, message, CanonicalJson.from_value(details))
    )


def raise_failure(
    stage: ResolutionStage,
    code: FailureCode,
    message: str,
    *,
    retryable: bool = False,
    **details: JsonValue,
) -> HostWeightError:
    """Build the exception for a failure (callers write `raise raise_failure(...)`)."""
    return HostWeightError(failure(stage, code, message, retryable=retryable, **details))


def hinted_failure(
    stage: ResolutionStage,
    code: FailureCode,
    problem: str,
    hint: ArgumentHint,
    *,
    retryable: bool = False,
    **details: JsonValue,
) -> HostWeightError:
    """`raise_failure` for a failure one argument can fix; the hint as in `usage_error`."""
    message = _with_hint(problem, hint, details)
    return HostWeightError(failure(stage, code, message, retryable=retryable, **details))

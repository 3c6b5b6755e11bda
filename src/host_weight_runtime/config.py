"""Runtime configuration: the mode, where the domain lives, and the policies that gate it."""

from __future__ import annotations

import enum
import math
import os
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from ._remote_url import DEFAULT_TIMEOUT_S, check_remote_url, is_writable_url
from .tensors import ValidationLevel

ENV_MODE = "HWR_MODE"
ENV_ROOT = "HWR_ROOT"
ENV_VALIDATION = "HWR_VALIDATION"
ENV_STORAGE_CLASS = "HWR_STORAGE_CLASS"
ENV_ALLOW_LOCAL_BUILD = "HWR_ALLOW_LOCAL_BUILD"
ENV_ALLOW_POST_LOAD_PUBLISH = "HWR_ALLOW_POST_LOAD_PUBLISH"
ENV_LOCK_TIMEOUT = "HWR_LOCK_TIMEOUT_S"
ENV_MAX_ARTIFACT_BYTES = "HWR_MAX_ARTIFACT_BYTES"
ENV_MAX_STORE_BYTES = "HWR_MAX_STORE_BYTES"
ENV_MIN_FREE_BYTES = "HWR_MIN_FREE_BYTES"
ENV_EVICTION = "HWR_EVICTION"
ENV_METRICS_PORT = "HWR_METRICS_PORT"
ENV_METRICS_ADDR = "HWR_METRICS_ADDR"
ENV_REMOTE = "HWR_REMOTE"
ENV_REMOTE_ENDPOINT_URL = "HWR_REMOTE_ENDPOINT_URL"
ENV_REMOTE_TIMEOUT = "HWR_REMOTE_TIMEOUT_S"
ENV_REMOTE_PUBLISH = "HWR_REMOTE_PUBLISH"
ENV_PREFAULT = "HWR_PREFAULT"
ENV_BACKGROUND_VERIFY = "HWR_BACKGROUND_VERIFY"

# Variables whose value may carry a credential when mistyped: an error never echoes them.
_UNECHOED_ENV = frozenset({ENV_REMOTE, ENV_REMOTE_ENDPOINT_URL})


class RuntimeMode(str, enum.Enum):
    """DISABLED never touches the store; PREFERRED falls back; REQUIRED fails instead."""

    DISABLED = "disabled"
    PREFERRED = "preferred"
    REQUIRED = "required"


class StorageClass(str, enum.Enum):
    """What backs a domain; AUTO accepts whatever node-local filesystem is detected."""

    AUTO = "auto"
    TMPFS = "tmpfs"
    DISK = "disk"


class BackgroundVerifyMode(str, enum.Enum):
    """Whether leases start a background full verification of a publication not yet verified on this node."""

    ONCE = "once"
    OFF = "off"


class EvictionPolicy(str, enum.Enum):
    """What a build does when the domain is full: LRU evicts unleased artifacts first; NONE only refuses."""

    LRU = "lru"
    NONE = "none"


@dataclass(frozen=True, slots=True)
class CapacityPolicy:
    """Byte limits checked before anything is written. None means no limit."""

    max_artifact_bytes: int | None = None
    max_store_bytes: int | None = None
    min_free_bytes: int = 0

    def __post_init__(self) -> None:
        for name in ("max_artifact_bytes", "max_store_bytes"):
            value = getattr(self, name)
            if value is not None and (type(value) is not int or value <= 0):
                raise ValueError(f"CapacityPolicy.{name} must be a positive int or None, got {value!r}")
        if type(self.min_free_bytes) is not int or self.min_free_bytes < 0:
            raise ValueError(f"CapacityPolicy.min_free_bytes must be a non-negative int, got {self.min_free_bytes!r}")

    def to_dict(self) -> dict[str, int | None]:
        return {
            "max_artifact_bytes": self.max_artifact_bytes,
            "max_store_bytes": self.max_store_bytes,
            "min_free_bytes": self.min_free_bytes,
        }


def default_root() -> Path:
    """A per-user domain under /dev/shm, or the user cache directory where there is none."""
    user = str(os.getuid())
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        return shm / f"host-weight-runtime-{user}"
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    if not cache:
        cache = tempfile.gettempdir()
    return Path(cache) / "host-weight-runtime"


# Kernel and device filesystems: never a place for a store, whatever the mount table says.
_FORBIDDEN_ROOTS = (Path("/proc"), Path("/sys"), Path("/dev"))
_ALLOWED_UNDER_DEV = Path("/dev/shm")


def _check_root(root: Path) -> None:
    """Refuse a domain root that is relative, spelled with '..' or NUL, or under /proc, /sys or /dev."""
    text = str(root)
    if "\x00" in text:
        raise ValueError("root must not contain a NUL character")
    if not root.is_absolute():
        raise ValueError(f"root must be an absolute path, got {text!r}; give the full path, e.g. /dev/shm/hwr")
    if ".." in root.parts:
        raise ValueError(f"root must not contain '..', got {text!r}; write the path it means directly")
    for spelled in (Path(os.path.normpath(text)), Path(os.path.realpath(text))):
        if spelled == Path(spelled.anchor):
            raise ValueError(f"root must not be the filesystem root {spelled}; use a directory such as /dev/shm/hwr")
        if spelled == _ALLOWED_UNDER_DEV or spelled.is_relative_to(_ALLOWED_UNDER_DEV):
            continue
        for forbidden in _FORBIDDEN_ROOTS:
            if spelled == forbidden or spelled.is_relative_to(forbidden):
                raise ValueError(
                    f"root {text!r} is under {forbidden} (a kernel or device filesystem, not storage); "
                    "use a directory on tmpfs such as /dev/shm/hwr or on a local disk"
                )


@dataclass(frozen=True, slots=True)
class HostWeightRuntimeConfig:
    """Everything the runtime needs; build it in code, from a dict, or from the environment."""

    mode: RuntimeMode = RuntimeMode.PREFERRED
    root: Path | None = None
    validation: ValidationLevel = ValidationLevel.MANIFEST_AND_METADATA
    storage_class: StorageClass = StorageClass.AUTO
    allow_local_build: bool = True
    allow_post_load_publish: bool = True
    lock_timeout_s: float = 600.0
    capacity: CapacityPolicy | None = None
    eviction: EvictionPolicy = EvictionPolicy.LRU
    metrics_port: int | None = None
    metrics_addr: str = "127.0.0.1"
    # Remote exact artifacts (HWR_REMOTE*): fsspec URLs tried in order after a local miss, the
    # S3 endpoint for s3:// URLs, the per-request timeout, and whether built artifacts are pushed.
    remote: tuple[str, ...] = ()
    remote_endpoint_url: str | None = None
    remote_timeout_s: float = DEFAULT_TIMEOUT_S
    remote_publish: bool = False
    # Lease behaviour (HWR_PREFAULT, HWR_BACKGROUND_VERIFY). None: the store reads the environment when it
    # is created, so a config built in code still honours the node's variables.
    prefault: bool | None = None
    background_verify: BackgroundVerifyMode | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.mode, RuntimeMode):
            raise ValueError(f"mode must be a RuntimeMode, got {self.mode!r}")
        if not isinstance(self.validation, ValidationLevel):
            raise ValueError(f"validation must be a ValidationLevel, got {self.validation!r}")
        if not isinstance(self.storage_class, StorageClass):
            raise ValueError(f"storage_class must be a StorageClass, got {self.storage_class!r}")
        if self.root is not None and not isinstance(self.root, Path):
            raise ValueError("root must be a pathlib.Path or None")
        if self.root is not None:
            _check_root(self.root)
        for name in ("allow_local_build", "allow_post_load_publish"):
            if type(getattr(self, name)) is not bool:
                raise ValueError(f"{name} must be a bool")
        if self.capacity is not None and not isinstance(self.capacity, CapacityPolicy):
            raise ValueError(f"capacity must be a CapacityPolicy or None, got {self.capacity!r}")
        timeout = self.lock_timeout_s
        if type(timeout) not in (int, float) or not math.isfinite(timeout) or timeout < 0:
            raise ValueError(f"lock_timeout_s must be a finite, non-negative number, got {timeout!r}")
        if not isinstance(self.eviction, EvictionPolicy):
            raise ValueError(f"eviction must be an EvictionPolicy, got {self.eviction!r}")
        port = self.metrics_port
        if port is not None and (type(port) is not int or not 0 <= port <= 65535):
            raise ValueError(f"metrics_port must be None or a port number 0-65535 (0 picks a free one), got {port!r}")
        if not isinstance(self.metrics_addr, str) or not self.metrics_addr.strip():
            raise ValueError(f"metrics_addr must be a non-empty host address, got {self.metrics_addr!r}")
        if self.prefault is not None and type(self.prefault) is not bool:
            raise ValueError(f"prefault must be a bool or None, got {self.prefault!r}")
        verify = self.background_verify
        if verify is not None and not isinstance(verify, BackgroundVerifyMode):
            raise ValueError(f"background_verify must be a BackgroundVerifyMode or None, got {verify!r}")
        self._check_remote()

    def _check_remote(self) -> None:
        """The remote settings; a URL is never echoed, since a mistyped one may carry a credential."""
        if type(self.remote) is not tuple or any(type(url) is not str for url in self.remote):
            raise ValueError("remote must be a tuple of URL strings (HWR_REMOTE: comma-separated URLs)")
        for position, url in enumerate(self.remote, start=1):
            try:
                check_remote_url(url)
            except ValueError as exc:
                raise ValueError(f"remote URL #{position}: {exc}") from None
        endpoint = self.remote_endpoint_url
        if endpoint is not None:
            try:
                scheme = check_remote_url(endpoint).split("://", 1)[0] if type(endpoint) is str else ""
            except ValueError as exc:
                raise ValueError(f"remote_endpoint_url: {exc}") from None
            if scheme not in ("http", "https"):
                raise ValueError("remote_endpoint_url must be an http:// or https:// URL such as http://127.0.0.1:9000")
        timeout = self.remote_timeout_s
        if type(timeout) not in (int, float) or not math.isfinite(timeout) or not timeout > 0:
            raise ValueError(f"remote_timeout_s must be a positive number of seconds, got {timeout!r}")
        if type(self.remote_publish) is not bool:
            raise ValueError("remote_publish must be a bool")
        if self.remote_publish and not any(is_writable_url(url) for url in self.remote):
            raise ValueError(
                "remote_publish needs a writable remote (s3://, gs://, file://, ...) among the remote URLs "
                f"({ENV_REMOTE}); http(s) remotes are read-only"
            )

    @property
    def remote_push_url(self) -> str | None:
        """Where `remote_publish` pushes: the first remote that is not plain HTTP(S), if any."""
        return next((url for url in self.remote if is_writable_url(url)), None)

    @property
    def resolved_root(self) -> Path:
        return self.root if self.root is not None else default_root()

    @classmethod
    def from_dict(cls, values: Mapping[str, object]) -> HostWeightRuntimeConfig:
        """Build from plain values (strings accepted for enums and paths); unknown keys fail."""
        known = {
            "mode",
            "root",
            "validation",
            "storage_class",
            "allow_local_build",
            "allow_post_load_publish",
            "lock_timeout_s",
            "max_artifact_bytes",
            "max_store_bytes",
            "min_free_bytes",
            "eviction",
            "metrics_port",
            "metrics_addr",
            "remote",
            "remote_endpoint_url",
            "remote_timeout_s",
            "remote_publish",
            "prefault",
            "background_verify",
        }
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown configuration key(s) {unknown}; known: {sorted(known)}")
        kwargs: dict[str, object] = {}
        if "mode" in values:
            kwargs["mode"] = _enum(RuntimeMode, values["mode"], "mode")
        if "validation" in values:
            kwargs["validation"] = _enum(ValidationLevel, values["validation"], "validation")
        if "storage_class" in values:
            kwargs["storage_class"] = _enum(StorageClass, values["storage_class"], "storage_class")
        if values.get("root") is not None:
            kwargs["root"] = Path(str(values["root"])).expanduser()
        for name in ("allow_local_build", "allow_post_load_publish"):
            if name in values:
                kwargs[name] = _bool(values[name], name)
        if "lock_timeout_s" in values:
            kwargs["lock_timeout_s"] = _float(values["lock_timeout_s"], "lock_timeout_s")
        if "eviction" in values:
            kwargs["eviction"] = _enum(EvictionPolicy, values["eviction"], "eviction")
        if values.get("metrics_port") is not None:
            kwargs["metrics_port"] = _port(values["metrics_port"], "metrics_port")
        if "metrics_addr" in values:
            kwargs["metrics_addr"] = str(values["metrics_addr"]).strip()
        if "remote" in values:
            kwargs["remote"] = _urls(values["remote"], "remote")
        if values.get("remote_endpoint_url") is not None:
            endpoint = values["remote_endpoint_url"]
            if not isinstance(endpoint, str):
                raise ValueError("remote_endpoint_url must be a URL string")
            kwargs["remote_endpoint_url"] = endpoint.strip()
        if "remote_timeout_s" in values:
            kwargs["remote_timeout_s"] = _float(values["remote_timeout_s"], "remote_timeout_s")
        if "remote_publish" in values:
            kwargs["remote_publish"] = _bool(values["remote_publish"], "remote_publish")
        if values.get("prefault") is not None:
            kwargs["prefault"] = _bool(values["prefault"], "prefault")
        if values.get("background_verify") is not None:
            kwargs["background_verify"] = _background_verify(values["background_verify"])
        capacity_keys = ("max_artifact_bytes", "max_store_bytes", "min_free_bytes")
        if any(key in values for key in capacity_keys):
            kwargs["capacity"] = CapacityPolicy(
                max_artifact_bytes=_optional_int(values.get("max_artifact_bytes"), "max_artifact_bytes"),
                max_store_bytes=_optional_int(values.get("max_store_bytes"), "max_store_bytes"),
                min_free_bytes=_optional_int(values.get("min_free_bytes"), "min_free_bytes") or 0,
            )
        return cls(**kwargs)  # type: ignore[arg-type]

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> HostWeightRuntimeConfig:
        """Read HWR_MODE, HWR_ROOT, HWR_VALIDATION and friends; unset ones keep defaults."""
        env = os.environ if environ is None else environ
        mapping = {
            ENV_MODE: "mode",
            ENV_ROOT: "root",
            ENV_VALIDATION: "validation",
            ENV_STORAGE_CLASS: "storage_class",
            ENV_ALLOW_LOCAL_BUILD: "allow_local_build",
            ENV_ALLOW_POST_LOAD_PUBLISH: "allow_post_load_publish",
            ENV_LOCK_TIMEOUT: "lock_timeout_s",
            ENV_MAX_ARTIFACT_BYTES: "max_artifact_bytes",
            ENV_MAX_STORE_BYTES: "max_store_bytes",
            ENV_MIN_FREE_BYTES: "min_free_bytes",
            ENV_EVICTION: "eviction",
            ENV_METRICS_PORT: "metrics_port",
            ENV_METRICS_ADDR: "metrics_addr",
            ENV_REMOTE: "remote",
            ENV_REMOTE_ENDPOINT_URL: "remote_endpoint_url",
            ENV_REMOTE_TIMEOUT: "remote_timeout_s",
            ENV_REMOTE_PUBLISH: "remote_publish",
            ENV_PREFAULT: "prefault",
            ENV_BACKGROUND_VERIFY: "background_verify",
        }
        values: dict[str, object] = {}
        for env_name, key in mapping.items():
            raw = env.get(env_name)
            if raw is not None and raw.strip() != "":
                values[key] = raw.strip()
                try:
                    # Check each variable on its own so the error names the one to fix.
                    if key == "remote_publish":  # alone it would lack the remote it needs: parse it only
                        _bool(values[key], key)
                    else:
                        cls.from_dict({key: values[key]})
                except ValueError as exc:
                    shown = env_name if env_name in _UNECHOED_ENV else f"{env_name}={raw!r}"
                    raise ValueError(f"{shown} is invalid: {exc}; fix or unset {env_name}") from exc
        try:
            return cls.from_dict(values)
        except ValueError as exc:
            names = ", ".join(sorted(env_name for env_name, key in mapping.items() if key in values))
            raise ValueError(f"invalid HWR_* environment ({names}): {exc}") from exc


def environment_config(names: Iterable[str], environ: Mapping[str, str] | None = None) -> HostWeightRuntimeConfig:
    """`from_env` over only the variables `names`: a part that reads one setting is not failed by another."""
    env = os.environ if environ is None else environ
    return HostWeightRuntimeConfig.from_env({name: env[name] for name in names if name in env})


def _background_verify(value: object) -> BackgroundVerifyMode:
    if isinstance(value, BackgroundVerifyMode):
        return value
    if isinstance(value, str):
        try:
            return BackgroundVerifyMode(value.strip().lower())
        except ValueError:
            pass
    raise ValueError(
        f"background_verify {value!r} is not understood: set it to 'once' (verify each artifact's payloads "
        "once per node after its first lease, the default) or 'off'"
    )


def _enum(enum_type: type[enum.Enum], value: object, name: str) -> enum.Enum:
    if isinstance(value, enum_type):
        return value
    if isinstance(value, str):
        try:
            return enum_type(value.strip().lower())
        except ValueError:
            pass
    choices = ", ".join(member.value for member in enum_type)
    raise ValueError(f"{name} must be one of {choices}; got {value!r}")


def _bool(value: object, name: str) -> bool:
    if type(value) is bool:
        return value
    if isinstance(value, str):
        lowered = value.strip().lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off"):
            return False
    raise ValueError(f"{name} must be a boolean (true/false/1/0); got {value!r}")


def _urls(value: object, name: str) -> tuple[str, ...]:
    """Remote URLs from a comma-separated string or a sequence of strings, in order, blanks dropped."""
    if isinstance(value, str):
        items: list[object] = list(value.split(","))
    elif isinstance(value, (list, tuple)):
        items = list(value)
    else:
        raise ValueError(f"{name} must be a comma-separated string or a list of URL strings")
    if any(not isinstance(item, str) for item in items):
        raise ValueError(f"{name} must hold URL strings only")
    return tuple(item.strip() for item in items if isinstance(item, str) and item.strip())


def _float(value: object, name: str) -> float:
    if type(value) in (int, float):
        return float(value)  # type: ignore[arg-type]
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            pass
    raise ValueError(f"{name} must be a number of seconds; got {value!r}")


def _optional_int(value: object, name: str) -> int | None:
    if value is None:
        return None
    if type(value) is int:
        return value
    if isinstance(value, str):
        try:
            return int(value.replace("_", ""))
        except ValueError:
            pass
    raise ValueError(f"{name} must be an integer number of bytes; got {value!r}")


def _port(value: object, name: str) -> int:
    if type(value) is int:
        return value
    if isinstance(value, str) and value.strip().isdigit():
        return int(value.strip())
    raise ValueError(f"{name} must be a TCP port number (0 picks a free one); got {value!r}")

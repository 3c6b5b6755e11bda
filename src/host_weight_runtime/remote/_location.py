"""One remote location behind fsspec: a secret-free name, bounded calls and typed failures.

Every call that touches the remote goes through `RemoteLocation`, so that three rules
hold everywhere: fsspec (and s3fs, aiohttp, botocore) are imported only when a remote
is actually used; a network call on an asynchronous backend (s3, gs, http) is cancelled
after `timeout_s`; and every error becomes a `HostWeightError` whose message and
details name the provider id and the object, never a credential, a storage option
value or a backend message (which may quote signed URLs).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn
from urllib.parse import urlsplit

from .._faults import fault_point
from .._remote_url import DEFAULT_TIMEOUT_S, check_remote_url
from ..canonical_json import JsonValue
from ..failures import FailureCode, HostWeightError, HostWeightUsageError, ResolutionStage, failure, usage_error
from ..filesystem import errno_name

if TYPE_CHECKING:
    from fsspec import AbstractFileSystem

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "RemoteLocation",
    "RemoteObject",
    "check_remote_url",
    "remote_failed",
]

_READ_ONLY_PROTOCOLS = frozenset({"http", "https"})
_LOCAL_PROTOCOLS = frozenset({"file", "local"})
_NETWORK_ERRNOS = frozenset(
    {
        errno.ECONNREFUSED,
        errno.ECONNRESET,
        errno.ECONNABORTED,
        errno.ETIMEDOUT,
        errno.EHOSTUNREACH,
        errno.ENETUNREACH,
        errno.ENETDOWN,
        errno.EPIPE,
        errno.EIO,
    }
)


def remote_failed(message: str, *, retryable: bool, **details: JsonValue) -> HostWeightError:
    """A REMOTE_FAILED error at the REMOTE stage: retryable only where a later try can succeed."""
    return HostWeightError(
        failure(ResolutionStage.REMOTE, FailureCode.REMOTE_FAILED, message, retryable=retryable, **details)
    )


@dataclass(frozen=True, slots=True)
class RemoteObject:
    """One listed object: its name relative to the listed folder, its size, whether it is a folder."""

    name: str
    size: int
    is_dir: bool


class _MissingObjectError(Exception):
    """Internal: the object or folder does not exist (a caller that allows that gets None)."""


@functools.cache
def _transient_types() -> tuple[type[BaseException], ...]:
    """Backend exception types that mean 'the network failed', imported only if installed."""
    found: list[type[BaseException]] = [TimeoutError, ConnectionError]
    try:
        import botocore.exceptions as boto

        found += [boto.ConnectionError, boto.HTTPClientError]
    except ImportError:  # pragma: no cover - s3fs brings botocore
        pass
    try:
        import aiohttp

        found += [aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, aiohttp.ServerTimeoutError]
    except ImportError:  # pragma: no cover - fsspec's http backend brings aiohttp
        pass
    return tuple(found)


def _unwrap(exc: BaseException) -> BaseException:
    """The real error behind a FileNotFoundError that a backend raised for any failure (fsspec's http info does)."""
    seen = 0
    while isinstance(exc, FileNotFoundError) and exc.__cause__ is not None and seen < 8:
        exc = exc.__cause__
        seen += 1
    return exc


def _http_status(exc: BaseException) -> int | None:
    """The HTTP status behind an error: aiohttp's `status`, or botocore's response metadata."""
    status = getattr(exc, "status", None)
    if type(status) is int:
        return status
    response = getattr(exc, "response", None)
    metadata = response.get("ResponseMetadata") if isinstance(response, dict) else None
    status = metadata.get("HTTPStatusCode") if isinstance(metadata, dict) else None
    return status if type(status) is int else None


def _service_error_code(exc: BaseException) -> str | None:
    """The error code an object store answered with (botocore's ClientError: "NoSuchBucket", "AccessDenied")."""
    response = getattr(exc, "response", None)
    error = response.get("Error") if isinstance(response, dict) else None
    code = error.get("Code") if isinstance(error, dict) else None
    return code if type(code) is str else None


_MISSING_BUCKET_CODES = frozenset({"NoSuchBucket"})


class RemoteLocation:
    """An fsspec filesystem rooted at one remote URL, with typed, time-bounded operations."""

    __slots__ = ("_fs", "_local", "_name", "_read_only", "_root", "_timeout_s")

    def __init__(
        self,
        url: str,
        *,
        storage_options: Mapping[str, Any] | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        self._name = check_remote_url(url)
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
            raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
        self._timeout_s = float(timeout_s)
        scheme = urlsplit(url.strip()).scheme.lower()
        try:
            import fsspec.core

            options = _with_timeouts(scheme, dict(storage_options or {}), self._timeout_s)
        except ImportError:
            raise _config_error(
                "fsspec is not installed; install the remote extra: pip install 'host-weight-runtime[remote]'",
                self._name,
            ) from None
        try:
            fs, root = fsspec.core.url_to_fs(url.strip(), **options)
        except ImportError as exc:
            raise _config_error(
                f"the {scheme}:// backend is not installed ({type(exc).__name__}); install its fsspec package "
                "(s3fs for s3://, gcsfs for gs://) or 'host-weight-runtime[remote]'",
                self._name,
            ) from None
        except (ValueError, TypeError) as exc:
            raise _config_error(
                f"fsspec rejected the remote URL or its storage options ({type(exc).__name__}); check both",
                self._name,
            ) from None
        self._fs: AbstractFileSystem = fs
        self._root = str(root).rstrip("/")
        protocols = {fs.protocol} if isinstance(fs.protocol, str) else set(fs.protocol)
        self._read_only = bool(protocols & _READ_ONLY_PROTOCOLS)
        self._local = bool(protocols & _LOCAL_PROTOCOLS)

    # -- facts

    @property
    def name(self) -> str:
        """The URL without anything secret: what messages, ids and listings show."""
        return self._name

    @property
    def timeout_s(self) -> float:
        return self._timeout_s

    @property
    def local(self) -> bool:
        """True for a folder on a local filesystem (file://), whose objects can be copied by the kernel."""
        return self._local

    @property
    def listable(self) -> bool:
        """Whether the backend can list a prefix (object stores and files can; plain HTTP cannot)."""
        return not self._read_only

    @property
    def writable(self) -> bool:
        return not self._read_only

    def path(self, *parts: str) -> str:
        return "/".join([self._root, *parts]) if parts else self._root

    # -- the one way to call the backend

    def _call(
        self,
        method: str,
        what: str,
        relative: str,
        *args: Any,
        timeout: bool = True,
        missing_ok: bool = False,
        **kwargs: Any,
    ) -> Any:
        """Run one filesystem method: on an async backend cancelled after timeout_s; errors typed."""
        try:
            if getattr(self._fs, "async_impl", False):
                from fsspec.asyn import sync

                bound = getattr(self._fs, "_" + method)
                return sync(self._fs.loop, bound, *args, timeout=self._timeout_s if timeout else None, **kwargs)
            return getattr(self._fs, method)(*args, **kwargs)
        except HostWeightError:
            raise
        except Exception as exc:
            cause = _unwrap(exc)
            if _service_error_code(cause) in _MISSING_BUCKET_CODES:
                raise self._missing_root("its bucket does not exist") from None
            if missing_ok and (isinstance(cause, FileNotFoundError) or _http_status(cause) == 404):
                raise _MissingObjectError from None
            self._raise_typed(cause, what, relative)

    def _raise_typed(self, exc: BaseException, what: str, relative: str) -> NoReturn:
        """Turn a backend exception into REMOTE_FAILED without quoting it (it may hold signed URLs)."""
        details: dict[str, JsonValue] = {"provider_id": self._name, "object": relative, "exception": type(exc).__name__}
        where = f"{what} ({relative} at {self._name})"
        number = exc.errno if isinstance(exc, OSError) else None
        if number is not None:
            details["errno"] = errno_name(number)
        status = _http_status(exc)
        if status is not None:
            details["http_status"] = status
        if isinstance(exc, FileNotFoundError) or status == 404:
            raise remote_failed(
                f"{where} failed: the object does not exist; the upload is incomplete or was removed — push the "
                "artifact again (hwr push)",
                retryable=False,
                missing=True,
                **details,
            ) from None
        if isinstance(exc, PermissionError) or status in (401, 403):
            raise remote_failed(
                f"{where} failed: access denied; check the credentials the backend uses (AWS_* environment "
                "variables, profile, storage options) and the bucket's policy",
                retryable=False,
                **details,
            ) from None
        if isinstance(exc, TimeoutError):
            raise remote_failed(
                f"{where} did not finish within {self._timeout_s:g} s; the endpoint stalled or is too slow. "
                "Retry, or raise HWR_REMOTE_TIMEOUT_S",
                retryable=True,
                timeout_s=self._timeout_s,
                **details,
            ) from None
        if isinstance(exc, _transient_types()) or number in _NETWORK_ERRNOS or (status is not None and status >= 500):
            raise remote_failed(
                f"{where} failed: the endpoint could not be reached or dropped the connection; check that it is up "
                "(and HWR_REMOTE_ENDPOINT_URL), then retry",
                retryable=True,
                **details,
            ) from None
        if isinstance(exc, (ValueError, TypeError)) or (status is not None and 400 <= status < 500 and status != 429):
            raise remote_failed(
                f"{where} failed: the backend rejected the request ({type(exc).__name__}); check the URL and the "
                "storage options",
                retryable=False,
                **details,
            ) from None
        raise remote_failed(
            f"{where} failed with {type(exc).__name__}; retry, and check the endpoint if it persists",
            retryable=True,
            **details,
        ) from None

    def _missing_root(self, problem: str) -> HostWeightUsageError:
        """A remote URL that names nothing: a typo or a missing bucket, which no retry can fix."""
        return usage_error(
            f"the remote {self._name} cannot be used: {problem}. Check the URL (and HWR_REMOTE_ENDPOINT_URL); "
            "create the bucket or folder first if it is meant to be new",
            provider_id=self._name,
            missing_root=True,
        )

    # -- operations

    def check_target(self, *, for_write: bool) -> None:
        """Raise a usage error unless the URL names something that exists (checked before anything is written).

        file://: the folder must exist; a push may create it only when its parent exists, so a
        mistyped path never grows a tree of folders. s3:// and gs://: the bucket must exist (a
        prefix inside it may be new). http(s):// is only read and has no folders to check.
        """
        if self._read_only:
            return
        if self._local:
            self._check_local_root(for_write=for_write)
            return
        bucket = self._root.split("/", 1)[0]
        try:
            self._call("info", "checking the bucket", bucket, bucket, missing_ok=True)
        except _MissingObjectError:
            raise self._missing_root(
                f"the bucket {bucket} does not exist (or these credentials cannot see it)"
            ) from None

    def _check_local_root(self, *, for_write: bool) -> None:
        root = self._root or "/"
        if os.path.isdir(root):
            return
        if os.path.lexists(root):
            raise self._missing_root(f"{root} exists but is not a folder")
        parent = os.path.dirname(root.rstrip("/")) or "/"
        if for_write and os.path.isdir(parent):
            return  # the first push creates the folder itself, never its parents
        if for_write:
            raise self._missing_root(f"neither the folder {root} nor its parent {parent} exists")
        raise self._missing_root(f"the folder {root} does not exist")

    def list_folder(self, relative: str) -> tuple[RemoteObject, ...] | None:
        """The objects directly under `relative` (a folder), or None when there is no such folder."""
        path = self.path(relative) if relative else self.path()
        self._fs.invalidate_cache(path)
        try:
            entries = self._call("ls", "listing", relative or ".", path, detail=True, missing_ok=True)
        except _MissingObjectError:
            return None
        found: list[RemoteObject] = []
        for entry in entries:
            full = str(entry.get("name", "")).rstrip("/")
            base = full.rsplit("/", 1)[-1]
            if not base or full == path.rstrip("/"):
                continue
            size = entry.get("size")
            found.append(
                RemoteObject(
                    name=base,
                    size=size if type(size) is int else -1,
                    is_dir=entry.get("type") == "directory",
                )
            )
        return tuple(sorted(found, key=lambda item: item.name))

    def size_of(self, relative: str) -> int | None:
        """The object's size, or None when it does not exist; a backend that reports no size is a failure."""
        try:
            info = self._call("info", "reading the size of", relative, self.path(relative), missing_ok=True)
        except _MissingObjectError:
            return None
        size = info.get("size") if isinstance(info, dict) else None
        if type(size) is not int or size < 0:
            raise remote_failed(
                f"{self._name} does not report the size of {relative}; the server must send Content-Length",
                retryable=False,
                provider_id=self._name,
                object=relative,
            )
        return size

    def read(self, relative: str, start: int | None = None, end: int | None = None) -> bytes:
        """Bytes [start, end) of an object (all of it without a range); the caller checks the length."""
        data = self._call("cat_file", "reading", relative, self.path(relative), start=start, end=end)
        if not isinstance(data, (bytes, bytearray)):
            raise remote_failed(
                f"reading {relative} at {self._name} returned {type(data).__name__}, not bytes",
                retryable=False,
                provider_id=self._name,
                object=relative,
            )
        return bytes(data) if isinstance(data, bytearray) else data

    def read_into(self, relative: str, start: int, end: int, buffer: bytearray) -> int:
        """Read bytes [start, end) into the front of `buffer` (at least end - start long); returns how many came.

        A local file is read straight into the buffer with pread (one copy, like a plain copy);
        other backends copy what they return. More bytes than asked (a server that ignores
        ranges) are counted, not copied, so the caller sees the wrong length.
        """
        if not self._local:
            data = self.read(relative, start, end)
            if len(data) <= len(buffer):
                buffer[: len(data)] = data
            return len(data)
        wanted = end - start
        done = 0
        try:
            fd = os.open(self.path(relative), os.O_RDONLY | os.O_CLOEXEC)
            try:
                with memoryview(buffer) as view:
                    while done < wanted:
                        count = os.preadv(fd, [view[done:wanted]], start + done)
                        if count == 0:
                            break  # the object is shorter than promised: the caller sees a short read
                        done += count
            finally:
                os.close(fd)
        except OSError as exc:
            self._raise_typed(exc, "reading", relative)
        return done

    def open_local(self, relative: str) -> int | None:
        """A read-only descriptor of a local object (for in-kernel copies), None on other backends."""
        if not self._local:
            return None
        try:
            return os.open(self.path(relative), os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            self._raise_typed(exc, "reading", relative)

    def require_writable(self, relative: str) -> None:
        """Raise UNSUPPORTED on a read-only (http/https) remote."""
        if self._read_only:
            raise HostWeightError(
                failure(
                    ResolutionStage.REMOTE,
                    FailureCode.UNSUPPORTED,
                    f"{self._name} is read-only (http/https); push to s3://, gs:// or file:// instead",
                    provider_id=self._name,
                    object=relative,
                )
            )

    def write(self, relative: str, data: bytes) -> None:
        """Write a small object whole. On local files it appears by rename, so no reader sees half of it."""
        self.require_writable(relative)
        target = self.path(relative)
        if self._local:
            folder = target.rsplit("/", 1)[0]
            self._call("makedirs", "creating the folder for", relative, folder, exist_ok=True)
            temporary = f"{folder}/.{relative.rsplit('/', 1)[-1]}.{os.getpid()}.tmp"
            self._call("pipe_file", "writing", relative, temporary, data)
            self._call("mv", "renaming into place", relative, temporary, target)
            return
        self._call("pipe_file", "writing", relative, target, data)

    def upload(self, local_path: str, relative: str) -> None:
        """Copy one local file to the remote (multipart on object stores); no whole-call timeout."""
        self.require_writable(relative)
        target = self.path(relative)
        if self._local:
            folder = target.rsplit("/", 1)[0]
            self._call("makedirs", "creating the folder for", relative, folder, exist_ok=True)
        self._call("put_file", "uploading", relative, local_path, target, timeout=False)

    def upload_files(self, pairs: Sequence[tuple[str, str]]) -> None:
        """Copy local files to the remote in one call, as a plain `fs.put` of them does: concurrently on
        object stores (multipart each), by the kernel (sendfile) on local folders; no whole-call timeout."""
        if not pairs:
            return
        first = pairs[0][1]
        for _, relative in pairs:
            self.require_writable(relative)
        try:
            fault_point("remote.upload")
        except OSError as exc:
            self._raise_typed(exc, "uploading", first)
        targets = [self.path(relative) for _, relative in pairs]
        if self._local:
            for folder in sorted({target.rsplit("/", 1)[0] for target in targets}):
                self._call("makedirs", "creating the folder for", first, folder, exist_ok=True)
        self._call("put", "uploading", first, [local for local, _ in pairs], targets, timeout=False)

    def remove(self, relative: str) -> None:
        self.require_writable(relative)
        self._call("rm_file", "removing", relative, self.path(relative))

    def remove_if_present(self, relative: str) -> None:
        """Remove an object this process wrote; one already gone is fine."""
        if self.size_of(relative) is not None:
            self.remove(relative)

    def remove_empty_folder(self, relative: str) -> None:
        """Remove a key folder left empty on a file:// remote (object stores have no folders to remove)."""
        if self._local:
            with contextlib.suppress(OSError):  # not empty (another writer) or already gone: leave it
                os.rmdir(self.path(relative))


def _with_timeouts(scheme: str, options: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """Add socket-level timeouts and bounded retries for the backends we know, never overriding the caller's."""
    options.setdefault("skip_instance_cache", True)
    if scheme in ("s3", "s3a"):
        config = dict(options.get("config_kwargs") or {})
        config.setdefault("connect_timeout", timeout_s)
        config.setdefault("read_timeout", timeout_s)
        config.setdefault("retries", {"max_attempts": 2, "mode": "standard"})
        options["config_kwargs"] = config
    elif scheme in ("http", "https"):
        client = dict(options.get("client_kwargs") or {})
        if "timeout" not in client:
            import aiohttp

            client["timeout"] = aiohttp.ClientTimeout(total=None, sock_connect=timeout_s, sock_read=timeout_s)
        options["client_kwargs"] = client
    return options


def _config_error(message: str, name: str) -> HostWeightError:
    return HostWeightError(
        failure(ResolutionStage.CONFIGURATION, FailureCode.INVALID_CONFIGURATION, message, provider_id=name)
    )

"""Remote URLs as configuration sees them: checked for secrets and named without them (no backend imported).

A contract of its own so that `config` can refuse a bad HWR_REMOTE value when it is
read, and `remote` names every location the same way.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from .failures import usage_error

__all__ = ["DEFAULT_TIMEOUT_S", "READ_ONLY_SCHEMES", "SUPPORTED_SCHEMES", "check_remote_url", "is_writable_url"]

# Seconds one network request (a metadata call, one ranged read) may take (HWR_REMOTE_TIMEOUT_S).
DEFAULT_TIMEOUT_S = 30.0
READ_ONLY_SCHEMES = frozenset({"http", "https"})
# The backends an artifact remote is tested on; any other scheme (ftp://, sftp://, memory://) is refused
# before a backend is imported, so a typo never reaches a socket or a surprising filesystem.
SUPPORTED_SCHEMES = frozenset({"s3", "s3a", "gs", "gcs", "file", "http", "https"})
_SUPPORTED_SPELLED = "s3://bucket/prefix, gs://bucket/prefix, file:///absolute/path or https://host/prefix (read-only)"


def check_remote_url(url: str) -> str:
    """The URL's secret-free name (scheme://host/path); raise `HostWeightUsageError` (a ValueError) otherwise.

    Credentials belong in the backend's own configuration (AWS environment, profiles,
    storage options), so a URL with user info or a query string (a signed URL) is
    refused without echoing it; so is a scheme no backend here is tested on, and a
    file:// URL that is not absolute.
    """
    if type(url) is not str or not url.strip():
        raise usage_error(f"a remote URL must be a non-empty string such as {_SUPPORTED_SPELLED}")
    try:
        parts = urlsplit(url.strip())
    except ValueError:
        raise usage_error("the remote URL cannot be parsed; give scheme://host/prefix") from None
    if not parts.scheme or len(parts.scheme) < 2:
        raise usage_error(f"a remote URL needs a scheme: {_SUPPORTED_SPELLED}")
    if "@" in parts.netloc:
        raise usage_error(
            "the remote URL carries credentials (user@ or user:password@); remove them and use the backend's own "
            "credentials (AWS_* environment variables, a profile, or storage options)"
        )
    if parts.query or parts.fragment:
        raise usage_error(
            "the remote URL carries a query string or fragment (a signed URL?); give the plain prefix URL and "
            "configure credentials through the backend instead"
        )
    scheme = parts.scheme.lower()
    if scheme not in SUPPORTED_SCHEMES:
        raise usage_error(
            f"remote URLs with the scheme {_printable(scheme)}:// are not supported; give {_SUPPORTED_SPELLED}",
            scheme=_printable(scheme),
        )
    if scheme == "file" and (parts.netloc not in ("", "localhost") or not parts.path.startswith("/")):
        raise usage_error(
            "a file:// remote needs an absolute path with three slashes, such as file:///shared/hwr "
            "(file://name/... would name a folder relative to the current directory)"
        )
    if scheme != "file" and not parts.netloc:
        raise usage_error(f"the remote URL names no bucket or host after {scheme}://; give {_SUPPORTED_SPELLED}")
    name = f"{scheme}://{parts.netloc}{parts.path}"
    return name.rstrip("/") if parts.path not in ("", "/") else name


def is_writable_url(url: str) -> bool:
    """Whether artifacts can be pushed to this (checked) URL: every scheme but plain HTTP(S)."""
    return check_remote_url(url).split("://", 1)[0] not in READ_ONLY_SCHEMES


def _printable(text: str, limit: int = 32) -> str:
    """A scheme as a message may echo it: printable ASCII only, bounded."""
    cleaned = "".join(char if char.isascii() and char.isprintable() else "?" for char in text)
    return cleaned if len(cleaned) <= limit else cleaned[:limit] + "..."

"""Remote URLs as configuration sees them: checked for secrets and named without them (no backend imported).

A contract of its own so that `config` can refuse a bad HWR_REMOTE value when it is
read, and `remote` names every location the same way.
"""

from __future__ import annotations

from urllib.parse import urlsplit

__all__ = ["DEFAULT_TIMEOUT_S", "READ_ONLY_SCHEMES", "check_remote_url", "is_writable_url"]

# Seconds one network request (a metadata call, one ranged read) may take (HWR_REMOTE_TIMEOUT_S).
DEFAULT_TIMEOUT_S = 30.0
READ_ONLY_SCHEMES = frozenset({"http", "https"})


def check_remote_url(url: str) -> str:
    """The URL's secret-free name (scheme://host/path); raise ValueError for a URL that carries secrets.

    Credentials belong in the backend's own configuration (AWS environment, profiles,
    storage options), so a URL with user info or a query string (a signed URL) is
    refused without echoing it.
    """
    if type(url) is not str or not url.strip():
        raise ValueError("a remote URL must be a non-empty string such as s3://bucket/prefix or file:///shared/hwr")
    try:
        parts = urlsplit(url.strip())
    except ValueError:
        raise ValueError("the remote URL cannot be parsed; give scheme://host/prefix") from None
    if not parts.scheme or len(parts.scheme) < 2:
        raise ValueError("a remote URL needs a scheme: s3://bucket/prefix, gs://..., https://... or file:///path")
    if "@" in parts.netloc:
        raise ValueError(
            "the remote URL carries credentials (user@ or user:password@); remove them and use the backend's own "
            "credentials (AWS_* environment variables, a profile, or storage options)"
        )
    if parts.query or parts.fragment:
        raise ValueError(
            "the remote URL carries a query string or fragment (a signed URL?); give the plain prefix URL and "
            "configure credentials through the backend instead"
        )
    name = f"{parts.scheme.lower()}://{parts.netloc}{parts.path}"
    return name.rstrip("/") if parts.path not in ("", "/") else name


def is_writable_url(url: str) -> bool:
    """Whether artifacts can be pushed to this (checked) URL: every scheme but plain HTTP(S)."""
    return check_remote_url(url).split("://", 1)[0] not in READ_ONLY_SCHEMES

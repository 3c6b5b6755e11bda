"""`hwr remote ls URL`: what a remote holds, each key COMPLETE, INCOMPLETE (no descriptor yet) or INVALID.

Also the remote settings `hwr push` shares: the S3 endpoint (`--endpoint-url`, else
HWR_REMOTE_ENDPOINT_URL) and the per-request timeout (`--timeout`, else
HWR_REMOTE_TIMEOUT_S). Credentials come only from the backend's own configuration (AWS_*
variables, profiles); nothing here prints them.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from rich.table import Table
from rich.text import Text

from ..config import ENV_REMOTE_ENDPOINT_URL, ENV_REMOTE_TIMEOUT, HostWeightRuntimeConfig
from ..failures import FailureCode, HostWeightError, HostWeightUsageError
from ._command import Subcommands, add_command, positive_float
from ._output import EXIT_FAILURE, EXIT_OK, UsageError, add_json_option, print_json, short_key, size, stdout_console

if TYPE_CHECKING:
    from ..remote import RemoteArtifactListing

__all__ = ["RemoteSettings", "add_remote_options", "register", "remote_settings", "run", "usage_on_unsupported"]

_T = TypeVar("_T")


def add_remote_options(parser: argparse.ArgumentParser) -> None:
    """The options every command that talks to a remote offers."""
    parser.add_argument(
        "--endpoint-url",
        default=None,
        metavar="URL",
        help=f"S3 endpoint for s3:// URLs, e.g. http://127.0.0.1:9000 (default: ${ENV_REMOTE_ENDPOINT_URL})",
    )
    parser.add_argument(
        "--timeout",
        type=positive_float,
        default=None,
        metavar="S",
        help=f"seconds one network request may take (default: ${ENV_REMOTE_TIMEOUT}, else 30)",
    )


class RemoteSettings:
    """The endpoint and timeout a command uses, and the fsspec storage options they make for a URL."""

    __slots__ = ("endpoint_url", "timeout_s")

    def __init__(self, endpoint_url: str | None, timeout_s: float) -> None:
        self.endpoint_url = endpoint_url
        self.timeout_s = timeout_s

    def storage_options(self, url: str) -> dict[str, Any]:
        from ..remote import storage_options_for

        return storage_options_for(url, endpoint_url=self.endpoint_url)


def remote_settings(args: argparse.Namespace) -> RemoteSettings:
    """--endpoint-url and --timeout, else the HWR_REMOTE_* variables (checked as the library checks them)."""
    names = (ENV_REMOTE_ENDPOINT_URL, ENV_REMOTE_TIMEOUT)
    config = HostWeightRuntimeConfig.from_env({name: os.environ[name] for name in names if name in os.environ})
    values: dict[str, object] = {}
    if args.endpoint_url is not None:
        values["remote_endpoint_url"] = args.endpoint_url
    if args.timeout is not None:
        values["remote_timeout_s"] = args.timeout
    if values:
        try:
            checked = HostWeightRuntimeConfig.from_dict(values)
        except ValueError as exc:
            raise UsageError(f"{exc}") from None
        return RemoteSettings(
            checked.remote_endpoint_url if args.endpoint_url is not None else config.remote_endpoint_url,
            checked.remote_timeout_s if args.timeout is not None else config.remote_timeout_s,
        )
    return RemoteSettings(config.remote_endpoint_url, config.remote_timeout_s)


def usage_on_unsupported(action: Callable[[], _T]) -> _T:
    """Run `action`; a remote that cannot do what was asked (http(s) is read-only, unlistable) is a usage error."""
    try:
        return action()
    except HostWeightError as exc:
        if exc.failure.code is FailureCode.UNSUPPORTED:
            raise UsageError(exc.failure.message) from None
        raise


def register(commands: Subcommands) -> None:
    """Add `hwr remote ls URL [--endpoint-url URL] [--timeout S] [--json]`."""
    sub = add_command(commands, "remote", run, "list what a remote (s3://, gs://, file://) holds")
    actions = sub.add_subparsers(dest="remote_command", required=True, metavar="ACTION")
    listing = actions.add_parser(
        "ls",
        help="every artifact key under a remote URL: complete, incomplete (no descriptor) or invalid",
        description="every artifact key under a remote URL: complete, incomplete (no descriptor) or invalid",
    )
    listing.add_argument("url", help="remote URL, e.g. s3://bucket/prefix or file:///shared/hwr")
    add_remote_options(listing)
    add_json_option(listing)


def run(args: argparse.Namespace) -> int:
    """Dispatch `hwr remote ACTION` (only `ls` so far)."""
    assert args.remote_command == "ls"
    return _list(args)


def _list(args: argparse.Namespace) -> int:
    """List the remote; exit 0 once it could be listed, whatever state its keys are in, else 1."""
    from ..remote import check_remote_url, list_remote

    name = check_remote_url(args.url)
    settings = remote_settings(args)
    started = time.monotonic()
    try:
        listings = usage_on_unsupported(
            lambda: list_remote(
                args.url, storage_options=settings.storage_options(args.url), timeout_s=settings.timeout_s
            )
        )
    except HostWeightUsageError:
        raise
    except HostWeightError as exc:
        if not args.json:
            raise
        print_json({"remote": name, "failure": exc.failure.to_dict()})
        return EXIT_FAILURE
    if args.json:
        print_json(
            {
                "remote": name,
                "artifacts": [listing.to_dict() for listing in listings],
                "elapsed_s": time.monotonic() - started,
            }
        )
        return EXIT_OK
    _render(name, listings)
    return EXIT_OK


_STATE_STYLE = {"complete": "green", "incomplete": "yellow", "invalid": "red bold"}


def _render(name: str, listings: tuple[RemoteArtifactListing, ...]) -> None:
    console = stdout_console()
    if not listings:
        console.print(Text(f"{name}: no artifacts"))
        return
    table = Table(title=f"{name}: {len(listings)} artifact key(s)", title_justify="left")
    for column in ("key", "state", "model", "size", "files", "detail"):
        table.add_column(column, justify="right" if column in ("size", "files") else "left")
    for listing in listings:
        state = listing.state.value
        if listing.problem is not None:
            detail = f"{listing.problem.code.value}: {listing.problem.message}"
        elif state == "incomplete":
            detail = "no descriptor: an upload is running or died; `hwr push` completes it"
        else:
            detail = ""
        table.add_row(
            short_key(listing.key),
            Text(state, style=_STATE_STYLE.get(state, "")),
            listing.model_id or "-",
            size(listing.total_bytes) if state == "complete" else "-",
            str(listing.file_count) if state == "complete" else "-",
            Text(detail),
        )
    console.print(table)

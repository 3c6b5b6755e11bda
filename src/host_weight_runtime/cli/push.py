"""`hwr push KEY --to URL`: upload a published artifact to a remote, verified first, descriptor last."""

from __future__ import annotations

import argparse
import sys
import time
from typing import TYPE_CHECKING

from rich.text import Text

from ..failures import HostWeightError
from ._command import Subcommands, add_command
from ._domain import add_key_argument, add_root_option, domain_root, open_existing, resolve_key
from ._output import (
    EXIT_FAILURE,
    EXIT_OK,
    add_json_option,
    print_json,
    seconds,
    short_key,
    size,
    stderr_console,
    stdout_console,
)
from .remote import add_remote_options, remote_settings, usage_on_unsupported

if TYPE_CHECKING:
    from ..remote import PushResult

__all__ = ["PUSH_LOCK_TIMEOUT_S", "register", "run"]

PUSH_LOCK_TIMEOUT_S = 60.0


def register(commands: Subcommands) -> None:
    """Add `hwr push KEY --to URL [--root DIR] [--endpoint-url URL] [--timeout S] [--json]`."""
    sub = add_command(
        commands,
        "push",
        run,
        "upload a published artifact to a remote (s3://, gs://, file://) after re-hashing every byte",
    )
    add_key_argument(sub)
    sub.add_argument("--to", required=True, metavar="URL", help="remote URL, e.g. s3://bucket/prefix")
    add_root_option(sub)
    add_remote_options(sub)
    add_json_option(sub)


def run(args: argparse.Namespace) -> int:
    """Verify the local artifact with FULL_CHECKSUM, upload it, write the descriptor; exit 1 on a failure."""
    from ..remote import check_remote_url, push_artifact

    name = check_remote_url(args.to)
    settings = remote_settings(args)
    store = open_existing(domain_root(args.root))
    key = resolve_key(store, args.key)

    def push() -> PushResult:
        return usage_on_unsupported(
            lambda: push_artifact(
                store,
                key,
                args.to,
                storage_options=settings.storage_options(args.to),
                timeout_s=settings.timeout_s,
                deadline=time.monotonic() + PUSH_LOCK_TIMEOUT_S,
            )
        )

    try:
        if not args.json and sys.stderr.isatty():
            with stderr_console().status(f"pushing {short_key(key)} to {name} (verifying, then uploading)"):
                result = push()
        else:
            result = push()
    except HostWeightError as exc:
        if not args.json:
            raise
        print_json({"key": key, "remote": name, "status": "failed", "failure": exc.failure.to_dict()})
        return EXIT_FAILURE
    if args.json:
        print_json(result.to_dict())
        return EXIT_OK
    line = Text()
    line.append(f"{result.status.value} ", style="green bold")
    if result.bytes_uploaded:
        line.append(
            f"{result.key} -> {result.remote}  {size(result.total_bytes)} of payloads in {seconds(result.elapsed_s)}"
        )
    else:
        line.append(f"{result.key} at {result.remote}: the remote already holds these exact bytes")
    stdout_console().print(line)
    return EXIT_OK

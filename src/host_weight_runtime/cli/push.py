"""`hwr push KEY --to URL` / `hwr push --all --to URL`: upload published artifacts, verified first, descriptor last."""

from __future__ import annotations

import argparse
import sys
import time
from typing import TYPE_CHECKING

from rich.text import Text

from ..failures import HostWeightError, HostWeightUsageError
from ._command import Subcommands, add_command
from ._domain import add_root_option, domain_root, open_existing, resolve_key
from ._output import (
    EXIT_FAILURE,
    EXIT_OK,
    UsageError,
    add_json_option,
    failure_message,
    print_json,
    seconds,
    short_key,
    size,
    stderr_console,
    stdout_console,
)
from .remote import add_remote_options, remote_settings, usage_on_unsupported

if TYPE_CHECKING:
    from ..filesystem.store import FilesystemHostWeightStore
    from ..remote import PushAllOutcome, PushResult
    from .remote import RemoteSettings

__all__ = ["PUSH_LOCK_TIMEOUT_S", "register", "run"]

PUSH_LOCK_TIMEOUT_S = 60.0


def register(commands: Subcommands) -> None:
    """Add `hwr push (KEY | --all) --to URL [--root DIR] [--endpoint-url URL] [--timeout S] [--json]`."""
    sub = add_command(
        commands,
        "push",
        run,
        "upload published artifacts to a remote (s3://, gs://, file://) after re-hashing every byte",
    )
    sub.add_argument("key", nargs="?", help="artifact key, or a unique prefix of it (see `hwr inspect`)")
    sub.add_argument(
        "--all",
        action="store_true",
        help="push every complete local artifact the remote lacks (those it holds are reported already_present)",
    )
    sub.add_argument("--to", required=True, metavar="URL", help="remote URL, e.g. s3://bucket/prefix")
    add_root_option(sub)
    add_remote_options(sub)
    add_json_option(sub)


def run(args: argparse.Namespace) -> int:
    """Push one key or every key; exit 1 when a push failed, 2 for a URL or command line that cannot work."""
    from ..remote import check_remote_url

    if args.all == (args.key is not None):
        raise UsageError("give either an artifact KEY or --all (not both)")
    name = check_remote_url(args.to)
    settings = remote_settings(args)
    store = open_existing(domain_root(args.root))
    if args.all:
        return _push_all(args, store, name, settings)
    return _push_one(args, store, name, settings)


def _push_one(args: argparse.Namespace, store: FilesystemHostWeightStore, name: str, settings: RemoteSettings) -> int:
    from ..remote import push_artifact

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
            with stderr_console().status(f"pushing {short_key(key)} to {name} (and checking the local copy)"):
                result = push()
        else:
            result = push()
    except HostWeightUsageError:
        raise
    except HostWeightError as exc:
        if not args.json:
            raise
        print_json({"key": key, "remote": name, "status": "failed", "failure": exc.failure.to_dict()})
        return EXIT_FAILURE
    if args.json:
        print_json(result.to_dict())
        return EXIT_OK
    stdout_console().print(_result_line(result))
    return EXIT_OK


def _push_all(args: argparse.Namespace, store: FilesystemHostWeightStore, name: str, settings: RemoteSettings) -> int:
    from ..remote import push_all_artifacts

    def show(outcome: PushAllOutcome) -> None:
        if args.json:
            return
        if outcome.result is not None:
            stdout_console().print(_result_line(outcome.result))
        else:
            assert outcome.failure is not None
            line = Text()
            line.append("failed ", style="red bold")
            line.append(f"{outcome.key}: [{outcome.failure.code.value}] {failure_message(outcome.failure)}")
            stdout_console().print(line)

    started = time.monotonic()
    outcomes = usage_on_unsupported(
        lambda: push_all_artifacts(
            store,
            args.to,
            storage_options=settings.storage_options(args.to),
            timeout_s=settings.timeout_s,
            lock_timeout_s=PUSH_LOCK_TIMEOUT_S,
            on_outcome=show,
        )
    )
    failed = sum(1 for outcome in outcomes if outcome.failure is not None)
    if args.json:
        print_json(
            {
                "remote": name,
                "artifacts": [outcome.to_dict() for outcome in outcomes],
                "failed": failed,
                "elapsed_s": time.monotonic() - started,
            }
        )
    elif not outcomes:
        stdout_console().print(Text(f"no complete artifact in {store.root} to push"))
    return EXIT_FAILURE if failed else EXIT_OK


def _result_line(result: PushResult) -> Text:
    line = Text()
    line.append(f"{result.status.value} ", style="green bold")
    if result.bytes_uploaded:
        line.append(
            f"{result.key} -> {result.remote}  {size(result.total_bytes)} of payloads in {seconds(result.elapsed_s)}"
        )
        line.append(" (re-hashed)" if result.rehashed else " (hashed on this node before)", style="dim")
    else:
        line.append(f"{result.key} at {result.remote}: the remote already holds these exact bytes")
    return line

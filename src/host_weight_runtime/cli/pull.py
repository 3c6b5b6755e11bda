"""`hwr pull REPO --revision R`: import an artifact by name on a node that holds nothing of the model.

The remote's name index (written by `hwr push`) maps repo id, pinned revision, component,
variant and dtype to an artifact key; the import is then verified as any other (every byte
against the manifest, before the atomic rename). Only commit hashes are accepted unless
`--allow-unpinned-revision` is given.
"""

from __future__ import annotations

import argparse
import os

from rich.text import Text

from ..config import ENV_REMOTE
from ..failures import HostWeightError, HostWeightUsageError
from ..outcomes import StoreStatus
from ._command import Subcommands, add_command
from ._domain import add_root_option, domain_root
from ._output import (
    EXIT_FAILURE,
    EXIT_OK,
    UsageError,
    add_json_option,
    failure_message,
    print_json,
    seconds,
    stdout_console,
)
from .remote import add_remote_options, remote_settings, usage_on_unsupported

__all__ = ["register", "run"]


def register(commands: Subcommands) -> None:
    """Add `hwr pull REPO --revision R [--subfolder S] [--variant V] [--dtype D] [--from URL] [--root DIR]`."""
    sub = add_command(
        commands,
        "pull",
        run,
        "import an artifact by repo id and pinned revision from a remote's name index (no checkpoint needed)",
    )
    sub.add_argument("repo", metavar="REPO", help="Hugging Face repo id, e.g. black-forest-labs/FLUX.1-dev")
    sub.add_argument("--revision", required=True, help="the 40-hex commit hash the artifact was built from")
    sub.add_argument("--subfolder", default=None, help="the component's folder in the repo, e.g. transformer")
    sub.add_argument("--variant", default=None, help="the weights variant the artifact was built from, e.g. fp16")
    sub.add_argument("--dtype", default="bfloat16", help="the artifact's dtype (default bfloat16)")
    sub.add_argument(
        "--from",
        dest="remote",
        default=None,
        metavar="URL",
        help=f"remote URL (default: the first URL of ${ENV_REMOTE})",
    )
    sub.add_argument(
        "--allow-unpinned-revision",
        action="store_true",
        help="accept a branch or tag name (it may move: the index then says which checkpoint it means)",
    )
    add_root_option(sub)
    add_remote_options(sub)
    add_json_option(sub)


def run(args: argparse.Namespace) -> int:
    """Look the name up, import the key it maps to; exit 1 when the remote lacks it or the import fails."""
    from ..remote import ArtifactName, check_remote_url, pull_by_name

    url = args.remote or next((item.strip() for item in os.environ.get(ENV_REMOTE, "").split(",") if item.strip()), "")
    if not url:
        raise UsageError(f"give the remote with --from URL or set {ENV_REMOTE}")
    remote_name = check_remote_url(url)
    name = ArtifactName(args.repo, args.revision, args.subfolder, args.variant, args.dtype)
    settings = remote_settings(args)
    store_root = domain_root(args.root)
    from ..filesystem.store import FilesystemHostWeightStore

    store = FilesystemHostWeightStore(store_root)
    try:
        pulled = usage_on_unsupported(
            lambda: pull_by_name(
                store,
                url,
                name,
                allow_unpinned_revision=args.allow_unpinned_revision,
                storage_options=settings.storage_options(url),
                timeout_s=settings.timeout_s,
            )
        )
    except HostWeightUsageError:
        raise
    except HostWeightError as exc:
        if not args.json:
            raise
        print_json(
            {"name": name.to_dict(), "remote": remote_name, "status": "failed", "failure": exc.failure.to_dict()}
        )
        return EXIT_FAILURE
    result = pulled.result
    if result.lease is not None:
        result.lease.close()
    ok = result.status in (StoreStatus.BUILT, StoreStatus.JOINED, StoreStatus.HIT)
    if args.json:
        print_json(
            {
                "name": name.to_dict(),
                "remote": remote_name,
                "key": pulled.key,
                "status": result.status.value,
                "elapsed_s": result.elapsed_s,
                "failure": None if result.failure is None else result.failure.to_dict(),
            }
        )
        return EXIT_OK if ok else EXIT_FAILURE
    line = Text()
    if ok:
        line.append(f"{result.status.value} ", style="green bold")
        line.append(f"{name} -> {pulled.key} from {remote_name} in {seconds(result.elapsed_s)} ({store.root})")
        stdout_console().print(line)
        return EXIT_OK
    assert result.failure is not None
    line.append("failed ", style="red bold")
    line.append(f"{name}: [{result.failure.code.value}] {failure_message(result.failure)}")
    stdout_console().print(line)
    return EXIT_FAILURE

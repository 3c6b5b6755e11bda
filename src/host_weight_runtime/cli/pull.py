"""`hwr pull REPO --revision R`: import an artifact by name on a node that holds nothing of the model.

The remote's name index (written by `hwr push`) maps repo id, pinned revision, component,
variant and dtype to an artifact key; the import is then verified as any other (every byte
against the manifest, before the atomic rename). Only commit hashes are accepted unless
`--allow-unpinned-revision` is given.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rich.text import Text

from ..config import ENV_REMOTE
from ..failures import HostWeightError, HostWeightFailure, HostWeightUsageError
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

if TYPE_CHECKING:
    from ..filesystem.store import FilesystemHostWeightStore
    from ..remote import ArtifactName

__all__ = ["register", "run"]


_FP8_DTYPE = "float8_e4m3fn"
"""The dtype an FP8 artifact's name carries (its representation's: float8 weights, BF16 compute)."""


def register(commands: Subcommands) -> None:
    """Add `hwr pull REPO --revision R [--subfolder S] [--variant V] [--dtype D] [--representation bf16|fp8]
    [--tensor-parallel-size N] [--from URL] [--root DIR]`."""
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
        "--representation",
        choices=("bf16", "fp8"),
        default="bf16",
        help="bf16 (as --dtype says), or fp8: the artifact load_component(representation='fp8') serves",
    )
    sub.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        metavar="N",
        help="N >= 2: the replicated part and every rank's shard part of a TP=N load (as prewarm_tensor_parallel)",
    )
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


def _names(args: argparse.Namespace) -> tuple[ArtifactName, ...]:
    """The names the arguments ask for: one artifact, or every part of a TP=N load."""
    from ..remote import ArtifactName, tensor_parallel_names

    dtype = args.dtype
    if args.representation == "fp8":
        if args.dtype not in ("bfloat16", "torch.bfloat16"):
            raise UsageError(f"--representation fp8 serves BF16 compute; drop --dtype {args.dtype}")
        dtype = _FP8_DTYPE
    if type(args.tensor_parallel_size) is not int or args.tensor_parallel_size < 1:
        raise UsageError(f"--tensor-parallel-size is a positive int, got {args.tensor_parallel_size}")
    whole = ArtifactName(args.repo, args.revision, args.subfolder, args.variant, dtype)
    return tensor_parallel_names(whole, args.tensor_parallel_size)


@dataclass(frozen=True, slots=True)
class _Pulled:
    """What the pull of one name came to."""

    name: ArtifactName
    status: str
    key: str | None = None
    elapsed_s: float | None = None
    failure: HostWeightFailure | None = None

    @property
    def ok(self) -> bool:
        return self.status in (StoreStatus.BUILT.value, StoreStatus.JOINED.value, StoreStatus.HIT.value)

    def to_json(self) -> dict[str, Any]:
        found: dict[str, Any] = {"name": self.name.to_dict()}
        if self.key is not None:
            found.update(key=self.key)
        found.update(status=self.status)
        if self.elapsed_s is not None:
            found.update(elapsed_s=self.elapsed_s)
        return {**found, "failure": None if self.failure is None else self.failure.to_dict()}

    def line(self, remote_name: str, root: object) -> Text:
        line = Text()
        if self.ok:
            line.append(f"{self.status} ", style="green bold")
            line.append(f"{self.name} -> {self.key} from {remote_name} in {seconds(self.elapsed_s or 0.0)} ({root})")
            return line
        assert self.failure is not None
        line.append("failed ", style="red bold")
        line.append(f"{self.name}: [{self.failure.code.value}] {failure_message(self.failure)}")
        return line


def run(args: argparse.Namespace) -> int:
    """Look each name up, import the key it maps to; exit 1 when the remote lacks one or an import fails."""
    from ..remote import check_remote_url

    url = args.remote or next((item.strip() for item in os.environ.get(ENV_REMOTE, "").split(",") if item.strip()), "")
    if not url:
        raise UsageError(f"give the remote with --from URL or set {ENV_REMOTE}")
    remote_name = check_remote_url(url)
    names = _names(args)
    from ..filesystem.store import FilesystemHostWeightStore

    store = FilesystemHostWeightStore(domain_root(args.root))
    outcomes = [_pull_one(store, url, name, args) for name in names]
    if args.json:
        if len(outcomes) == 1:
            print_json({**outcomes[0].to_json(), "remote": remote_name})
        else:
            print_json({"remote": remote_name, "parts": [outcome.to_json() for outcome in outcomes]})
    else:
        for outcome in outcomes:
            stdout_console().print(outcome.line(remote_name, store.root))
    return EXIT_OK if all(outcome.ok for outcome in outcomes) else EXIT_FAILURE


def _pull_one(store: FilesystemHostWeightStore, url: str, name: ArtifactName, args: argparse.Namespace) -> _Pulled:
    """What the pull of one name came to; a usage error is raised, and so is a failure without --json."""
    from ..remote import pull_by_name

    settings = remote_settings(args)
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
        return _Pulled(name, "failed", failure=exc.failure)
    result = pulled.result
    if result.lease is not None:
        result.lease.close()
    return _Pulled(name, result.status.value, pulled.key, result.elapsed_s, result.failure)

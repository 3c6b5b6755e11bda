"""`hwr verify KEY`: validate one artifact read-only; exit 1 unless it is ready."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from rich.text import Text

from ..filesystem.inspection import ArtifactInspection, ArtifactState
from ..tensors import ValidationLevel
from ._command import Subcommands, add_command
from ._domain import add_key_argument, add_root_option, domain_root, open_existing, resolve_key
from ._output import (
    EXIT_FAILURE,
    EXIT_OK,
    add_json_option,
    byte_progress,
    print_json,
    short_key,
    size,
    stderr_console,
    stdout_console,
)

__all__ = ["VERIFY_LOCK_TIMEOUT_S", "register", "run"]

VERIFY_LOCK_TIMEOUT_S = 60.0


def register(commands: Subcommands) -> None:
    """Add `hwr verify KEY [--full] [--root DIR] [--json]`."""
    sub = add_command(commands, "verify", run, "validate one artifact read-only; exit 1 unless it is ready")
    add_key_argument(sub)
    sub.add_argument("--full", action="store_true", help="re-hash every payload byte (FULL_CHECKSUM)")
    add_root_option(sub)
    add_json_option(sub)


def run(args: argparse.Namespace) -> int:
    """Inspect the artifact at the requested validation level, with a hashing bar on a terminal."""
    store = open_existing(domain_root(args.root))
    key = resolve_key(store, args.key)
    validation = ValidationLevel.FULL_CHECKSUM if args.full else ValidationLevel.MANIFEST_AND_METADATA
    deadline = time.monotonic() + VERIFY_LOCK_TIMEOUT_S
    if args.full and sys.stderr.isatty():
        total = _payload_bytes(store.layout.artifact_dir(key))
        with byte_progress("hashing") as progress:
            task = progress.add_task(short_key(key), total=total or None)

            def advance(nbytes: int) -> None:
                progress.advance(task, nbytes)

            result = store.inspect_artifact(key, validation=validation, deadline=deadline, progress=advance)
    else:
        result = store.inspect_artifact(key, validation=validation, deadline=deadline)
    verified = result.state is ArtifactState.READY and result.problem is None
    record = store.background_verification(key)
    background = (
        record is not None and result.publication_id is not None and record.publication_id == result.publication_id
    )
    if args.json:
        print_json(
            {
                "validation": validation.value,
                "verified": verified,
                "background_verified": background,
                "background_verified_at_ns": record.verified_at_ns if background and record is not None else None,
                **result.to_dict(),
            }
        )
    else:
        _render_verify(verified, validation, result, background=background)
    return EXIT_OK if verified else EXIT_FAILURE


def _payload_bytes(directory: Path) -> int:
    """Bytes FULL_CHECKSUM hashes: every payload file, header included (the progress bar's total)."""
    total = 0
    try:
        with os.scandir(directory) as listing:
            for entry in listing:
                if entry.name.endswith(".safetensors") and entry.is_file(follow_symlinks=False):
                    total += entry.stat(follow_symlinks=False).st_size
    except OSError:
        return 0
    return total


def _render_verify(
    verified: bool, validation: ValidationLevel, result: ArtifactInspection, *, background: bool
) -> None:
    what = "every payload byte re-hashed" if validation is ValidationLevel.FULL_CHECKSUM else "manifest and metadata"
    if validation is ValidationLevel.MANIFEST_AND_METADATA:
        what += (
            "; payloads hashed on this node by a background verification"
            if background
            else "; payloads not hashed on this node yet: --full hashes them"
        )
    if verified:
        line = Text()
        line.append("ok ", style="green bold")
        line.append(
            f"{result.key}  {result.model_id or '-'}  {result.tensor_count} tensors  "
            f"{size(result.size_bytes)} on disk  ({what})"
        )
        stdout_console().print(line)
        return
    console = stderr_console()
    line = Text()
    line.append(f"{result.state.value} ", style="red bold")
    line.append(f"{result.key} ({what})")
    console.print(line)
    if result.state is ArtifactState.MISSING:
        console.print(Text(f"no artifact with this key at {result.path}; `hwr inspect` lists what is stored"))
    elif result.state is ArtifactState.TEMPORARY:
        console.print(Text(f"only a build in progress (or a dead builder's leftovers) at {result.path}"))
    if result.problem is not None:
        console.print(Text(f"{result.problem.code.value}: {result.problem.message}"))
    if result.state in (ArtifactState.INVALID, ArtifactState.DENIED):
        first = "a worker's lookup will deny it and " if result.state is ArtifactState.INVALID else ""
        console.print(
            Text(
                f"workers will not use it: {first}the next build quarantines and rebuilds it; "
                f"`hwr cleanup {short_key(result.key)}` removes it now"
            )
        )

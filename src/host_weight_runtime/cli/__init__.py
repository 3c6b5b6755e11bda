"""The `hwr` command: inspect, verify, clean and gc a domain, prewarm a model, push, pull and list remote artifacts,
run the demo and the benchmark.

Thin by design: parse arguments, call the library, print. One module per command, each
exposing `register(commands)` (see `_command`); every command prints through `_output`
(tables and progress bars for people, `--json` for machines). Exit codes: 0 success,
1 a failure the command reports, 2 a usage error (argparse's own, a bad key, a refused
unattended cleanup).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from .. import __version__
from ..config import ENV_ROOT, default_root
from . import bench, cleanup, demo, gc, inspect, prewarm, pull, push, remote, verify
from ._command import CommandModule, Handler
from ._output import run_command

__all__ = ["main"]

# The order is the order `hwr --help` lists them in; a new command is one module and one entry here.
COMMANDS: tuple[CommandModule, ...] = (inspect, verify, cleanup, gc, prewarm, push, pull, remote, demo, bench)


def build_parser() -> argparse.ArgumentParser:
    """The `hwr` parser, with one subcommand per module in COMMANDS."""
    parser = argparse.ArgumentParser(
        prog="hwr",
        description="Inspect, verify and clean a host weight runtime domain; run the sharing demo.",
        epilog=f"The domain root is --root, else ${ENV_ROOT}, else {default_root()}.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        command.register(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run `hwr`; returns the exit status (argparse exits 2 itself on a malformed command line)."""
    args, stray = build_parser().parse_known_args(argv)
    if stray:  # the command's own usage, not the top-level one: `hwr inspect --bogus` shows inspect's options
        command_parser: argparse.ArgumentParser = args.command_parser
        command_parser.error(f"unrecognized arguments: {' '.join(stray)}")
    handler: Handler = args.handler
    return run_command(args.command, lambda: handler(args), json_output=bool(getattr(args, "json", False)))

"""The interface every `hwr` command module follows, and the argument types they share.

A command module exposes `register(commands)`, which adds its subparser through
`add_command` (so the parsed namespace carries its handler) and its options.
Adding a command is one new module and one entry in `cli.COMMANDS`.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Protocol, TypeAlias

__all__ = ["CommandModule", "Handler", "Subcommands", "add_command", "positive_float", "positive_int"]

Handler: TypeAlias = Callable[[argparse.Namespace], int]
Subcommands: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"


class CommandModule(Protocol):
    """What `cli.main` needs from a command module (a module satisfies it by defining `register`)."""

    def register(self, commands: Subcommands) -> None:
        """Add this command's subparser, options and handler to `commands`."""


def add_command(commands: Subcommands, name: str, handler: Handler, help_text: str) -> argparse.ArgumentParser:
    """Add one subcommand whose parsed namespace carries `handler` (main calls it with the namespace)."""
    sub = commands.add_parser(name, help=help_text, description=help_text)
    sub.set_defaults(handler=handler, command_parser=sub)  # main reports a stray option with this usage
    return sub


def positive_int(text: str) -> int:
    """An argparse type: an integer of at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def positive_float(text: str) -> float:
    """An argparse type: a number greater than 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return value

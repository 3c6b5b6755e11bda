"""The one output layer every `hwr` command prints through.

Consoles, JSON emission, the byte progress bar, size/key/time formatting, the
confirmation prompt, the exit codes and the mapping from errors to exit codes live
here, so every command reports the same way and a new command cannot drift.
Exit codes: 0 success, 1 a failure the command reports, 2 a usage error.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from collections.abc import Callable

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)
from rich.prompt import Confirm
from rich.text import Text

from ..canonical_json import JsonValue
from ..failures import ArgumentHint, FailureCode, HostWeightError, HostWeightFailure, HostWeightUsageError

__all__ = [
    "EXIT_FAILURE",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_USAGE",
    "SHORT_KEY",
    "ReportedError",
    "UsageError",
    "add_json_option",
    "ago",


    "age",
    "byte_progress",
    "confirm",
    "failure_message",
    "limit",
    "option_spelling",
    "print_json",
    "run_command",
    "seconds",
    "short_key",
    "size",
    "stderr_console",
    "stdout_console",
    "timestamp",
    "wide_console",
]

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130

SHORT_KEY = 12
WIDE_COLUMNS = 1000


class UsageError(Exception):
    """A command line that cannot run as given (exit 2); the message says what to change."""


class ReportedError(Exception):
    """A failure the command reports in one line (exit 1); `code` is what `--json` reports it as."""

    def __init__(self, message: str, *, code: FailureCode | None = None) -> None:
        super().__init__(message)
        self.code = code


def stdout_console() -> Console:
    """Results go to stdout, without rich's guessed highlighting so keys and paths print as they are."""
    return Console(highlight=False, soft_wrap=True)


def wide_console() -> Console:
    """Results for `--wide`: every value in full on one line, however wide the terminal (like `ps ww`)."""
    return Console(highlight=False, soft_wrap=True, width=WIDE_COLUMNS)


def stderr_console() -> Console:
    """Failures, prompts' echoes and progress go to stderr, keeping stdout parseable."""
    return Console(stderr=True, highlight=False, soft_wrap=True)


def add_json_option(parser: argparse.ArgumentParser) -> None:
    """The `--json` switch every command that prints a result offers."""
    parser.add_argument("--json", action="store_true", help="print JSON for machines instead of tables")


def print_json(value: JsonValue) -> None:
    """The `--json` result: one indented document on stdout."""
    sys.stdout.write(json.dumps(value, indent=2) + "\n")
    sys.stdout.flush()


def short_key(key: str) -> str:
    """The key prefix tables show; `hwr verify` and `hwr cleanup` accept it back."""
    return key[:SHORT_KEY]


def size(nbytes: int | None) -> str:
    """Bytes in binary units for people ("-" when unknown)."""
    if nbytes is None:
        return "-"
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{nbytes} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")  # pragma: no cover


def limit(nbytes: int | None) -> str:
    """A capacity limit, where None means there is none."""
    return "unlimited" if nbytes is None else size(nbytes)


def seconds(value: float) -> str:
    """A duration for people."""
    return f"{value:.2f} s"


def ago(timestamp_ns: int | None, *, now_ns: int | None = None) -> str:
    """How long ago a wall-clock time (ns since the epoch) was, for people ("-" when unknown)."""
    if timestamp_ns is None:
        return "-"
    elapsed = max(0.0, ((time.time_ns() if now_ns is None else now_ns) - timestamp_ns) / 1e9)
    for unit, length in (("d", 86400.0), ("h", 3600.0), ("min", 60.0)):
        if elapsed >= length:
            return f"{elapsed / length:.1f} {unit} ago"
    return f"{elapsed:.0f} s ago"


def age(elapsed_ns: int) -> str:
    """How long ago, the way `hf cache scan` says it: 'just now', '5 min ago', '3 days ago'."""
    elapsed = max(elapsed_ns, 0) / 1e9
    for unit, plural, length in (
        ("year", "years", 365 * 86400),
        ("week", "weeks", 7 * 86400),
        ("day", "days", 86400),
        ("hour", "hours", 3600),
        ("min", "min", 60),
    ):
        count = int(elapsed // length)
        if count:
            return f"{count} {unit if count == 1 else plural} ago"
    return "just now"


def timestamp(ns: int) -> str:
    """A point in time in the local zone, to the second."""
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ns / 1e9))


def byte_progress(verb: str) -> Progress:
    """A transient progress bar on stderr for long byte-bound work (hashing, streaming)."""
    return Progress(
        TextColumn(verb + " {task.description}"),
        BarColumn(),
        DownloadColumn(binary_units=True),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=stderr_console(),
        transient=True,
    )


def confirm(question: str, console: Console) -> bool:
    """Ask a yes/no question on a terminal; no answer (end of input) means no."""
    try:
        return bool(Confirm.ask(question, default=False, console=console))
    except EOFError:
        return False


def option_spelling(name: str, value: str | None) -> str:
    """A library argument as the `hwr` option that sets it: subfolder='transformer' is `--subfolder transformer`."""
    option = "--" + name.replace("_", "-")
    return f"{option} ..." if value is None else f"{option} {shlex.quote(value)}"


def failure_message(problem: HostWeightFailure) -> str:
    """A failure's message, with a library hint (`subfolder="transformer"`) said as options (`--subfolder ...`)."""
    hinted = ArgumentHint.of(problem)
    if hinted is None:
        return problem.message
    text, hint = hinted
    return f"{text}; {hint.render(option_spelling)}"


def run_command(command: str, action: Callable[[], int], *, json_output: bool = False) -> int:
    """Run one command and map what it raises to a one-line message on stderr and an exit code.

    With `json_output` (`--json`) stdout also gets one JSON object, `{"error": {...}}`, carrying the
    failure code, so a script never has to parse the stderr line.
    """
    try:
        return action()
    except UsageError as exc:
        return _report_error(command, str(exc), FailureCode.INVALID_CONFIGURATION.value, EXIT_USAGE, json_output)
    except ReportedError as exc:
        code = exc.code.value if exc.code is not None else "failed"
        return _report_error(command, str(exc), code, EXIT_FAILURE, json_output)
    except HostWeightUsageError as exc:  # a bad argument or model folder: a usage error, whatever its family
        problem = exc.failure
        return _report_error(
            command, failure_message(problem), problem.code.value, EXIT_USAGE, json_output, failure=problem
        )
    except HostWeightError as exc:
        problem = exc.failure
        text = f"[{problem.code.value}] {failure_message(problem)}"
        return _report_error(command, text, problem.code.value, EXIT_FAILURE, json_output, failure=problem)
    except ValueError as exc:
        return _report_error(command, str(exc), FailureCode.INVALID_CONFIGURATION.value, EXIT_USAGE, json_output)
    except KeyboardInterrupt:
        stderr_console().print("interrupted")
        return EXIT_INTERRUPTED


def _report_error(
    command: str,
    text: str,
    code: str,
    exit_code: int,
    json_output: bool,
    *,
    failure: HostWeightFailure | None = None,
) -> int:
    """One line on stderr (`hwr COMMAND: message`), and with `--json` the same as a JSON object on stdout."""
    stderr_console().print(Text(f"hwr {command}: {_one_line(text)}"))
    if json_output:
        print_json(
            {
                "error": {
                    "command": command,
                    "code": code,
                    "message": text,
                    "exit_code": exit_code,
                    "failure": None if failure is None else failure.to_dict(),
                }
            }
        )
    return exit_code


def _one_line(text: str, limit: int = 2000) -> str:
    """A message as one line of bounded length: an echoed hostile argument cannot flood or forge lines."""
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."

"""The tools package (`hwr_tools`) is a separate install: the commands that run it say how to get it when it is absent.

`hwr bench` and `hwr demo` import it inside the command, so the rest of `hwr` and every worker import
only the runtime.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from ._output import UsageError

__all__ = ["TOOLS_PACKAGE", "tools_needed"]

TOOLS_PACKAGE = "hwr_tools"


@contextmanager
def tools_needed(command: str) -> Iterator[None]:
    """Around a command's import of the tools: a missing `hwr_tools` becomes a usage error naming the install."""
    try:
        yield
    except ModuleNotFoundError as exc:
        missing = exc.name or ""
        if missing != TOOLS_PACKAGE and not missing.startswith(TOOLS_PACKAGE + "."):
            raise
        raise UsageError(
            f"`hwr {command}` needs the tools package {TOOLS_PACKAGE}, which is not installed: "
            "run `make setup` in a checkout of this project, or `pip install -e tools` from its root"
        ) from exc

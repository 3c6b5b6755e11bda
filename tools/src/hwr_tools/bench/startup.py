"""How long `hwr inspect` takes in a fresh process, next to a bare `python -c pass`.

The read-only commands (`inspect`, `verify`, `cleanup`) must not import torch or diffusers,
so they start in a fraction of a second; this row keeps that visible. Each figure is the
wall time of one fresh interpreter, measured alternately so both see the same machine state.
"""

from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from ..common import JsonValue
from .goals import ratio
from .stats import Stats

__all__ = ["HEAVY_MODULES", "CliStartup", "measure_cli_startup"]

HEAVY_MODULES = ("torch", "diffusers")
_TIMEOUT_S = 120.0
_PROBE = (
    "import sys\n"
    "from host_weight_runtime.cli import main\n"
    "status = main(sys.argv[1:])\n"
    "print(' '.join(name for name in {heavy!r} if name in sys.modules) or '-', file=sys.stderr)\n"
    "sys.exit(status)\n"
)


@dataclass(frozen=True, slots=True)
class CliStartup:
    """Seconds per fresh process for `hwr inspect --root ROOT` and for `python -c pass`, and what it imported."""

    command: str
    inspect_s: tuple[float, ...]
    python_s: tuple[float, ...]
    heavy_imports: tuple[str, ...]

    def to_dict(self) -> dict[str, JsonValue]:
        inspect, python = Stats.of(self.inspect_s), Stats.of(self.python_s)
        return {
            "command": self.command,
            "inspect_s": inspect.to_dict(),
            "python_pass_s": python.to_dict(),
            "overhead_s": inspect.median - python.median,
            "vs_python": ratio(inspect.median, python.median),
            "heavy_imports": list(self.heavy_imports),
        }


def _wall(argv: list[str]) -> float:
    started = time.perf_counter()
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=_TIMEOUT_S)
    return time.perf_counter() - started


def measure_cli_startup(root: Path, runs: int) -> CliStartup:
    """`runs` fresh `hwr inspect` processes against the domain at `root`, alternating with `python -c pass`."""
    args = ["inspect", "--root", str(root)]
    command = [sys.executable, "-m", "host_weight_runtime.cli", *args]
    inspect: list[float] = []
    python: list[float] = []
    for _ in range(runs):
        python.append(_wall([sys.executable, "-c", "pass"]))
        inspect.append(_wall(command))
    probe = subprocess.run(
        [sys.executable, "-c", _PROBE.format(heavy=HEAVY_MODULES), *args],
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        timeout=_TIMEOUT_S,
    )
    heavy = probe.stderr.strip().splitlines()[-1] if probe.stderr.strip() else "-"
    return CliStartup(
        command="hwr inspect --root DOMAIN",
        inspect_s=tuple(inspect),
        python_s=tuple(python),
        heavy_imports=() if heavy == "-" else tuple(heavy.split()),
    )

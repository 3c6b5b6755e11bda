"""The README's diffusers example, run as written against a small real Flux pipeline folder."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from hwr_tools.synthetic_models import save_pipeline_folder

README = Path(__file__).resolve().parents[1] / "README.md"
EXAMPLE_MODEL = '"black-forest-labs/FLUX.1-dev"'


def _diffusers_example() -> str:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), flags=re.DOTALL)
    chosen = [block for block in blocks if "load_component" in block]
    assert chosen, "README.md has no ```python block that calls load_component"
    return str(chosen[0])


def _run(script: Path, root: Path) -> str:
    environment = {name: value for name, value in os.environ.items() if not name.startswith("HWR_")}
    environment["HWR_ROOT"] = str(root)
    completed = subprocess.run(
        [sys.executable, str(script)], env=environment, capture_output=True, text=True, timeout=240, check=False
    )
    assert completed.returncode == 0, completed.stderr
    return completed.stdout


def test_readme_diffusers_example_runs_as_written(tmp_path: Path) -> None:
    """D14: the README's load_component example, with the repo id swapped for a local pipeline folder: the first
    fresh process falls back canonically (and publishes), the second gets a local hit restored from the artifact."""
    source = _diffusers_example()
    assert EXAMPLE_MODEL in source
    pipeline = save_pipeline_folder(tmp_path / "pipeline", "flux")
    script = tmp_path / "example.py"
    script.write_text(source.replace(EXAMPLE_MODEL, repr(str(pipeline))), encoding="utf-8")
    root = tmp_path / "domain"
    first = _run(script, root).split()
    second = _run(script, root).split()
    assert first[:2] == ["canonical_fallback", "canonical"]
    assert second[:2] == ["local_hit", "artifact"]


def test_readme_pipeline_example_runs_as_written(tmp_path: Path) -> None:
    """P01/P02: the README's load_pipeline example, with the repo id swapped for a tiny real Flux pipeline folder:
    the first fresh process loads every weighted component canonically (and publishes), the second hits each."""
    from hwr_tools.synthetic_pipelines import save_tiny_pipeline

    blocks = re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), flags=re.DOTALL)
    chosen = [block for block in blocks if "load_pipeline(" in block]
    assert chosen and EXAMPLE_MODEL in chosen[0]
    pipeline = save_tiny_pipeline(tmp_path / "pipeline", "flux")
    script = tmp_path / "example.py"
    script.write_text(chosen[0].replace(EXAMPLE_MODEL, repr(str(pipeline))), encoding="utf-8")
    root = tmp_path / "domain"
    runs = [{line.split()[0]: line.split()[1:] for line in _run(script, root).splitlines()} for _ in range(2)]
    for run, outcome in zip(runs, ("canonical_fallback", "local_hit"), strict=True):
        assert run["transformer"][:2] == ["served", outcome] and run["vae"][:2] == ["served", outcome]
        assert run["tokenizer"] == ["unweighted"] and run["scheduler"] == ["unweighted"]

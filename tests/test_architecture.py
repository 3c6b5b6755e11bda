"""C08: the core package depends on nothing from the diffusion adapters, diffusers or torch's GPU/distributed parts.

Two independent checks: a static scan of every core source file (so a lazy import
inside a function is caught too), and a real interpreter that imports every core
module and then looks at sys.modules. Both discover modules at test time, so
modules added later are covered without editing this file.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

import host_weight_runtime

PACKAGE = "host_weight_runtime"
PACKAGE_DIR = Path(host_weight_runtime.__file__).resolve().parent
ADAPTER_PACKAGE = f"{PACKAGE}.diffusion"
FORBIDDEN_PREFIXES = (ADAPTER_PACKAGE, "diffusers", "torch.distributed", "torch.cuda")
# torch imports torch.cuda (and parts of torch.distributed) itself, so the runtime check
# can only speak for the packages torch does not pull in.
FORBIDDEN_AT_RUNTIME = (ADAPTER_PACKAGE, "diffusers")
IMPORT_FUNCTIONS = {"import_module", "__import__"}
CONTRACT_MODULES = {
    f"{PACKAGE}.{name}"
    for name in ("canonical_json", "_strict", "identity", "failures", "manifest", "config", "tensors", "outcomes", "_digest")
}


@dataclass(frozen=True)
class Violation:
    module: str
    line: int
    target: str

    def __str__(self) -> str:
        return f"{self.module}:{self.line} depends on {self.target}"


def _is_forbidden(name: str, prefixes: tuple[str, ...] = FORBIDDEN_PREFIXES) -> bool:
    return any(name == prefix or name.startswith(prefix + ".") for prefix in prefixes)


def module_name_for(path: Path, package_dir: Path = PACKAGE_DIR, package: str = PACKAGE) -> str:
    parts = list(path.relative_to(package_dir).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([package, *parts])


# The `hwr` command package is the application layer on top of both core and adapters
# (DESIGN: "nothing -> cli"); every module of it may reach the adapters, but only lazily.
CLI_PACKAGE = "cli"
CLI_MODULE = f"{PACKAGE}.{CLI_PACKAGE}"
# The tools behind `hwr demo` / `hwr bench` and the tests are a package of their own (`hwr_tools`, under
# tools/src); tests/test_tools_layout.py holds them to the public API and the runtime off them.
TOOLS_MODULE = "hwr_tools"


def core_source_files(package_dir: Path = PACKAGE_DIR) -> list[Path]:
    """Every .py file of the package except the diffusion adapters and the CLI package."""
    skipped = (package_dir / "diffusion", package_dir / CLI_PACKAGE)
    return sorted(p for p in package_dir.rglob("*.py") if not any(folder in p.parents for folder in skipped))


def cli_source_files(package_dir: Path = PACKAGE_DIR) -> list[Path]:
    """Every .py file of the CLI package, so a command module added later is checked too."""
    return sorted((package_dir / CLI_PACKAGE).rglob("*.py"))


def module_level_imports(source: str, module: str, is_package: bool) -> list[str]:
    """Imports executed when the module is imported (top-level statements only, not function bodies)."""
    found: list[str] = []
    for node in ast.parse(source).body:
        if isinstance(node, ast.Import):
            found.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _resolve_from(module, is_package, node.level, node.module)
            found.append(base)
            found.extend(f"{base}.{alias.name}" for alias in node.names if alias.name != "*")
    return found


def _resolve_from(module: str, is_package: bool, level: int, target: str | None) -> str:
    """The absolute module named by `from <level dots><target> import ...` inside `module`."""
    if level == 0:
        return target or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join([*base, target] if target else base)


def scan_source(source: str, module: str, is_package: bool) -> list[Violation]:
    """Imports (absolute, relative, lazy, importlib) and torch.cuda/torch.distributed attribute uses."""
    tree = ast.parse(source)
    found: list[Violation] = []
    torch_aliases: set[str] = set()
    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            for alias in node.names:
                targets.append(alias.name)
                if alias.name == "torch":
                    torch_aliases.add(alias.asname or "torch")
        elif isinstance(node, ast.ImportFrom):
            base = _resolve_from(module, is_package, node.level, node.module)
            targets.append(base)
            targets.extend(f"{base}.{alias.name}" for alias in node.names if alias.name != "*")
        elif isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
            if name in IMPORT_FUNCTIONS and node.args:
                first = node.args[0]
                if isinstance(first, ast.Constant) and isinstance(first.value, str):
                    targets.append(first.value)
        found.extend(Violation(module, node.lineno, t) for t in targets if _is_forbidden(t))
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in torch_aliases
            and _is_forbidden(f"torch.{node.attr}")
        ):
            found.append(Violation(module, node.lineno, f"torch.{node.attr}"))
    return found


def eager_adapter_imports(package_dir: Path = PACKAGE_DIR, package: str = PACKAGE) -> list[tuple[str, str]]:
    """(module, target) for every forbidden import a CLI module runs at import time."""
    found: list[tuple[str, str]] = []
    for path in cli_source_files(package_dir):
        module = module_name_for(path, package_dir, package)
        targets = module_level_imports(path.read_text(encoding="utf-8"), module, path.name == "__init__.py")
        found.extend((module, target) for target in targets if _is_forbidden(target))
    return found


def scan_package(package_dir: Path = PACKAGE_DIR, package: str = PACKAGE) -> tuple[list[str], list[Violation]]:
    modules: list[str] = []
    violations: list[Violation] = []
    for path in core_source_files(package_dir):
        module = module_name_for(path, package_dir, package)
        modules.append(module)
        violations.extend(scan_source(path.read_text(encoding="utf-8"), module, path.name == "__init__.py"))
    return modules, violations


def test_static_scan_finds_no_forbidden_imports() -> None:
    """C08: no core source file imports diffusion adapters, diffusers, torch.distributed or torch.cuda."""
    modules, violations = scan_package()
    assert set(modules) >= CONTRACT_MODULES, "the scan did not see the core modules"
    assert not any(_is_forbidden(m, (ADAPTER_PACKAGE,)) for m in modules)
    assert [str(v) for v in violations] == []


def test_application_layer_reaches_adapters_only_lazily() -> None:
    """C08: no module of the `hwr` package imports the diffusion adapters at import time, only inside commands."""
    scanned = {module_name_for(path) for path in cli_source_files()}
    assert {CLI_MODULE, f"{CLI_MODULE}.__main__", f"{CLI_MODULE}.prewarm"} <= scanned, "the scan missed the CLI"
    assert eager_adapter_imports() == []


def test_no_core_module_imports_the_application_layer() -> None:
    """C08: dependencies point up to the CLI and the tools only; no core module imports them."""
    for path in core_source_files():
        module = module_name_for(path)
        targets = module_level_imports(path.read_text(encoding="utf-8"), module, path.name == "__init__.py")
        assert not [t for t in targets if _is_forbidden(t, (CLI_MODULE, TOOLS_MODULE))], f"{module} imports the CLI or tools"


def test_cli_scan_covers_every_command_module(tmp_path: Path) -> None:
    """C08: the CLI check can fail: an eager adapter import in any CLI module is reported, a lazy one is not,
    and the core scan leaves the CLI package to it."""
    root = tmp_path / PACKAGE
    (root / CLI_PACKAGE).mkdir(parents=True)
    (root / "__init__.py").write_text("")
    (root / CLI_PACKAGE / "__init__.py").write_text("from . import lazy, eager\n")
    (root / CLI_PACKAGE / "lazy.py").write_text("def run():\n    from ..diffusion.loader import prewarm_component\n")
    (root / CLI_PACKAGE / "eager.py").write_text("import diffusers\nfrom ..diffusion import loader\n")
    assert eager_adapter_imports(root, PACKAGE) == [
        (f"{CLI_MODULE}.eager", "diffusers"),
        (f"{CLI_MODULE}.eager", ADAPTER_PACKAGE),
        (f"{CLI_MODULE}.eager", f"{ADAPTER_PACKAGE}.loader"),
    ]
    modules, violations = scan_package(root, PACKAGE)
    assert modules == [PACKAGE]
    assert violations == []


def test_module_level_import_scan_ignores_function_bodies() -> None:
    """C08: the lazy-import check can fail: a top-level adapter import is seen, a function-local one is not."""
    eager = "from .diffusion import loader\n"
    lazy = "def f():\n    from .diffusion import loader\n"
    assert "host_weight_runtime.diffusion" in module_level_imports(eager, "host_weight_runtime.cli", False)
    assert module_level_imports(lazy, "host_weight_runtime.cli", False) == []


@pytest.mark.parametrize(
    ("source", "module", "is_package", "expected"),
    [
        ("import diffusers", "host_weight_runtime.x", False, "diffusers"),
        ("import diffusers.models as m", "host_weight_runtime.x", False, "diffusers.models"),
        ("from diffusers import ModelMixin", "host_weight_runtime.x", False, "diffusers"),
        ("import torch.distributed as dist", "host_weight_runtime.x", False, "torch.distributed"),
        ("from torch import distributed", "host_weight_runtime.x", False, "torch.distributed"),
        ("from torch.cuda import Stream", "host_weight_runtime.x", False, "torch.cuda"),
        ("from .diffusion import contracts", "host_weight_runtime.x", False, "host_weight_runtime.diffusion"),
        ("from . import diffusion", "host_weight_runtime", True, "host_weight_runtime.diffusion"),
        ("from ..diffusion.model_contracts import M", "host_weight_runtime.filesystem.store", False,
         "host_weight_runtime.diffusion.model_contracts"),
        ("from .. import diffusion", "host_weight_runtime.filesystem", True, "host_weight_runtime.diffusion"),
        ("def f():\n    import diffusers\n", "host_weight_runtime.x", False, "diffusers"),
        ("import importlib\nimportlib.import_module('diffusers')", "host_weight_runtime.x", False, "diffusers"),
        ("__import__('torch.cuda')", "host_weight_runtime.x", False, "torch.cuda"),
        ("import torch\ntorch.cuda.is_available()", "host_weight_runtime.x", False, "torch.cuda"),
        ("import torch as t\nt.distributed.barrier()", "host_weight_runtime.x", False, "torch.distributed"),
    ],
)
def test_static_scanner_catches_each_import_form(source: str, module: str, is_package: bool, expected: str) -> None:
    """C08: the scanner itself detects every import form it is meant to forbid (so the scan can fail)."""
    targets = {v.target for v in scan_source(source, module, is_package)}
    assert expected in targets


@pytest.mark.parametrize(
    ("source", "module", "is_package"),
    [
        ("import torch\nx = torch.empty(1)", "host_weight_runtime.x", False),
        ("from .canonical_json import CanonicalJson", "host_weight_runtime.x", False),
        ("from ..identity import WeightArtifactIdentity", "host_weight_runtime.filesystem.store", False),
        ("import diffusers_like_name", "host_weight_runtime.x", False),
        ("from . import diffusion_helpers", "host_weight_runtime", True),
        ("cuda = 1\nprint(cuda)", "host_weight_runtime.x", False),
    ],
)
def test_static_scanner_allows_ordinary_imports(source: str, module: str, is_package: bool) -> None:
    """C08: core imports and look-alike names are not reported."""
    assert scan_source(source, module, is_package) == []


def test_scan_discovers_modules_added_later(tmp_path: Path) -> None:
    """C08: a new core module (even in a new subpackage) is scanned; the diffusion subpackage is not."""
    root = tmp_path / PACKAGE
    (root / "diffusion").mkdir(parents=True)
    (root / "newpkg").mkdir()
    (root / "__init__.py").write_text("")
    (root / "diffusion" / "__init__.py").write_text("import diffusers\n")
    (root / "newpkg" / "__init__.py").write_text("")
    (root / "newpkg" / "helper.py").write_text("from ..diffusion import models\n")
    modules, violations = scan_package(root, PACKAGE)
    assert f"{PACKAGE}.newpkg.helper" in modules
    assert not any(m.startswith(ADAPTER_PACKAGE) for m in modules)
    assert [(v.module, v.target) for v in violations] == [
        (f"{PACKAGE}.newpkg.helper", f"{ADAPTER_PACKAGE}"),
        (f"{PACKAGE}.newpkg.helper", f"{ADAPTER_PACKAGE}.models"),
    ]


_IMPORT_EVERYTHING = textwrap.dedent(
    """
    import importlib, json, pkgutil, sys

    PACKAGE = "host_weight_runtime"
    SKIP = ("host_weight_runtime.diffusion",)

    def skipped(name):
        return any(name == s or name.startswith(s + ".") for s in SKIP)

    imported, errors = [], []

    def walk(package):
        # pkgutil.walk_packages would import every package (diffusion included) to
        # recurse, so iterate level by level and skip before importing.
        for info in pkgutil.iter_modules(package.__path__, package.__name__ + "."):
            if skipped(info.name):
                continue
            try:
                module = importlib.import_module(info.name)
            except Exception as exc:
                errors.append(f"{info.name}: {type(exc).__name__}: {exc}")
                continue
            imported.append(info.name)
            if info.ispkg:
                walk(module)

    root = importlib.import_module(PACKAGE)
    imported.append(PACKAGE)
    walk(root)
    report = {"imported": imported, "errors": errors, "modules": sorted(sys.modules), "file": root.__file__}
    print(json.dumps(report))
    """
)


def test_importing_every_core_module_loads_no_adapter_or_diffusers() -> None:
    """C08: a fresh interpreter that imports every core module has no diffusers or diffusion module loaded."""
    # The child must import the same source tree as this test process.
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PACKAGE_DIR.parent), env.get("PYTHONPATH")]))
    completed = subprocess.run(
        [sys.executable, "-c", _IMPORT_EVERYTHING],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr
    report = json.loads(completed.stdout.strip().splitlines()[-1])
    assert report["errors"] == []
    imported = set(report["imported"])
    assert report["file"] == str(PACKAGE_DIR / "__init__.py")
    assert imported >= CONTRACT_MODULES
    loaded = [name for name in report["modules"] if _is_forbidden(name, FORBIDDEN_AT_RUNTIME)]
    assert loaded == []
    assert "diffusers" not in report["modules"]

"""C08: the tools (`hwr demo`, `hwr bench`, soak, synthetic models) are a package of their own that uses the runtime
only through its public API, and the runtime does not import them.

The benchmark, soak, demo and synthetic-model code lives in `hwr_tools` (tools/src, installed by `make setup`),
outside the `host_weight_runtime` import tree, so a worker imports only the runtime. A static scan of every
tools source file (function bodies and importlib calls included) checks that each name it takes from the
runtime is exported by `host_weight_runtime` or `host_weight_runtime.diffusion` (`__all__`), the named fault
seams of `_faults` aside. The runtime reaches the tools only inside the two commands that run them
(`hwr bench`, `hwr demo`), lazily.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

import host_weight_runtime
import hwr_tools

PACKAGE = "host_weight_runtime"
PACKAGE_DIR = Path(host_weight_runtime.__file__).resolve().parent
TOOLS = "hwr_tools"
TOOLS_DIR = Path(hwr_tools.__file__).resolve().parent
# The targeted measurements time the runtime's own steps (they wrap its private functions by name), so they
# alone may reach past the public API; everything else in the tools is held to it.
STUDIES = f"{TOOLS}.studies"
# The commands that run the tools; they import them inside the command, never at module level.
TOOL_COMMANDS = frozenset({f"{PACKAGE}.cli.bench", f"{PACKAGE}.cli.demo"})
DIFFUSION = f"{PACKAGE}.diffusion"
CLI = f"{PACKAGE}.cli"
# Fault seams are named on purpose so tools and tests can reach them (STYLE: fault injection).
SEAMS = f"{PACKAGE}._faults"
PUBLIC_MODULES = (PACKAGE, DIFFUSION)
IMPORT_FUNCTIONS = {"import_module", "__import__"}
TOOLING_WORDS = ("bench", "demo", "synthetic")

PublicNames = dict[str, frozenset[str]]


@dataclass(frozen=True)
class Violation:
    module: str
    line: int
    target: str

    def __str__(self) -> str:
        return f"{self.module}:{self.line} imports {self.target}, which is not public API"


def module_name_for(path: Path, package_dir: Path = PACKAGE_DIR, package: str = PACKAGE) -> str:
    parts = list(path.relative_to(package_dir).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([package, *parts])


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _resolve_from(module: str, is_package: bool, level: int, target: str | None) -> str:
    """The absolute module named by `from <level dots><target> import ...` inside `module`."""
    if level == 0:
        return target or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join([*base, target] if target else base)


def declared_all(init_file: Path) -> frozenset[str]:
    """The names a package's `__init__.py` lists in `__all__`, read without importing it."""
    for node in ast.parse(init_file.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return frozenset(ast.literal_eval(node.value))
    raise AssertionError(f"{init_file} declares no __all__")


def public_names(package_dir: Path = PACKAGE_DIR, package: str = PACKAGE) -> PublicNames:
    return {
        package: declared_all(package_dir / "__init__.py"),
        f"{package}.diffusion": declared_all(package_dir / "diffusion" / "__init__.py"),
    }


# The store's remove_tree (a public name of the store room, not of the front door), taken by hwr_tools/common.py
# so that no tool keeps a copy; the only exception, named exactly.
STORE_HELPERS = frozenset({f"{PACKAGE}.filesystem.remove_tree"})


def _module_allowed(name: str, package: str) -> bool:
    """A whole module a tool may import: another tool, or the fault seams."""
    return _within(name, TOOLS) or name == f"{package}._faults"


def scan_tool_source(
    source: str, module: str, is_package: bool, public: PublicNames, package: str = PACKAGE
) -> list[Violation]:
    """Every import of the product that is not a public name (absolute, relative, lazy or through importlib).

    `import host_weight_runtime` itself is reported too: attribute access past it cannot be checked.
    """
    found: list[Violation] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            base = _resolve_from(module, is_package, node.level, node.module)
            if not _within(base, package) or _module_allowed(base, package):
                continue
            for alias in node.names:
                target = f"{base}.{alias.name}"
                if _module_allowed(target, package) or alias.name in public.get(base, frozenset()):
                    continue
                if target in STORE_HELPERS and module == f"{TOOLS}.common":
                    continue
                found.append(Violation(module, node.lineno, target))
            continue
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.Call):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
            first = node.args[0] if node.args else None
            if called in IMPORT_FUNCTIONS and isinstance(first, ast.Constant) and isinstance(first.value, str):
                names = [first.value]
        found.extend(
            Violation(module, node.lineno, name)
            for name in names
            if _within(name, package) and not _module_allowed(name, package)
        )
    return found


def _sources_under(folder: Path) -> list[Path]:
    return sorted(folder.rglob("*.py"))


def test_tools_import_only_the_public_api() -> None:
    """C08: every tools module (the targeted measurements of `hwr_tools.studies` aside) takes from the product only
    names its two public `__init__` files export."""
    public = public_names()
    tools = [p for p in _sources_under(TOOLS_DIR) if not _within(module_name_for(p, TOOLS_DIR, TOOLS), STUDIES)]
    modules = {module_name_for(p, TOOLS_DIR, TOOLS) for p in tools}
    assert {f"{TOOLS}.demo_store", f"{TOOLS}.demo_diffusers", f"{TOOLS}.synthetic_models", f"{TOOLS}.bench.runner"} <= (
        modules
    ), "the scan did not see the tools"
    violations = [
        str(v)
        for path in tools
        for v in scan_tool_source(
            path.read_text(encoding="utf-8"), module_name_for(path, TOOLS_DIR, TOOLS), path.name == "__init__.py", public
        )
    ]
    assert violations == []


def test_no_runtime_module_is_tooling() -> None:
    """C08: no module of `host_weight_runtime` (the diffusion adapters included) is a benchmark, demo or synthetic model.

    The CLI's command modules (`cli/bench.py`, `cli/demo.py`) are named after their commands and only parse
    and print; they are the one place allowed to import the tools."""
    modules = [module_name_for(p) for p in _sources_under(PACKAGE_DIR)]
    assert any(_within(m, DIFFUSION) for m in modules), "the scan did not see the diffusion adapters"
    tooling = [
        m
        for m in modules
        if not _within(m, CLI) and any(word in part.lower() for part in m.split(".") for word in TOOLING_WORDS)
    ]
    assert tooling == []
    assert not (PACKAGE_DIR / "tools").exists()


def tool_imports(source: str, module: str, is_package: bool) -> list[tuple[int, bool]]:
    """Each import of `hwr_tools` in `source`: (line, whether it runs at module import)."""
    tree = ast.parse(source)
    top_level = {id(node) for node in tree.body}
    found: list[tuple[int, bool]] = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [_resolve_from(module, is_package, node.level, node.module)]
        elif isinstance(node, ast.Call):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
            first = node.args[0] if node.args else None
            if called in IMPORT_FUNCTIONS and isinstance(first, ast.Constant) and isinstance(first.value, str):
                names = [first.value]
        if any(_within(name, TOOLS) for name in names):
            found.append((node.lineno, id(node) in top_level))
    return found


def test_runtime_imports_the_tools_only_inside_their_commands() -> None:
    """C08: no runtime module imports `hwr_tools`, not even lazily, but `hwr bench` and `hwr demo` inside the command."""
    bad: list[str] = []
    seen: set[str] = set()
    for path in _sources_under(PACKAGE_DIR):
        module = module_name_for(path)
        for line, eager in tool_imports(path.read_text(encoding="utf-8"), module, path.name == "__init__.py"):
            seen.add(module)
            if module not in TOOL_COMMANDS or eager:
                bad.append(f"{module}:{line}")
    assert bad == []
    assert seen == TOOL_COMMANDS, "the scan did not see the two commands' imports"


def test_tool_import_scan_can_fail() -> None:
    """C08: an eager import, a lazy one and an importlib call of the tools are each found, a look-alike is not."""
    source = (
        "import hwr_tools.soak\n"
        "def f():\n    from hwr_tools.bench.runner import run_bench\n"
        "import importlib\nimportlib.import_module('hwr_tools.demo_store')\n"
        "import hwr_tools_like\n"
    )
    assert tool_imports(source, f"{PACKAGE}.x", False) == [(1, True), (3, False), (5, False)]


_PUBLIC: PublicNames = {PACKAGE: frozenset({"HostWeightRuntime"}), DIFFUSION: frozenset({"load_component"})}


@pytest.mark.parametrize(
    ("source", "module", "is_package", "expected"),
    [
        ("from host_weight_runtime.filesystem._fsutil import remove_tree", f"{TOOLS}.demo", False,
         f"{PACKAGE}.filesystem._fsutil.remove_tree"),
        ("from host_weight_runtime.runtime import HostWeightRuntime", f"{TOOLS}.bench.runner", False,
         f"{PACKAGE}.runtime.HostWeightRuntime"),
        ("from host_weight_runtime.tensors import SAFETENSORS_DTYPES", f"{TOOLS}.x", False,
         f"{PACKAGE}.tensors.SAFETENSORS_DTYPES"),
        ("from host_weight_runtime import default_root", f"{TOOLS}.x", False, f"{PACKAGE}.default_root"),
        ("from host_weight_runtime.diffusion.loader import build_skeleton", f"{TOOLS}.x", False,
         f"{DIFFUSION}.loader.build_skeleton"),
        ("from host_weight_runtime.diffusion import prewarm_component", f"{TOOLS}.x", False,
         f"{DIFFUSION}.prewarm_component"),
        ("from host_weight_runtime import runtime", f"{TOOLS}", True, f"{PACKAGE}.runtime"),
        ("from host_weight_runtime import *", f"{TOOLS}.x", False, f"{PACKAGE}.*"),
        ("def f():\n    from host_weight_runtime.diffusion import loader\n", f"{TOOLS}.x", False, f"{DIFFUSION}.loader"),
        ("import host_weight_runtime.config", f"{TOOLS}.x", False, f"{PACKAGE}.config"),
        ("import host_weight_runtime", f"{TOOLS}.x", False, PACKAGE),
        ("import importlib\nimportlib.import_module('host_weight_runtime.lease')", f"{TOOLS}.x", False,
         f"{PACKAGE}.lease"),
    ],
)
def test_scanner_flags_private_imports(source: str, module: str, is_package: bool, expected: str) -> None:
    """C08: the tools scan can fail: a private module or a name missing from `__all__` is reported."""
    assert expected in {v.target for v in scan_tool_source(source, module, is_package, _PUBLIC)}


@pytest.mark.parametrize(
    ("source", "module", "is_package"),
    [
        ("from host_weight_runtime import HostWeightRuntime", f"{TOOLS}.x", False),
        ("from host_weight_runtime.diffusion import load_component", f"{TOOLS}.bench.measure", False),
        ("from host_weight_runtime.diffusion import load_component", f"{TOOLS}.x", False),
        ("from host_weight_runtime._faults import fault_point", f"{TOOLS}.bench.runner", False),
        ("from host_weight_runtime import _faults", f"{TOOLS}.x", False),
        ("from ..common import remove_tree", f"{TOOLS}.bench.runner", False),
        ("from . import common", f"{TOOLS}", True),
        ("from .demo_store import _terminate_as_exit", f"{TOOLS}.demo_diffusers", False),
        ("import hwr_tools.bench.worker", f"{TOOLS}.x", False),
        ("import torch\nfrom diffusers import ModelMixin", f"{TOOLS}.x", False),
        ("import host_weight_runtime_like", f"{TOOLS}.x", False),
    ],
)
def test_scanner_allows_public_and_tool_imports(source: str, module: str, is_package: bool) -> None:
    """C08: public names, other tools, the fault seams and third-party packages are not reported."""
    assert scan_tool_source(source, module, is_package, _PUBLIC) == []


def test_public_names_are_read_from_both_init_files() -> None:
    """C08: the allowed names are exactly the two `__all__` lists, so exporting a name is what makes it usable."""
    public = public_names()
    assert public[PACKAGE] == frozenset(host_weight_runtime.__all__)
    assert "load_component" in public[DIFFUSION]
    assert "load_component" not in public[PACKAGE]


@pytest.mark.parametrize("command", [["demo", "--synthetic"], ["bench", "--quick"]])
def test_a_tools_command_without_the_tools_says_how_to_install_them(command: list[str]) -> None:
    """C08: `hwr demo` / `hwr bench` where `hwr_tools` cannot be imported exit 2 naming `make setup` and the pip install."""
    child = (
        "import sys\n"
        "sys.modules['hwr_tools'] = None  # as if the tools package were not installed\n"
        "from host_weight_runtime.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(PACKAGE_DIR.parent)}
    done = subprocess.run(
        [sys.executable, "-c", child, *command, "--json"], env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 2, done.stderr
    message = json.loads(done.stdout)["error"]["message"]
    assert "make setup" in message
    assert "pip install -e tools" in message

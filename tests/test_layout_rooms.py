"""C08: the rooms of docs/ARCHITECTURE.md and the imports each may make, checked on the real source tree.

Every module of the package belongs to exactly one room; a room may import only the rooms its row
allows. Imports are read statically (module level and inside functions alike), so a lazy import
that crosses a wall is caught too. The document itself is checked as well: every module path it
names exists, so a reader who follows it never lands on a file that moved.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

import host_weight_runtime

PACKAGE = "host_weight_runtime"
PACKAGE_DIR = Path(host_weight_runtime.__file__).resolve().parent
REPO_ROOT = PACKAGE_DIR.parent.parent
ARCHITECTURE = REPO_ROOT / "docs" / "ARCHITECTURE.md"

CONTRACTS = "contracts"
STORE = "store"
POLICY = "policy"
REMOTE = "remote"
OPERATIONS = "operations"
ADAPTERS = "adapters"
APPLICATION = "application"
TESTING = "testing"
PACKAGE_ROOT = "package front door"

# Prefixes are matched longest first; a module's room is the room of its longest matching prefix.
ROOM_PREFIXES: dict[str, str] = {
    f"{PACKAGE}.filesystem": STORE,
    f"{PACKAGE}.runtime": POLICY,
    f"{PACKAGE}._resolution": POLICY,
    f"{PACKAGE}.remote": REMOTE,
    f"{PACKAGE}.metrics": OPERATIONS,
    f"{PACKAGE}.diffusion": ADAPTERS,
    f"{PACKAGE}.cli": APPLICATION,
    f"{PACKAGE}.tools": APPLICATION,
    f"{PACKAGE}.testing": TESTING,
}

# Which rooms each room may import. The front door re-exports the public API of every core room.
ALLOWED: dict[str, frozenset[str]] = {
    CONTRACTS: frozenset({CONTRACTS}),
    STORE: frozenset({CONTRACTS, STORE}),
    POLICY: frozenset({CONTRACTS, POLICY, STORE, REMOTE, OPERATIONS}),
    REMOTE: frozenset({CONTRACTS, REMOTE, STORE}),
    OPERATIONS: frozenset({CONTRACTS, STORE, POLICY, OPERATIONS}),
    ADAPTERS: frozenset({CONTRACTS, STORE, POLICY, REMOTE, OPERATIONS, ADAPTERS, PACKAGE_ROOT}),
    APPLICATION: frozenset({CONTRACTS, STORE, POLICY, REMOTE, OPERATIONS, ADAPTERS, APPLICATION, PACKAGE_ROOT}),
    TESTING: frozenset({CONTRACTS, STORE, TESTING, PACKAGE_ROOT}),
    PACKAGE_ROOT: frozenset({CONTRACTS, STORE, POLICY, REMOTE, OPERATIONS, PACKAGE_ROOT}),
}


def room_of(module: str) -> str:
    if module == PACKAGE:
        return PACKAGE_ROOT
    matches = [prefix for prefix in ROOM_PREFIXES if module == prefix or module.startswith(prefix + ".")]
    return ROOM_PREFIXES[max(matches, key=len)] if matches else CONTRACTS


@dataclass(frozen=True, slots=True)
class Crossing:
    module: str
    line: int
    target: str

    def __str__(self) -> str:
        return f"{self.module}:{self.line} ({room_of(self.module)}) imports {self.target} ({room_of(self.target)})"


def _module_name(path: Path, package_dir: Path) -> str:
    parts = list(path.relative_to(package_dir).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([PACKAGE, *parts])


def _absolute(module: str, is_package: bool, level: int, target: str | None) -> str:
    if level == 0:
        return target or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (level - 1)] if level > 1 else base
    return ".".join([*base, target] if target else base)


def package_imports(source: str, module: str, is_package: bool) -> list[tuple[int, str]]:
    """Every import of a module of this package, as (line, absolute module), wherever it occurs."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(module, is_package, node.level, node.module)
            # `from . import x` may name a submodule: judge the submodule, not the package.
            names = [f"{base}.{alias.name}" for alias in node.names] if node.module is None else [base]
            found.extend((node.lineno, name) for name in names)
    return [(line, name) for line, name in found if name == PACKAGE or name.startswith(PACKAGE + ".")]


def crossings(package_dir: Path = PACKAGE_DIR) -> list[Crossing]:
    bad: list[Crossing] = []
    for path in sorted(package_dir.rglob("*.py")):
        module = _module_name(path, package_dir)
        for line, target in package_imports(path.read_text(encoding="utf-8"), module, path.name == "__init__.py"):
            if room_of(target) not in ALLOWED[room_of(module)]:
                bad.append(Crossing(module, line, target))
    return bad


def test_every_import_stays_inside_the_rooms_its_room_may_use() -> None:
    """C08: contracts import only contracts; the store only contracts; nothing but the application imports it."""
    assert [str(c) for c in crossings()] == []


@pytest.mark.parametrize(
    ("module", "source", "target"),
    [
        (f"{PACKAGE}.manifest", "from .filesystem.store import FilesystemHostWeightStore", f"{PACKAGE}.filesystem.store"),
        (f"{PACKAGE}.filesystem._lookup", "from ..metrics import register_metrics", f"{PACKAGE}.metrics"),
        (f"{PACKAGE}.filesystem._build", "from ..runtime import HostWeightRuntime", f"{PACKAGE}.runtime"),
        (f"{PACKAGE}.filesystem._build", "def f():\n    from ..diffusion import loader\n", f"{PACKAGE}.diffusion"),
        (f"{PACKAGE}.diffusion.loader", "from ..cli import main", f"{PACKAGE}.cli"),
        (f"{PACKAGE}.diffusion.loader", "from ..tools import synthetic_models", f"{PACKAGE}.tools"),
    ],
)
def test_room_check_can_fail(module: str, source: str, target: str, tmp_path: Path) -> None:
    """C08: the room check itself reports a forbidden crossing (contracts -> store, store -> policy, ...)."""
    relative = Path(*module.split(".")[1:]).with_suffix(".py")
    root = tmp_path / PACKAGE
    (root / relative).parent.mkdir(parents=True, exist_ok=True)
    (root / relative).write_text(source, encoding="utf-8")
    assert target in [c.target for c in crossings(root)]


def test_room_check_allows_imports_inside_a_room_and_down_the_stack(tmp_path: Path) -> None:
    """C08: contracts importing contracts, the store importing contracts and the CLI importing adapters pass."""
    root = tmp_path / PACKAGE
    (root / "filesystem").mkdir(parents=True)
    (root / "cli").mkdir()
    (root / "identity.py").write_text("import host_weight_runtime.lease\nfrom .canonical_json import X\n")
    (root / "filesystem" / "_build.py").write_text("from ..manifest import WeightManifest\nfrom ._fsutil import x\n")
    (root / "cli" / "prewarm.py").write_text("def run():\n    from ..diffusion.loader import prewarm_component\n")
    assert crossings(root) == []


def test_architecture_page_names_only_files_that_exist() -> None:
    """C08: every `src/...` or `tests/...` path in docs/ARCHITECTURE.md exists, so each hop lands somewhere."""
    text = ARCHITECTURE.read_text(encoding="utf-8")
    named = sorted(set(re.findall(r"`((?:src|tests|docs|benchmarks)/[A-Za-z0-9_./-]+)`", text)))
    assert len(named) >= 20, "the page should point at the modules and tests it describes"
    missing = [path for path in named if not (REPO_ROOT / path.rstrip("/")).exists()]
    assert missing == []


def test_architecture_page_maps_every_behaviour_id_to_a_test_that_names_it() -> None:
    """C08: each behaviour id the page lists is named in the docstring of the test file the page points to."""
    text = ARCHITECTURE.read_text(encoding="utf-8")
    rows = re.findall(r"^\| ([CSRD]\d{2}(?:-[CSRD]?\d{2})?) \|[^|]*\|[^|]*\| `(tests/[a-z_]+\.py)`", text, re.MULTILINE)
    assert rows, "the guarantee table is missing"
    for ids, test_file in rows:
        first = ids.split("-")[0]
        assert re.search(rf"\b{first}\b", (REPO_ROOT / test_file).read_text(encoding="utf-8")), (ids, test_file)

"""C08: the rooms of docs/ARCHITECTURE.md and the imports each may make, checked on the real source tree.

Every module of the package belongs to exactly one room (a module in none is an error, never
counted as a contract); a room may import only the rooms its row allows, never a private (`_`)
module of another room, and no module imports itself back through others (no import circle).
Imports are read statically (module level, inside functions and under TYPE_CHECKING alike), so a
lazy import that crosses a wall is caught too. The table in this file must equal the table in the
document, and every module path the document names must exist.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

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
COMPAT = "compat"
FRONT_DOOR = "front door"

_CONTRACT_MODULES = (
    "canonical_json",
    "identity",
    "manifest",
    "failures",
    "outcomes",
    "protocols",
    "lease",
    "config",
    "tensors",
    "version",
    "_digest",
    "_strict",
    "_records",
    "_faults",
    "_remote_url",
    "_exit_wait",
    "_telemetry",
)

# The modules of each room, as dotted prefixes (a module belongs to the room of its longest matching
# prefix); the front door is the package itself, matched exactly.
ROOM_MODULES: dict[str, frozenset[str]] = {
    CONTRACTS: frozenset(f"{PACKAGE}.{name}" for name in _CONTRACT_MODULES),
    STORE: frozenset({f"{PACKAGE}.filesystem"}),
    POLICY: frozenset({f"{PACKAGE}.runtime", f"{PACKAGE}._resolution"}),
    REMOTE: frozenset({f"{PACKAGE}.remote"}),
    OPERATIONS: frozenset({f"{PACKAGE}.metrics", f"{PACKAGE}._metrics_pod"}),
    ADAPTERS: frozenset({f"{PACKAGE}.diffusion"}),
    APPLICATION: frozenset({f"{PACKAGE}.cli"}),
    TESTING: frozenset({f"{PACKAGE}.testing"}),
    COMPAT: frozenset({f"{PACKAGE}.compat"}),
    FRONT_DOOR: frozenset({PACKAGE}),
}

# Which other rooms each room may import (every room may import itself).
ALLOWED: dict[str, frozenset[str]] = {
    CONTRACTS: frozenset(),
    STORE: frozenset({CONTRACTS}),
    POLICY: frozenset({CONTRACTS, STORE, REMOTE, OPERATIONS}),
    REMOTE: frozenset({CONTRACTS, STORE}),
    OPERATIONS: frozenset({CONTRACTS, STORE}),
    ADAPTERS: frozenset({CONTRACTS, STORE, POLICY, REMOTE, OPERATIONS, FRONT_DOOR}),
    APPLICATION: frozenset({CONTRACTS, STORE, POLICY, REMOTE, OPERATIONS, ADAPTERS, FRONT_DOOR}),
    TESTING: frozenset({CONTRACTS, STORE}),
    COMPAT: frozenset({CONTRACTS, STORE, POLICY, REMOTE}),
    FRONT_DOOR: frozenset({CONTRACTS, STORE, POLICY, REMOTE, OPERATIONS}),
}


def room_of(module: str) -> str | None:
    """The module's room, or None when no room holds it."""
    if module == PACKAGE:
        return FRONT_DOOR
    best: tuple[int, str] | None = None
    for room, prefixes in ROOM_MODULES.items():
        for prefix in prefixes:
            matches = prefix != PACKAGE and (module == prefix or module.startswith(prefix + "."))
            if matches and (best is None or len(prefix) > best[0]):
                best = (len(prefix), room)
    return None if best is None else best[1]


def is_private(module: str) -> bool:
    """A module below the package with a `_` part (`filesystem._fsutil`, `_resolution.stage_lookup`); contracts are shared."""
    return room_of(module) != CONTRACTS and any(part.startswith("_") for part in module.split(".")[1:])


@dataclass(frozen=True, slots=True)
class Import:
    """One import of a module of the package: who, where, and the module it resolves to."""

    module: str
    line: int
    target: str

    def __str__(self) -> str:
        return f"{self.module}:{self.line} ({room_of(self.module)}) imports {self.target} ({room_of(self.target)})"


def modules_in(package_dir: Path) -> dict[str, bool]:
    """Every module under `package_dir`, by dotted name, and whether it is a package."""
    found: dict[str, bool] = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = list(path.relative_to(package_dir).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts.pop()
        found[".".join([PACKAGE, *parts])] = is_package
    return found


def _base(module: str, is_package: bool, level: int, target: str | None) -> str:
    """The absolute module a `from` import starts from (level dots, then `target`)."""
    if level == 0:
        return target or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join([*base, target] if target else base)


def resolve_imports(source: str, module: str, is_package: bool, known: Iterable[str]) -> list[tuple[int, str]]:
    """Every import of this package in `source`, as (line, module it loads), wherever it occurs.

    `from X import y` loads the submodule `X.y` where one exists and `X` itself otherwise, so
    `from .. import __version__` in a subpackage of the root is the front door, and `from . import x`
    in a package is its submodule `x`. A name that is no module of the package stays as written.
    """
    modules = set(known)
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _base(module, is_package, node.level, node.module)
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                found.append((node.lineno, submodule if submodule in modules else base))
    return [(line, name) for line, name in found if name == PACKAGE or name.startswith(PACKAGE + ".")]


def package_imports(package_dir: Path = PACKAGE_DIR) -> list[Import]:
    modules = modules_in(package_dir)
    imports: list[Import] = []
    for module, is_package in modules.items():
        relative = Path(*module.split(".")[1:])
        path = package_dir / relative / "__init__.py" if is_package else (package_dir / relative).with_suffix(".py")
        source = path.read_text(encoding="utf-8")
        found = dict.fromkeys(resolve_imports(source, module, is_package, modules))  # one per line and target
        imports.extend(Import(module, line, target) for line, target in found)
    return imports


def unknown_modules(package_dir: Path = PACKAGE_DIR) -> list[str]:
    """Modules no room holds, and imports of names that are no module of the package."""
    modules = modules_in(package_dir)
    problems = [f"{module} is in no room" for module in modules if room_of(module) is None]
    problems.extend(
        f"{i.module}:{i.line} imports {i.target}, which is no module"
        for i in package_imports(package_dir)
        if i.target not in modules
    )
    return problems


def crossings(package_dir: Path = PACKAGE_DIR) -> list[Import]:
    """Imports of a room its importer's row does not allow, or of another room's private module."""
    bad: list[Import] = []
    for found in package_imports(package_dir):
        source, target = room_of(found.module), room_of(found.target)
        if source is None or target is None or source == target:
            continue
        if target not in ALLOWED[source] or is_private(found.target):
            bad.append(found)
    return bad


def import_cycles(package_dir: Path = PACKAGE_DIR) -> list[list[str]]:
    """Every import circle (strongly connected set of two or more modules, or a module importing itself)."""
    edges: dict[str, set[str]] = {module: set() for module in modules_in(package_dir)}
    for found in package_imports(package_dir):
        if found.target in edges:
            edges[found.module].add(found.target)
    return _strongly_connected(edges)


def _strongly_connected(edges: Mapping[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative; only the components that are circles."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    for start in sorted(edges):
        if start in index:
            continue
        work: list[tuple[str, list[str]]] = [(start, sorted(edges[start]))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, pending = work[-1]
            if pending:
                nxt = pending.pop()
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, sorted(edges[nxt])))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component: list[str] = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1 or node in edges[node]:
                    cycles.append(sorted(component))
    return sorted(cycles)


def test_every_module_is_in_a_room_and_every_import_names_a_module() -> None:
    """C08: a new top-level module must be given a room; it is never silently counted as a contract."""
    assert unknown_modules() == []


def test_every_import_stays_inside_the_rooms_its_room_may_use() -> None:
    """C08: contracts import only contracts; the store only contracts; no room takes another's private module."""
    assert [str(c) for c in crossings()] == []


def test_no_import_circle_in_the_package() -> None:
    """C08: no module imports itself back, through any chain (function-level and TYPE_CHECKING imports count)."""
    assert import_cycles() == []


def _plant(root: Path, files: Mapping[str, str]) -> Path:
    package = root / PACKAGE
    for relative, source in files.items():
        path = package / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source, encoding="utf-8")
    for directory in [package, *(p for p in package.rglob("*") if p.is_dir())]:
        (directory / "__init__.py").touch()
    return package


def test_the_checker_reports_planted_violations(tmp_path: Path) -> None:
    """C08: a wall crossing, a private reach-in, a front-door import from the store, an unknown module and a
    circle, planted in a small fake package, are each reported."""
    package = _plant(
        tmp_path,
        {
            "identity.py": "from .filesystem.store import Store\n",  # contracts -> store
            "remote/push.py": "from .. import __version__\nfrom ..filesystem._fsutil import x\n",
            "filesystem/store.py": "def f():\n    from ..diffusion import loader\n",  # store -> adapters
            "filesystem/_fsutil.py": "",
            "filesystem/a.py": "from . import b\n",
            "filesystem/b.py": "from .a import thing\n",
            "diffusion/loader.py": "",
            "stray.py": "",
        },
    )
    found = {(c.module, c.target) for c in crossings(package)}
    assert found == {
        (f"{PACKAGE}.identity", f"{PACKAGE}.filesystem.store"),
        (f"{PACKAGE}.remote.push", PACKAGE),
        (f"{PACKAGE}.remote.push", f"{PACKAGE}.filesystem._fsutil"),
        (f"{PACKAGE}.filesystem.store", f"{PACKAGE}.diffusion.loader"),
    }
    assert import_cycles(package) == [[f"{PACKAGE}.filesystem.a", f"{PACKAGE}.filesystem.b"]]
    assert unknown_modules(package) == [f"{PACKAGE}.stray is in no room"]


def test_the_checker_resolves_relative_imports_to_submodules_or_the_package(tmp_path: Path) -> None:
    """C08: `from . import x` is the submodule x where one exists; `from .. import name` is the package itself."""
    package = _plant(
        tmp_path,
        {
            "diffusion/parallel/loader.py": "from .. import skeleton\nfrom .. import load_component\nfrom ... import y\n",
            "diffusion/skeleton.py": "",
        },
    )
    targets = {i.target for i in package_imports(package) if i.module == f"{PACKAGE}.diffusion.parallel.loader"}
    assert targets == {f"{PACKAGE}.diffusion.skeleton", f"{PACKAGE}.diffusion", PACKAGE}


def test_the_checker_reports_an_import_of_no_module(tmp_path: Path) -> None:
    """C08: an import of a module the package does not have is reported, not assigned a room."""
    package = _plant(tmp_path, {"runtime.py": "import host_weight_runtime.gone\n"})
    assert unknown_modules(package) == [f"{PACKAGE}.runtime:1 imports {PACKAGE}.gone, which is no module"]


def test_room_check_allows_imports_inside_a_room_and_down_the_stack(tmp_path: Path) -> None:
    """C08: contracts importing contracts, the store importing contracts and the CLI importing adapters pass."""
    package = _plant(
        tmp_path,
        {
            "identity.py": "import host_weight_runtime.lease\nfrom .canonical_json import X\n",
            "lease.py": "",
            "canonical_json.py": "",
            "manifest.py": "",
            "filesystem/_build.py": "from ..manifest import WeightManifest\nfrom ._fsutil import x\n",
            "filesystem/_fsutil.py": "",
            "cli/prewarm.py": "def run():\n    from ..diffusion.loader import prewarm_component\n",
            "diffusion/loader.py": "",
        },
    )
    assert crossings(package) == []
    assert import_cycles(package) == []


def _rooms_table(text: str) -> list[list[str]]:
    section = text.split("## The rooms", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")]
    return [[cell.strip() for cell in row.strip().strip("|").split("|")] for row in rows[2:]]


def _documented_modules(cell: str) -> frozenset[str]:
    """Backticked paths of a modules cell as dotted prefixes; a bare file name is in the previous path's folder."""
    modules: set[str] = set()
    folder = ""
    for path in re.findall(r"`([^`]+)`", cell):
        if path.startswith("src/"):
            folder = path.rstrip("/").rsplit("/", 1)[0] if path.endswith(".py") else path.rstrip("/")
            full = path[len("src/") :]
        else:
            full = f"{folder[len('src/') :]}/{path}"
        dotted = full.removesuffix("/").removesuffix(".py").removesuffix("/__init__").replace("/", ".")
        modules.add(dotted)
    return frozenset(modules)


def _documented_allowed(cell: str) -> frozenset[str]:
    plain = re.sub(r"\([^)]*\)", "", cell).strip()
    if plain == "nothing":
        return frozenset()
    return frozenset(name.strip() for name in plain.split(","))


def test_the_room_table_here_equals_the_architecture_page() -> None:
    """C08: the rooms, their modules and what each may import are the page's table, row for row."""
    table = _rooms_table(ARCHITECTURE.read_text(encoding="utf-8"))
    assert {row[0]: _documented_allowed(row[3]) for row in table} == ALLOWED
    assert {row[0]: _documented_modules(row[1]) for row in table} == ROOM_MODULES


def test_architecture_page_names_only_files_that_exist() -> None:
    """C08: every `src/...`, `tools/...` or `tests/...` path in docs/ARCHITECTURE.md exists, so each hop lands somewhere."""
    text = ARCHITECTURE.read_text(encoding="utf-8")
    named = sorted(set(re.findall(r"`((?:src|tools|tests|docs|benchmarks)/[A-Za-z0-9_./-]+)`", text)))
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

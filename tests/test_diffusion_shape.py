"""C08: the adapter room stays a composition of small named steps.

No function in `diffusion/` grows past 80 lines of code (its docstring aside), and no module of
the room takes a private (underscore) name from another module: a step another module needs is
a public name of the module that owns it. Both checks read the source statically and are shown
to fail on planted code.
"""

from __future__ import annotations

import ast
from pathlib import Path

import host_weight_runtime

DIFFUSION_DIR = Path(host_weight_runtime.__file__).resolve().parent / "diffusion"
MAX_FUNCTION_LINES = 80


def _docstring_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    first = node.body[0] if node.body else None
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        assert first.end_lineno is not None
        return first.end_lineno - first.lineno + 1
    return 0


def long_functions(root: Path, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """Every function under `root` whose code (signature and body, docstring aside) exceeds `limit` lines."""
    found: list[str] = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                assert node.end_lineno is not None
                lines = node.end_lineno - node.lineno + 1 - _docstring_lines(node)
                if lines > limit:
                    found.append(f"{path.relative_to(root)}:{node.lineno} {node.name} ({lines} lines)")
    return found


def private_name_imports(root: Path) -> list[str]:
    """Every `from <package module> import _name` under `root` (a private module itself may be imported)."""
    found: list[str] = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            ours = isinstance(node, ast.ImportFrom) and (
                node.level > 0 or (node.module or "").startswith("host_weight_runtime")
            )
            if not ours:
                continue
            assert isinstance(node, ast.ImportFrom)
            for alias in node.names:
                # `from . import _module` names a module; `from .module import _name` reaches into one.
                if alias.name.startswith("_") and node.module is not None:
                    found.append(f"{path.relative_to(root)}:{node.lineno} imports {alias.name} from {node.module}")
    return found


def test_no_function_in_the_adapter_room_is_over_80_lines() -> None:
    """C08: `load_component`, the TP loader and every step stay short enough to read in one screen."""
    assert long_functions(DIFFUSION_DIR) == []


def test_no_adapter_module_imports_a_private_name() -> None:
    """C08: the loaders compose public step names only (no `_Skeleton`, `_anchor`, `_digest_cache`...)."""
    assert private_name_imports(DIFFUSION_DIR) == []


def test_the_shape_checks_report_planted_code(tmp_path: Path) -> None:
    """C08: a 90-line function and a private-name import are both reported, with their place."""
    body = "".join(f"    x{i} = {i}\n" for i in range(90))
    (tmp_path / "long.py").write_text(f'def long():\n    """Doc."""\n{body}', encoding="utf-8")
    (tmp_path / "reach.py").write_text("from .loader import _anchor\nfrom . import _load_options\n", encoding="utf-8")
    assert long_functions(tmp_path) == ["long.py:1 long (91 lines)"]
    assert private_name_imports(tmp_path) == ["reach.py:1 imports _anchor from loader"]

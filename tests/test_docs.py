"""The documentation covers what it promises: every public name in the API reference, every `HWR_*` variable
in the configuration reference, every `hwr` command and option in the generated CLI reference, and every
link of the README and of the site's navigation lands on a file. (`make docs` builds the site with --strict.)"""

from __future__ import annotations

import argparse
import importlib.util
import re
from pathlib import Path
from types import ModuleType

import pytest

import host_weight_runtime
import host_weight_runtime.diffusion
from host_weight_runtime.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
REFERENCE_PAGES = {
    "host_weight_runtime": DOCS / "reference" / "api.md",
    "host_weight_runtime.diffusion": DOCS / "reference" / "diffusion.md",
}


def _documented(page: Path, package: str) -> list[str]:
    """The names `::: package.NAME` directives render on `page` (nested packages' names are not counted)."""
    pattern = re.compile(rf"^::: {re.escape(package)}\.([A-Za-z_][A-Za-z0-9_]*)\s*$", re.MULTILINE)
    return pattern.findall(page.read_text(encoding="utf-8"))


@pytest.mark.parametrize("package", sorted(REFERENCE_PAGES))
def test_every_public_name_is_in_the_api_reference(package: str) -> None:
    """Each name of the package's __all__ has exactly one `:::` entry on its reference page, and the page
    documents nothing the package does not export."""
    module = {
        "host_weight_runtime": host_weight_runtime,
        "host_weight_runtime.diffusion": host_weight_runtime.diffusion,
    }
    exported = sorted(module[package].__all__)
    documented = _documented(REFERENCE_PAGES[package], package)
    assert sorted(set(documented)) == exported, set(documented) ^ set(exported)
    assert len(documented) == len(set(documented)), "a name is documented twice"


def test_every_hwr_variable_in_the_source_is_in_the_configuration_reference() -> None:
    """Every `HWR_*` name that appears in src/ (a prefix such as `HWR_REMOTE_` counts as its stem) is named
    in docs/reference/configuration.md."""
    names: set[str] = set()
    for path in (ROOT / "src").rglob("*.py"):
        names |= {name.rstrip("_") for name in re.findall(r"\bHWR_[A-Z0-9_]+", path.read_text(encoding="utf-8"))}
    assert {"HWR_ROOT", "HWR_MODE"} <= names
    reference = (DOCS / "reference" / "configuration.md").read_text(encoding="utf-8")
    missing = sorted(name for name in names if f"`{name}`" not in reference)
    assert not missing, f"not in docs/reference/configuration.md: {missing}"


def _hook() -> ModuleType:
    spec = importlib.util.spec_from_file_location("cli_reference", DOCS / "hooks" / "cli_reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _leaf_commands(parser: argparse.ArgumentParser, prog: str) -> dict[str, argparse.ArgumentParser]:
    found: dict[str, argparse.ArgumentParser] = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                nested = _leaf_commands(sub, f"{prog} {name}")
                found.update(nested or {f"{prog} {name}": sub})
    return found


def test_cli_reference_names_every_command_and_option() -> None:
    """The hook the site build runs gives a section per `hwr` command (nested ones included) whose table
    names every option the command's parser accepts; the CLI page carries the hook's marker."""
    hook = _hook()
    parser = build_parser()
    text = hook.cli_reference(parser)
    sections = dict(re.findall(r"^## `([^`]+)`\n(.*?)(?=^## |\Z)", text, flags=re.MULTILINE | re.DOTALL))
    commands = _leaf_commands(parser, parser.prog)
    assert set(sections) == set(commands) and "hwr remote ls" in commands
    for name, sub in commands.items():
        for action in sub._actions:
            for option in action.option_strings:
                if option not in ("-h", "--help"):
                    assert f"`{option}" in sections[name] or f", {option}" in sections[name], (name, option)
    assert hook.MARKER in (DOCS / "reference" / "cli.md").read_text(encoding="utf-8")


def _links(markdown: str) -> list[str]:
    return [target for target in re.findall(r"\]\(([^)\s]+)\)", markdown) if "://" not in target]


def test_readme_and_site_links_land_on_files() -> None:
    """Every relative link of the README and of docs/*.md, and every page of the site's navigation, exists."""
    pages = [ROOT / "README.md", *DOCS.rglob("*.md")]
    for page in pages:
        for target in _links(page.read_text(encoding="utf-8")):
            path = target.split("#", 1)[0]
            if path:
                assert (page.parent / path).exists(), f"{page.relative_to(ROOT)} links to a missing {target}"
    navigation = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    listed = re.findall(r":\s*([\w./-]+\.md)\s*$", navigation, flags=re.MULTILINE)
    assert len(listed) >= 15
    for page_path in listed:
        assert (DOCS / page_path).is_file(), page_path


def test_site_builds_offline() -> None:
    """Only plugins that fetch nothing at build time: search and mkdocstrings, and the theme's web fonts off."""
    config = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    plugins = config.split("plugins:", 1)[1].split("\n\n", 1)[0]
    assert re.findall(r"^  - (\w[\w-]*)", plugins, flags=re.MULTILINE) == ["search", "mkdocstrings"]
    assert "font: false" in config and "strict: true" in config

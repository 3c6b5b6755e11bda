"""MkDocs hook: the CLI reference page is generated from `hwr`'s own argparse parser at build time.

The page `reference/cli.md` holds the marker below; each build replaces it with one section per command
(usage, description, a table of its arguments), so the reference cannot drift from the parser.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

MARKER = "<!-- hwr-cli-reference -->"
PAGE = "reference/cli.md"


def on_config(config: Any) -> Any:
    """Import the package from this checkout's src/, the tree being documented."""
    source = str(Path(config.config_file_path).resolve().parent / "src")
    if source not in sys.path:
        sys.path.insert(0, source)
    return config


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """Replace the marker on the CLI page with the generated reference; other pages pass through."""
    if page.file.src_uri != PAGE:
        return markdown
    if MARKER not in markdown:
        raise ValueError(f"{PAGE} lacks the marker {MARKER}")
    from host_weight_runtime.cli import build_parser

    return markdown.replace(MARKER, cli_reference(build_parser()))


def cli_reference(parser: argparse.ArgumentParser) -> str:
    """Markdown for every subcommand of `parser` (nested ones too, such as `hwr remote ls`)."""
    return "\n".join(_sections(parser, parser.prog))


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, tuple[argparse.ArgumentParser, str]]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help or "" for choice in action._choices_actions}
            return {name: (sub, helps.get(name, "")) for name, sub in action.choices.items()}
    return {}


def _sections(parser: argparse.ArgumentParser, prog: str) -> list[str]:
    lines: list[str] = []
    for name, (sub, help_text) in _subcommands(parser).items():
        command = f"{prog} {name}"
        nested = _subcommands(sub)
        if nested:
            lines += _sections(sub, command)
            continue
        usage = " ".join(sub.format_usage().split())
        usage = usage.removeprefix("usage: ")
        lines += [f"## `{command}`", "", (sub.description or help_text).strip(), "", "```", usage, "```", ""]
        lines += _arguments_table(sub)
    return lines


def _arguments_table(parser: argparse.ArgumentParser) -> list[str]:
    rows = ["| argument | default | what it does |", "|---|---|---|"]
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction) or action.help == argparse.SUPPRESS:
            continue
        if action.option_strings:
            spelling = ", ".join(action.option_strings)
            if action.nargs != 0:
                spelling += f" {action.metavar or action.dest.upper()}"
        else:
            spelling = str(action.metavar or action.dest)
        default = ""
        if action.option_strings and action.nargs != 0 and action.default not in (None, argparse.SUPPRESS):
            default = f"`{action.default}`"
        choices = f" (one of: {', '.join(f'`{c}`' for c in action.choices)})" if action.choices else ""
        text = (action.help or "").replace("|", "\\|").replace("\n", " ")
        rows.append(f"| `{spelling.replace('|', chr(92) + '|')}` | {default} | {text}{choices} |")
    return [*rows, ""]

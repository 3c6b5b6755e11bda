"""Which domain a command works on, and which artifact a key (or key prefix) names.

Shared by every command that takes `--root` or a key: the root comes from `--root`,
else HWR_ROOT, else the default; a key is the full 64-character key or a unique prefix.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
from pathlib import Path

from ..config import ENV_ROOT, HostWeightRuntimeConfig, default_root
from ..failures import FailureCode
from ..filesystem import DomainLayout, check_key
from ..filesystem.store import FilesystemHostWeightStore
from ._output import ReportedError, UsageError, short_key

__all__ = [
    "MIN_KEY_PREFIX",
    "add_key_argument",
    "add_root_option",
    "domain_root",
    "open_existing",
    "resolve_key",
    "runtime_config",
]

MIN_KEY_PREFIX = 4

_HEX_PREFIX = re.compile(r"[0-9a-f]+")


def add_root_option(parser: argparse.ArgumentParser) -> None:
    """The `--root` option every command that works on a domain offers."""
    parser.add_argument("--root", metavar="DIR", help=f"domain root (default: ${ENV_ROOT}, else {default_root()})")


def add_key_argument(parser: argparse.ArgumentParser) -> None:
    """The positional artifact key, which `resolve_key` turns into a full key."""
    parser.add_argument("key", help="artifact key, or a unique prefix of it (see `hwr inspect`)")


def domain_root(option: str | None) -> Path:
    """--root, else HWR_ROOT (validated as the library validates it), else the default root."""
    if option is not None and "\x00" in option:
        raise UsageError("--root contains a NUL character; give the domain root as a plain path")
    if option is not None:
        return Path(option).expanduser().absolute()
    if os.environ.get(ENV_ROOT, "").strip():
        return HostWeightRuntimeConfig.from_env({ENV_ROOT: os.environ[ENV_ROOT]}).resolved_root
    return default_root()


def runtime_config(root_option: str | None) -> HostWeightRuntimeConfig:
    """The runtime configuration from the environment, with `--root` taking precedence when given."""
    config = HostWeightRuntimeConfig.from_env()
    if root_option is not None:
        config = dataclasses.replace(config, root=domain_root(root_option))
    return config


def open_existing(root: Path) -> FilesystemHostWeightStore:
    """Open the domain at `root` without creating one (opening a store creates a missing domain)."""
    if not DomainLayout(root).domain_file.is_file():
        where = "nothing is there" if not root.exists() else f"{root} holds no domain.json"
        raise ReportedError(
            f"no domain at {root} ({where}); pass --root or set {ENV_ROOT} to the directory your workers use",
            code=FailureCode.NOT_FOUND,
        )
    return FilesystemHostWeightStore(root)


def resolve_key(store: FilesystemHostWeightStore, text: str) -> str:
    """A full key as given, or the one stored key that starts with an unambiguous hex prefix."""
    text = text.strip().lower()
    if len(text) == 64:
        try:
            return check_key(text)
        except ValueError as exc:
            raise UsageError(f"{exc}; `hwr inspect` lists the keys") from None
    if len(text) < MIN_KEY_PREFIX or len(text) > 64 or not _HEX_PREFIX.fullmatch(text):
        shown = text if len(text) <= 80 else f"{text[:64]}... ({len(text)} characters)"
        raise UsageError(
            f"{shown!r} is not an artifact key: give the 64-character hex key or a unique prefix of at least "
            f"{MIN_KEY_PREFIX} characters (`hwr inspect` lists the keys)"
        )
    matches = sorted(key for key in _stored_keys(store.layout) if key.startswith(text) and len(key) == 64)
    if not matches:
        raise ReportedError(
            f"no artifact key in {store.root} starts with {text}; `hwr inspect` lists the keys",
            code=FailureCode.NOT_FOUND,
        )
    if len(matches) > 1:
        listed = ", ".join(short_key(key) for key in matches)
        raise UsageError(f"key prefix {text} is ambiguous ({listed}); give more characters")
    return matches[0]


def _stored_keys(layout: DomainLayout) -> set[str]:
    """Every key with something on disk: a published artifact, a deny marker or a build in progress."""
    known: set[str] = set()
    for directory in (layout.artifacts, layout.deny, layout.tmp):
        try:
            names = os.listdir(directory)
        except FileNotFoundError:
            continue
        known.update(name.split(".", 1)[0] for name in names)
    return known

"""X03: vLLM-Omni's reference Host Weight Runtime API on this runtime, and its own adapters on this store.

The surface tests read the installed reference (vllm-omni 0.30.0, a test dependency installed without its
dependencies) as source, never importing it, and hold `host_weight_runtime.compat.vllm_omni` to every public
name, enum member, field and signature in it. The adapter tests run vLLM-Omni's own final-layout identity,
producer and restorer, unmodified, in spawned processes through `install()`.
"""

from __future__ import annotations

import ast
import dataclasses
import enum
import importlib
import importlib.machinery
import inspect
from pathlib import Path

import pytest

from host_weight_runtime.compat import vllm_omni as compat
from hwr_tools.synthetic_models import build_model, save_model_folder

from . import _vllm_omni
from .support import recv_within, spawned_child

# The reference's public modules, as `install()` aliases them (the package itself is "").
PUBLIC_MODULES = (
    "",
    "config",
    "errors",
    "identity",
    "inspection",
    "lease",
    "manifest",
    "outcomes",
    "protocols",
    "runtime",
    "filesystem",
    "filesystem.locks",
    "filesystem.store",
)

# Records whose fields are this runtime's own on purpose (docs/vllm-omni.md says why): the on-disk manifest
# and marker, and the lease's provenance, keep this runtime's fields; every other record has the reference's.
OWN_FIELDS = frozenset(
    {"WeightManifest", "TensorManifestEntry", "FileManifestEntry", "PublicationMarker", "LeaseProvenance"}
)


def _reference_root() -> Path:
    found = importlib.machinery.PathFinder.find_spec("vllm_omni")
    assert found is not None and found.submodule_search_locations, "vllm-omni==0.30.0 is a test dependency (make setup)"
    return Path(next(iter(found.submodule_search_locations))) / "host_weight_runtime"


def _reference_tree(module: str) -> ast.Module:
    base = _reference_root().joinpath(*module.split(".")) if module else _reference_root()
    path = base / "__init__.py" if base.is_dir() else base.with_suffix(".py")
    return ast.parse(path.read_text(encoding="utf-8"))


def _compat_module(module: str) -> object:
    return importlib.import_module(f"{compat.__name__}.{module}" if module else compat.__name__)


def _reference_all(tree: ast.Module) -> list[str]:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            value = ast.literal_eval(node.value)
            assert isinstance(value, list)
            return [str(name) for name in value]
    return []


def _classes(tree: ast.Module) -> list[ast.ClassDef]:
    return [node for node in tree.body if isinstance(node, ast.ClassDef)]


def _base_names(node: ast.ClassDef) -> set[str]:
    return {base.id if isinstance(base, ast.Name) else getattr(base, "attr", "") for base in node.bases}


def _is_dataclass(node: ast.ClassDef) -> bool:
    return any("dataclass" in ast.unparse(decorator) for decorator in node.decorator_list)


def _annotated_fields(node: ast.ClassDef) -> list[str]:
    return [
        item.target.id for item in node.body if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)
    ]


@pytest.mark.parametrize("module", PUBLIC_MODULES)
def test_every_public_name_of_the_reference_exists(module: str) -> None:
    """X03: each public module of vllm_omni.host_weight_runtime 0.30.0 has its compat module with every name."""
    names = _reference_all(_reference_tree(module))
    assert names, f"the reference's {module or 'package'} lists no names"
    missing = [name for name in names if not hasattr(_compat_module(module), name)]
    assert missing == []


@pytest.mark.parametrize("module", [m for m in PUBLIC_MODULES if m and m != "filesystem"])
def test_enum_members_and_record_fields_match_the_reference(module: str) -> None:
    """X03: every enum member of the reference exists (same value where this runtime reports it), and every
    record has the reference's fields (the deliberate exceptions are listed in OWN_FIELDS)."""
    ours = _compat_module(module)
    problems: list[str] = []
    for node in _classes(_reference_tree(module)):
        mine = getattr(ours, node.name, None)
        if mine is None:
            continue
        if _base_names(node) & {"Enum", "str"} == {"Enum", "str"} or "Enum" in _base_names(node):
            assert isinstance(mine, enum.EnumMeta), node.name
            for item in node.body:
                if isinstance(item, ast.Assign) and isinstance(item.targets[0], ast.Name):
                    member = item.targets[0].id
                    if not hasattr(mine, member):
                        problems.append(f"{node.name}.{member} is missing")
        elif _is_dataclass(node) and node.name not in OWN_FIELDS:
            wanted = _annotated_fields(node)
            have = [field.name for field in dataclasses.fields(mine)] if dataclasses.is_dataclass(mine) else []
            absent = [name for name in wanted if name not in have and not hasattr(mine, name)]
            problems.extend(f"{node.name}.{name} is missing" for name in absent)
    assert problems == []


def _reference_signature(module: str, qualname: str) -> list[tuple[str, str, str | None]]:
    class_name, _, method = qualname.partition(".")
    for node in _classes(_reference_tree(module)):
        if node.name != class_name:
            continue
        for item in node.body:
            if isinstance(item, ast.FunctionDef) and item.name == method:
                arguments = item.args
                positional = [*arguments.posonlyargs, *arguments.args]
                defaults: list[ast.expr | None] = [None] * (len(positional) - len(arguments.defaults))
                defaults += list(arguments.defaults)
                made = [
                    (a.arg, "positional", None if d is None else ast.unparse(d))
                    for a, d in zip(positional, defaults, strict=True)
                ]
                made += [
                    (a.arg, "keyword", None if d is None else ast.unparse(d))
                    for a, d in zip(arguments.kwonlyargs, arguments.kw_defaults, strict=True)
                ]
                return [entry for entry in made if entry[0] not in ("self", "cls")]
    raise AssertionError(f"the reference has no {qualname} in {module}")


def _our_signature(function: object) -> list[tuple[str, str, str | None]]:
    made: list[tuple[str, str, str | None]] = []
    for parameter in inspect.signature(function).parameters.values():  # type: ignore[arg-type]
        if parameter.name in ("self", "cls"):
            continue
        kind = "keyword" if parameter.kind is inspect.Parameter.KEYWORD_ONLY else "positional"
        default = None if parameter.default is inspect.Parameter.empty else parameter.default
        shown = None if default is None and parameter.default is inspect.Parameter.empty else _spell(default)
        made.append((parameter.name, kind, shown))
    return made


def _spell(value: object) -> str:
    if isinstance(value, enum.Enum):
        return f"{type(value).__name__}.{value.name}"
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return f"{type(value).__name__}()"
    return repr(value)


@pytest.mark.parametrize(
    ("module", "qualname"),
    [
        ("runtime", "HostWeightRuntime.__init__"),
        ("runtime", "HostWeightRuntime.from_config"),
        ("runtime", "HostWeightRuntime.resolve"),
        ("runtime", "HostWeightRuntime.publish_after_load"),
        ("filesystem.store", "FilesystemHostWeightStore.__init__"),
        ("filesystem.store", "FilesystemHostWeightStore.lookup"),
        ("filesystem.store", "FilesystemHostWeightStore.get_or_build"),
        ("filesystem.store", "FilesystemHostWeightStore.cleanup"),
        ("filesystem.store", "FilesystemHostWeightStore.inspect_artifact"),
        ("filesystem.locks", "FileLock.__init__"),
    ],
)
def test_signatures_and_defaults_match_the_reference(module: str, qualname: str) -> None:
    """X03: the reference's entry points take the same parameters, in the same kinds, with the same defaults."""
    class_name, _, method = qualname.partition(".")
    ours = getattr(getattr(_compat_module(module), class_name), method)
    assert _our_signature(ours) == _reference_signature(module, qualname)


def test_install_makes_the_reference_names_this_runtime() -> None:
    """X03: after install() (twice) every `vllm_omni.host_weight_runtime` import is the compat module, the
    vllm_omni package's own __init__ (which needs vLLM) never runs, vLLM-Omni's adapters bind this runtime's
    types, and the reference's private modules are refused rather than mixed in."""
    with spawned_child(_vllm_omni.install_facts_in_child) as conn:
        facts = recv_within(conn)
    assert isinstance(facts, dict)
    assert facts["same_module"] is True
    assert facts["locks"] == f"{compat.__name__}.filesystem.locks"
    assert facts["finders"] == 1
    assert facts["package_init_ran"] is False and facts["vllm_loaded"] is False
    assert facts["adapters_see"] == "host_weight_runtime.failures"
    assert "private module" in facts["private"]


def test_install_after_the_reference_runtime_is_refused() -> None:
    """X03: a process that already holds the reference's runtime module is told to call install() first."""
    with spawned_child(_vllm_omni.install_after_reference_in_child) as conn:
        message = recv_within(conn)
    assert isinstance(message, str) and "call install() first" in message


def test_vllm_omni_adapters_publish_and_restore_bit_exact_on_this_store(tmp_path: Path) -> None:
    """X03: vLLM-Omni's own identity adapter and FinalLayoutBF16Producer publish a real diffusers DiT's final
    layout on this store in one process; in another, its FinalLayoutTensorRestorer restores it into a fresh
    skeleton with other values: every tensor bit-exact, viewing the lease's mapped pages."""
    checkpoint = save_model_folder(build_model("flux", seed=0), tmp_path / "checkpoint")
    root, cache = tmp_path / "hwr", tmp_path / "source-digests"
    with spawned_child(_vllm_omni.publish_in_child, str(root), str(checkpoint), str(cache)) as conn:
        published = recv_within(conn)
    assert isinstance(published, dict)
    assert (published["outcome"], published["failure"]) == ("published", None)
    assert (root / "artifacts" / published["key"]).is_dir()

    with spawned_child(_vllm_omni.restore_in_child, str(root), str(checkpoint), str(cache)) as conn:
        restored = recv_within(conn)
    assert isinstance(restored, dict)
    assert restored["outcome"] == "local_hit"
    assert restored["key"] == published["key"]
    assert restored["before"] != published["digests"]  # the skeleton's own values differed everywhere it counts
    assert restored["restored"] == published["digests"]
    assert restored["shares_lease_memory"] is True

"""`hwr inspect`, `hwr verify` and `hwr cleanup` as a new user runs them.

Artifacts come from `hwr prewarm` on small real diffusers models (a Hugging Face cache
snapshot with default and fp16 weights, and a local pipeline folder); the read-only commands
then run in fresh interpreters, as typed in a shell, against that real domain. Start-up
speed is a benchmark row (`hwr bench`); here the test checks its cause: these commands
import neither torch nor diffusers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from host_weight_runtime import cli
from host_weight_runtime.cli._output import age, size
from host_weight_runtime.diffusion.loader import load_component
from host_weight_runtime.filesystem.store import FilesystemHostWeightStore
from host_weight_runtime.outcomes import ResolutionOutcome
from hwr_tools.synthetic_models import save_hub_snapshot, save_pipeline_folder

from ._adoption import KIND, SUBFOLDER, isolate_environment, save_variant_folder
from ._diffusion import runtime_at

REPO_ID = "hwr-test/tiny-flux-listing"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
RUN_TIMEOUT_S = 120.0
HEAVY = ("torch", "diffusers")

# Runs one `hwr` command in this fresh interpreter and reports on stderr which heavy modules it imported.
_IMPORT_PROBE = f"""
import json, sys
from host_weight_runtime.cli import main
try:
    status = main(sys.argv[1:])
except SystemExit as exc:
    status = exc.code
print(json.dumps({{"status": status, "imported": [m for m in {HEAVY!r} if m in sys.modules]}}), file=sys.stderr)
"""


@dataclass(frozen=True)
class Domain:
    """A domain holding three prewarmed artifacts: the hub repo's default and fp16 weights, and a local model."""

    root: Path
    cache: Path
    local: Path
    prewarmed: dict[str, dict[str, Any]]  # "hub", "hub-fp16", "local" -> `hwr prewarm --json` report


def _hwr(*args: str, columns: int = 80, stdin: int | None = subprocess.DEVNULL) -> subprocess.CompletedProcess[str]:
    """`hwr ARGS` in a fresh interpreter, as typed in a shell of `columns` columns (stdin not a terminal)."""
    environment = {name: value for name, value in os.environ.items() if not name.startswith("HWR_")}
    environment["COLUMNS"] = str(columns)
    return subprocess.run(
        [sys.executable, "-m", "host_weight_runtime.cli", *args],
        stdin=stdin,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
        env=environment,
        check=False,
    )


def _prewarm(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, Any]:
    assert cli.main(["prewarm", *args, "--json"]) == 0
    report: dict[str, Any] = json.loads(capsys.readouterr().out)
    return report


@pytest.fixture
def domain(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> Iterator[Domain]:
    isolate_environment(monkeypatch, tmp_path)
    cache = tmp_path / "hub"
    save_hub_snapshot(cache, REPO_ID, save_variant_folder(tmp_path / "variants", seed=3), revision=COMMIT)
    local = save_pipeline_folder(tmp_path / "models" / "local-flux", KIND, seed=4)
    root = tmp_path / "domain"
    hub = ["--subfolder", SUBFOLDER, "--cache-dir", str(cache), "--root", str(root)]
    prewarmed = {
        "hub": _prewarm(capsys, REPO_ID, *hub),
        "hub-fp16": _prewarm(capsys, REPO_ID, *hub, "--variant", "fp16"),
        "local": _prewarm(capsys, str(local), "--subfolder", SUBFOLDER, "--root", str(root)),
    }
    assert len({report["identity_key"] for report in prewarmed.values()}) == 3
    yield Domain(root, cache, local, prewarmed)


def _rows(stdout: str, keys: list[str]) -> dict[str, str]:
    """The one inventory line that shows each key's prefix."""
    found: dict[str, str] = {}
    for key in keys:
        lines = [line for line in stdout.splitlines() if key[:12] in line]
        assert len(lines) == 1, (key, stdout)
        found[key] = lines[0]
    return found


# ----------------------------------------------------------------------------- start-up


def test_read_only_commands_import_neither_torch_nor_diffusers(domain: Domain) -> None:
    """`hwr --help`, `hwr inspect` (empty and full domain), `hwr verify --full`, `hwr cleanup --dry-run` and
    `hwr cleanup --model --dry-run` finish without importing torch or diffusers (once the start-up cost of every
    command); `hwr bench` reports the resulting start-up time."""
    key = domain.prewarmed["hub"]["identity_key"]
    empty = domain.root.parent / "empty-domain"
    FilesystemHostWeightStore(empty)
    root = str(domain.root)
    commands = [
        (["--help"], 0),
        (["inspect", "--root", str(empty)], 0),
        (["inspect", "--root", root], 0),
        (["inspect", "--root", root, "--wide", "--json"], 0),
        (["verify", key[:12], "--full", "--root", root], 0),
        (["cleanup", key[:12], "--dry-run", "--root", root], 0),
        (["cleanup", "--model", REPO_ID, "--dry-run", "--json", "--root", root], 0),
    ]
    environment = {name: value for name, value in os.environ.items() if not name.startswith("HWR_")}
    for args, expected in commands:
        completed = subprocess.run(
            [sys.executable, "-c", _IMPORT_PROBE, *args],
            capture_output=True,
            text=True,
            timeout=RUN_TIMEOUT_S,
            env=environment,
            check=False,
        )
        report = json.loads(completed.stderr.strip().splitlines()[-1])
        assert report == {"status": expected, "imported": []}, (args, completed.stderr)
    assert sorted(path.name for path in (domain.root / "artifacts").iterdir()) == sorted(
        report["identity_key"] for report in domain.prewarmed.values()
    )


def test_the_import_probe_sees_a_heavy_import(domain: Domain) -> None:
    """The probe above can fail: `hwr prewarm` of a stored model (which needs the diffusers model class) is
    reported importing both."""
    args = ["prewarm", str(domain.local), "--subfolder", SUBFOLDER, "--root", str(domain.root), "--json"]
    completed = subprocess.run(
        [sys.executable, "-c", _IMPORT_PROBE, *args],
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
        check=False,
    )
    report = json.loads(completed.stderr.strip().splitlines()[-1])
    assert report == {"status": 0, "imported": list(HEAVY)}, completed.stderr


# ----------------------------------------------------------------------------- inspect


def test_inspect_at_80_columns_is_one_line_per_artifact_grouped_per_model(domain: Domain) -> None:
    """`hwr inspect --root DIR` in an 80-column terminal: no line is wider than 80, each artifact is one line
    with its state, the dtype, the size `hwr prewarm` printed, its tensor count, its age and its short key;
    the hub model's two artifacts (default and fp16) are next to each other."""
    before_ns = time.time_ns()
    result = _hwr("inspect", "--root", str(domain.root), columns=80)
    after_ns = time.time_ns()
    assert result.returncode == 0, result.stderr
    assert all(len(line) <= 80 for line in result.stdout.splitlines()), result.stdout
    store = FilesystemHostWeightStore(domain.root)
    keys = [report["identity_key"] for report in domain.prewarmed.values()]
    rows = _rows(result.stdout, keys)
    header = next(line for line in result.stdout.splitlines() if line.startswith("MODEL"))
    assert header.split() == ["MODEL", "COMPONENT", "REVISION", "DTYPE", "SIZE*", "TENSORS", "CREATED", "STATE", "KEY"]
    for report in domain.prewarmed.values():
        line = rows[report["identity_key"]]
        assert size(report["total_bytes"]) in line, line
        assert f" {report['tensor_count']} " in line and " bf16 " in line and " ready " in line
        created_ns = store.inspect_artifact(report["identity_key"]).created_at_ns
        assert created_ns is not None
        # The age of its creation when the command ran: the column says exactly that (it ran between the two).
        ages = {age(before_ns - created_ns), age(after_ns - created_ns)}
        assert any(f" {text} " in line for text in ages), (ages, line)
    lines = result.stdout.splitlines()
    hub_rows = sorted(lines.index(rows[domain.prewarmed[name]["identity_key"]]) for name in ("hub", "hub-fp16"))
    local_row = lines.index(rows[domain.prewarmed["local"]["identity_key"]])
    assert hub_rows[1] - hub_rows[0] == 1 and local_row not in range(hub_rows[0], hub_rows[1] + 1)
    assert COMMIT[:8] in rows[domain.prewarmed["hub"]["identity_key"]]
    assert "3 artifacts from 2 models" in result.stdout


def test_inspect_on_a_wide_terminal_shows_model_component_and_revision(domain: Domain) -> None:
    """With room, every row shows its model id (the repo id, or the folder's real path) and its component."""
    result = _hwr("inspect", "--root", str(domain.root), columns=200)
    assert result.returncode == 0, result.stderr
    rows = _rows(result.stdout, [report["identity_key"] for report in domain.prewarmed.values()])
    for name in ("hub", "hub-fp16"):
        line = rows[domain.prewarmed[name]["identity_key"]]
        assert line.startswith(REPO_ID) and f" {SUBFOLDER} " in line and COMMIT[:8] in line
    local = rows[domain.prewarmed["local"]["identity_key"]]
    assert local.startswith(str(domain.local.resolve())) and f" {SUBFOLDER} " in local


def test_inspect_wide_prints_full_keys_revisions_and_paths_on_one_line(domain: Domain) -> None:
    """`hwr inspect --wide` even at 80 columns: each artifact's full key, full revision, source folder and
    artifact path on its one line, nothing cut with an ellipsis."""
    result = _hwr("inspect", "--root", str(domain.root), "--wide", columns=80)
    assert result.returncode == 0, result.stderr
    rows = _rows(result.stdout, [report["identity_key"] for report in domain.prewarmed.values()])
    store = FilesystemHostWeightStore(domain.root)
    for name, report in domain.prewarmed.items():
        line = rows[report["identity_key"]]
        assert report["identity_key"] in line and str(store.layout.artifact_dir(report["identity_key"])) in line
        assert "…" not in line
        if name.startswith("hub"):
            assert COMMIT in line and str(domain.cache) in line
        else:
            assert str(domain.local.resolve() / SUBFOLDER) in line


def test_inspect_json_carries_every_field(domain: Domain) -> None:
    """`hwr inspect --json`: per artifact the model, component, revision, dtype, the tensor bytes `hwr prewarm`
    reported (and the bytes on disk), tensor count, creation time and source folders."""
    result = _hwr("inspect", "--root", str(domain.root), "--json")
    assert result.returncode == 0, result.stderr
    entries = {entry["key"]: entry for entry in json.loads(result.stdout)["artifacts"]}
    for name, report in domain.prewarmed.items():
        entry = entries[report["identity_key"]]
        assert entry["state"] == "ready" and entry["component"] == SUBFOLDER and entry["dtype"] == "bfloat16"
        assert entry["tensor_bytes"] == report["total_bytes"] and entry["tensor_count"] == report["tensor_count"]
        assert entry["size_bytes"] > entry["tensor_bytes"]
        assert isinstance(entry["created_at_ns"], int) and entry["created_at"].endswith("+00:00")
        if name.startswith("hub"):
            assert entry["model_id"] == REPO_ID and entry["revision"] == COMMIT
            assert [Path(path).parent.parent.parent.name for path in entry["source_paths"]] == [
                "models--hwr-test--tiny-flux-listing"
            ]
        else:
            assert entry["model_id"] == str(domain.local.resolve()) and entry["revision"] is None
            assert entry["source_paths"] == [str(domain.local.resolve() / SUBFOLDER)]


# ----------------------------------------------------------------------------- cleanup


def test_cleanup_dry_run_json_is_a_plan_and_yes_reports_what_it_removed(domain: Domain) -> None:
    """`hwr cleanup KEY --dry-run --json` says planned_bytes/planned_paths and no removed_*; `--yes --json`
    then says removed_bytes (the same figure) and removed_paths."""
    key = domain.prewarmed["local"]["identity_key"]
    plan = _hwr("cleanup", key[:12], "--dry-run", "--json", "--root", str(domain.root))
    assert plan.returncode == 0, plan.stderr
    planned = json.loads(plan.stdout)
    assert planned["status"] == "planned" and planned["dry_run"] is True and planned["planned_bytes"] > 0
    assert not {"removed_bytes", "removed_paths"} & set(planned)
    assert (domain.root / "artifacts" / key).is_dir()

    done = _hwr("cleanup", key[:12], "--yes", "--json", "--root", str(domain.root))
    assert done.returncode == 0, done.stderr
    removed = json.loads(done.stdout)
    assert removed["status"] == "removed" and removed["dry_run"] is False
    assert removed["removed_bytes"] == planned["planned_bytes"]
    assert removed["removed_paths"] == planned["planned_paths"]
    assert not {"planned_bytes", "planned_paths"} & set(removed)
    assert not (domain.root / "artifacts" / key).exists()


def test_cleanup_model_removes_every_artifact_of_that_model_only(domain: Domain) -> None:
    """`hwr cleanup --model ORG/NAME --dry-run` plans the model's two artifacts (default and fp16) and nothing
    else; `--yes` removes exactly those; the other model's artifact stays and `hwr inspect` still lists it."""
    hub_keys = sorted(domain.prewarmed[name]["identity_key"] for name in ("hub", "hub-fp16"))
    plan = _hwr("cleanup", "--model", REPO_ID, "--dry-run", "--json", "--root", str(domain.root))
    assert plan.returncode == 0, plan.stderr
    planned = json.loads(plan.stdout)
    assert planned["model"] == REPO_ID and planned["dry_run"] is True
    assert sorted(entry["key"] for entry in planned["artifacts"]) == hub_keys
    assert planned["planned_bytes"] == sum(entry["planned_bytes"] for entry in planned["artifacts"]) > 0
    assert "removed_bytes" not in planned

    human = _hwr("cleanup", "--model", REPO_ID, "--dry-run", "--root", str(domain.root))
    assert human.returncode == 0 and f"{REPO_ID}: would remove" in human.stdout
    assert all(key[:12] in human.stdout for key in hub_keys)

    done = _hwr("cleanup", "--model", REPO_ID, "--yes", "--json", "--root", str(domain.root))
    assert done.returncode == 0, done.stderr
    removed = json.loads(done.stdout)
    assert removed["removed_bytes"] == planned["planned_bytes"]
    assert [entry["status"] for entry in removed["artifacts"]] == ["removed", "removed"]
    remaining = json.loads(_hwr("inspect", "--root", str(domain.root), "--json").stdout)["artifacts"]
    assert [entry["key"] for entry in remaining] == [domain.prewarmed["local"]["identity_key"]]


def test_cleanup_model_accepts_the_folder_as_typed(domain: Domain, monkeypatch: pytest.MonkeyPatch) -> None:
    """A local model is named by its folder in any spelling (here relative, from its parent directory)."""
    monkeypatch.chdir(domain.local.parent)
    plan = _hwr("cleanup", "--model", domain.local.name, "--dry-run", "--json", "--root", str(domain.root))
    assert plan.returncode == 0, plan.stderr
    assert [entry["key"] for entry in json.loads(plan.stdout)["artifacts"]] == [
        domain.prewarmed["local"]["identity_key"]
    ]


def test_cleanup_model_refuses_a_leased_artifact_and_removes_the_rest(domain: Domain) -> None:
    """While a worker holds the fp16 artifact, `hwr cleanup --model ORG/NAME --yes` removes the default one,
    refuses the leased one (active_lease) and exits 1."""
    leased = domain.prewarmed["hub-fp16"]["identity_key"]
    free = domain.prewarmed["hub"]["identity_key"]
    runtime = runtime_at(domain.root)
    with load_component(
        REPO_ID, subfolder=SUBFOLDER, variant="fp16", cache_dir=domain.cache, runtime=runtime
    ) as worker:
        assert worker.outcome is ResolutionOutcome.LOCAL_HIT and worker.identity_key == leased
        result = _hwr("cleanup", "--model", REPO_ID, "--yes", "--json", "--root", str(domain.root))
        assert result.returncode == 1
        statuses = {entry["key"]: entry["status"] for entry in json.loads(result.stdout)["artifacts"]}
        assert statuses == {leased: "active_lease", free: "removed"}
        assert (domain.root / "artifacts" / leased).is_dir() and not (domain.root / "artifacts" / free).exists()


def test_cleanup_needs_a_key_or_a_model_and_knows_the_models(domain: Domain) -> None:
    """`hwr cleanup` with neither KEY nor --model (or both) is a usage error (exit 2); a model with no artifact
    exits 1 naming it; nothing is removed."""
    key = domain.prewarmed["hub"]["identity_key"]
    for args in ([], [key[:12], "--model", REPO_ID]):
        result = _hwr("cleanup", *args, "--dry-run", "--root", str(domain.root))
        assert result.returncode == 2 and "--model" in result.stderr, result.stderr
    unknown = _hwr("cleanup", "--model", "hwr-test/unknown", "--yes", "--root", str(domain.root))
    assert unknown.returncode == 1 and "hwr-test/unknown" in unknown.stderr
    assert len(list((domain.root / "artifacts").iterdir())) == 3


# ----------------------------------------------------------------------------- README


README = Path(__file__).resolve().parents[1] / "README.md"
README_MODEL = "black-forest-labs/FLUX.1-dev"


def _readme_section(start: str) -> str:
    text = README.read_text(encoding="utf-8")
    return text[text.index(start) :]


def test_readme_hwr_session_runs_as_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The README's `hwr` session, line by line in fresh processes, against a Hugging Face cache holding a small
    real Flux pipeline under the README's repo id: every command exits 0 (KEY is the prefix `hwr inspect`
    shows), inspect prints the inventory header, and the last cleanup leaves no artifact."""
    isolate_environment(monkeypatch, tmp_path)
    cache = tmp_path / "hub"
    save_hub_snapshot(cache, README_MODEL, save_pipeline_folder(tmp_path / "flux", KIND, seed=5))
    root = tmp_path / "domain"
    block = _readme_section("A session on a node").split("```\n", 2)[1]
    commands = [line.split("#", 1)[0].split() for line in block.splitlines() if line.startswith("hwr ")]
    assert [command[1] for command in commands] == ["prewarm", "inspect", "inspect", "verify", "cleanup", "cleanup"]
    environment = {name: value for name, value in os.environ.items() if not name.startswith("HWR_")}
    environment.update({"HWR_ROOT": str(root), "HF_HUB_CACHE": str(cache), "COLUMNS": "120"})
    for written in commands:
        keys = [path.name[:12] for path in (root / "artifacts").iterdir()] if "KEY" in written else []
        command = [keys[0] if word == "KEY" and len(keys) == 1 else word for word in written]
        completed = subprocess.run(
            [sys.executable, "-m", "host_weight_runtime.cli", *command[1:]],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=RUN_TIMEOUT_S,
            env=environment,
            check=False,
        )
        assert completed.returncode == 0, (command, completed.stderr)
        if command[1] == "inspect":
            assert "MODEL" in completed.stdout and README_MODEL in completed.stdout
    assert list((root / "artifacts").iterdir()) == []


def test_readme_command_table_lists_every_option() -> None:
    """Each `hwr` command in the README's table names exactly the options its parser accepts."""
    table = _readme_section("| command | what it does |").split("\n\n", 1)[0]
    parser = cli.build_parser()
    subparsers = next(action for action in parser._actions if action.dest == "command")
    listed: dict[str, set[str]] = {}
    for row in table.splitlines()[2:]:
        usage = row.split("`", 2)[1]
        name = usage.split()[1]
        listed[name] = {word.strip("[]()") for word in usage.split() if word.strip("[]()").startswith("--")}
    choices: dict[str, Any] = subparsers.choices  # type: ignore[attr-defined]
    for name in ("inspect", "verify", "cleanup", "prewarm"):
        accepted = {
            option for action in choices[name]._actions for option in action.option_strings if option.startswith("--")
        }
        assert listed[name] == accepted - {"--help"}, name

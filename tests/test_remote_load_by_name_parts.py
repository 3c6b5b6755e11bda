"""A load by name of the FP8 representation and of tensor-parallel parts, on a node without the checkpoint (E14).

Node A holds a real tiny Flux (4 heads, so TP=2 splits its attention) as a Hugging Face cache
snapshot at a pinned commit and prewarms four layouts of its transformer: BF16 and FP8 whole,
and the BF16 and FP8 TP=2 bundles (a replicated part and two shard parts each), then pushes
everything. Each layout gets a name of its own in the remote's index (the dtype of its
representation; for a part the TP size and the part). Node B's Hugging Face cache is empty:
`load_component(..., representation="fp8")` and two spawned TP ranks in a gloo group import
node A's exact keys by name (over `file://`, and over moto's S3); a shard entry that names another
key, or a rank whose shard has no entry at all, fails every rank of the group at once, typed.
The name lookup goes past a remote that is down, refuses an index object that is another name's
entry, and `prewarm_tensor_parallel` without the checkpoint says to `hwr pull` the parts.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from host_weight_runtime import FailureCode, FilesystemHostWeightStore, HostWeightError, HostWeightUsageError
from host_weight_runtime.config import HostWeightRuntimeConfig, RuntimeMode
from host_weight_runtime.diffusion import (
    load_component,
    plan_for_model,
    prewarm_component,
    prewarm_tensor_parallel,
    resolve_tensor_shards,
)
from host_weight_runtime.outcomes import ResolutionOutcome
from host_weight_runtime.remote import ArtifactName, FsspecArtifactProvider, NameIndexEntry, pull_by_name
from host_weight_runtime.runtime import HostWeightRuntime
from hwr_tools.synthetic_models import save_hub_snapshot

from ._diffusion import DIT, Folder, save_folder
from .remote_support import (
    MotoEndpoint,
    Remote,
    assert_bitwise_equal,
    closed_endpoint,
    moto_endpoint,
)
from .test_diffusion_tp import FLUX_TP4
from .test_diffusion_tp_group import run_group

REPO_ID = "hwr-test/tiny-flux-parts-by-name"
REVISION = hashlib.sha1(b"hwr-test/tiny-flux-parts-by-name@1").hexdigest()
FP8 = "float8_e4m3fn"


@dataclass
class NodeA:
    folder: Folder
    cache: Path
    root: Path
    keys: dict[ArtifactName, str]


def name(dtype: str = "bfloat16", size: int = 1, part: str | None = None) -> ArtifactName:
    return ArtifactName(REPO_ID, REVISION, DIT, None, dtype, size, part)


def runtime(root: Path, remote: Remote | None = None) -> HostWeightRuntime:
    providers = (
        () if remote is None else (FsspecArtifactProvider(remote.read_url, storage_options=remote.read_options),)
    )
    return HostWeightRuntime(
        HostWeightRuntimeConfig(mode=RuntimeMode.PREFERRED, root=root, lock_timeout_s=60.0), remote_providers=providers
    )


@pytest.fixture(scope="module")
def moto() -> Iterator[MotoEndpoint]:
    with moto_endpoint() as endpoint:
        yield endpoint


@pytest.fixture(scope="module")
def node_a(tmp_path_factory: pytest.TempPathFactory) -> NodeA:
    """Node A prewarmed BF16 and FP8, whole and as TP=2 parts, from its hub cache snapshot."""
    base = tmp_path_factory.mktemp("node-a-parts")
    folder = save_folder(base / "tiny-flux", "flux", seed=5, config_overrides=FLUX_TP4)
    cache = base / "hub"
    save_hub_snapshot(cache, REPO_ID, folder.root, revision=REVISION)
    root = base / "domain"
    keys: dict[ArtifactName, str] = {}
    for representation, dtype in (("bf16", "bfloat16"), ("fp8", FP8)):
        whole = prewarm_component(
            REPO_ID, subfolder=DIT, revision=REVISION, cache_dir=cache, runtime=runtime(root),
            representation=representation,
        )  # fmt: skip
        keys[name(dtype)] = whole.identity_key
        replicated, *shards = prewarm_tensor_parallel(
            REPO_ID, tensor_parallel_size=2, subfolder=DIT, revision=REVISION, cache_dir=cache,
            runtime=runtime(root), representation=representation,
        )  # fmt: skip
        keys[name(dtype, 2, "replicated")] = replicated.identity_key
        for rank, shard in enumerate(shards):
            keys[name(dtype, 2, f"shard-{rank}")] = shard.identity_key
    assert len(set(keys.values())) == 8
    return NodeA(folder, cache, root, keys)


def _entry(remote: Remote, artifact: ArtifactName) -> NameIndexEntry:
    return NameIndexEntry.from_bytes(bytes(remote.raw.cat_file(f"{remote.raw_root}/{artifact.object_path()}")))


@pytest.mark.parametrize("pushed", ["file"], indirect=True)
def test_every_layout_has_a_name_of_its_own(node_a: NodeA, pushed: Remote) -> None:
    """E14: BF16 and FP8, whole and each TP=2 part, are eight names mapping to node A's eight keys: a part
    never takes the name of the whole artifact, FP8 never that of BF16; each entry lists the checkpoint."""
    for artifact, key in node_a.keys.items():
        entry = _entry(pushed, artifact)
        assert (entry.name, entry.key) == (artifact, key)
        assert [record.name for record in entry.checkpoint] == ["diffusion_pytorch_model.safetensors"]


def _fp8_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: tensor.detach() for name, tensor in model.state_dict().items()}


def test_fp8_component_by_name(node_a: NodeA, pushed: Remote, tmp_path: Path) -> None:
    """E14: node B, holding nothing of the model, loads the FP8 representation by repo id and commit: a
    REMOTE_IMPORT of node A's FP8 key (not the BF16 one), every FP8 weight and scale equal to node A's;
    the next load is a LOCAL_HIT."""
    root_b = tmp_path / "node-b"
    first = load_component(
        REPO_ID, subfolder=DIT, revision=REVISION, representation="fp8", runtime=runtime(root_b, pushed)
    )
    assert first.outcome is ResolutionOutcome.REMOTE_IMPORT, first.summary()
    assert first.identity_key == node_a.keys[name(FP8)]
    reference = load_component(
        REPO_ID, subfolder=DIT, revision=REVISION, cache_dir=node_a.cache, representation="fp8",
        runtime=runtime(node_a.root),
    )  # fmt: skip
    assert reference.outcome is ResolutionOutcome.LOCAL_HIT
    ours, theirs = _fp8_state(first.model), _fp8_state(reference.model)
    assert sorted(ours) == sorted(theirs)
    assert any(tensor.dtype == torch.float8_e4m3fn for tensor in theirs.values())
    for key, tensor in theirs.items():
        assert_bitwise_equal(ours[key], tensor)
    second = load_component(
        REPO_ID, subfolder=DIT, revision=REVISION, representation="fp8", runtime=runtime(root_b, pushed)
    )
    assert second.outcome is ResolutionOutcome.LOCAL_HIT and second.identity_key == first.identity_key


@pytest.mark.parametrize("pushed", ["file"], indirect=True)
def test_an_fp8_entry_naming_another_key_is_refused(node_a: NodeA, pushed: Remote, tmp_path: Path) -> None:
    """E14: an FP8 index entry that points at the BF16 key is a non-retryable REMOTE_FAILED; nothing imported."""
    entry = _entry(pushed, name(FP8))
    fields = {field: getattr(entry, field) for field in NameIndexEntry.__dataclass_fields__}
    fields["key"] = node_a.keys[name()]
    pushed.raw.pipe_file(f"{pushed.raw_root}/{name(FP8).object_path()}", NameIndexEntry(**fields).to_bytes())
    root_b = tmp_path / "node-b"
    with pytest.raises(HostWeightError) as refused:
        load_component(REPO_ID, subfolder=DIT, revision=REVISION, representation="fp8", runtime=runtime(root_b, pushed))
    assert refused.value.failure.code is FailureCode.REMOTE_FAILED and not refused.value.failure.retryable
    artifacts = root_b / "artifacts"
    assert not artifacts.exists() or list(artifacts.iterdir()) == []


def _expected_local_bytes(folder: Folder, size: int) -> list[dict[str, str]]:
    """Per rank: parameter name -> sha256 of the BF16 bytes that rank holds (its slice, or the whole tensor)."""
    canonical = folder.canonical()
    plan = plan_for_model(canonical, size)
    expected = []
    for rank in range(size):
        shards = resolve_tensor_shards(canonical, plan, size, rank)
        found = {}
        for parameter_name, parameter in canonical.named_parameters():
            shard = shards.get(parameter_name)
            local = parameter.detach() if shard is None else shard.take(parameter.detach())
            found[parameter_name] = hashlib.sha256(local.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
        expected.append(found)
    return expected


@pytest.mark.parametrize("pushed", ["file"], indirect=True)
def test_tensor_parallel_ranks_by_name(node_a: NodeA, pushed: Remote, tmp_path: Path) -> None:
    """E14/T01: two spawned TP ranks of a gloo group on node B load by repo id and commit, BF16 then FP8: each
    imports its shard part and the one replicated part under node A's keys (REMOTE_IMPORT), every BF16 rank
    holds exactly its slice of the canonical weights, and the FP8 ranks serve FP8 from node A's FP8 parts.
    Then rank 1's shard entry is pointed at rank 0's key: the whole group fails REMOTE_FAILED."""
    domain = tmp_path / "node-b"
    by_name: dict[str, Any] = {"mode": "preferred", "model": REPO_ID, "revision": REVISION, "remote": pushed.read_url}
    bf16, fp8 = run_group(
        tmp_path, node_a.folder, domain, 2,
        [{**by_name, "placements": True}, {**by_name, "representation": "fp8", "fp8_bits": True}],
    )  # fmt: skip
    for dtype, results in (("bfloat16", bf16), (FP8, fp8)):
        assert [result["outcome"] for result in results] == ["remote_import", "remote_import"], results
        assert [result["key"] for result in results] == [node_a.keys[name(dtype, 2, f"shard-{r}")] for r in range(2)]
    for result, expected in zip(bf16, _expected_local_bytes(node_a.folder, 2), strict=True):
        assert {parameter: digest for parameter, (_p, _d, digest) in result["placements"].items()} == expected
    assert all(result["fp8"] for result in fp8)
    store = FilesystemHostWeightStore(domain)
    assert sorted(path.name for path in store.layout.artifacts.iterdir()) == sorted(
        key for artifact, key in node_a.keys.items() if artifact.part is not None
    )
    shard = name("bfloat16", 2, "shard-1")
    entry = _entry(pushed, shard)
    fields = {field: getattr(entry, field) for field in NameIndexEntry.__dataclass_fields__}
    fields["key"] = node_a.keys[name("bfloat16", 2, "shard-0")]
    pushed.raw.pipe_file(f"{pushed.raw_root}/{shard.object_path()}", NameIndexEntry(**fields).to_bytes())
    (refused,) = run_group(tmp_path, node_a.folder, tmp_path / "node-c", 2, [by_name])
    assert [result.get("failed") for result in refused] == ["remote_failed", "remote_failed"]


@pytest.mark.parametrize("pushed", ["s3"], indirect=True)
def test_tensor_parallel_bf16_ranks_by_name_over_s3(node_a: NodeA, pushed: Remote, tmp_path: Path) -> None:
    """E13/E14/T01: over S3 (moto's threaded server, spoken to over HTTP with the storage options each rank's
    runtime is given), two spawned TP ranks of a gloo group on node B, which holds no checkpoint, load the BF16
    layout by repo id and commit: each imports its shard part and the one replicated part under node A's keys
    (REMOTE_IMPORT) and holds exactly its slice of the canonical weights; node B's domain then holds exactly the
    three BF16 parts, and the next load by name is a LOCAL_HIT of the same keys."""
    by_name: dict[str, Any] = {
        "mode": "preferred", "model": REPO_ID, "revision": REVISION, "remote": pushed.read_url,
        "remote_options": pushed.read_options,
    }  # fmt: skip
    domain = tmp_path / "node-b"
    cold, warm = run_group(tmp_path, node_a.folder, domain, 2, [{**by_name, "placements": True}, by_name])
    shard_keys = [node_a.keys[name("bfloat16", 2, f"shard-{rank}")] for rank in range(2)]
    assert [result.get("outcome") for result in cold] == ["remote_import", "remote_import"], cold
    assert [result["key"] for result in cold] == shard_keys
    for result, expected in zip(cold, _expected_local_bytes(node_a.folder, 2), strict=True):
        assert {parameter: digest for parameter, (_p, _d, digest) in result["placements"].items()} == expected
    assert sorted(path.name for path in FilesystemHostWeightStore(domain).layout.artifacts.iterdir()) == sorted(
        key for artifact, key in node_a.keys.items() if artifact.dtype == "bfloat16" and artifact.part is not None
    )
    assert [(result.get("outcome"), result["key"]) for result in warm] == [("local_hit", key) for key in shard_keys]


@pytest.mark.parametrize("pushed", ["s3"], indirect=True)
def test_a_rank_without_an_index_entry_fails_the_whole_group_at_once(
    node_a: NodeA, pushed: Remote, tmp_path: Path
) -> None:
    """E14/E13: on S3 (moto), rank 1's BF16 shard entry is gone from the index (as if only some parts were
    pushed): rank 0 finds its entry, rank 1 has no checkpoint and no entry. Both ranks fail NOT_FOUND at once,
    in PREFERRED (no checkpoint to fall back to) and in REQUIRED, and import nothing; the cohort deadline is an
    hour, so a rank left waiting for it would overrun the group's read deadline instead. The same group then
    loads FP8 by name over S3 (REMOTE_IMPORT of node A's shard keys): the ranks stayed in step."""
    shard = name("bfloat16", 2, "shard-1")
    pushed.raw.rm_file(f"{pushed.raw_root}/{shard.object_path()}")
    by_name: dict[str, Any] = {
        "model": REPO_ID, "revision": REVISION, "remote": pushed.read_url, "remote_options": pushed.read_options,
        "lock_timeout_s": 3600.0,
    }  # fmt: skip
    domain = tmp_path / "node-b"
    preferred, required, fp8 = run_group(
        tmp_path, node_a.folder, domain, 2,
        [{**by_name, "mode": "preferred"}, {**by_name, "mode": "required"},
         {**by_name, "mode": "preferred", "representation": "fp8"}],
    )  # fmt: skip
    assert [result.get("failed") for result in preferred] == ["not_found", "not_found"], preferred
    assert [result.get("failed") for result in required] == ["not_found", "not_found"], required
    assert [result["outcome"] for result in fp8] == ["remote_import", "remote_import"], fp8
    assert [result["key"] for result in fp8] == [node_a.keys[name(FP8, 2, f"shard-{r}")] for r in range(2)]
    imported = sorted(path.name for path in FilesystemHostWeightStore(domain).layout.artifacts.iterdir())
    assert imported == sorted(key for artifact, key in node_a.keys.items() if artifact.dtype == FP8 and artifact.part)


@pytest.mark.parametrize("pushed", ["file"], indirect=True)
def test_prewarm_tensor_parallel_by_name_says_to_pull(node_a: NodeA, pushed: Remote, tmp_path: Path) -> None:
    """E14: `prewarm_tensor_parallel` builds from a checkpoint; on node B (none, a remote configured) it refuses
    with a typed UNSUPPORTED usage error whose message gives the `hwr pull ... --tensor-parallel-size 2
    --representation fp8` that imports the parts by name, and writes no artifact."""
    root_b = tmp_path / "node-b"
    with pytest.raises(HostWeightUsageError) as refused:
        prewarm_tensor_parallel(
            REPO_ID, tensor_parallel_size=2, subfolder=DIT, revision=REVISION, runtime=runtime(root_b, pushed),
            representation="fp8",
        )  # fmt: skip
    assert refused.value.failure.code is FailureCode.UNSUPPORTED
    command = f"hwr pull {REPO_ID} --revision {REVISION} --subfolder {DIT} --tensor-parallel-size 2"
    command += " --representation fp8"
    assert f"`{command}`" in refused.value.failure.message
    assert not (root_b / "artifacts").exists() or list((root_b / "artifacts").iterdir()) == []


@pytest.mark.parametrize("pushed", ["file"], indirect=True)
def test_a_remote_that_is_down_is_passed_by_the_name_lookup(node_a: NodeA, pushed: Remote, tmp_path: Path) -> None:
    """E14: with a first remote that refuses connections and then the pushed one, a load by name takes the index
    entry and the snapshot files from the second (REMOTE_IMPORT of node A's key), as the import stage goes past a
    remote that is down; with only the dead remote it fails as a retryable REMOTE_FAILED (not a name the index
    lacks) and imports nothing."""
    down = FsspecArtifactProvider(f"{closed_endpoint()}/fleet", timeout_s=5.0)

    def node(root: Path, *providers: FsspecArtifactProvider) -> HostWeightRuntime:
        config = HostWeightRuntimeConfig(mode=RuntimeMode.PREFERRED, root=root, lock_timeout_s=60.0)
        return HostWeightRuntime(config, remote_providers=providers)

    loaded = load_component(
        REPO_ID, subfolder=DIT, revision=REVISION, runtime=node(tmp_path / "node-b", down, pushed.provider())
    )
    assert loaded.outcome is ResolutionOutcome.REMOTE_IMPORT, loaded.summary()
    assert loaded.identity_key == node_a.keys[name()]
    loaded.close()
    with pytest.raises(HostWeightError) as failed:
        load_component(REPO_ID, subfolder=DIT, revision=REVISION, runtime=node(tmp_path / "node-c", down))
    assert failed.value.failure.code is FailureCode.REMOTE_FAILED and failed.value.failure.retryable, failed.value
    artifacts = tmp_path / "node-c" / "artifacts"
    assert not artifacts.exists() or list(artifacts.iterdir()) == []


@pytest.mark.parametrize("pushed", ["file"], indirect=True)
def test_an_entry_under_another_names_path_is_refused(node_a: NodeA, pushed: Remote, tmp_path: Path) -> None:
    """E13: rank 0's shard entry copied over rank 1's (the object at shard-1's path is shard-0's entry): a pull of
    shard-1 is a non-retryable REMOTE_FAILED naming both and imports nothing, instead of rank 0's shard as
    rank 1's."""
    copied, target = name("bfloat16", 2, "shard-0"), name("bfloat16", 2, "shard-1")
    entry = bytes(pushed.raw.cat_file(f"{pushed.raw_root}/{copied.object_path()}"))
    pushed.raw.pipe_file(f"{pushed.raw_root}/{target.object_path()}", entry)
    root_b = tmp_path / "node-b"
    with pytest.raises(HostWeightError) as refused:
        pull_by_name(FilesystemHostWeightStore(root_b), pushed.read_url, target)
    failure = refused.value.failure
    assert failure.code is FailureCode.REMOTE_FAILED and not failure.retryable, failure
    assert str(copied) in failure.message and str(target) in failure.message
    assert not (root_b / "artifacts").exists() or list((root_b / "artifacts").iterdir()) == []


@pytest.mark.parametrize("pushed", ["file"], indirect=True)
def test_hwr_pull_fp8_parts_by_name(node_a: NodeA, pushed: Remote, tmp_path: Path) -> None:
    """E14: `hwr pull --representation fp8 --tensor-parallel-size 2` imports the FP8 replicated part and both
    shard parts under node A's keys (one JSON record per part); --representation fp8 with another --dtype is a
    usage error (exit 2) and imports nothing."""
    environment = {key: value for key, value in os.environ.items() if not key.startswith("HWR_")}
    root_b = tmp_path / "node-b"
    base = ["pull", REPO_ID, "--revision", REVISION, "--subfolder", DIT, "--from", pushed.read_url]
    base += ["--root", str(root_b), "--json", "--representation", "fp8"]

    def hwr(*extra: str) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(
            [sys.executable, "-m", "host_weight_runtime.cli", *base, *extra],
            stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300, env=environment, check=False,
        )  # fmt: skip
        assert "Traceback" not in done.stderr, done.stderr
        return done

    refused = hwr("--dtype", "float16")
    assert refused.returncode == 2 and "dtype" in json.loads(refused.stdout)["error"]["message"]
    assert not (root_b / "artifacts").exists() or list((root_b / "artifacts").iterdir()) == []
    pulled = hwr("--tensor-parallel-size", "2")
    assert pulled.returncode == 0, pulled.stdout + pulled.stderr
    parts = json.loads(pulled.stdout)["parts"]
    expected = [name(FP8, 2, part) for part in ("replicated", "shard-0", "shard-1")]
    assert [ArtifactName.from_dict(part["name"]) for part in parts] == expected
    assert [part["key"] for part in parts] == [node_a.keys[artifact] for artifact in expected]
    assert [part["status"] for part in parts] == ["built"] * 3
    assert sorted(path.name for path in (root_b / "artifacts").iterdir()) == sorted(part["key"] for part in parts)

"""What a process keeps between loads of one artifact: identity keys hashed once, manifests parsed once per
exact bytes, tensor ownership discovered once per kind of skeleton; none may ever answer for another
identity, other bytes or another skeleton (C03, C06, S10, D01, D05, D14)."""

from __future__ import annotations

import dataclasses
import hashlib
import pickle
import time
from pathlib import Path

import pytest
import torch

from host_weight_runtime import BuildRequest, FilesystemHostWeightStore, StoreStatus, ValidationLevel
from host_weight_runtime.canonical_json import CanonicalJson, encode_canonical
from host_weight_runtime.diffusion import ComponentLoadPath, load_component
from host_weight_runtime.diffusion._load_options import LoadOptions
from host_weight_runtime.diffusion._ownership_plans import OWNERSHIP_PLANS
from host_weight_runtime.diffusion.component_source import ComponentLocation
from host_weight_runtime.diffusion.contracts import FinalLayoutParallelIdentity
from host_weight_runtime.diffusion.identity_adapter import discover_final_layout
from host_weight_runtime.diffusion.producers.finalized import FinalLayoutBF16Producer
from host_weight_runtime.diffusion.representation import quantize_model_fp8, tensor_policy
from host_weight_runtime.diffusion.restorer import CHECKED_LAYOUTS
from host_weight_runtime.diffusion.skeleton import ComponentSkeleton, identify_component, prepare_skeleton
from host_weight_runtime.failures import FailureCode, HostWeightError
from host_weight_runtime.identity import RuntimeWeightLayout
from host_weight_runtime.manifest import MANIFEST_FILE_NAME, PARSED_MANIFESTS, ParsedManifests, WeightManifest
from host_weight_runtime.outcomes import CleanupStatus, PostLoadPublicationStatus, ResolutionOutcome

from . import _children
from ._diffusion import DIT, runtime_at, save_folder
from ._hostile import reseal, writable
from .support import CHILD_TIMEOUT_S, SPAWN, SyntheticProducer, make_identity, make_tensors, reaped_children

META = ValidationLevel.MANIFEST_AND_METADATA


def _publish(store: FilesystemHostWeightStore, tag: str, seed: int) -> str:
    identity = make_identity(tag=tag)
    producer = SyntheticProducer(identity, make_tensors(seed))
    result = store.get_or_build(BuildRequest(identity), producer, validation=META, deadline=time.monotonic() + 60)
    assert result.status is StoreStatus.BUILT, result.failure
    assert result.lease is not None
    result.lease.close()
    return identity.key


def test_identity_key_is_hashed_once_and_stays_exact() -> None:
    """C03: the key read twice is the SHA-256 of the canonical identity; a changed field is a new key, and the
    remembered key never changes equality, pickling or a `replace`d copy."""
    identity = make_identity()
    expected = hashlib.sha256(encode_canonical(identity.to_dict())).hexdigest()
    assert identity.key == expected
    assert identity.key is identity.key  # remembered, not re-hashed
    fresh = make_identity()
    assert fresh == identity  # one whose key was never read equals one whose key was
    other = dataclasses.replace(identity, layout=RuntimeWeightLayout(name=identity.layout.name, tensor_parallel_size=2))
    assert other.key != identity.key
    assert other.key == hashlib.sha256(encode_canonical(other.to_dict())).hexdigest()
    assert pickle.loads(pickle.dumps(identity)).key == expected
    assert make_identity(tag="another").key != expected


def test_parsed_manifests_answer_only_for_the_same_bytes(tmp_path: Path) -> None:
    """C06: a manifest is parsed once per exact bytes; another artifact's manifest, or the same manifest with one
    field changed, is parsed afresh and gives its own identity and fields; unparsable bytes are never kept."""
    store = FilesystemHostWeightStore(tmp_path / "domain")
    first, second = _publish(store, "first", 0), _publish(store, "second", 1)
    first_bytes = (store.layout.artifact_dir(first) / MANIFEST_FILE_NAME).read_bytes()
    second_bytes = (store.layout.artifact_dir(second) / MANIFEST_FILE_NAME).read_bytes()
    parsed = ParsedManifests(limit=2)
    digest, manifest = parsed.parse(first_bytes)
    assert digest == hashlib.sha256(first_bytes).hexdigest() and manifest.identity_key == first
    assert parsed.parse(first_bytes)[1] is manifest and (parsed.hits, parsed.parses) == (1, 1)
    _digest, other = parsed.parse(second_bytes)
    assert other.identity_key == second and other is not manifest and parsed.parses == 2
    changed = dataclasses.replace(manifest, format_metadata=CanonicalJson.from_value({"note": "changed"}))
    _digest, reparsed = parsed.parse(changed.to_bytes())
    assert reparsed == changed and reparsed != manifest and parsed.parses == 3
    assert parsed.parse(first_bytes)[1] is not manifest  # the limit of 2 let the oldest go: parsed again
    with pytest.raises(ValueError):
        parsed.parse(first_bytes.replace(b'"tensors"', b'"tensorz"'))
    assert parsed.parses == 4


def test_lookup_serves_the_manifest_on_disk_not_one_parsed_before(tmp_path: Path) -> None:
    """S10: after a lookup parsed an artifact's manifest, a manifest rewritten on disk (READY re-sealed to it) is
    what the next lease holds, and one that no longer matches READY.json is an invalid artifact, whatever this
    process parsed before."""
    store = FilesystemHostWeightStore(tmp_path / "domain")
    key = _publish(store, "cached", 0)
    identity = make_identity(tag="cached")
    with store.lookup(identity, validation=META, deadline=time.monotonic() + 60).lease as lease:  # type: ignore[union-attr]
        original = lease.manifest
    directory = store.layout.artifact_dir(key)
    changed = dataclasses.replace(original, format_metadata=CanonicalJson.from_value({"rewritten": True}))
    with writable(directory):
        reseal(directory, changed.to_bytes())
    result = store.lookup(identity, validation=META, deadline=time.monotonic() + 60)
    assert result.status is StoreStatus.HIT and result.lease is not None
    with result.lease as lease:
        assert lease.manifest == changed and lease.manifest != original
    with writable(directory):
        (directory / MANIFEST_FILE_NAME).write_bytes(original.to_bytes())  # READY still names `changed`
    refused = store.lookup(identity, validation=META, deadline=time.monotonic() + 60)
    assert refused.status is StoreStatus.INVALID and refused.lease is None
    assert refused.failure is not None and refused.failure.code is FailureCode.MANIFEST_INVALID
    assert WeightManifest.from_bytes(original.to_bytes()) == original
    assert PARSED_MANIFESTS.parse(original.to_bytes())[1] == original


def test_a_build_reads_back_the_manifest_it_sealed_without_parsing_it(tmp_path: Path) -> None:
    """S10: the lease a build hands back holds exactly what a parse of the sealed manifest.json gives, and the
    read-back parses nothing; a manifest changed on disk afterwards is still refused, by this process and by a
    fresh one, since only the exact bytes this process sealed are answered from memory."""
    store = FilesystemHostWeightStore(tmp_path / "domain")
    identity = make_identity()
    parses = PARSED_MANIFESTS.parses
    producer = SyntheticProducer(identity, make_tensors(7))
    result = store.get_or_build(BuildRequest(identity), producer, validation=META, deadline=time.monotonic() + 60)
    assert result.status is StoreStatus.BUILT and result.lease is not None
    directory = store.layout.artifact_dir(identity.key)
    sealed = (directory / MANIFEST_FILE_NAME).read_bytes()
    with result.lease as lease:
        assert lease.manifest == WeightManifest.from_bytes(sealed)
        assert lease.manifest.to_bytes() == sealed
    assert PARSED_MANIFESTS.parses == parses

    changed = dataclasses.replace(lease.manifest, format_metadata=CanonicalJson.from_value({"tampered": True}))
    with writable(directory):
        (directory / MANIFEST_FILE_NAME).write_bytes(changed.to_bytes())  # READY.json still names the sealed bytes
    report_parent, report_child = SPAWN.Pipe(duplex=False)
    control_child, _control_parent = SPAWN.Pipe(duplex=False)
    with reaped_children() as children:
        child = SPAWN.Process(
            target=_children.lookup_in_child,
            args=(str(store.root), report_child, control_child),
            kwargs={"validation": META.value},
        )
        child.start()
        children.append(child)
        assert report_parent.poll(CHILD_TIMEOUT_S)
        outcome = report_parent.recv()
    assert outcome["status"] == "invalid" and outcome["backing"] is None
    refused = store.lookup(identity, validation=META, deadline=time.monotonic() + 60)
    assert refused.status is StoreStatus.INVALID and refused.lease is None


def _skeleton(root: Path, options: LoadOptions | None = None) -> ComponentSkeleton:
    location = ComponentLocation(root, subfolder=DIT)
    return prepare_skeleton(location, options or LoadOptions(), FinalLayoutParallelIdentity())


def test_ownership_is_discovered_once_per_kind_of_skeleton(tmp_path: Path) -> None:
    """D01/D05: a second skeleton of the same component reuses the discovered ownership and gets the identity a
    fresh discovery gives; another config, another dtype or an FP8-quantized skeleton is discovered afresh and
    keyed apart."""
    OWNERSHIP_PLANS.clear()
    folder = save_folder(tmp_path / "model", "flux")
    runtime = runtime_at(tmp_path / "domain")
    first = identify_component(_skeleton(folder.root), runtime)
    before = (OWNERSHIP_PLANS.hits, OWNERSHIP_PLANS.discoveries)
    again = _skeleton(folder.root)
    second = identify_component(again, runtime)
    assert (OWNERSHIP_PLANS.hits, OWNERSHIP_PLANS.discoveries) == (before[0] + 1, before[1])
    fresh, _contracts = discover_final_layout([(DIT, again.model)], again.policy, again.aliases)
    assert second.context.tensors == fresh.tensors == first.context.tensors
    assert second.context.identity.key == first.context.identity.key
    assert second.context.identity.component == first.context.identity.component

    wider = save_folder(tmp_path / "wider", "flux", config_overrides={"num_layers": 3})
    other = identify_component(_skeleton(wider.root), runtime)
    assert OWNERSHIP_PLANS.discoveries == before[1] + 1
    assert other.context.tensor_names != first.context.tensor_names
    assert other.context.identity.key != first.context.identity.key

    fp16 = identify_component(_skeleton(folder.root, LoadOptions(dtype=torch.float16)), runtime)
    assert OWNERSHIP_PLANS.discoveries == before[1] + 2
    assert {t.dtype for t in fp16.context.tensors} != {t.dtype for t in first.context.tensors}

    quantized = _skeleton(folder.root)
    quantize_model_fp8(quantized.model)
    fp8 = identify_component(quantized, runtime, tensor_policy(True))
    assert OWNERSHIP_PLANS.discoveries == before[1] + 3
    assert fp8.context.identity.key != first.context.identity.key
    assert torch.float8_e4m3fn in {t.dtype for t in fp8.context.tensors}


def test_a_second_load_in_one_process_restores_the_same_bytes(tmp_path: Path) -> None:
    """D14: two warm loads in one process (the second served from the kept manifest and ownership plan) give
    models whose every tensor views the artifact and equals the canonical model's."""
    folder = save_folder(tmp_path / "model", "flux")
    runtime = runtime_at(tmp_path / "domain")
    with load_component(folder.root, subfolder=DIT, runtime=runtime) as cold:
        assert cold.load_path is ComponentLoadPath.CANONICAL
    canonical = folder.canonical()
    expected = dict(canonical.state_dict())
    for _ in range(2):
        hits = (OWNERSHIP_PLANS.hits, PARSED_MANIFESTS.hits, CHECKED_LAYOUTS.hits)
        with load_component(folder.root, subfolder=DIT, runtime=runtime) as warm:
            assert warm.load_path is ComponentLoadPath.ARTIFACT
            got = dict(warm.model.state_dict())
            assert got.keys() == expected.keys()
            assert all(torch.equal(got[name], expected[name]) for name in expected)
            assert warm.lease is not None
            leased = {t.data_ptr() for t in warm.lease.tensors.values()}
            assert all(t.data_ptr() in leased for t in warm.model.parameters())
    assert OWNERSHIP_PLANS.hits > hits[0] and PARSED_MANIFESTS.hits > hits[1] and CHECKED_LAYOUTS.hits > hits[2]


def test_a_manifest_is_checked_once_per_object_and_never_answers_for_another(tmp_path: Path) -> None:
    """D12: a restore reuses the check of the very manifest object it checked before; an equal manifest parsed
    apart, or one another artifact holds, is checked afresh, and a manifest that fails its check is never kept."""
    folder = save_folder(tmp_path / "model", "flux")
    runtime = runtime_at(tmp_path / "domain")
    with load_component(folder.root, subfolder=DIT, runtime=runtime) as cold:
        assert cold.load_path is ComponentLoadPath.CANONICAL
    context = identify_component(_skeleton(folder.root), runtime).context
    with load_component(folder.root, subfolder=DIT, runtime=runtime) as warm:
        assert warm.lease is not None
        manifest = warm.lease.manifest
    schema = manifest.restorer_schema
    first = CHECKED_LAYOUTS.rows(schema, context, manifest)
    counts = (CHECKED_LAYOUTS.hits, CHECKED_LAYOUTS.checks)
    assert CHECKED_LAYOUTS.rows(schema, context, manifest) is first
    assert (CHECKED_LAYOUTS.hits, CHECKED_LAYOUTS.checks) == (counts[0] + 1, counts[1])
    apart = WeightManifest.from_bytes(manifest.to_bytes())
    assert apart == manifest and apart is not manifest
    assert CHECKED_LAYOUTS.rows(schema, context, apart) == first
    assert CHECKED_LAYOUTS.checks == counts[1] + 1

    entries = list(manifest.tensors)
    entries[0] = dataclasses.replace(entries[0], role="another-role")
    altered = dataclasses.replace(manifest, tensors=tuple(entries))
    for _ in range(2):
        with pytest.raises(HostWeightError) as refused:
            CHECKED_LAYOUTS.rows(schema, context, altered)
        assert refused.value.failure.code is FailureCode.RESTORE_FAILED
    assert CHECKED_LAYOUTS.checks == counts[1] + 1


def test_an_evicted_then_republished_artifact_is_served_from_disk_not_from_the_process_caches(
    tmp_path: Path,
) -> None:
    """S02/D14: after warm loads filled this process's caches, the artifact is cleaned up: the next load misses
    and loads canonically (nothing is answered from memory); republished under the same key with other shards (other
    manifest bytes), the next warm load holds the new manifest and views the new mappings, bit-identical to
    canonical."""
    folder = save_folder(tmp_path / "model", "flux")
    runtime = runtime_at(tmp_path / "domain")
    with load_component(folder.root, subfolder=DIT, runtime=runtime, publish_in_background=False) as cold:
        assert cold.load_path is ComponentLoadPath.CANONICAL
    with load_component(folder.root, subfolder=DIT, runtime=runtime, publish_in_background=False) as warm:
        assert warm.load_path is ComponentLoadPath.ARTIFACT and warm.lease is not None
        first_manifest = warm.lease.manifest
        key = warm.lease.identity.key
    store = FilesystemHostWeightStore(tmp_path / "domain")
    assert store.cleanup(key).status is CleanupStatus.REMOVED

    with load_component(folder.root, subfolder=DIT, runtime=runtime, publish_in_background=False) as after_eviction:
        assert after_eviction.outcome is not ResolutionOutcome.LOCAL_HIT  # the lookup missed: nothing from memory
        assert after_eviction.load_path is ComponentLoadPath.CANONICAL and after_eviction.lease is None
    assert store.cleanup(key).status is CleanupStatus.REMOVED  # what that load published goes too

    canonical = folder.canonical()
    identified = identify_component(_skeleton(folder.root), runtime)
    assert identified.context.identity.key == key
    republished = runtime.publish_after_load(
        identified.context.identity,
        FinalLayoutBF16Producer(identified.context, [(DIT, canonical)], shard_bytes=16 * 1024),
    )
    assert republished.status is PostLoadPublicationStatus.PUBLISHED, republished.failure
    on_disk = (store.layout.artifact_dir(key) / MANIFEST_FILE_NAME).read_bytes()

    with load_component(folder.root, subfolder=DIT, runtime=runtime, publish_in_background=False) as again:
        assert again.load_path is ComponentLoadPath.ARTIFACT and again.lease is not None
        assert again.lease.manifest == WeightManifest.from_bytes(on_disk)
        assert again.lease.manifest != first_manifest
        assert len({entry.file for entry in again.lease.manifest.tensors}) > 1
        leased = {t.data_ptr() for t in again.lease.tensors.values()}
        assert all(t.data_ptr() in leased for t in again.model.parameters())
        expected = dict(canonical.state_dict())
        got = dict(again.model.state_dict())
        assert got.keys() == expected.keys()
        assert all(torch.equal(got[name], expected[name]) for name in expected)

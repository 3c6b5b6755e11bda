"""Both payload digest formats, recomputed by an independent reader written from docs/DIGEST.md.

The reader below uses only hashlib, blake3 and json on the published files; it never calls
host_weight_runtime's digest code, so a silent change to the format fails here.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
import time
from pathlib import Path

import blake3
import pytest
import torch

from host_weight_runtime import (
    BuildRequest,
    DigestAlgorithm,
    FilesystemHostWeightStore,
    StoreStatus,
    ValidationLevel,
    WeightProductionSpec,
)
from host_weight_runtime._digest import DIGEST_ALGORITHM, TreeHasher, tree_digest, tree_digests_parallel
from host_weight_runtime.failures import FailureCode, HostWeightError
from host_weight_runtime.filesystem.writer import StagingArtifactWriter
from host_weight_runtime.protocols import ProductionSourceMode, TensorWriteSpec

from .support import SyntheticProducer, make_identity, make_tensors

ALGORITHMS = [DigestAlgorithm.SHA256_TREE_V1, DigestAlgorithm.BLAKE3_TREE_V1]
CHUNK = 1024


# --- the independent reader (docs/DIGEST.md, nothing imported from the package) ----------------


def _leaf(name: str, chunk: bytes) -> bytes:
    if name == "sha256-tree-v1":
        return hashlib.sha256(chunk).digest()
    if name == "blake3-tree-v1":
        return blake3.blake3(chunk).digest()
    raise AssertionError(f"the documented format has no algorithm {name!r}")


def reference_tree(name: str, chunk_bytes: int, data: bytes) -> str:
    chunks = [data[i : i + chunk_bytes] for i in range(0, len(data), chunk_bytes)] or [b""]
    outer = hashlib.sha256(b"hwr/" + name.encode("ascii") + b"\x00")
    outer.update(len(data).to_bytes(8, "little"))
    for chunk in chunks:
        outer.update(_leaf(name, chunk))
    return outer.hexdigest()


def recompute_artifact(directory: Path) -> dict[str, str]:
    """Every digest the documented format defines, from the files alone; asserts each one."""
    manifest_bytes = (directory / "manifest.json").read_bytes()
    ready = json.loads((directory / "READY.json").read_bytes())
    manifest = json.loads(manifest_bytes)
    assert ready["manifest_sha256"] == hashlib.sha256(manifest_bytes).hexdigest()
    name, chunk_bytes = manifest["digest_algorithm"], manifest["digest_chunk_bytes"]
    tensors = {entry["name"]: entry for entry in manifest["tensors"]}
    for file in manifest["files"]:
        raw = (directory / file["name"]).read_bytes()
        assert len(raw) == file["size"] and file["header_size"] == 8 + int.from_bytes(raw[:8], "little")
        outer = hashlib.sha256(b"hwr/file-v1\x00")
        outer.update(bytes.fromhex(reference_tree(name, chunk_bytes, raw[: file["header_size"]])))
        for tensor_name in file["tensors"]:
            begin, end = tensors[tensor_name]["data_offsets"]
            digest = reference_tree(name, chunk_bytes, raw[file["header_size"] + begin : file["header_size"] + end])
            assert digest == tensors[tensor_name]["digest"], tensor_name
            outer.update(bytes.fromhex(digest))
        assert outer.hexdigest() == file["digest"], file["name"]
    rows = sorted([t["name"], t["dtype"], t["shape"], t["digest"]] for t in manifest["tensors"])
    canonical = json.dumps(rows, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    assert hashlib.sha256(canonical).hexdigest() == manifest["content_digest"] == ready["content_digest"]
    return {"algorithm": name}


# --- tests ----------------------------------------------------------------------------------------


def _build(root: Path, algorithm: DigestAlgorithm, *, files: int = 2) -> tuple[FilesystemHostWeightStore, Path]:
    store = FilesystemHostWeightStore(root)
    identity = make_identity(manifest_schema=f"hwr-test-manifest-{algorithm.value}")
    tensors = make_tensors(3, scale=40)  # several 1 KiB chunks per tensor
    producer = SyntheticProducer(identity, tensors, files=files, digest_algorithm=algorithm)
    result = store.get_or_build(
        BuildRequest(identity), producer, validation=ValidationLevel.MANIFEST_AND_METADATA, deadline=time.monotonic() + 60
    )
    assert result.status is StoreStatus.BUILT, result.failure
    assert result.lease is not None
    result.lease.close()
    return store, store.layout.artifact_dir(identity.key)


@pytest.mark.parametrize("algorithm", ALGORITHMS, ids=lambda a: a.value)
def test_an_independent_reader_recomputes_every_published_digest(tmp_path: Path, algorithm: DigestAlgorithm) -> None:
    """Every tensor, file, content and manifest digest of a published artifact follows from docs/DIGEST.md."""
    store, directory = _build(tmp_path / "domain", algorithm)
    assert recompute_artifact(directory) == {"algorithm": algorithm.value}
    identity = make_identity(manifest_schema=f"hwr-test-manifest-{algorithm.value}")
    full = store.lookup(identity, validation=ValidationLevel.FULL_CHECKSUM)
    assert full.status is StoreStatus.HIT, full.failure
    assert full.lease is not None and full.lease.manifest.digest_algorithm == algorithm.value
    full.lease.close()


def test_a_flipped_byte_fails_full_verification_of_a_blake3_artifact(tmp_path: Path) -> None:
    """FULL_CHECKSUM catches one changed payload byte under blake3-tree-v1 as under sha256-tree-v1."""
    store, directory = _build(tmp_path / "domain", DigestAlgorithm.BLAKE3_TREE_V1, files=1)
    payload = next(directory.glob("*.safetensors"))
    os.chmod(directory, 0o755)
    os.chmod(payload, 0o644)
    raw = bytearray(payload.read_bytes())
    raw[-5] ^= 0x40
    payload.write_bytes(bytes(raw))
    os.chmod(payload, 0o444)
    os.chmod(directory, 0o555)
    identity = make_identity(manifest_schema="hwr-test-manifest-blake3-tree-v1")
    result = store.lookup(identity, validation=ValidationLevel.FULL_CHECKSUM)
    assert result.status is StoreStatus.INVALID
    assert result.failure is not None and result.failure.code is FailureCode.CHECKSUM_MISMATCH


@pytest.mark.parametrize("algorithm", ALGORITHMS, ids=lambda a: a.value)
@pytest.mark.parametrize("size", [0, 1, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 5])
def test_tree_digest_matches_the_reference_whole_incremental_and_parallel(algorithm: DigestAlgorithm, size: int) -> None:
    """One-shot, odd-sized incremental and multi-threaded hashing all give the documented digest."""
    data = random.Random(size).randbytes(size)
    expected = reference_tree(algorithm.value, CHUNK, data)
    assert tree_digest(data, CHUNK, algorithm) == expected
    hasher = TreeHasher(CHUNK, algorithm)
    for start in range(0, size, 333):
        hasher.update(data[start : start + 333])
    assert hasher.hexdigest() == expected
    assert tree_digests_parallel([memoryview(data)] * 3, chunk_bytes=CHUNK, threads=2, algorithm=algorithm) == [
        expected
    ] * 3


def test_the_two_algorithms_never_agree_and_blake3_is_pinned() -> None:
    """The tag separates the formats; golden values pin blake3-tree-v1; the default stays sha256-tree-v1."""
    for data in (b"", b"abc", bytes(5000)):
        assert tree_digest(data, CHUNK, DigestAlgorithm.BLAKE3_TREE_V1) != tree_digest(data, CHUNK)
    assert tree_digest(b"", CHUNK, DigestAlgorithm.BLAKE3_TREE_V1) == reference_tree("blake3-tree-v1", CHUNK, b"")
    assert (
        tree_digest(b"abc", 2, DigestAlgorithm.BLAKE3_TREE_V1)
        == "5948947908f02b6879fee1605bf87d0a5ddedaaeb1ed1fd94b31057f8a3a86e3"
    )
    assert DIGEST_ALGORITHM == "sha256-tree-v1"
    assert DigestAlgorithm.from_name("blake3-tree-v1") is DigestAlgorithm.BLAKE3_TREE_V1
    with pytest.raises(ValueError, match="unknown digest algorithm"):
        DigestAlgorithm.from_name("md5-tree-v1")


def test_a_manifest_naming_an_unknown_algorithm_is_incompatible(tmp_path: Path) -> None:
    """An artifact whose manifest names an algorithm this version does not know is never trusted."""
    from host_weight_runtime.manifest import WeightManifest, manifest_sha256

    store, directory = _build(tmp_path / "domain", DigestAlgorithm.BLAKE3_TREE_V1, files=1)
    manifest = WeightManifest.from_bytes((directory / "manifest.json").read_bytes())
    changed = dataclasses.replace(manifest, digest_algorithm="blake9-tree-v1").to_bytes()
    ready = json.loads((directory / "READY.json").read_bytes())
    ready["manifest_sha256"] = manifest_sha256(changed)
    os.chmod(directory, 0o755)
    for name, data in (
        ("manifest.json", changed),
        ("READY.json", json.dumps(ready, sort_keys=True, separators=(",", ":")).encode()),
    ):
        os.chmod(directory / name, 0o644)
        (directory / name).write_bytes(data)
        os.chmod(directory / name, 0o444)
    os.chmod(directory, 0o555)
    identity = make_identity(manifest_schema="hwr-test-manifest-blake3-tree-v1")
    result = store.lookup(identity, validation=ValidationLevel.MANIFEST_AND_METADATA)
    assert result.status is StoreStatus.INVALID
    assert result.failure is not None and result.failure.code is FailureCode.MANIFEST_INCOMPATIBLE


def test_the_algorithm_is_declared_typed_and_fixed_before_the_first_file(tmp_path: Path) -> None:
    """A spec takes only a DigestAlgorithm; a writer adopts another one only before it opens a file."""
    with pytest.raises(ValueError, match="DigestAlgorithm"):
        WeightProductionSpec(
            producer_id="p",
            outputs=(make_identity(),),
            source_mode=ProductionSourceMode.CHECKPOINT_STREAM,
            digest_algorithm="blake3-tree-v1",  # type: ignore[arg-type]
        )
    staging = tmp_path / "staging"
    staging.mkdir(mode=0o700)
    writer = StagingArtifactWriter(staging, reserve=lambda size: None)
    writer.adopt_digest_algorithm(DigestAlgorithm.BLAKE3_TREE_V1)
    assert writer.digest_algorithm is DigestAlgorithm.BLAKE3_TREE_V1
    writer.open_tensor_file("a.safetensors", (TensorWriteSpec("x", (2,), torch.float32),))
    with pytest.raises(HostWeightError, match="before the first payload file"):
        writer.adopt_digest_algorithm(DigestAlgorithm.SHA256_TREE_V1)
    writer.abort()


def test_the_bf16_final_layout_spec_commits_its_key_to_blake3() -> None:
    """The BF16 producers digest with blake3-tree-v1 and their ABI document (so the key) says so."""
    from host_weight_runtime.diffusion.contracts import FINAL_LAYOUT_BF16_SPEC

    abi = FINAL_LAYOUT_BF16_SPEC.implementation_abi.to_value()
    assert isinstance(abi, dict)
    assert FINAL_LAYOUT_BF16_SPEC.digest_algorithm is DigestAlgorithm.BLAKE3_TREE_V1
    assert abi["payload_digest"] == "blake3-tree-v1"
    assert FINAL_LAYOUT_BF16_SPEC.producer.manifest_schema == "final-layout-bf16-manifest-v2"
    with pytest.raises(ValueError, match="payload_digest"):
        dataclasses.replace(FINAL_LAYOUT_BF16_SPEC, digest_algorithm=DigestAlgorithm.SHA256_TREE_V1)

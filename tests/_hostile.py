"""Helpers for adversarial tests: plant bytes into a published artifact the way a hostile co-tenant would.

Each helper makes the artifact writable, changes exactly what it is asked to, re-seals whatever
digests must agree so that the planted defect is the only one, and restores the published modes
(files 0444, directory 0555).
"""

from __future__ import annotations

import json
import os
import shutil
import stat
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import torch
from hypothesis import HealthCheck, settings
from safetensors import safe_open

from host_weight_runtime._digest import file_digest, tree_digest
from host_weight_runtime.canonical_json import encode_canonical
from host_weight_runtime.filesystem.store import FilesystemHostWeightStore
from host_weight_runtime.manifest import MANIFEST_FILE_NAME, READY_FILE_NAME, PublicationMarker, manifest_sha256

FUZZ_EXAMPLES_ENV = "HWR_FUZZ_EXAMPLES"


def fuzz_settings(default_examples: int) -> settings:
    """A fuzz test's Hypothesis settings: few examples by default, HWR_FUZZ_EXAMPLES=N for long runs (`make fuzz`)."""
    raw = os.environ.get(FUZZ_EXAMPLES_ENV, "").strip()
    examples = int(raw) if raw else default_examples
    return settings(
        database=None,
        deadline=None,
        max_examples=examples,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example],
    )


@contextmanager
def writable(directory: Path) -> Iterator[Path]:
    """Open a published artifact for planting; afterwards every regular file is 0444 and the directory 0555."""
    os.chmod(directory, 0o755)
    for path in directory.iterdir():
        if _is_regular(path):
            os.chmod(path, 0o644)
    try:
        yield directory
    finally:
        for path in directory.iterdir():
            if _is_regular(path):
                os.chmod(path, 0o444)
        os.chmod(directory, 0o555)


def _is_regular(path: Path) -> bool:
    return stat.S_ISREG(os.lstat(path).st_mode)


def manifest_value(directory: Path) -> dict[str, object]:
    value = json.loads((directory / MANIFEST_FILE_NAME).read_bytes())
    assert isinstance(value, dict)
    return value


def reseal(directory: Path, manifest_bytes: bytes, *, content_digest: str | None = None) -> None:
    """Write `manifest_bytes` and a READY.json that names them (call inside `writable`)."""
    (directory / MANIFEST_FILE_NAME).write_bytes(manifest_bytes)
    marker = PublicationMarker.from_bytes((directory / READY_FILE_NAME).read_bytes())
    forged = PublicationMarker(
        identity_key=marker.identity_key,
        publication_id=marker.publication_id,
        manifest_sha256=manifest_sha256(manifest_bytes),
        content_digest=content_digest or marker.content_digest,
        published_at_ns=marker.published_at_ns,
    )
    (directory / READY_FILE_NAME).write_bytes(forged.to_bytes())


def plant_manifest_text(directory: Path, text: bytes) -> None:
    """Replace manifest.json with arbitrary bytes and re-hash READY.json to match them."""
    with writable(directory):
        reseal(directory, text)


def split_payload(path: Path) -> tuple[bytes, bytes]:
    """(header JSON bytes, data bytes) of a safetensors file."""
    data = path.read_bytes()
    length = int.from_bytes(data[:8], "little")
    return data[8 : 8 + length], data[8 + length :]


def padded(header: bytes) -> bytes:
    """Pad a header with spaces to a multiple of 8 bytes, as safetensors writers do, so data stays aligned."""
    return header + b" " * (-len(header) % 8)


def plant_header(directory: Path, file_name: str, header: bytes, *, length_prefix: int | None = None) -> None:
    """Replace one payload's header, keeping its tensor bytes, and re-seal manifest and READY around it.

    The manifest's size, header size and file digest are recomputed for the new header, so at every
    validation level the header's content is the only defect. `length_prefix` overrides the 8-byte
    length field (to plant one that disagrees with the header).
    """
    payload = directory / file_name
    _old_header, data = split_payload(payload)
    prefix = (len(header) if length_prefix is None else length_prefix).to_bytes(8, "little")
    manifest = manifest_value(directory)
    chunk = manifest["digest_chunk_bytes"]
    assert isinstance(chunk, int)
    files = manifest["files"]
    tensors = manifest["tensors"]
    assert isinstance(files, list) and isinstance(tensors, list)
    digests = {entry["name"]: entry["digest"] for entry in tensors}
    for entry in files:
        if entry["name"] == file_name:
            entry["size"] = 8 + len(header) + len(data)
            entry["header_size"] = 8 + len(header)
            entry["digest"] = file_digest(
                tree_digest(prefix + header, chunk), [digests[name] for name in entry["tensors"]]
            )
    manifest["total_bytes"] = sum(entry["size"] for entry in files)
    with writable(directory):
        payload.write_bytes(prefix + header + data)
        reseal(directory, encode_canonical(manifest))


class PristineArtifact:
    """A published artifact plus a saved copy of it, restored before each planted example."""

    def __init__(self, store: FilesystemHostWeightStore, key: str, saved: Path) -> None:
        self.store = store
        self.key = key
        self.directory = store.layout.artifact_dir(key)
        self.saved = saved
        shutil.copytree(self.directory, saved, symlinks=True)

    def restore(self) -> Path:
        """Put the published artifact back exactly as it was, with no deny marker and no quarantine."""
        if os.path.lexists(self.directory):
            _remove(self.directory)
        shutil.copytree(self.saved, self.directory, symlinks=True)
        for path in self.directory.iterdir():
            os.chmod(path, 0o444)
        os.chmod(self.directory, 0o555)
        deny = self.store.layout.deny_marker(self.key)
        if os.path.lexists(deny):
            deny.unlink()
        for path in self.store.layout.quarantined_dirs(self.key):
            _remove(path)
        return self.directory


def _remove(path: Path) -> None:
    if path.is_symlink() or not path.is_dir():
        path.unlink()
        return
    for directory, _subdirs, _files in os.walk(path):
        os.chmod(directory, 0o755)
    shutil.rmtree(path)


def assert_served_exactly(tensors: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor]) -> None:
    """A served lease must hold exactly the published tensors, bit for bit."""
    assert sorted(tensors) == sorted(expected)
    for name, tensor in expected.items():
        got = tensors[name]
        assert got.dtype == tensor.dtype and tuple(got.shape) == tuple(tensor.shape), name
        assert torch.equal(got.reshape(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8)), name


def assert_stock_safetensors_agrees(directory: Path, expected: Mapping[str, torch.Tensor]) -> None:
    """What the store served must also be what stock safetensors reads from the same files."""
    seen: dict[str, torch.Tensor] = {}
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:  # type: ignore[no-untyped-call]
            for name in handle.keys():  # noqa: SIM118 - safe_open handles are not iterable
                seen[name] = handle.get_tensor(name)
    assert_served_exactly(seen, expected)

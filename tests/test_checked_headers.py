"""A checkpoint file's safetensors header is checked once per node per exact file state (D03, D14): a later
worker trusts the node's marker only for the very state it was written for, so a header damaged in place,
a file replaced under the same name and timestamps, or an untrusted marker directory is read and refused."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from host_weight_runtime.diffusion._file_state import FileState
from host_weight_runtime.diffusion._load_options import LoadOptions
from host_weight_runtime.diffusion.component_source import ComponentLocation, checkpoint_source, node_digest_cache
from host_weight_runtime.failures import HostWeightUsageError

from ._diffusion import DIT, Folder, runtime_at, save_folder

# A fresh interpreter checks the folder's checkpoint through the node cache and says how many headers it read.
_CHILD = r"""
import json, sys
from pathlib import Path
import host_weight_runtime.diffusion.component_source as component_source
from host_weight_runtime import HostWeightRuntime, HostWeightRuntimeConfig, RuntimeMode
from host_weight_runtime.diffusion._load_options import LoadOptions
from host_weight_runtime.failures import HostWeightUsageError

reads = []
original = component_source.read_safetensors_header
def counted(path):
    reads.append(str(path))
    return original(path)
component_source.read_safetensors_header = counted
folder, root, subfolder = sys.argv[1:4]
runtime = HostWeightRuntime(HostWeightRuntimeConfig(mode=RuntimeMode.PREFERRED, root=Path(root)))
location = component_source.ComponentLocation(folder, subfolder)
try:
    component_source.checkpoint_source(location, LoadOptions(), component_source.node_digest_cache(runtime))
    error = None
except HostWeightUsageError as exc:
    error = str(exc)
print(json.dumps({"reads": reads, "error": error}))
"""


def _check_in_child(folder: Folder, root: Path) -> dict[str, object]:
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, str(folder.root), str(root), DIT],
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def _checked_once(tmp_path: Path) -> tuple[Folder, Path]:
    folder = save_folder(tmp_path / "pipeline", "flux")
    root = tmp_path / "hwr"
    cache = node_digest_cache(runtime_at(root))
    assert cache is not None
    checkpoint_source(ComponentLocation(folder.root, DIT), LoadOptions(), cache)
    assert cache.header_checked(folder.weights, FileState.of(folder.weights))
    return folder, root


def _damage_header_in_place(path: Path) -> None:
    """Same size, same mtime: a tensor's dtype in the header becomes an unknown code."""
    before = os.stat(path)
    data = bytearray(path.read_bytes())
    at = data.index(b'"dtype":"') + len(b'"dtype":"')
    data[at : at + 2] = b"Q9"
    with open(path, "r+b") as stream:
        stream.write(data)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert os.stat(path).st_size == before.st_size


def test_a_later_worker_does_not_read_a_header_the_node_checked(tmp_path: Path) -> None:
    """D14 D03: the first check leaves a node marker; a fresh process on the same node reads no header."""
    folder, root = _checked_once(tmp_path)
    result = _check_in_child(folder, root)
    assert result == {"reads": [], "error": None}


def test_a_header_damaged_in_place_is_read_and_refused_in_a_second_process(tmp_path: Path) -> None:
    """D03 D14: the same path, size and mtime but a new ctime is another state: the marker does not vouch for it."""
    folder, root = _checked_once(tmp_path)
    _damage_header_in_place(folder.weights)
    result = _check_in_child(folder, root)
    assert result["reads"] == [str(folder.weights)]
    assert "damaged, incomplete or not safetensors" in str(result["error"])


def test_a_file_replaced_under_the_same_name_is_read_again(tmp_path: Path) -> None:
    """D03: a new inode behind the same name (a re-download) is checked afresh, then trusted in its own state."""
    folder, root = _checked_once(tmp_path)
    before = os.stat(folder.weights)
    copy = folder.weights.with_name("replacement.tmp")
    copy.write_bytes(folder.weights.read_bytes())
    os.utime(copy, ns=(before.st_atime_ns, before.st_mtime_ns))
    os.replace(copy, folder.weights)
    first = _check_in_child(folder, root)
    assert first == {"reads": [str(folder.weights)], "error": None}
    assert _check_in_child(folder, root) == {"reads": [], "error": None}


def test_markers_in_a_directory_others_can_write_are_not_believed(tmp_path: Path) -> None:
    """D03: a marker directory another user could write is not trusted; the header is read (and still checked)."""
    folder, root = _checked_once(tmp_path)
    cache = node_digest_cache(runtime_at(root))
    assert cache is not None
    os.chmod(cache.headers, 0o777)
    try:
        assert not cache.header_checked(folder.weights, FileState.of(folder.weights))
        _damage_header_in_place(folder.weights)
        with pytest.raises(HostWeightUsageError, match="damaged"):
            checkpoint_source(ComponentLocation(folder.root, DIT), LoadOptions(), cache)
    finally:
        os.chmod(cache.headers, 0o700)

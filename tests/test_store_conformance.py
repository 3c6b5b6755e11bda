"""The `HostWeightStore` conformance suite, run against the filesystem store on disk and on tmpfs."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

from host_weight_runtime import FilesystemHostWeightStore, HostWeightStore
from host_weight_runtime.filesystem._fsutil import remove_tree
from host_weight_runtime.testing.store_conformance import HostWeightStoreConformance

SHM = Path("/dev/shm")


def remove_domain(path: Path) -> None:
    """Remove a test domain, read-only (0555) published directories included."""
    remove_tree(path)


class TestFilesystemStoreConformance(HostWeightStoreConformance):
    """The filesystem store on pytest's tmp_path (local disk, usually ext4)."""

    def make_store(self, tmp_path: Path) -> HostWeightStore:
        return FilesystemHostWeightStore(tmp_path / "domain")

    def close_store(self, store: HostWeightStore) -> None:
        # tmp_path is kept by pytest for inspection; make it removable by pytest's own pruning.
        assert isinstance(store, FilesystemHostWeightStore)
        remove_domain(store.root)


class TestTmpfsFilesystemStoreConformance(HostWeightStoreConformance):
    """The filesystem store on a unique directory under /dev/shm (tmpfs), removed after each test."""

    def make_store(self, tmp_path: Path) -> HostWeightStore:
        if not SHM.is_dir() or not os.access(SHM, os.W_OK):
            pytest.skip("/dev/shm is not available for a tmpfs domain")
        self._shm_dir = Path(tempfile.mkdtemp(prefix="hwr-conformance-", dir=SHM))
        try:
            store = FilesystemHostWeightStore(self._shm_dir / "domain")
        except BaseException:
            remove_domain(self._shm_dir)
            raise
        assert store.domain.fs_type == "tmpfs"
        return store

    def close_store(self, store: HostWeightStore) -> None:
        remove_domain(self._shm_dir)


def test_the_suite_is_not_collected_by_itself() -> None:
    """The base class has no Test prefix and refuses to run without a store."""
    assert not HostWeightStoreConformance.__name__.startswith("Test")
    with pytest.raises(NotImplementedError):
        HostWeightStoreConformance().make_store(Path("/nonexistent"))


def test_the_filesystem_store_satisfies_the_protocol(tmp_path: Path) -> None:
    """FilesystemHostWeightStore is a runtime-checkable HostWeightStore."""
    store = FilesystemHostWeightStore(tmp_path / "domain")
    assert isinstance(store, HostWeightStore)
    remove_domain(store.root)

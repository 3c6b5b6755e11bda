"""Leases fill their page tables on a background thread: read faults only, never a copy, and they stop on close."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from host_weight_runtime import (
    BuildRequest,
    FilesystemHostWeightStore,
    HostWeightLease,
    MappedHostRegion,
    ValidationLevel,
)
from host_weight_runtime.filesystem._prefault import (
    ENV_PREFAULT,
    BackgroundPrefault,
    prefault_enabled,
    prefault_threads,
)

from .support import SyntheticProducer, make_identity

SHM = Path("/dev/shm")
KIB = 1024


@pytest.fixture
def shm_root() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(dir=SHM) as folder:
        yield Path(folder) / "domain"


def _big_tensors() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    return {
        f"blocks.{index}.weight": torch.randn(512, 1024, generator=generator).to(torch.bfloat16) for index in range(8)
    }


def _lease(root: Path) -> HostWeightLease:
    """Publish 8 MiB in one process-local store, then look it up (a fresh lease with fresh mappings)."""
    identity = make_identity(tag="prefault")
    store = FilesystemHostWeightStore(root)
    built = store.get_or_build(
        BuildRequest(identity),
        SyntheticProducer(identity, _big_tensors()),
        validation=ValidationLevel.MANIFEST_AND_METADATA,
        deadline=time.monotonic() + 120,
    )
    assert built.lease is not None
    built.lease.close()
    found = store.lookup(identity, validation=ValidationLevel.MANIFEST_AND_METADATA)
    assert found.lease is not None
    return found.lease


def _mapping_memory(lease: HostWeightLease) -> tuple[int, int]:
    """(Rss, Anonymous) in bytes of this process's mappings of the lease's payload files, from /proc/self/smaps."""
    return _smaps_memory(lease.mapped_regions)


def _regions_rss(regions: tuple[MappedHostRegion, ...]) -> int:
    return _smaps_memory(regions)[0]


def _smaps_memory(mapped: tuple[MappedHostRegion, ...]) -> tuple[int, int]:
    regions = [(region.address, region.length) for region in mapped]
    rss = anonymous = 0
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split(maxsplit=1)[0]
            if "-" in head and not head.endswith(":"):
                low_text, _, high_text = head.partition("-")
                low, high = int(low_text, 16), int(high_text, 16)
                inside = any(address < high and low < address + length for address, length in regions)
            elif inside and head == "Rss:":
                rss += int(line.split()[1]) * KIB
            elif inside and head == "Anonymous:":
                anonymous += int(line.split()[1]) * KIB
    return rss, anonymous


def test_a_lease_populates_its_mappings_by_read_faults_without_copying(
    shm_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After the background prefault, which the first read of the lease's tensors starts, every payload page is
    mapped and none is a private copy."""
    monkeypatch.delenv(ENV_PREFAULT, raising=False)
    lease = _lease(shm_root)
    try:
        prefault = lease._background
        assert isinstance(prefault, BackgroundPrefault)
        assert not prefault.started
        assert len(lease.tensors) == len(_big_tensors())
        assert prefault.started
        assert prefault.wait(timeout=60)
        assert prefault.error is None
        total = sum(region.length for region in lease.mapped_regions)
        rss, anonymous = _mapping_memory(lease)
        assert rss >= total - 4 * KIB * len(lease.mapped_regions)  # each file's last partial page rounds
        assert anonymous == 0
    finally:
        lease.close()


def test_prefault_can_be_turned_off(shm_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """HWR_PREFAULT=0: no background thread, pages are mapped only when first read."""
    monkeypatch.setenv(ENV_PREFAULT, "0")
    assert not prefault_enabled()
    lease = _lease(shm_root)
    try:
        assert lease._background is None
        rss, _anonymous = _mapping_memory(lease)
        total = sum(region.length for region in lease.mapped_regions)
        assert rss < total // 2  # only the headers the validation read
    finally:
        lease.close()


def test_closing_a_lease_stops_its_prefault_thread(shm_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """close() ends the background work before it releases the lease: the thread has taken its last step."""
    monkeypatch.delenv(ENV_PREFAULT, raising=False)
    lease = _lease(shm_root)
    prefault = lease._background
    assert isinstance(prefault, BackgroundPrefault)
    assert lease.mapped_regions  # a transport asking for the regions starts it too
    assert prefault.started
    lease.close()
    assert prefault.wait(timeout=0)  # set by the thread after its last step, so close() waited for it
    assert prefault._keepalive is None


def test_a_lease_nobody_reads_maps_no_page_and_starts_no_thread(
    shm_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lease that is only held and closed (a prewarm, a background publication, a push) never starts its
    prefault: its payload pages stay unmapped in this process, and none is mapped after it closes."""
    monkeypatch.delenv(ENV_PREFAULT, raising=False)
    lease = _lease(shm_root)
    prefault = lease._background
    assert isinstance(prefault, BackgroundPrefault)
    regions = lease._regions  # read without starting anything, as a holder that never reads would
    total = sum(region.length for region in regions)
    rss = _regions_rss(regions)
    assert rss < total // 2  # only the headers the validation read
    lease.close()
    assert not prefault.started
    assert prefault.wait(timeout=0)
    prefault.start()  # a stopped prefault never starts
    assert not prefault.started


def test_a_forked_child_stops_a_prefault_its_parent_started_without_waiting() -> None:
    """A child forked while the thread ran has no such thread: its stop() returns instead of waiting forever."""
    prefault = BackgroundPrefault([], ())
    prefault.start()
    assert prefault.wait(timeout=60)
    prefault._done.clear()  # as the child of a fork taken while the parent's thread was still running sees it
    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:  # the child: says so once stop() returned
        try:
            prefault.stop()
            os.write(write_end, b"x")
        finally:
            os._exit(0)
    os.close(write_end)
    try:
        ready, _, _ = select.select([read_end], [], [], 60)  # a hang detector, not a timing threshold
        returned = bool(ready) and os.read(read_end, 1) == b"x"
    finally:
        os.close(read_end)
        if not returned:
            os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
    assert returned, "stop() in the forked child waited for a thread that does not exist there"


def test_a_large_lease_is_populated_by_one_thread_per_spare_core() -> None:
    """X01: a multi-GiB lease is filled by one thread per core beside the loader (at most 8, one per 256 MiB);
    a 2-core machine keeps one thread, and a small lease never takes more than its size calls for."""
    gib = 1 << 30
    assert prefault_threads(6 * gib, cores=16) == 8
    assert prefault_threads(6 * gib, cores=2) == 1
    assert prefault_threads(6 * gib, cores=1) == 1
    assert prefault_threads(300 << 20, cores=16) == 2
    assert prefault_threads(0, cores=16) == 1
    assert prefault_threads(64 * gib, cores=64) == 8


def test_several_threads_populate_every_page_by_read_faults_without_copying(shm_root: Path) -> None:
    """X01: the steps of a region shared by four threads leave every payload page mapped, none a private copy,
    and the count of populated bytes equals the regions' (each step taken exactly once)."""
    lease = _lease(shm_root)
    try:
        regions = [(region.address, region.length) for region in lease.mapped_regions]
        prefault = BackgroundPrefault(regions, (lease,), threads=4)
        assert prefault.threads == 4
        prefault.start()
        assert prefault.wait(timeout=60)  # a hang detector, not a timing threshold
        assert prefault.error is None
        page = os.sysconf("SC_PAGE_SIZE")
        expected = sum(length + address % page for address, length in regions)
        assert prefault.populated_bytes == expected
        total = sum(length for _address, length in regions)
        rss, anonymous = _mapping_memory(lease)
        assert rss >= total - 4 * KIB * len(regions)
        assert anonymous == 0
        prefault.stop()  # after the threads ended: returns at once, and again
        prefault.stop()
    finally:
        lease.close()


def test_stopping_several_threads_before_they_start_keeps_them_from_starting() -> None:
    """X01: stop() before start() ends a multi-thread prefault that never runs; start() then does nothing."""
    prefault = BackgroundPrefault([(0, 64 << 20)], (), threads=3)
    prefault.stop()
    prefault.start()
    assert not prefault.started
    assert prefault.wait(timeout=0)


_EXIT_CHILD = """
import atexit, ctypes, mmap, os, sys
state = {}
def report():  # registered before the module's own exit hook, so it runs after it
    prefault = state["prefault"]
    os.write(1, f"{prefault.populated_bytes} {prefault.wait(timeout=0)}".encode())
atexit.register(report)
from host_weight_runtime.filesystem._prefault import BackgroundPrefault
size = 4 << 30  # read faults on anonymous memory map the zero page: a long fill that costs no memory
region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
address = ctypes.addressof(ctypes.c_char.from_buffer(region))
prefault = BackgroundPrefault([(address, size)], (region,), threads=1)
state["prefault"] = prefault
prefault.start()
sys.exit(0)
"""


def test_the_interpreter_exit_stops_a_running_prefault_before_it_finalizes() -> None:
    """X01: a process that exits while its prefault thread is still reading (a short-lived script, a warm worker
    that ends) stops the thread at exit, before the interpreter finalizes, and exits 0; a thread left inside
    torch's read would be unwound through C++ at finalization and abort the process."""
    completed = subprocess.run(
        [sys.executable, "-c", _EXIT_CHILD], capture_output=True, text=True, timeout=120, check=False
    )
    assert completed.returncode == 0, completed.stderr
    populated, finished = completed.stdout.split()
    assert finished == "True"  # every thread had ended when the last exit hook ran
    assert int(populated) < 4 << 30  # stopped early, not run to the end

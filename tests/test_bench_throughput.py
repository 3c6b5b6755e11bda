"""`hwr bench`'s publication and FULL_CHECKSUM throughput figures at any `--size`, small ones included."""

from __future__ import annotations

from pathlib import Path

import pytest

from hwr_tools.bench.throughput import measure_throughput

MIB = 1 << 20


@pytest.mark.parametrize(
    ("asked", "payload"),
    [
        (1, 2 * 8192),  # one 4096-element BF16 row in each of the two payload files
        (3 * MIB, 3 * MIB),  # under two 16 MiB tensors: two smaller ones, one per payload file
        (40 * MIB, 32 * MIB),  # two 16 MiB tensors; the remainder is dropped
    ],
)
def test_throughput_is_measured_on_a_payload_below_two_full_tensors(tmp_path: Path, asked: int, payload: int) -> None:
    """A payload under 32 MiB (`hwr bench --size` below about 0.03 GiB) still puts tensors in every payload
    file, so publication and FULL_CHECKSUM succeed in every run, on the bytes reported, leaving nothing behind."""
    samples = measure_throughput(tmp_path, asked, runs=2)
    assert samples.payload_bytes == payload
    for seconds in (
        samples.raw_write_fsync_s,
        samples.raw_preallocated_s,
        samples.raw_sized_s,
        samples.publish_s,
        samples.single_thread_sha256_s,
        samples.full_checksum_s,
    ):
        assert len(seconds) == 2 and all(second > 0 for second in seconds)
    assert list(tmp_path.iterdir()) == []


def test_the_raw_write_bound_is_the_faster_of_a_preallocated_and_a_sized_write(tmp_path: Path) -> None:
    """The store sizes tmpfs payload files with `ftruncate` (no zeroing) and preallocates them elsewhere, so the
    raw write that publication is judged against is, in every run, the faster of the two ways, both measured."""
    samples = measure_throughput(tmp_path, 3 * MIB, runs=3)
    assert len(samples.raw_preallocated_s) == len(samples.raw_sized_s) == 3
    assert samples.raw_write_fsync_s == tuple(map(min, samples.raw_preallocated_s, samples.raw_sized_s))
    assert list(tmp_path.iterdir()) == []

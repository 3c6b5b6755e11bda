"""The checkpoint-streaming producer's memory stays bounded, measured as real RSS in a fresh process."""

from __future__ import annotations

from multiprocessing.connection import Connection
from pathlib import Path

import pytest
from safetensors import safe_open

from hwr_tools.synthetic_models import save_flux_pipeline_folder

from .support import recv_within, spawned_child

MIB = 2**20
BOUND_BEYOND_LARGEST = 256 * MIB  # the budget: at most this much beyond the largest tensor
CHECKPOINT_BYTES = 400 * MIB  # more than the budget, so holding the checkpoint in memory would fail the test


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"/proc/self/status has no {field}")


def _prewarm_child(pipeline: str, root: str, conn: Connection) -> None:
    """Import everything first, reset the peak-RSS counter, then stream the checkpoint into a new artifact."""
    from host_weight_runtime import HostWeightRuntime, HostWeightRuntimeConfig
    from host_weight_runtime.diffusion import prewarm_component

    runtime = HostWeightRuntime(HostWeightRuntimeConfig(root=Path(root)))
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
    before = _status_kib("VmRSS") * 1024
    result = prewarm_component(pipeline, subfolder="transformer", runtime=runtime)
    peak = _status_kib("VmHWM") * 1024
    conn.send((result.resolution.outcome.value, result.total_bytes, before, peak))


def _largest_tensor_bytes(folder: Path) -> int:
    largest = 0
    for shard in folder.glob("*.safetensors"):
        with safe_open(str(shard), framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118 (a safe_open handle is not iterable)
                piece = handle.get_slice(key)
                numel = 1
                for size in piece.get_shape():
                    numel *= size
                largest = max(largest, numel * 4)
    return largest


@pytest.mark.slow
def test_streaming_producer_rss_stays_within_the_largest_tensor_plus_256_mib(tmp_path: Path) -> None:
    """D13/prewarm: streaming a 400 MiB FP32 checkpoint into its BF16 artifact raises the producing process's
    peak RSS by at most the largest tensor plus 256 MiB (so it never holds the checkpoint or the artifact)."""
    if not Path("/proc/self/clear_refs").exists():
        pytest.fail("this test needs /proc/self/clear_refs (Linux) to measure peak RSS")
    pipeline = save_flux_pipeline_folder(tmp_path / "pipeline", target_bytes=CHECKPOINT_BYTES)
    weights = pipeline / "transformer"
    checkpoint_bytes = sum(path.stat().st_size for path in weights.glob("*.safetensors"))
    largest = _largest_tensor_bytes(weights)
    assert checkpoint_bytes > largest + BOUND_BEYOND_LARGEST, "the checkpoint must exceed the budget"
    with spawned_child(_prewarm_child, str(pipeline), str(tmp_path / "domain")) as conn:
        outcome, total_bytes, before, peak = recv_within(conn)  # type: ignore[misc]
    assert outcome == "local_production"
    assert total_bytes * 2 >= checkpoint_bytes * 0.95  # BF16 halves the FP32 checkpoint
    growth = peak - before
    assert growth <= largest + BOUND_BEYOND_LARGEST, (
        f"peak RSS grew by {growth / MIB:.0f} MiB; the bound is {(largest + BOUND_BEYOND_LARGEST) / MIB:.0f} MiB"
    )

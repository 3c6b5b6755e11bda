"""The streaming producer leaves one core to the writer's lane and gives the caller's intra-op thread count back.

The writer's lane writes and hashes on one core while the producer's thread casts on the others; the
producer lowers torch's intra-op threads by one for the stream only, and the bytes it writes do not depend on it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from host_weight_runtime._faults import Fault, FaultAction, armed, disarm_all
from host_weight_runtime.diffusion import prewarm_component
from hwr_tools.synthetic_models import save_flux_pipeline_folder

from ._diffusion import runtime_at


@pytest.fixture(autouse=True)
def _restore_threads() -> Iterator[None]:
    previous = torch.get_num_threads()
    yield
    disarm_all()
    torch.set_num_threads(previous)


def _prewarm(pipeline: Path, root: Path) -> tuple[list[int], dict[str, bytes]]:
    """Stream `pipeline` into a new domain at `root`: the intra-op thread counts seen at each mapped chunk,
    and the published payload files' bytes by name."""
    seen: list[int] = []
    producer_thread = threading.current_thread()

    def record(_point: str) -> None:
        assert threading.current_thread() is producer_thread
        seen.append(torch.get_num_threads())

    with armed("checkpoint.map", Fault(FaultAction.PAUSE, hook=record, times=1_000_000)):
        result = prewarm_component(pipeline, subfolder="transformer", runtime=runtime_at(root))
    assert result.resolution.outcome.value == "local_production"
    payloads = {path.name: path.read_bytes() for path in root.rglob("final-layout-*.safetensors")}
    assert payloads
    return seen, payloads


def test_d13_the_stream_leaves_one_core_to_the_lane_and_restores_the_callers_count(tmp_path: Path) -> None:
    """D13/prewarm: while the checkpoint streams, the producer's thread casts with one intra-op thread fewer
    than the caller's (one core stays with the lane); afterwards the caller's own count is back, and the
    artifact is the one a stream at any count makes (byte-identical payload files)."""
    pipeline = save_flux_pipeline_folder(tmp_path / "pipeline", target_bytes=4 * 2**20)
    torch.set_num_threads(3)
    seen_three, payloads_three = _prewarm(pipeline, tmp_path / "three")
    assert seen_three and set(seen_three) == {2}
    assert torch.get_num_threads() == 3
    torch.set_num_threads(2)
    seen, payloads = _prewarm(pipeline, tmp_path / "two")
    assert seen and set(seen) == {1}
    assert torch.get_num_threads() == 2
    torch.set_num_threads(1)  # already one: nothing to lower, nothing to restore
    seen_single, payloads_single = _prewarm(pipeline, tmp_path / "one")
    assert seen_single and set(seen_single) == {1}
    assert torch.get_num_threads() == 1
    assert payloads_single == payloads == payloads_three

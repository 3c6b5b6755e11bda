"""The ring that `copy_rows` converts chunks into: many small chunks in flight, and a slot's bytes reused only
once the lane has written and hashed the chunk in it (S05: what is hashed and written is what was converted)."""

from __future__ import annotations

from concurrent.futures import Future

import pytest
import torch

from host_weight_runtime.filesystem._cast_buffers import CastBuffers


class _Lane:
    """Stands in for the lane's futures: a chunk is done only when the ring waits for it (recorded) or the test
    says so, so every wait the ring makes is seen and none can hang."""

    def __init__(self) -> None:
        self.waited: list[int] = []
        self.futures: list[Future[None]] = []

    def chunk(self) -> Future[None]:
        future: Future[None] = Future()
        self.futures.append(future)
        return future

    def await_chunk(self, future: Future[None]) -> None:
        assert not future.done()
        self.waited.append(self.futures.index(future))
        future.set_result(None)


def _take(ring: CastBuffers, lane: _Lane, nbytes: int, fill: int) -> tuple[int, int, torch.Tensor]:
    slot, view = ring.take(nbytes)
    view.fill_(fill)
    ring.hashed_by(slot, lane.chunk())
    return slot.begin, slot.end, view


def test_s05_small_chunks_stay_in_flight_until_the_slot_limit() -> None:
    """S05: small chunks (a bias after a weight) do not wait for earlier ones while slots and room are left;
    the next one waits for the oldest chunk only, and no chunk in flight is ever overwritten."""
    lane = _Lane()
    ring = CastBuffers(ring_bytes=1024, slots=4, await_chunk=lane.await_chunk)
    taken = [_take(ring, lane, 100, fill) for fill in range(4)]
    assert lane.waited == []
    assert [begin for begin, _end, _view in taken] == [0, 128, 256, 384]  # cache-line aligned slots
    _take(ring, lane, 100, 4)
    assert lane.waited == [0]
    for fill, (_begin, _end, view) in enumerate(taken[1:], start=1):
        assert bool((view == fill).all())  # still in flight: untouched


def test_s05_a_wrapped_chunk_waits_only_for_the_chunks_it_overlaps() -> None:
    """S05: a chunk that does not fit before the ring's end starts again at its beginning and waits for the
    chunks there, and only those."""
    lane = _Lane()
    ring = CastBuffers(ring_bytes=1024, slots=8, await_chunk=lane.await_chunk)
    first = [_take(ring, lane, 300, fill) for fill in range(3)]  # [0, 300), [320, 620), [640, 940)
    begin, end, _view = _take(ring, lane, 300, 3)
    assert (begin, end) == (0, 300)
    assert lane.waited == [0]
    begin, end, _view = _take(ring, lane, 30, 4)  # fits after the wrapped chunk, before the second one
    assert (begin, end) == (320, 350)
    assert lane.waited == [0, 1]  # it overlaps the second chunk, which must be done first
    assert bool((first[2][2] == 2).all())


def test_s05_a_chunk_larger_than_half_the_ring_waits_for_all_and_gets_a_larger_ring() -> None:
    """S05: a chunk too large for the ring (an FP32 tensor kept in FP32) waits for every chunk in flight,
    then gets a ring of twice its size, so the chunks after it still overlap with its write."""
    lane = _Lane()
    ring = CastBuffers(ring_bytes=1024, slots=8, await_chunk=lane.await_chunk)
    _take(ring, lane, 100, 0)
    _take(ring, lane, 100, 1)
    begin, end, view = _take(ring, lane, 2000, 2)
    assert lane.waited == [0, 1]
    assert (begin, end) == (0, 2000)
    assert view.numel() == 2000
    begin, end, _view = _take(ring, lane, 1000, 3)
    assert begin >= 2000 and lane.waited == [0, 1]


def test_a_ring_with_no_room_or_no_slots_is_refused() -> None:
    """A ring needs bytes and slots: zero of either is a ValueError that names them."""
    with pytest.raises(ValueError, match="ring_bytes and slots must be positive"):
        CastBuffers(ring_bytes=0)
    with pytest.raises(ValueError, match="ring_bytes and slots must be positive"):
        CastBuffers(slots=0)

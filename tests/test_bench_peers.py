"""Bench peers: every peer loads back exactly the tensors written, and its `copies` flag tells the truth."""

from __future__ import annotations

import mmap
import sys
from pathlib import Path

import pytest
import torch

from hwr_tools.bench.peers import (
    PEERS,
    REFERENCE_PEERS,
    Peer,
    PeerFormat,
    PeerLoad,
    load_peer,
    peer_file_name,
    peer_named,
    peer_unavailable_reason,
    write_peer_files,
)

EXPECTED_NAMES = (
    "safetensors-load_file",
    "safetensors-mmap-views",
    "torch-load-mmap",
    "tensorizer",
    "runai-model-streamer",
    "fastsafetensors",
)


def _state_dict() -> dict[str, torch.Tensor]:
    """Final-layout-like tensors: BF16 of several shapes (0-d and one element included), one FP32, dotted names."""
    g = torch.Generator().manual_seed(1234)
    return {
        "blocks.0.attn.to_q.weight": torch.randn(48, 32, generator=g).to(torch.bfloat16),
        "blocks.0.attn.to_q.bias": torch.randn(48, generator=g).to(torch.bfloat16),
        "blocks.0.norm.scale": torch.randn((), generator=g).to(torch.bfloat16),
        "blocks.0.gate": torch.randn(1, generator=g).to(torch.bfloat16),
        "blocks.1.ff.weight": torch.randn(3, 5, 7, generator=g).to(torch.bfloat16),
        "pos_embed.freqs": torch.randn(16, 4, generator=g),
    }


def _available(peer: Peer) -> None:
    """`make setup` installs the bench extra, so a peer missing here is a broken setup, not a reason to skip."""
    reason = peer_unavailable_reason(peer)
    if reason is not None:
        pytest.fail(f"{peer.name} cannot be imported ({reason}); install the bench extra")


@pytest.fixture
def written(tmp_path: Path) -> tuple[dict[str, torch.Tensor], dict[PeerFormat, Path]]:
    state_dict = _state_dict()
    formats = [f for f in PeerFormat if not (f is PeerFormat.TENSORIZER and peer_unavailable_reason(peer_named("tensorizer")))]
    return state_dict, write_peer_files(state_dict, tmp_path, formats)


def test_peers_are_named_and_ordered_as_benchmark_rows() -> None:
    assert tuple(p.name for p in PEERS) == EXPECTED_NAMES
    assert {p.name: p.copies for p in PEERS} == {
        "safetensors-load_file": False,
        "safetensors-mmap-views": False,
        "torch-load-mmap": False,
        "tensorizer": True,
        "runai-model-streamer": True,
        "fastsafetensors": True,
    }
    assert all(peer_named(p.name) is p for p in PEERS)


def test_file_names_per_format(written: tuple[dict[str, torch.Tensor], dict[PeerFormat, Path]]) -> None:
    assert [peer_file_name(f) for f in PeerFormat] == ["model.safetensors", "model.pt", "model.tensors"]
    _, paths = written
    for file_format, path in paths.items():
        assert path.name == peer_file_name(file_format)
        assert path.stat().st_size > 0


@pytest.mark.parametrize("peer", (*PEERS, *REFERENCE_PEERS), ids=[p.name for p in (*PEERS, *REFERENCE_PEERS)])
def test_peer_loads_exactly_what_was_written(
    peer: Peer, written: tuple[dict[str, torch.Tensor], dict[PeerFormat, Path]]
) -> None:
    _available(peer)
    state_dict, paths = written
    with load_peer(peer, paths[peer.file_format]) as loaded:
        assert sorted(loaded.tensors) == sorted(state_dict)
        for name, expected in state_dict.items():
            got = loaded.tensors[name]
            assert type(got) is torch.Tensor, name
            assert not got.requires_grad, name
            assert got.device.type == "cpu", name
            assert got.dtype == expected.dtype, name
            assert got.shape == expected.shape, name
            assert torch.equal(got, expected), name
        # What a benchmark does with the dict: assign it into a module skeleton, strictly.
        module = torch.nn.Module()
        for name, tensor in loaded.tensors.items():
            owner = module
            *parents, leaf = name.split(".")
            for part in parents:
                if not hasattr(owner, part):
                    owner.add_module(part, torch.nn.Module())
                owner = getattr(owner, part)
            owner.register_buffer(leaf, torch.empty_like(tensor, device="meta"))
        module.load_state_dict(loaded.tensors, assign=True, strict=True)
        assert torch.equal(module.state_dict()["pos_embed.freqs"], state_dict["pos_embed.freqs"])
        del module
    assert loaded.tensors == {}
    assert loaded.keepalive is None
    loaded.close()  # idempotent


@pytest.mark.parametrize("peer", (*PEERS, *REFERENCE_PEERS), ids=[p.name for p in (*PEERS, *REFERENCE_PEERS)])
def test_copies_flag_matches_whether_file_writes_show_through(
    peer: Peer, written: tuple[dict[str, torch.Tensor], dict[PeerFormat, Path]]
) -> None:
    """A zero-copy peer's tensors are file pages: a later write to the file shows through; a copy's does not."""
    _available(peer)
    state_dict, paths = written
    path = paths[peer.file_format]
    name = "blocks.0.attn.to_q.weight"
    raw = state_dict[name].reshape(-1).view(torch.uint8).numpy().tobytes()
    with load_peer(peer, path) as loaded:
        tensor = loaded.tensors[name]
        before = tensor.reshape(-1).view(torch.uint8)[0].item()
        with path.open("r+b") as file, mmap.mmap(file.fileno(), 0, flags=mmap.MAP_SHARED) as writable:
            offset = writable.find(raw)
            assert offset >= 0 and writable.find(raw, offset + 1) == -1, "tensor bytes not found exactly once"
            writable[offset] = before ^ 0xFF
            writable.flush()
        after = tensor.reshape(-1).view(torch.uint8)[0].item()
    assert (after != before) == (not peer.copies), f"{peer.name}: copies={peer.copies} but write shows through={after != before}"


def _mapping_of(address: int) -> tuple[str, str]:
    """(permissions, path) of the mapping in this process that holds address."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        low, high = (int(x, 16) for x in fields[0].split("-"))
        if low <= address < high:
            return fields[1], fields[5] if len(fields) > 5 else ""
    raise AssertionError(f"{address:#x} is in no mapping")


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc/self/maps")
def test_mmap_views_are_read_only_shared_views_of_the_file(
    written: tuple[dict[str, torch.Tensor], dict[PeerFormat, Path]],
) -> None:
    _, paths = written
    path = paths[PeerFormat.SAFETENSORS]
    loaded = load_peer(peer_named("safetensors-mmap-views"), path)
    try:
        assert isinstance(loaded.keepalive, mmap.mmap)
        assert len(loaded.keepalive) == path.stat().st_size
        for name, tensor in loaded.tensors.items():
            permissions, mapped_path = _mapping_of(tensor.data_ptr())
            assert permissions == "r--s", name
            assert mapped_path == str(path.resolve()), name
    finally:
        loaded.close()
    assert loaded.keepalive is None


def test_fastsafetensors_keeps_its_buffer_until_close(
    written: tuple[dict[str, torch.Tensor], dict[PeerFormat, Path]],
) -> None:
    peer = peer_named("fastsafetensors")
    _available(peer)
    _, paths = written
    loaded = load_peer(peer, paths[PeerFormat.SAFETENSORS])
    assert loaded.keepalive is not None
    loaded.close()
    loaded.close()
    assert loaded.keepalive is None and loaded.tensors == {}


def test_peer_named_rejects_unknown_names_listing_valid_ones() -> None:
    with pytest.raises(ValueError, match="safetensors-load_file") as info:
        peer_named("nope")
    assert "nope" in str(info.value)


def test_unavailable_reason_is_none_for_installed_and_one_line_for_missing() -> None:
    assert peer_unavailable_reason(peer_named("safetensors-load_file")) is None
    assert peer_unavailable_reason(peer_named("torch-load-mmap")) is None
    fake = Peer("fake", PeerFormat.SAFETENSORS, True, "no_such_module_xyz", "nothing")
    reason = peer_unavailable_reason(fake)
    assert reason is not None and "no_such_module_xyz" in reason and "\n" not in reason


@pytest.mark.parametrize("requirement", ["tensorizer", "runai_model_streamer", "fastsafetensors"])
def test_missing_bench_package_names_the_extra(requirement: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, requirement, None)  # import now raises ModuleNotFoundError
    peer = next(p for p in PEERS if p.requirement == requirement)
    reason = peer_unavailable_reason(peer)
    assert reason == f"{requirement} is not installed (pip install 'host-weight-runtime[bench]')"


def test_writer_for_a_missing_package_is_a_value_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "tensorizer", None)
    with pytest.raises(ValueError, match="tensorizer"):
        write_peer_files(_state_dict(), tmp_path, [PeerFormat.SAFETENSORS, PeerFormat.TENSORIZER])
    assert list(tmp_path.iterdir()) == []  # checked before anything is written


def test_load_peer_rejects_missing_package_and_unknown_peer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="not one of PEERS"):
        load_peer(Peer("fake", PeerFormat.SAFETENSORS, True, "torch", "nothing"), tmp_path / "model.safetensors")
    monkeypatch.setitem(sys.modules, "fastsafetensors", None)
    with pytest.raises(ImportError, match="fastsafetensors is not installed"):
        load_peer(peer_named("fastsafetensors"), tmp_path / "model.safetensors")


def test_writer_normalizes_views_and_non_contiguous_tensors(tmp_path: Path) -> None:
    base = torch.randn(8, 6, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    state_dict = {"t": base.t(), "slice": base[2:4], "same": base, "same_again": base}
    paths = write_peer_files(state_dict, tmp_path, [PeerFormat.SAFETENSORS, PeerFormat.TORCH])
    for peer in (peer_named("safetensors-mmap-views"), peer_named("torch-load-mmap")):
        with load_peer(peer, paths[peer.file_format]) as loaded:
            for name, expected in state_dict.items():
                assert torch.equal(loaded.tensors[name], expected), (peer.name, name)


def test_peer_load_close_without_keepalive_is_idempotent() -> None:
    load = PeerLoad({"x": torch.zeros(2)}, None)
    load.close()
    load.close()
    assert load.tensors == {}


def _resident_bytes(address: int) -> tuple[int, int]:
    """(size, Rss) in bytes of this process's mapping that holds address, from /proc/self/smaps."""
    found: int | None = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and len(fields) >= 5:
            low, high = (int(x, 16) for x in fields[0].split("-"))
            found = high - low if low <= address < high else None
        elif found is not None and fields[0] == "Rss:":
            return found, int(fields[1]) * 1024
    raise AssertionError(f"{address:#x} is in no mapping")


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs /proc/self/smaps")
@pytest.mark.parametrize("peer", (peer_named("safetensors-mmap-views"), *REFERENCE_PEERS), ids=lambda p: p.name)
def test_reference_mappings_have_every_page_mapped_before_any_read(
    peer: Peer, written: tuple[dict[str, torch.Tensor], dict[PeerFormat, Path]], tmp_path: Path
) -> None:
    """The bare references' page tables are filled up front (MAP_POPULATE, or MADV_POPULATE_READ on a thread), so
    the goals judge warm loads against the best population; the page-by-page views map only what was read."""
    large = {**written[0], "large": torch.zeros(1 << 20, dtype=torch.bfloat16)}  # 2 MiB: beyond any fault-around
    folder = tmp_path / "large"
    folder.mkdir()
    path = write_peer_files(large, folder, [PeerFormat.SAFETENSORS])[PeerFormat.SAFETENSORS]
    loaded = load_peer(peer, path)
    try:
        keepalive = loaded.keepalive
        thread = getattr(keepalive, "thread", None)
        if thread is not None:
            thread.join()
            assert getattr(keepalive, "error", None) is None
        address = loaded.tensors["large"].data_ptr()
        size, resident = _resident_bytes(address)
        assert (resident == size > 0) is (peer in REFERENCE_PEERS), f"{peer.name}: {resident} of {size} bytes mapped"
    finally:
        loaded.close()

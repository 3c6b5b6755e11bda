"""The store-scoped streaming safetensors writer, on real files in a temporary directory."""

from __future__ import annotations

import errno
import json
import os
import stat
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from host_weight_runtime._digest import content_digest, tree_digest
from host_weight_runtime._faults import Fault, FaultAction, armed, disarm_all
from host_weight_runtime.failures import FailureCode, HostWeightError, ResolutionStage, failure
from host_weight_runtime.filesystem.writer import StagingArtifactWriter, StagingTensorFileWriter, WrittenFile
from host_weight_runtime.protocols import ArtifactWriter, TensorFileWriter, TensorWriteSpec
from host_weight_runtime.tensors import SAFETENSORS_DTYPES, TensorKind, dtype_itemsize

SMALL_CHUNK = 64  # small digest chunks so a few hundred bytes already span several chunks


@pytest.fixture(autouse=True)
def _no_leftover_faults() -> Iterator[None]:
    yield
    disarm_all()


def new_writer(root: Path, *, reserve: Callable[[int], None] | None = None, **kwargs: int) -> StagingArtifactWriter:
    staging = root / "staging"
    staging.mkdir(mode=0o700, parents=True, exist_ok=True)
    return StagingArtifactWriter(staging, reserve=reserve or (lambda size: None), **kwargs)


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Deterministic arbitrary bytes of `dtype` (NaN patterns included); bools stay 0/1."""
    generator = torch.Generator().manual_seed(seed)
    count = 1
    for dim in shape:
        count *= dim
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=generator, dtype=torch.uint8).bool()
    raw = torch.randint(0, 256, (count * dtype_itemsize(dtype),), generator=generator, dtype=torch.uint8)
    return raw.view(dtype).reshape(shape)


def raw_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def spec_of(name: str, tensor: torch.Tensor) -> TensorWriteSpec:
    return TensorWriteSpec(name=name, shape=tuple(tensor.shape), dtype=tensor.dtype)


def write_file(
    writer: StagingArtifactWriter,
    file_name: str,
    tensors: dict[str, torch.Tensor],
    *,
    ordered: bool,
    rows: int | None = None,
    reverse: bool = False,
) -> None:
    """Write `tensors` whole or `rows` rows at a time, in layout order or reversed."""
    file_writer = writer.open_tensor_file(
        file_name, tuple(spec_of(name, tensor) for name, tensor in tensors.items()), ordered=ordered
    )
    layout = list(file_writer.layout)
    for spec in reversed(layout) if reverse else layout:
        tensor = tensors[spec.name]
        if rows is None or tensor.dim() == 0:
            file_writer.write_tensor(spec.name, tensor)
            continue
        starts = list(range(0, tensor.shape[0], rows))
        for start in reversed(starts) if reverse else starts:
            file_writer.write_rows(spec.name, start, tensor[start : start + rows])
    file_writer.close()


def mixed_tensors() -> dict[str, torch.Tensor]:
    """Declared deliberately out of size order, with 0-dim and zero-element tensors."""
    return {
        "embed.ids": random_tensor((9,), torch.uint8, 1),
        "blocks.0.weight": random_tensor((12, 5), torch.float32, 2),
        "blocks.0.bias": random_tensor((12,), torch.bfloat16, 3),
        "scale": random_tensor((), torch.float64, 4),
        "empty": random_tensor((0, 3), torch.float16, 5),
        "mask": random_tensor((7, 3), torch.bool, 6),
        "positions": random_tensor((33,), torch.int64, 7),
    }


def expect_producer_failed(writer: StagingArtifactWriter, action: Callable[[], object], *needles: str) -> None:
    with pytest.raises(HostWeightError) as caught:
        action()
    assert caught.value.code is FailureCode.PRODUCER_FAILED
    assert caught.value.retryable is False
    assert caught.value.failure.stage is ResolutionStage.PRODUCTION
    for needle in needles:
        assert needle in caught.value.failure.message
    assert writer.failure is not None


# --------------------------------------------------------------------------- format and round trips


def test_s05_s06_every_dtype_round_trips_bit_exactly_through_stock_safetensors(tmp_path: Path) -> None:
    """S05/S06: every supported dtype, written by the writer, reads back bit-exactly with safe_open."""
    tensors: dict[str, torch.Tensor] = {}
    for index, (code, dtype) in enumerate(sorted(SAFETENSORS_DTYPES.items())):
        tensors[f"{code}.matrix"] = random_tensor((3, 5), dtype, 10 + index)
        tensors[f"{code}.scalar"] = random_tensor((), dtype, 50 + index)
        tensors[f"{code}.empty"] = random_tensor((0, 4), dtype, 90 + index)
    writer = new_writer(tmp_path, chunk_bytes=SMALL_CHUNK)
    write_file(writer, "model.safetensors", tensors, ordered=False, rows=2)
    (written,) = writer.finish()
    path = writer.staging_dir / "model.safetensors"
    assert path.stat().st_size == written.size
    with safe_open(str(path), "pt") as reader:
        assert set(reader.keys()) == set(tensors)
        for name, expected in tensors.items():
            loaded = reader.get_tensor(name)
            assert loaded.dtype == expected.dtype, name
            assert tuple(loaded.shape) == tuple(expected.shape), name
            assert raw_bytes(loaded) == raw_bytes(expected), name
    for entry in written.tensors:
        assert entry.digest == tree_digest(raw_bytes(tensors[entry.name]), SMALL_CHUNK)


def test_header_is_padded_aligned_and_tensors_sorted_by_element_size(tmp_path: Path) -> None:
    """Every tensor's absolute and relative offset is a multiple of its element size; no holes."""
    tensors = mixed_tensors()
    writer = new_writer(tmp_path)
    write_file(writer, "a.safetensors", tensors, ordered=True)
    (written,) = writer.finish()
    data = (writer.staging_dir / "a.safetensors").read_bytes()
    length = int.from_bytes(data[:8], "little")
    assert written.header_size == 8 + length and written.header_size % 8 == 0
    text = data[8 : 8 + length]
    header = json.loads(text)
    assert text == text.rstrip(b" ") + b" " * (len(text) - len(text.rstrip(b" ")))
    assert header.pop("__metadata__") == {"format": "pt"}
    position = 0
    itemsizes = []
    for entry in written.tensors:
        begin, end = entry.data_offsets
        itemsize = dtype_itemsize(tensors[entry.name].dtype)
        assert begin == position and begin % itemsize == 0 and (written.header_size + begin) % itemsize == 0
        assert header[entry.name] == {"dtype": entry.dtype, "shape": list(entry.shape), "data_offsets": [begin, end]}
        assert entry.strides == tuple(tensors[entry.name].stride())
        itemsizes.append(itemsize)
        position = end
    assert written.size == written.header_size + position == len(data)
    assert itemsizes == sorted(itemsizes, reverse=True)
    # Stable: equal element sizes keep their declared order.
    declared = [name for name in tensors if dtype_itemsize(tensors[name].dtype) == 1]
    assert [e.name for e in written.tensors if dtype_itemsize(tensors[e.name].dtype) == 1] == declared


def test_zero_element_tensors_occupy_no_bytes_and_need_no_write(tmp_path: Path) -> None:
    writer = new_writer(tmp_path)
    empty = torch.zeros((4, 0), dtype=torch.float32)
    file_writer = writer.open_tensor_file(
        "z.safetensors", (spec_of("empty", empty), spec_of("one", torch.ones(1, dtype=torch.int32))), ordered=True
    )
    file_writer.write_tensor("one", torch.ones(1, dtype=torch.int32))
    file_writer.close()
    (written,) = writer.finish()
    by_name = {entry.name: entry for entry in written.tensors}
    assert by_name["empty"].data_offsets[0] == by_name["empty"].data_offsets[1]
    assert written.size == written.header_size + 4


def test_written_file_manifest_entry_kinds_roles_and_reservation(tmp_path: Path) -> None:
    reserved: list[int] = []
    writer = new_writer(tmp_path, reserve=reserved.append)
    spec = TensorWriteSpec("norm.running_mean", (4,), torch.float32, kind=TensorKind.BUFFER, role="running_mean")
    file_writer = writer.open_tensor_file("m.safetensors", (spec,))
    assert isinstance(writer, ArtifactWriter) and isinstance(file_writer, TensorFileWriter)
    file_writer.write_tensor("norm.running_mean", torch.arange(4, dtype=torch.float32))
    file_writer.close()
    file_writer.close()  # idempotent
    (written,) = writer.finish()
    assert writer.finish() == (written,)
    assert isinstance(written, WrittenFile)
    assert reserved == [written.size] and writer.bytes_reserved == written.size
    entry = written.manifest_entry()
    assert (entry.name, entry.size, entry.header_size, entry.digest, entry.tensors) == (
        "m.safetensors",
        written.size,
        written.header_size,
        written.digest,
        ("norm.running_mean",),
    )
    (tensor_entry,) = written.tensors
    assert tensor_entry.kind is TensorKind.BUFFER and tensor_entry.role == "running_mean"
    assert tensor_entry.file == "m.safetensors"
    assert stat.S_IMODE((writer.staging_dir / "m.safetensors").stat().st_mode) == 0o600
    assert writer.failure is None


def test_non_contiguous_and_grad_tensors_are_written_by_value(tmp_path: Path) -> None:
    writer = new_writer(tmp_path)
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    transposed = base.t()
    parameter = torch.nn.Parameter(torch.arange(5, dtype=torch.float32))
    file_writer = writer.open_tensor_file("n.safetensors", (spec_of("t", transposed), spec_of("p", parameter)))
    file_writer.write_rows("t", 0, transposed[:2])
    file_writer.write_rows("t", 2, transposed[2:])
    file_writer.write_tensor("p", parameter)
    file_writer.close()
    writer.finish()
    with safe_open(str(writer.staging_dir / "n.safetensors"), "pt") as reader:
        assert torch.equal(reader.get_tensor("t"), transposed)
        assert torch.equal(reader.get_tensor("p"), parameter.detach())


# --------------------------------------------------------------------------- digests


@pytest.mark.parametrize(
    ("ordered", "rows", "reverse"),
    [(True, 2, False), (False, None, True), (False, 3, True), (False, 1, False)],
)
def test_digests_do_not_depend_on_write_order_or_granularity(
    tmp_path: Path, ordered: bool, rows: int | None, reverse: bool
) -> None:
    """Ordered whole-tensor writing is the reference; every other way of writing gives the same digests."""
    tensors = mixed_tensors()
    reference_writer = new_writer(tmp_path / "reference", chunk_bytes=SMALL_CHUNK, hash_threads=1)
    write_file(reference_writer, "w.safetensors", tensors, ordered=True)
    (reference,) = reference_writer.finish()
    writer = new_writer(tmp_path / "other", chunk_bytes=SMALL_CHUNK, hash_threads=4)
    write_file(writer, "w.safetensors", tensors, ordered=ordered, rows=rows, reverse=reverse)
    (other,) = writer.finish()
    assert other == reference
    assert (writer.staging_dir / "w.safetensors").read_bytes() == (
        reference_writer.staging_dir / "w.safetensors"
    ).read_bytes()


def test_unordered_rows_from_many_threads(tmp_path: Path) -> None:
    tensor = random_tensor((64, 16), torch.float32, 11)
    reference_writer = new_writer(tmp_path / "reference", chunk_bytes=SMALL_CHUNK)
    write_file(reference_writer, "p.safetensors", {"w": tensor}, ordered=True)
    writer = new_writer(tmp_path / "threads", chunk_bytes=SMALL_CHUNK)
    file_writer = writer.open_tensor_file("p.safetensors", (spec_of("w", tensor),))
    with ThreadPoolExecutor(max_workers=8) as pool:
        list(pool.map(lambda start: file_writer.write_rows("w", start, tensor[start : start + 4]), range(0, 64, 4)))
    file_writer.close()
    assert writer.finish() == reference_writer.finish()


def test_d10_content_digest_does_not_depend_on_file_split(tmp_path: Path) -> None:
    """D10: the same three tensors as one file or split across two files give one content digest."""
    tensors = {
        "a.weight": random_tensor((8, 4), torch.bfloat16, 21),
        "b.weight": random_tensor((5,), torch.float32, 22),
        "c.bias": random_tensor((3, 3), torch.int8, 23),
    }
    one = new_writer(tmp_path / "one")
    write_file(one, "model.safetensors", tensors, ordered=True)
    two = new_writer(tmp_path / "two")
    write_file(two, "part-1.safetensors", {"a.weight": tensors["a.weight"]}, ordered=False)
    write_file(two, "part-2.safetensors", {k: tensors[k] for k in ("b.weight", "c.bias")}, ordered=True)

    def digest(files: tuple[WrittenFile, ...]) -> str:
        return content_digest((t.name, t.dtype, t.shape, t.digest) for f in files for t in f.tensors)

    single, split = one.finish(), two.finish()
    assert len(single) == 1 and len(split) == 2
    assert digest(single) == digest(split)
    assert single[0].digest not in {f.digest for f in split}


# --------------------------------------------------------------------------- producer mistakes


def test_s04_overlapping_rows_fail_and_are_recorded(tmp_path: Path) -> None:
    """S04: writing rows that were already written is PRODUCER_FAILED, recorded as the writer's failure."""
    tensor = random_tensor((10, 2), torch.float32, 31)
    writer = new_writer(tmp_path)
    file_writer = writer.open_tensor_file("o.safetensors", (spec_of("w", tensor),))
    file_writer.write_rows("w", 0, tensor[:6])
    expect_producer_failed(writer, lambda: file_writer.write_rows("w", 5, tensor[5:]), "w", "overlap")
    first = writer.failure
    expect_producer_failed(writer, lambda: file_writer.write_tensor("w", tensor), "overlap")
    assert writer.failure is first  # the first failure stays the recorded one


def test_s04_incomplete_tensor_fails_at_close_naming_the_gap(tmp_path: Path) -> None:
    """S04: a tensor with unwritten rows fails close() with PRODUCER_FAILED naming tensor and rows."""
    tensor = random_tensor((10, 2), torch.float32, 32)
    writer = new_writer(tmp_path)
    file_writer = writer.open_tensor_file("g.safetensors", (spec_of("w", tensor), spec_of("v", torch.ones(3))))
    file_writer.write_tensor("v", torch.ones(3))
    file_writer.write_rows("w", 0, tensor[:4])
    file_writer.write_rows("w", 7, tensor[7:])
    expect_producer_failed(writer, file_writer.close, "tensor w rows 4..7")
    file_writer.close()  # a second close does nothing
    with pytest.raises(HostWeightError) as caught:
        writer.finish()
    assert caught.value.failure == writer.failure


def test_unwritten_tensor_fails_at_close(tmp_path: Path) -> None:
    writer = new_writer(tmp_path)
    file_writer = writer.open_tensor_file("u.safetensors", (spec_of("a", torch.ones(2)), spec_of("b", torch.ones(2))))
    file_writer.write_tensor("a", torch.ones(2))
    expect_producer_failed(writer, file_writer.close, "tensor b rows 0..2")


def declared_file(writer: StagingArtifactWriter, *, ordered: bool = False) -> StagingTensorFileWriter:
    specs = (
        TensorWriteSpec("matrix", (4, 3), torch.float32),
        TensorWriteSpec("scalar", (), torch.float32),
    )
    return writer.open_tensor_file("d.safetensors", specs, ordered=ordered)


@pytest.mark.parametrize(
    ("label", "write"),
    [
        ("unknown name", lambda f: f.write_tensor("nope", torch.zeros(4, 3))),
        ("wrong dtype", lambda f: f.write_tensor("matrix", torch.zeros(4, 3, dtype=torch.float16))),
        ("wrong shape", lambda f: f.write_tensor("matrix", torch.zeros(3, 4))),
        ("wrong row shape", lambda f: f.write_rows("matrix", 0, torch.zeros(2, 4))),
        ("rows out of range", lambda f: f.write_rows("matrix", 3, torch.zeros(2, 3))),
        ("negative start", lambda f: f.write_rows("matrix", -1, torch.zeros(1, 3))),
        ("rows of a 0-dim tensor", lambda f: f.write_rows("scalar", 0, torch.zeros(()))),
        ("not on the cpu", lambda f: f.write_tensor("matrix", torch.zeros(4, 3, device="meta"))),
        ("not a tensor", lambda f: f.write_tensor("matrix", [[0.0] * 3] * 4)),
    ],
)
def test_bad_writes_are_producer_failures(
    tmp_path: Path, label: str, write: Callable[[StagingTensorFileWriter], None]
) -> None:
    writer = new_writer(tmp_path)
    file_writer = declared_file(writer)
    expect_producer_failed(writer, lambda: write(file_writer))
    assert writer.failure is not None and writer.failure.code is FailureCode.PRODUCER_FAILED, label


def test_ordered_file_rejects_out_of_order_writes(tmp_path: Path) -> None:
    writer = new_writer(tmp_path)
    file_writer = declared_file(writer, ordered=True)
    assert [spec.name for spec in file_writer.layout] == ["matrix", "scalar"]
    expect_producer_failed(writer, lambda: file_writer.write_tensor("scalar", torch.zeros(())), "matrix row 0")
    file_writer.write_rows("matrix", 0, torch.zeros(1, 3))
    expect_producer_failed(writer, lambda: file_writer.write_rows("matrix", 2, torch.zeros(2, 3)), "matrix row 1")
    # In-order writing still works after a rejected write; the writer keeps the first failure.
    file_writer.write_rows("matrix", 1, torch.zeros(3, 3))
    file_writer.write_tensor("scalar", torch.zeros(()))
    file_writer.close()
    assert file_writer.result is not None
    with pytest.raises(HostWeightError):
        writer.finish()


@pytest.mark.parametrize("name", ["", ".", "..", "../x", "a/b", "../x.safetensors", "a/b.safetensors", "x.bin"])
def test_bad_file_names_are_rejected_before_anything_is_created(tmp_path: Path, name: str) -> None:
    """C07-style names: one safe basename or nothing is created."""
    writer = new_writer(tmp_path)
    expect_producer_failed(writer, lambda: writer.open_tensor_file(name, (TensorWriteSpec("x", (1,), torch.uint8),)))
    assert os.listdir(writer.staging_dir) == []
    assert sorted(os.listdir(tmp_path)) == ["staging"]
    assert writer.bytes_reserved == 0


def test_duplicate_names_and_empty_specs_are_rejected(tmp_path: Path) -> None:
    writer = new_writer(tmp_path)
    one = TensorWriteSpec("x", (2,), torch.float32)
    expect_producer_failed(writer, lambda: writer.open_tensor_file("e.safetensors", ()), "at least one tensor")
    expect_producer_failed(writer, lambda: writer.open_tensor_file("d.safetensors", (one, one)), "twice")
    expect_producer_failed(
        writer,
        lambda: writer.open_tensor_file("m.safetensors", (TensorWriteSpec("__metadata__", (1,), torch.uint8),)),
    )
    first = writer.open_tensor_file("a.safetensors", (one,))
    expect_producer_failed(
        writer,
        lambda: writer.open_tensor_file("a.safetensors", (TensorWriteSpec("y", (1,), torch.uint8),)),
        "already opened",
    )
    expect_producer_failed(writer, lambda: writer.open_tensor_file("b.safetensors", (one,)), "another file")
    assert sorted(os.listdir(writer.staging_dir)) == ["a.safetensors"]
    first.write_tensor("x", torch.ones(2))
    first.close()
    assert writer.failure is not None and "at least one tensor" in writer.failure.message


# --------------------------------------------------------------------------- capacity and I/O


def test_s18_reserve_failure_is_recorded_and_reraised_unchanged(tmp_path: Path) -> None:
    """S18: a capacity failure from reserve() reaches the producer as the very same exception."""
    refusal = HostWeightError(
        failure(ResolutionStage.PRODUCTION, FailureCode.ARTIFACT_TOO_LARGE, "too large", retryable=True, limit=10)
    )

    def reserve(size: int) -> None:
        raise refusal

    writer = new_writer(tmp_path, reserve=reserve)
    with pytest.raises(HostWeightError) as caught:
        writer.open_tensor_file("r.safetensors", (TensorWriteSpec("x", (64,), torch.float32),))
    assert caught.value is refusal
    assert writer.failure is refusal.failure
    assert writer.bytes_reserved == 0
    assert os.listdir(writer.staging_dir) == []


@pytest.mark.parametrize("point", ["writer.preallocate", "writer.pwrite"])
@pytest.mark.parametrize(
    ("number", "code"), [(errno.ENOSPC, FailureCode.NO_SPACE), (errno.EDQUOT, FailureCode.QUOTA_EXCEEDED)]
)
def test_s18_out_of_space_is_typed_and_retryable(tmp_path: Path, point: str, number: int, code: FailureCode) -> None:
    """S18: ENOSPC and EDQUOT while preallocating or writing are typed, retryable capacity failures."""
    writer = new_writer(tmp_path)
    spec = TensorWriteSpec("x", (16,), torch.float32)
    fault = Fault(FaultAction.RAISE_OSERROR, errno=number)
    with pytest.raises(HostWeightError) as caught:
        if point == "writer.preallocate":
            with armed(point, fault):
                writer.open_tensor_file("s.safetensors", (spec,))
        else:
            file_writer = writer.open_tensor_file("s.safetensors", (spec,))
            with armed(point, fault):
                file_writer.write_tensor("x", torch.ones(16))
    assert caught.value.code is code
    assert caught.value.retryable is True
    assert caught.value.failure.stage is ResolutionStage.PRODUCTION
    assert writer.failure == caught.value.failure
    if point == "writer.preallocate":
        assert os.listdir(writer.staging_dir) == []  # the half-made file is gone
    writer.abort()


def test_failed_pwrite_can_be_retried_and_header_write_failure_is_typed(tmp_path: Path) -> None:
    writer = new_writer(tmp_path)
    spec = TensorWriteSpec("x", (16,), torch.float32)
    with (
        armed("writer.pwrite", Fault(FaultAction.RAISE_OSERROR, errno=errno.EIO)),
        pytest.raises(HostWeightError) as caught,
    ):
        writer.open_tensor_file("h.safetensors", (spec,))  # the header is the first pwrite
    assert caught.value.code is FailureCode.IO_ERROR and caught.value.retryable is True
    file_writer = writer.open_tensor_file("h.safetensors", (spec,))
    with (
        armed("writer.pwrite", Fault(FaultAction.RAISE_OSERROR, errno=errno.EROFS)),
        pytest.raises(HostWeightError) as caught,
    ):
        file_writer.write_tensor("x", torch.ones(16))
    assert caught.value.code is FailureCode.IO_ERROR and caught.value.retryable is False
    file_writer.write_tensor("x", torch.ones(16))  # the failed write claimed nothing
    file_writer.close()
    assert file_writer.result is not None
    assert writer.failure is not None and writer.failure.code is FailureCode.IO_ERROR and writer.failure.retryable


def test_fsync_error_at_close_is_typed(tmp_path: Path) -> None:
    writer = new_writer(tmp_path)
    file_writer = writer.open_tensor_file("f.safetensors", (TensorWriteSpec("x", (2,), torch.float32),))
    file_writer.write_tensor("x", torch.ones(2))
    with (
        armed("writer.fsync", Fault(FaultAction.RAISE_OSERROR, errno=errno.EIO)),
        pytest.raises(HostWeightError) as caught,
    ):
        file_writer.close()
    assert caught.value.code is FailureCode.IO_ERROR and caught.value.retryable is True
    assert file_writer.closed and file_writer.result is None


# --------------------------------------------------------------------------- finish and abort


def test_finish_fails_without_files_or_with_an_unclosed_file(tmp_path: Path) -> None:
    empty = new_writer(tmp_path / "empty")
    expect_producer_failed(empty, empty.finish, "no payload file")

    writer = new_writer(tmp_path / "open")
    file_writer = writer.open_tensor_file("o.safetensors", (TensorWriteSpec("x", (2,), torch.float32),))
    file_writer.write_tensor("x", torch.ones(2))
    expect_producer_failed(writer, writer.finish, "never closed")
    assert file_writer.closed  # finish released the descriptor on its way out


def test_abort_closes_descriptors_and_never_raises(tmp_path: Path) -> None:
    writer = new_writer(tmp_path)
    file_writer = writer.open_tensor_file("a.safetensors", (TensorWriteSpec("x", (2,), torch.float32),))
    writer.abort()
    writer.abort()
    assert file_writer.closed
    expect_producer_failed(writer, lambda: file_writer.write_tensor("x", torch.ones(2)), "closed")
    expect_producer_failed(
        writer, lambda: writer.open_tensor_file("b.safetensors", (TensorWriteSpec("y", (1,), torch.uint8),)), "aborted"
    )
    assert (writer.staging_dir / "a.safetensors").exists()  # the store removes the directory, not the writer


def test_writes_after_close_and_finish_are_rejected(tmp_path: Path) -> None:
    writer = new_writer(tmp_path)
    file_writer = writer.open_tensor_file("c.safetensors", (TensorWriteSpec("x", (2,), torch.float32),))
    file_writer.write_tensor("x", torch.ones(2))
    file_writer.close()
    writer.finish()
    expect_producer_failed(writer, lambda: file_writer.write_tensor("x", torch.ones(2)), "closed")
    expect_producer_failed(
        writer, lambda: writer.open_tensor_file("d.safetensors", (TensorWriteSpec("y", (1,), torch.uint8),)), "finished"
    )

"""Several consecutive tensors written by one vectored call (`write_data_parts`), on real files.

A post-load publication of a private model writes whole tensors straight from their memory, many per
`pwritev`; the file and its manifest record must be exactly those of writing each tensor on its own.
"""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
import torch

from host_weight_runtime._digest import tree_digest
from host_weight_runtime._faults import Fault, FaultAction, armed
from host_weight_runtime.failures import FailureCode, HostWeightError
from host_weight_runtime.filesystem.writer import StagingArtifactWriter, StagingTensorFileWriter

from .test_writer import SMALL_CHUNK, new_writer, random_tensor, spec_of, write_file


def _many_tensors(count: int) -> dict[str, torch.Tensor]:
    """`count` small tensors of varied sizes, zero-element ones among them (more than one pwritev takes)."""
    return {
        f"t{index:05d}": random_tensor((index % 7, 3) if index % 11 else (0, 3), torch.bfloat16, index)
        for index in range(count)
    }


def _flat(tensor: torch.Tensor) -> memoryview:
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy().data


def _open_caller_hashed(writer: StagingArtifactWriter, tensors: dict[str, torch.Tensor]) -> StagingTensorFileWriter:
    specs = tuple(spec_of(name, tensor) for name, tensor in tensors.items())
    file_writer = writer.open_tensor_file("v.safetensors", specs, ordered=True, caller_hashes=True)
    assert isinstance(file_writer, StagingTensorFileWriter)
    return file_writer


def _write_vectored(file_writer: StagingTensorFileWriter, tensors: dict[str, torch.Tensor]) -> None:
    """Every tensor in layout order: the bytes in one `write_data_parts` call, zero-element tensors on their own."""
    parts = []
    for spec in file_writer.layout:
        tensor = tensors[spec.name]
        if tensor.numel():
            parts.append(_flat(tensor))
    file_writer.write_data_parts(parts)
    for spec in file_writer.layout:
        if not tensors[spec.name].numel():
            file_writer.write_tensor(spec.name, tensors[spec.name])


def test_d10_vectored_write_of_many_tensors_is_byte_identical_to_tensor_by_tensor(tmp_path: Path) -> None:
    """D10: 1500 tensors (more buffers than one pwritev takes) written by one `write_data_parts` call give the
    very file and manifest record that writing (and hashing) each tensor on its own gives."""
    tensors = _many_tensors(1500)
    reference_writer = new_writer(tmp_path / "reference", chunk_bytes=SMALL_CHUNK)
    write_file(reference_writer, "v.safetensors", tensors, ordered=True)
    (reference,) = reference_writer.finish()

    writer = new_writer(tmp_path / "vectored", chunk_bytes=SMALL_CHUNK)
    file_writer = _open_caller_hashed(writer, tensors)
    _write_vectored(file_writer, tensors)
    file_writer.close_hashed([tree_digest(_flat(tensors[spec.name]), SMALL_CHUNK) for spec in file_writer.layout])
    (vectored,) = writer.finish()

    assert vectored == reference
    assert (writer.staging_dir / "v.safetensors").read_bytes() == (
        reference_writer.staging_dir / "v.safetensors"
    ).read_bytes()


@pytest.mark.parametrize("point", ["writer.pwrite", "writer.after_pwrite"])
def test_s18_vectored_write_out_of_space_is_typed_and_claims_nothing(tmp_path: Path, point: str) -> None:
    """S18: ENOSPC before or after part of a vectored write landed is a typed, retryable NO_SPACE failure,
    recorded as the writer's failure."""
    tensors = _many_tensors(40)
    writer = new_writer(tmp_path / "full", chunk_bytes=SMALL_CHUNK)
    file_writer = _open_caller_hashed(writer, tensors)
    with armed(point, Fault(FaultAction.RAISE_OSERROR, errno=errno.ENOSPC)), pytest.raises(HostWeightError) as caught:
        file_writer.write_data_parts([_flat(tensors[spec.name]) for spec in file_writer.layout])
    assert caught.value.code is FailureCode.NO_SPACE and caught.value.retryable
    assert writer.failure is not None and writer.failure.code is FailureCode.NO_SPACE

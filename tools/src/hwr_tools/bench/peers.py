"""Peer loaders: the same final-layout state dict, loaded by other libraries, for side-by-side benchmarks.

A benchmark row is only fair if every peer loads exactly the tensors our runtime restores
(final layout, BF16 with some FP32), so this module writes one state dict in each peer's
file format and loads it back with that peer's own API into a plain ``dict[str, Tensor]``
that a model skeleton takes with ``load_state_dict(tensors, assign=True, strict=True)``.

What each peer's tensors are, with the versions pinned in this repository's venv
(safetensors 0.8, torch 2.13, tensorizer 2.12, runai-model-streamer 0.17, fastsafetensors 0.5):

    safetensors-load_file   views of a private (copy-on-write) mmap of the file: load_file's
                            default backend is "mmap", so nothing is copied until written
    safetensors-mmap-views  views of a read-only MAP_SHARED mmap; invalid after PeerLoad.close()
    safetensors-mmap-populate         the same views, the mapping made with MAP_POPULATE (the kernel
                            fills every page-table entry inside mmap, no fault later)
    safetensors-mmap-prefault-thread  the same views, madvise(MADV_POPULATE_READ) on a thread of its
                            own from the moment the file is mapped (what a warm lease does)
    torch-load-mmap         views of a private (copy-on-write) mmap of the zip's storages
    tensorizer              anonymous memory the deserializer reads into; nn.Parameters are
                            detached into plain tensors (no copy), the deserializer is closed
    runai-model-streamer    slices of the streamer's CPU ring slots; with ``owned=True`` (0.17)
                            a slot is never reused, so no clone; older versions reuse slots and
                            every tensor is cloned
    fastsafetensors         a host buffer filled by pread (nogds); the buffer object stays in
                            the keepalive and is closed by PeerLoad.close()

Every peer handles 0-d and one-element tensors. The peer libraries are optional (the
``bench`` extra) and imported only inside the functions that use them.
"""

from __future__ import annotations

import ctypes
import enum
import importlib
import inspect
import json
import mmap
import os
import struct
import threading
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Protocol, runtime_checkable

import torch

__all__ = [
    "PEERS",
    "REFERENCE_PEERS",
    "Peer",
    "PeerFormat",
    "PeerLoad",
    "load_peer",
    "peer_file_name",
    "peer_named",
    "peer_unavailable_reason",
    "write_peer_files",
]


class PeerFormat(str, enum.Enum):
    """The file format a peer reads; one file per format holds the whole state dict."""

    SAFETENSORS = "safetensors"
    TORCH = "torch"
    TENSORIZER = "tensorizer"


@dataclass(frozen=True, slots=True)
class Peer:
    """One benchmark row: a library API that loads a state dict from a file."""

    name: str
    file_format: PeerFormat
    copies: bool
    requirement: str
    description: str


PEERS: tuple[Peer, ...] = (
    Peer(
        "safetensors-load_file",
        PeerFormat.SAFETENSORS,
        False,
        "safetensors",
        "safetensors.torch.load_file(path) (default backend 'mmap': copy-on-write views of the file)",
    ),
    Peer(
        "safetensors-mmap-views",
        PeerFormat.SAFETENSORS,
        False,
        "torch",
        "mmap.mmap(fd, 0, MAP_SHARED, PROT_READ) + own header parse + torch.frombuffer view per tensor",
    ),
    Peer(
        "torch-load-mmap",
        PeerFormat.TORCH,
        False,
        "torch",
        "torch.load(path, mmap=True, weights_only=True)",
    ),
    Peer(
        "tensorizer",
        PeerFormat.TENSORIZER,
        True,
        "tensorizer",
        "tensorizer.TensorDeserializer(path, device='cpu'), parameters detached into a dict",
    ),
    Peer(
        "runai-model-streamer",
        PeerFormat.SAFETENSORS,
        True,
        "runai_model_streamer",
        "runai_model_streamer.SafetensorsStreamer: stream_file(path, owned=True) then get_tensors()",
    ),
    Peer(
        "fastsafetensors",
        PeerFormat.SAFETENSORS,
        True,
        "fastsafetensors",
        "fastsafetensors.SafeTensorsFileLoader(SingleGroup(), 'cpu', nogds=True): copy_files_to_device(), get_tensor",
    ),
)

REFERENCE_PEERS: tuple[Peer, ...] = (
    Peer(
        "safetensors-mmap-populate",
        PeerFormat.SAFETENSORS,
        False,
        "torch",
        "mmap.mmap(fd, 0, MAP_SHARED | MAP_POPULATE, PROT_READ) + the same views: page tables filled in mmap",
    ),
    Peer(
        "safetensors-mmap-prefault-thread",
        PeerFormat.SAFETENSORS,
        False,
        "torch",
        "the same read-only mapping and views, madvise(MADV_POPULATE_READ) on a thread from the moment it is mapped",
    ),
)
"""The bare mapping with the best honest page-table population: the tmpfs reference rows only (the warm goals'
bound), not rows of their own on disk; `safetensors-mmap-views` is the same mapping faulted page by page."""

_BENCH_REQUIREMENTS = frozenset({"tensorizer", "runai_model_streamer", "fastsafetensors"})
_WRITER_REQUIREMENT = {
    PeerFormat.SAFETENSORS: "safetensors",
    PeerFormat.TORCH: "torch",
    PeerFormat.TENSORIZER: "tensorizer",
}
_FILE_NAMES = {
    PeerFormat.SAFETENSORS: "model.safetensors",
    PeerFormat.TORCH: "model.pt",
    PeerFormat.TENSORIZER: "model.tensors",
}


def peer_named(name: str) -> Peer:
    """The peer with this row name, so command lines can pick peers by name."""
    for peer in (*PEERS, *REFERENCE_PEERS):
        if peer.name == name:
            return peer
    valid = ", ".join(peer.name for peer in (*PEERS, *REFERENCE_PEERS))
    raise ValueError(f"unknown peer {name!r}; valid peers: {valid}")


def _import_failure(requirement: str) -> str | None:
    """None when the module imports; otherwise one line saying why not and how to fix it."""
    try:
        importlib.import_module(requirement)
    except ImportError as exc:
        missing = isinstance(exc, ModuleNotFoundError) and exc.name is not None
        if missing and (exc.name == requirement or requirement.startswith(f"{exc.name}.")):
            if requirement in _BENCH_REQUIREMENTS:
                return f"{requirement} is not installed (pip install 'host-weight-runtime[bench]')"
            return f"{requirement} is not installed"
        return f"{requirement} cannot be imported: {' '.join(str(exc).split())}"
    except OSError as exc:  # a compiled extension whose shared library is missing
        return f"{requirement} cannot be imported: {' '.join(str(exc).split())}"
    return None


def peer_unavailable_reason(peer: Peer) -> str | None:
    """None when the peer's library imports; otherwise a one-line reason, so a benchmark can skip the row."""
    return _import_failure(peer.requirement)


def peer_file_name(file_format: PeerFormat) -> str:
    """The file name each format is written under, one file per format in a benchmark directory."""
    return _FILE_NAMES[file_format]


def _plain_cpu_tensors(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Detached, contiguous CPU tensors that each own exactly their storage, as every writer needs."""
    plain: dict[str, torch.Tensor] = {}
    seen_storages: set[int] = set()
    for name, tensor in state_dict.items():
        cpu = tensor.detach().to("cpu")
        storage = cpu.untyped_storage()
        owns_storage = cpu.storage_offset() == 0 and storage.nbytes() == cpu.nbytes
        shared = storage.data_ptr() in seen_storages and storage.nbytes() > 0
        if not cpu.is_contiguous() or not owns_storage or shared:
            cpu = cpu.clone(memory_format=torch.contiguous_format)
        seen_storages.add(cpu.untyped_storage().data_ptr())
        plain[name] = cpu
    return plain


def _fsync(path: Path, *, directory: bool = False) -> None:
    """Make a written file (or a directory's entries) durable before a cold-cache benchmark reads it."""
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_tensorizer(tensors: dict[str, torch.Tensor], path: Path) -> None:
    from tensorizer import TensorSerializer

    serializer = TensorSerializer(str(path))
    try:
        serializer.write_state_dict(tensors)
    finally:
        serializer.close()


def write_peer_files(
    state_dict: Mapping[str, torch.Tensor],
    directory: Path,
    formats: Iterable[PeerFormat] = tuple(PeerFormat),
) -> dict[PeerFormat, Path]:
    """Write the state dict once per format into an existing directory, fsynced: every peer reads the same tensors."""
    wanted = list(dict.fromkeys(PeerFormat(f) for f in formats))
    for file_format in wanted:
        reason = _import_failure(_WRITER_REQUIREMENT[file_format])
        if reason is not None:
            raise ValueError(f"cannot write the {file_format.value} peer file: {reason}")
    if not directory.is_dir():
        raise NotADirectoryError(f"{directory} is not a directory; create it before writing peer files")
    tensors = _plain_cpu_tensors(state_dict)
    written: dict[PeerFormat, Path] = {}
    for file_format in wanted:
        path = directory / peer_file_name(file_format)
        if file_format is PeerFormat.SAFETENSORS:
            from safetensors.torch import save_file

            save_file(tensors, str(path))
        elif file_format is PeerFormat.TORCH:
            torch.save(tensors, path)
        else:
            _write_tensorizer(tensors, path)
        _fsync(path)
        written[file_format] = path
    _fsync(directory, directory=True)
    return written


@runtime_checkable
class _Closeable(Protocol):
    def close(self) -> None: ...


@dataclass(slots=True)
class PeerLoad:
    """A peer's loaded tensors and whatever must stay alive under them; close() releases both."""

    tensors: dict[str, torch.Tensor]
    keepalive: object | None

    def close(self) -> None:
        """Drop the tensors and release the keepalive; a zero-copy peer's tensors held elsewhere become invalid."""
        keepalive, self.keepalive = self.keepalive, None
        self.tensors = {}
        if isinstance(keepalive, _Closeable):
            keepalive.close()

    def __enter__(self) -> PeerLoad:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()


def _checked_tensor(name: object, value: object, peer: str) -> tuple[str, torch.Tensor]:
    """The untyped peer libraries hand back Any; check what they returned instead of trusting it."""
    if not isinstance(name, str) or not isinstance(value, torch.Tensor):
        raise TypeError(f"{peer} returned {type(name).__name__} -> {type(value).__name__}, not str -> Tensor")
    return name, value


def _load_safetensors_load_file(path: Path) -> PeerLoad:
    from safetensors.torch import load_file

    return PeerLoad(load_file(str(path)), None)


def _safetensors_dtypes() -> dict[str, torch.dtype]:
    """The format's dtype codes this torch build has; the peer reads the format on its own, not through the product."""
    names = {
        "BOOL": "bool",
        "U8": "uint8",
        "I8": "int8",
        "I16": "int16",
        "U16": "uint16",
        "I32": "int32",
        "U32": "uint32",
        "I64": "int64",
        "U64": "uint64",
        "F16": "float16",
        "BF16": "bfloat16",
        "F32": "float32",
        "F64": "float64",
        "C64": "complex64",
        "F8_E4M3": "float8_e4m3fn",
        "F8_E4M3FNUZ": "float8_e4m3fnuz",
        "F8_E5M2": "float8_e5m2",
        "F8_E5M2FNUZ": "float8_e5m2fnuz",
    }
    found = {code: getattr(torch, name, None) for code, name in names.items()}
    return {code: dtype for code, dtype in found.items() if isinstance(dtype, torch.dtype)}


_SAFETENSORS_DTYPES = _safetensors_dtypes()


def _mmap_views(mapped: mmap.mmap, path: Path) -> dict[str, torch.Tensor]:
    """Parse the safetensors header (8-byte little-endian length, then JSON) and view each tensor in place."""
    if len(mapped) < 8:
        raise ValueError(f"{path} is too short to be a safetensors file")
    (header_len,) = struct.unpack("<Q", mapped[:8])
    data_start = 8 + header_len
    if data_start > len(mapped):
        raise ValueError(f"{path}: header length {header_len} runs past the end of the file")
    header = json.loads(mapped[8:data_start])
    if not isinstance(header, dict):
        raise ValueError(f"{path}: the safetensors header is not a JSON object")
    tensors: dict[str, torch.Tensor] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        dtype = _SAFETENSORS_DTYPES.get(entry["dtype"])
        if dtype is None:
            raise ValueError(f"{path}: tensor {name!r} has dtype {entry['dtype']!r}, which this peer does not map")
        shape = [int(d) for d in entry["shape"]]
        begin, end = (int(o) for o in entry["data_offsets"])
        numel = 1
        for dim in shape:
            numel *= dim
        if end - begin != numel * dtype.itemsize or data_start + end > len(mapped):
            raise ValueError(f"{path}: tensor {name!r} has offsets [{begin}, {end}] that do not match its shape")
        if numel == 0:
            tensors[name] = torch.empty(shape, dtype=dtype)
            continue
        offset = data_start + begin
        if offset % dtype.itemsize:
            raise ValueError(f"{path}: tensor {name!r} at byte {offset} is not aligned for {dtype}; cannot view it")
        with warnings.catch_warnings():
            # The mapping is read-only on purpose: a write through these views faults instead of
            # changing the file. torch warns that it cannot mark tensors read-only; that is known.
            warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)
            flat = torch.frombuffer(mapped, dtype=dtype, count=numel, offset=offset)
        tensors[name] = flat.view(shape)
    return tensors


def _load_safetensors_mmap_views(path: Path) -> PeerLoad:
    with path.open("rb") as file:
        mapped = mmap.mmap(file.fileno(), 0, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    try:
        tensors = _mmap_views(mapped, path)
    except BaseException:
        mapped.close()
        raise
    return PeerLoad(tensors, mapped)


def _load_safetensors_mmap_populate(path: Path) -> PeerLoad:
    with path.open("rb") as file:
        mapped = mmap.mmap(file.fileno(), 0, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE, prot=mmap.PROT_READ)
    try:
        tensors = _mmap_views(mapped, path)
    except BaseException:
        mapped.close()
        raise
    return PeerLoad(tensors, mapped)


_MADV_POPULATE_READ = 22  # Linux 5.14+; Python's mmap module has no constant for it before 3.13


class _PrefaultedMapping:
    """A read-only mapping whose page tables a thread fills (GIL released in madvise); close() joins it first."""

    __slots__ = ("error", "mapped", "thread")

    def __init__(self, mapped: mmap.mmap) -> None:
        self.mapped = mapped
        self.error: str | None = None
        # The buffer is read-only, so ctypes cannot take its address; torch's one-byte view gives it without a copy.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)
            address = torch.frombuffer(mapped, dtype=torch.uint8, count=1).data_ptr()
        self.thread = threading.Thread(target=self._populate, args=(address, len(mapped)), daemon=True)
        self.thread.start()

    def _populate(self, address: int, length: int) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        if libc.madvise(address, length, _MADV_POPULATE_READ) != 0:
            self.error = os.strerror(ctypes.get_errno())  # an older kernel: the views fault page by page instead

    def close(self) -> None:
        self.thread.join()
        self.mapped.close()


def _load_safetensors_mmap_prefault_thread(path: Path) -> PeerLoad:
    with path.open("rb") as file:
        mapped = mmap.mmap(file.fileno(), 0, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    if len(mapped) < 8:
        mapped.close()
        raise ValueError(f"{path} is too short to be a safetensors file")
    prefaulted = _PrefaultedMapping(mapped)
    try:
        tensors = _mmap_views(mapped, path)
    except BaseException:
        prefaulted.close()
        raise
    return PeerLoad(tensors, prefaulted)


def _load_torch_mmap(path: Path) -> PeerLoad:
    loaded = torch.load(path, mmap=True, weights_only=True)
    if not isinstance(loaded, dict):
        raise TypeError(f"{path} holds a {type(loaded).__name__}, not a state dict")
    return PeerLoad(dict(_checked_tensor(k, v, "torch.load") for k, v in loaded.items()), None)


def _load_tensorizer(path: Path) -> PeerLoad:
    from tensorizer import TensorDeserializer

    # lazy_load=False (the default) reads every tensor in the constructor; the tensors own their
    # memory, so the deserializer (file handle, reader threads) can be closed before returning.
    deserializer = TensorDeserializer(str(path), device="cpu")
    try:
        tensors = dict(_checked_tensor(k, v, "tensorizer") for k, v in deserializer.items())
    finally:
        deserializer.close()
    # Plain tensors, as from every other peer: the deserializer yields nn.Parameters (requires_grad=True).
    return PeerLoad({name: tensor.detach() for name, tensor in tensors.items()}, None)


def _load_runai(path: Path) -> PeerLoad:
    from runai_model_streamer import SafetensorsStreamer

    tensors: dict[str, torch.Tensor] = {}
    with SafetensorsStreamer() as streamer:
        # From 0.17, owned=True hands each ring slot to the caller and never reuses it; older
        # versions yield views of slots that the next chunk overwrites, so those must be cloned.
        owned = "owned" in inspect.signature(streamer.stream_file).parameters
        if owned:
            streamer.stream_file(str(path), owned=True)
        else:
            streamer.stream_file(str(path))
        for key, value in streamer.get_tensors():
            name, tensor = _checked_tensor(key, value, "runai-model-streamer")
            tensors[name] = tensor if owned else tensor.clone()
    return PeerLoad(tensors, None)


class _FastSafetensorsHandles:
    """The loader and its host buffer: older fastsafetensors tensors are views of that buffer."""

    __slots__ = ("buffer", "loader")

    def __init__(self, loader: object, buffer: object) -> None:
        self.loader = loader
        self.buffer = buffer

    def close(self) -> None:
        try:
            if isinstance(self.buffer, _Closeable):
                self.buffer.close()
        finally:
            if isinstance(self.loader, _Closeable):
                self.loader.close()


def _load_fastsafetensors(path: Path) -> PeerLoad:
    from fastsafetensors import SafeTensorsFileLoader, SingleGroup

    # SingleGroup is fastsafetensors' world-size-1 process group: no torch.distributed needed.
    loader = SafeTensorsFileLoader(SingleGroup(), device="cpu", nogds=True)
    handles = _FastSafetensorsHandles(loader, None)
    try:
        loader.add_filenames({0: [str(path.resolve())]})
        handles.buffer = buffer = loader.copy_files_to_device()
        tensors = dict(_checked_tensor(k, buffer.get_tensor(k), "fastsafetensors") for k in loader.get_keys())
    except BaseException:
        handles.close()
        raise
    return PeerLoad(tensors, handles)


_LOADERS: dict[str, Callable[[Path], PeerLoad]] = {
    "safetensors-load_file": _load_safetensors_load_file,
    "safetensors-mmap-views": _load_safetensors_mmap_views,
    "safetensors-mmap-populate": _load_safetensors_mmap_populate,
    "safetensors-mmap-prefault-thread": _load_safetensors_mmap_prefault_thread,
    "torch-load-mmap": _load_torch_mmap,
    "tensorizer": _load_tensorizer,
    "runai-model-streamer": _load_runai,
    "fastsafetensors": _load_fastsafetensors,
}


def load_peer(peer: Peer, path: Path) -> PeerLoad:
    """Load every tensor of the peer's file with that peer's own API; close() the result when done."""
    known = (*PEERS, *REFERENCE_PEERS)
    if peer not in known:
        raise ValueError(f"{peer.name!r} is not one of PEERS; valid peers: {', '.join(p.name for p in known)}")
    reason = peer_unavailable_reason(peer)
    if reason is not None:
        raise ImportError(reason, name=peer.requirement)
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist; write it with write_peer_files first")
    return _LOADERS[peer.name](path)

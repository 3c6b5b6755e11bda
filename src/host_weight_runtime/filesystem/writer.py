"""The store-scoped streaming safetensors writer: the only way a producer puts bytes into a build.

Each payload file is laid out completely when it is opened: the safetensors header is
written first, the file is preallocated to its final size, and every tensor has a fixed,
aligned place. Producers then fill those places in any order (or in layout order, which
lets the writer hash while writing). A file is accepted only when every byte of every
tensor was written exactly once.

This module holds the artifact-level writer (file names, reservations, the pool, finish
and abort). The parts it is built from, one idea each:

- `_safetensors_layout`: header bytes, tensor offsets and the on-disk format drawing;
- `_tensor_file`: one payload file (preallocation, writes at fixed offsets, close);
- `_written_file`: a closed file's record (the completeness check, its manifest entries, `WrittenFile`);
- `_coverage`: the row bookkeeping that proves every byte was written exactly once;
- `_payload_hashing`: the one place payload bytes are hashed;
- `_write_failures`: how misuse and OS errors are typed.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

from .._digest import DEFAULT_DIGEST_ALGORITHM, DIGEST_CHUNK_BYTES, DigestAlgorithm, default_hash_threads
from .._faults import fault_point
from ..failures import HostWeightError, HostWeightFailure
from ..manifest import validate_file_name
from ..protocols import TensorWriteSpec
from ._safetensors_layout import HEADER_ALIGNMENT, FileLayout, check_specs, plan_layout
from ._tensor_file import StagingTensorFileWriter, create_tensor_file
from ._write_failures import os_failed, producer_failed
from ._written_file import WrittenFile

__all__ = [
    "HEADER_ALIGNMENT",
    "StagingArtifactWriter",
    "StagingTensorFileWriter",
    "WrittenFile",
]

_T = TypeVar("_T")


class StagingArtifactWriter:
    """The `ArtifactWriter` a store hands a producer: one staging directory, typed failures.

    The store owns the directory and its removal; this writer owns the payload files
    inside it, their capacity reservations (via `reserve`) and their digests.
    """

    __slots__ = (
        "_aborted",
        "_bytes_reserved",
        "_chunk_bytes",
        "_digest_algorithm",
        "_failure",
        "_file_names",
        "_files",
        "_finished",
        "_hash_threads",
        "_lock",
        "_pool",
        "_reservation_guard",
        "_reserve",
        "_sparse_files",
        "_staging_dir",
        "_tensor_names",
    )

    def __init__(
        self,
        staging_dir: Path,
        *,
        reserve: Callable[[int], None],
        chunk_bytes: int = DIGEST_CHUNK_BYTES,
        hash_threads: int | None = None,
        digest_algorithm: DigestAlgorithm = DEFAULT_DIGEST_ALGORITHM,
        reservation_guard: Callable[[], contextlib.AbstractContextManager[object]] = contextlib.nullcontext,
        sparse_files: bool = False,
    ) -> None:
        if type(chunk_bytes) is not int or chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be a positive int, got {chunk_bytes!r}")
        if hash_threads is not None and (type(hash_threads) is not int or hash_threads < 1):
            raise ValueError(f"hash_threads must be None or a positive int, got {hash_threads!r}")
        if not isinstance(digest_algorithm, DigestAlgorithm):
            raise ValueError(f"digest_algorithm must be a DigestAlgorithm, got {digest_algorithm!r}")
        self._staging_dir = Path(staging_dir)
        self._reserve = reserve
        self._reservation_guard = reservation_guard
        self._sparse_files = sparse_files
        self._chunk_bytes = chunk_bytes
        self._hash_threads = hash_threads
        self._digest_algorithm = digest_algorithm
        self._lock = threading.Lock()
        self._failure: HostWeightFailure | None = None
        self._bytes_reserved = 0
        self._files: list[StagingTensorFileWriter] = []
        self._file_names: set[str] = set()
        self._tensor_names: set[str] = set()
        self._finished: tuple[WrittenFile, ...] | None = None
        self._aborted = False
        self._pool: ThreadPoolExecutor | None = None

    def _executor(self) -> ThreadPoolExecutor:
        """Threads that write and hash ordered files side by side (hashlib and pwrite release the GIL)."""
        with self._lock:
            if self._pool is None:
                workers = max(2, self._hash_threads or default_hash_threads())
                self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="hwr-write")
            return self._pool

    def _shutdown_pool(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)

    # -- read-only facts

    @property
    def staging_dir(self) -> Path:
        return self._staging_dir

    @property
    def chunk_bytes(self) -> int:
        """The digest chunk size; the manifest must record it as `digest_chunk_bytes`."""
        return self._chunk_bytes

    @property
    def digest_algorithm(self) -> DigestAlgorithm:
        """How payload bytes are digested; the manifest must record it as `digest_algorithm`."""
        return self._digest_algorithm

    def adopt_digest_algorithm(self, algorithm: DigestAlgorithm) -> None:
        """Digest with `algorithm` instead: an import reproduces the digests its source manifest recorded.

        Only before the first payload file is opened, so every file of an artifact uses one algorithm.
        """
        self._guarded(lambda: self._adopt(algorithm))

    def _adopt(self, algorithm: DigestAlgorithm) -> None:
        self._check_open()
        if not isinstance(algorithm, DigestAlgorithm):
            raise producer_failed(f"digest algorithm must be a DigestAlgorithm, got {algorithm!r}")
        with self._lock:
            if self._file_names and algorithm is not self._digest_algorithm:
                raise producer_failed("the digest algorithm can only change before the first payload file is opened")
            self._digest_algorithm = algorithm

    @property
    def hash_threads(self) -> int | None:
        return self._hash_threads

    @property
    def failure(self) -> HostWeightFailure | None:
        """The first failure raised to the producer, even if the producer swallowed or wrapped it."""
        return self._failure

    @property
    def bytes_reserved(self) -> int:
        """Bytes granted by `reserve` so far (a file that later failed to open still counts)."""
        return self._bytes_reserved

    # -- failure plumbing

    def _record(self, value: HostWeightFailure) -> None:
        with self._lock:
            if self._failure is None:
                self._failure = value

    def _guarded(self, action: Callable[[], _T]) -> _T:
        """Run a producer-facing operation so that only HostWeightError escapes, first one recorded."""
        try:
            return action()
        except HostWeightError as exc:
            self._record(exc.failure)
            raise
        except Exception as exc:
            error = producer_failed(
                f"the writer failed unexpectedly: {type(exc).__name__}: {exc}", exception=type(exc).__name__
            )
            self._record(error.failure)
            raise error from exc

    def _check_open(self) -> None:
        if self._aborted:
            raise producer_failed("the artifact writer was aborted; the build is over")
        if self._finished is not None:
            raise producer_failed("the artifact writer is finished; no more writes are accepted")

    # -- the ArtifactWriter protocol

    def open_tensor_file(
        self,
        relative_name: str,
        specs: tuple[TensorWriteSpec, ...],
        *,
        ordered: bool = False,
        caller_hashes: bool = False,
    ) -> StagingTensorFileWriter:
        """Create, preallocate and header-stamp one payload file for exactly `specs`.

        `caller_hashes` (ordered files only): the caller hashes what it writes and closes the
        file with `close_hashed(digests)`, so nothing is read back (a remote import's one pass).
        """
        if caller_hashes and not ordered:
            raise producer_failed("caller_hashes needs an ordered file", file=str(relative_name))
        return self._guarded(lambda: self._open(relative_name, specs, ordered, caller_hashes))

    def _open(
        self, relative_name: str, specs: Iterable[TensorWriteSpec], ordered: bool, caller_hashes: bool = False
    ) -> StagingTensorFileWriter:
        self._check_open()
        try:
            name = validate_file_name(relative_name)
        except ValueError as exc:
            raise producer_failed(f"bad payload file name: {exc}", file=str(relative_name)) from None
        declared = check_specs(name, specs)
        layout = plan_layout(declared)
        tensor_names = {spec.name for spec in declared}
        with self._lock:
            if name in self._file_names:
                raise producer_failed(f"payload file {name} was already opened; each file is written once", file=name)
            clashes = sorted(tensor_names & self._tensor_names)
            if clashes:
                raise producer_failed(
                    f"{name}: tensor {clashes[0]} is already declared in another file; tensor names are unique "
                    "across the artifact",
                    file=name,
                    tensor=clashes[0],
                )
            self._file_names.add(name)
            self._tensor_names |= tensor_names
        try:
            file_writer = self._create(name, layout, ordered, caller_hashes)
        except BaseException:
            with self._lock:
                self._file_names.discard(name)
                self._tensor_names -= tensor_names
            raise
        with self._lock:
            self._files.append(file_writer)
        return file_writer

    def _create(
        self, name: str, layout: FileLayout, ordered: bool, caller_hashes: bool = False
    ) -> StagingTensorFileWriter:
        # The guard (the store's capacity lock) spans the check and the preallocation, so the
        # preallocated file is the reservation the next builder counts.
        with self._reservation_guard():
            self._reserve(layout.size)  # capacity failures propagate unchanged (and are recorded)
            with self._lock:
                self._bytes_reserved += layout.size
            return create_tensor_file(
                self,
                self._staging_dir,
                name,
                layout,
                ordered=ordered,
                caller_hashes=caller_hashes,
                sparse=self._sparse_files,
            )

    def finish(self) -> tuple[WrittenFile, ...]:
        """All files closed, complete and fsynced (and their names durable); returns them in open order."""
        return self._guarded(self._finish)

    def _finish(self) -> tuple[WrittenFile, ...]:
        if self._finished is not None:
            return self._finished
        try:
            if self._aborted:
                raise producer_failed("the artifact writer was aborted; nothing can be published")
            if self._failure is not None:
                raise HostWeightError(self._failure)
            with self._lock:
                files = list(self._files)
            if not files:
                raise producer_failed("the producer wrote no payload file; an artifact needs at least one")
            results: list[WrittenFile] = []
            for file_writer in files:
                if not file_writer.closed:
                    raise producer_failed(
                        f"{file_writer.name} was never closed; the producer must close() every file it opens",
                        file=file_writer.name,
                    )
                if file_writer.result is None:
                    raise producer_failed(f"{file_writer.name} is incomplete", file=file_writer.name)
                results.append(file_writer.result)
            try:
                fault_point("writer.fsync_staging")
                fd = os.open(self._staging_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
            except OSError as exc:
                raise os_failed(exc, "fsyncing the staging directory") from exc
        except BaseException:
            self.abort()
            raise
        self._finished = tuple(results)
        self._shutdown_pool()
        return self._finished

    def abort(self) -> None:
        """Close every open payload descriptor; never raises; the store removes the directory."""
        with self._lock:
            self._aborted = True
            files = list(self._files)
        self._shutdown_pool()
        for file_writer in files:
            with contextlib.suppress(Exception):  # abort must never raise
                file_writer._abandon()

"""FsspecArtifactProvider: exact artifacts from any fsspec URL, streamed into the store's own writer.

`probe` reads a key's DESCRIPTOR.json (absent: None; bad: a typed failure) and checks
that the identity it names is exactly the one asked for and that every object it
promises is present with its exact size. `fetch` reads manifest.json (its SHA-256 must
be the descriptor's), declares each payload file to the writer with the remote layout,
and streams the tensor bytes in bounded ranges into the writer in order, one pass with
no second copy: from an object store several ranges are in flight, each written from the
bytes the backend returned and hashed from them on a hash lane behind the writes; from a
local folder (file://) each file is read piece by piece into a small buffer, written from it
into the staged file and hashed from it while it is still in the cache (`_piece_lane.py`).
Before `fetch` returns, each tensor digest and each file digest must equal the remote
manifest's, so a wrong byte fails the build and nothing is ever published from it.

Memory: at most `max_concurrency` ranges of about `chunk_bytes` are being read and as many
wait for hashing (a writer other than the store's also keeps up to twice that many emptied
buffers for reuse; a single row longer than `chunk_bytes` is read whole).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    pass

import collections
import contextlib
import functools
import hashlib
import os
from collections.abc import Callable, Generator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from .._digest import DEFAULT_DIGEST_ALGORITHM, DigestAlgorithm
from .._faults import fault_point
from ..canonical_json import JsonValue
from ..failures import HostWeightError
from ..filesystem.writer import StagingArtifactWriter, StagingTensorFileWriter
from ..identity import WeightArtifactIdentity
from ..manifest import MANIFEST_FILE_NAME, FileManifestEntry, TensorManifestEntry, WeightManifest
from ..protocols import (
    ArtifactWriter,
    ProductionMetadata,
    RemoteArtifactDescriptor,
    TensorFileWriter,
)
from ..tensors import dtype_from_code, dtype_itemsize
from ._descriptor import DESCRIPTOR_FILE_NAME, MAX_DESCRIPTOR_BYTES, MAX_MANIFEST_BYTES, RemoteDescriptorRecord
from ._location import DEFAULT_TIMEOUT_S, RemoteLocation, remote_failed
from ._piece_lane import PIECE_BYTES, FileHashes, PieceLane, hash_on_a_lane
from ._ranges import HashLanes, RangeBuffers, ReadRange, plan_ranges, spec_of, tensor_from

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "DEFAULT_MAX_CONCURRENCY",
    "FsspecArtifactProvider",
]

DEFAULT_CHUNK_BYTES = 32 << 20
DEFAULT_MAX_CONCURRENCY = 4


class FsspecArtifactProvider:
    """A `RemoteArtifactProvider` over one fsspec URL (s3://, gs://, file://, http(s):// read-only).

    Credentials come from the backend's own conventions (AWS_* variables, profiles) or
    `storage_options`; neither the options nor anything secret ever reaches a message,
    a failure's details or the descriptor. `timeout_s` bounds each network request (one
    metadata call or one ranged read of about `chunk_bytes`) on asynchronous backends.
    """

    __slots__ = ("_chunk_bytes", "_concurrency", "_location", "_provider_id", "_root_seen")

    def __init__(
        self,
        url: str,
        *,
        storage_options: Mapping[str, Any] | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        provider_id: str | None = None,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        max_concurrency: int = DEFAULT_MAX_CONCURRENCY,
    ) -> None:
        if type(chunk_bytes) is not int or chunk_bytes < 4096:
            raise ValueError(f"chunk_bytes must be an int of at least 4096, got {chunk_bytes!r}")
        if type(max_concurrency) is not int or max_concurrency < 1:
            raise ValueError(f"max_concurrency must be a positive int, got {max_concurrency!r}")
        if provider_id is not None and (type(provider_id) is not str or not provider_id):
            raise ValueError("provider_id must be a non-empty string or None")
        self._location = RemoteLocation(url, storage_options=storage_options, timeout_s=timeout_s)
        self._provider_id = provider_id or self._location.name
        self._chunk_bytes = chunk_bytes
        self._concurrency = max_concurrency
        self._root_seen = False

    @property
    def provider_id(self) -> str:
        """A secret-free name: the URL without user info or query, unless given explicitly."""
        return self._provider_id

    @property
    def location(self) -> RemoteLocation:
        return self._location

    def __repr__(self) -> str:
        return f"FsspecArtifactProvider({self._provider_id!r})"

    # -- probe

    def probe(self, identity: WeightArtifactIdentity) -> RemoteArtifactDescriptor | None:
        """The descriptor of `identity`'s artifact, None when the remote has none; raise typed when it is bad."""
        key = identity.key
        read = self.read_descriptor(key)
        if read is None:
            self._require_root()
            return None
        record, listing = read
        if record.identity != identity or record.identity.to_dict() != identity.to_dict():
            raise self._content_failure(
                key,
                "its descriptor names another identity than the one requested; the remote folder was written for a "
                "different artifact: remove it and push again",
            )
        self.check_objects(key, record, listing)
        return RemoteArtifactDescriptor(
            provider_id=self._provider_id,
            identity=identity,
            manifest_sha256=record.manifest_sha256,
            content_sha256=record.content_sha256,
        )

    def read_descriptor(self, key: str) -> tuple[RemoteDescriptorRecord, dict[str, int] | None] | None:
        """The parsed descriptor of `key` and, on listable backends, the folder's objects with sizes."""
        listing: dict[str, int] | None = None
        if self._location.listable:
            objects = self._location.list_folder(key)
            if objects is None:
                return None
            listing = {item.name: (-2 if item.is_dir else item.size) for item in objects}
            size = listing.get(DESCRIPTOR_FILE_NAME)
        else:
            size = self._location.size_of(f"{key}/{DESCRIPTOR_FILE_NAME}")
        if size is None:
            return None  # no descriptor: nothing uploaded, or an upload still running or dead
        if not 0 < size <= MAX_DESCRIPTOR_BYTES:
            raise self._content_failure(
                key, f"its descriptor is {size} bytes; a descriptor holds 1..{MAX_DESCRIPTOR_BYTES} bytes"
            )
        data = self._location.read(f"{key}/{DESCRIPTOR_FILE_NAME}")
        if len(data) != size:
            raise remote_failed(
                f"the descriptor of {key[:16]}... at {self._provider_id} changed size while it was read; retry",
                retryable=True,
                provider_id=self._provider_id,
                key=key,
            )
        try:
            record = RemoteDescriptorRecord.from_bytes(data)
        except (ValueError, KeyError, TypeError) as exc:
            raise self._content_failure(key, f"its descriptor is invalid: {exc}") from None
        if record.identity_key != key:
            raise self._content_failure(key, "its descriptor belongs to another key (identity_key differs)")
        return record, listing

    def _require_root(self) -> None:
        """On a miss, make sure the remote itself exists: a mistyped URL must not look like an empty remote."""
        if not self._root_seen:
            self._location.check_target(for_write=False)
            self._root_seen = True

    def check_objects(self, key: str, record: RemoteDescriptorRecord, listing: dict[str, int] | None) -> None:
        """Raise typed unless every promised object is there with its exact size (and, if listable, nothing else)."""
        expected = record.expected_objects()
        if listing is not None:
            found = {name: size for name, size in listing.items() if name != DESCRIPTOR_FILE_NAME}
            extra = sorted(set(found) - set(expected))
            if extra:
                raise self._content_failure(
                    key,
                    f"its folder holds {len(extra)} object(s) the descriptor does not list (first: {extra[0]}); "
                    "remove the folder and push again",
                    extra=list(extra[:16]),
                )
        else:
            found = {}
            for name in expected:
                size = self._location.size_of(f"{key}/{name}")
                if size is not None:
                    found[name] = size
        missing = sorted(set(expected) - set(found))
        if missing:
            raise self._content_failure(
                key,
                f"{len(missing)} object(s) the descriptor lists are missing (first: {missing[0]}): the upload is "
                "incomplete or was partly deleted; push the artifact again",
                missing=list(missing[:16]),
            )
        for name, size in sorted(expected.items()):
            if found[name] != size:
                raise self._content_failure(
                    key,
                    f"{name} is {found[name]} bytes but the descriptor says {size} (truncated or replaced); "
                    "push the artifact again",
                    object=name,
                    size=found[name],
                    expected_size=size,
                )

    # -- fetch

    def fetch(self, descriptor: RemoteArtifactDescriptor, writer: ArtifactWriter) -> ProductionMetadata:
        """Stream the artifact into `writer`; raise typed REMOTE_FAILED unless every byte matches the manifest."""
        key = descriptor.identity.key
        fault_point("remote.fetch.start")
        read = self.read_descriptor(key)
        if read is None:
            raise remote_failed(
                f"the descriptor of {key[:16]}... disappeared from {self._provider_id} after the probe; retry",
                retryable=True,
                provider_id=self._provider_id,
                key=key,
            )
        record, listing = read
        if (record.manifest_sha256, record.content_sha256) != (descriptor.manifest_sha256, descriptor.content_sha256):
            raise remote_failed(
                f"the artifact {key[:16]}... at {self._provider_id} was replaced after the probe; retry",
                retryable=True,
                provider_id=self._provider_id,
                key=key,
            )
        self.check_objects(key, record, listing)
        manifest = self._read_manifest(key, record, descriptor)
        writer_chunk = getattr(writer, "chunk_bytes", None)
        if type(writer_chunk) is int and writer_chunk != manifest.digest_chunk_bytes:
            raise self._content_failure(
                key,
                f"it was hashed in {manifest.digest_chunk_bytes}-byte chunks but this store hashes in "
                f"{writer_chunk}-byte chunks, so its digests cannot be reproduced here",
            )
        algorithm = DigestAlgorithm.from_name(manifest.digest_algorithm)
        adopt = getattr(writer, "adopt_digest_algorithm", None)
        if callable(adopt):
            adopt(algorithm)
        elif algorithm is not DEFAULT_DIGEST_ALGORITHM:
            raise self._content_failure(
                key, f"it was digested with {algorithm.value} and this store's writer cannot reproduce that"
            )
        by_file = self._layout_by_file(key, manifest)
        if isinstance(writer, StagingArtifactWriter) and self._location.local:
            self._copy_files(key, manifest, by_file, writer, algorithm)
        else:
            self._fetch_files(key, manifest, by_file, writer, algorithm)
        return ProductionMetadata(
            producer_schema=manifest.producer_schema,
            restorer_schema=manifest.restorer_schema,
            format_metadata=manifest.format_metadata,
        )

    def _fetch_files(
        self,
        key: str,
        manifest: WeightManifest,
        by_file: dict[str, tuple[TensorManifestEntry, ...]],
        writer: ArtifactWriter,
        algorithm: DigestAlgorithm,
    ) -> None:
        """Ranged reads, several in flight, each written and hashed behind the writes."""
        with (
            ThreadPoolExecutor(max_workers=self._concurrency, thread_name_prefix="hwr-remote") as pool,
            HashLanes(
                manifest.digest_chunk_bytes,
                algorithm,
                pending=self._concurrency,
                buffers=RangeBuffers(self._chunk_bytes, keep=2 * self._concurrency + 2),
            ) as lanes,
        ):
            for file in manifest.files:
                self._fetch_file(key, file, by_file[file.name], writer, pool=pool, lanes=lanes)

    def _copy_files(
        self,
        key: str,
        manifest: WeightManifest,
        by_file: dict[str, tuple[TensorManifestEntry, ...]],
        writer: StagingArtifactWriter,
        algorithm: DigestAlgorithm,
    ) -> None:
        """A local source: each file's data section copied piece by piece, each piece hashed as stored (read into a
        reused buffer, written and hashed from it; or, with a hash thread, copied in the kernel and read back by
        that thread: `_piece_lane.py`); the source is opened once per file. A file is closed and compared once
        the next file's bytes are stored (a hash lane may still be hashing its last pieces meanwhile)."""
        lane = PieceLane(min(self._chunk_bytes, PIECE_BYTES), threaded=hash_on_a_lane())
        previous: Callable[[], None] | None = None
        try:
            for file in manifest.files:
                tensors = by_file[file.name]
                opened = writer.open_tensor_file(
                    file.name, tuple(map(spec_of, tensors)), ordered=True, caller_hashes=True
                )
                sizes = [tensor.data_offsets[1] - tensor.data_offsets[0] for tensor in tensors]
                hashes = FileHashes(sizes, manifest.digest_chunk_bytes, algorithm)
                lane.open_file(hashes, reader=opened.reader() if lane.threaded else -1)
                relative = f"{key}/{file.name}"
                wanted = file.size - file.header_size
                if wanted:
                    fault_point("remote.fetch.chunk")  # the first piece's: the source is opened for it
                    source_fd = self._location.open_local(relative)
                    assert source_fd is not None
                    try:
                        if lane.threaded:
                            stored = opened.send_data(source_fd, file.header_size, wanted, lane)
                        else:
                            stored = opened.read_data(source_fd, file.header_size, wanted, lane)
                    finally:
                        os.close(source_fd)
                    if stored != wanted:
                        raise self._short_read(relative, ReadRange(file.header_size, file.size, ()), stored)
                lane.end_file()
                if previous is not None:
                    previous()

                def finish(
                    file: FileManifestEntry = file,
                    opened: StagingTensorFileWriter = opened,
                    tensors: tuple[TensorManifestEntry, ...] = tensors,
                    hashes: FileHashes = hashes,
                ) -> None:
                    opened.close_hashed(lane.finish(hashes), expected=tensors)
                    self._compare_written(key, file, tensors, opened)

                previous = finish
            if previous is not None:
                previous()
        finally:
            lane.close()

    def _read_manifest(
        self, key: str, record: RemoteDescriptorRecord, descriptor: RemoteArtifactDescriptor
    ) -> WeightManifest:
        data = self._location.read(f"{key}/{MANIFEST_FILE_NAME}")
        if len(data) != record.manifest_size or len(data) > MAX_MANIFEST_BYTES:
            raise self._content_failure(
                key, f"manifest.json is {len(data)} bytes but the descriptor says {record.manifest_size}"
            )
        if hashlib.sha256(data).hexdigest() != descriptor.manifest_sha256:
            raise self._content_failure(
                key, "manifest.json does not hash to the descriptor's manifest_sha256 (corrupt or replaced)"
            )
        try:
            manifest = WeightManifest.from_bytes(data)
        except (ValueError, KeyError, TypeError) as exc:
            raise self._content_failure(key, f"its manifest is invalid: {exc}") from None
        if manifest.identity != descriptor.identity:
            raise self._content_failure(key, "its manifest is for another identity than the one requested")
        if manifest.content_digest != descriptor.content_sha256:
            raise self._content_failure(key, "its manifest's content digest differs from the descriptor's")
        try:
            DigestAlgorithm.from_name(manifest.digest_algorithm)
        except ValueError as exc:
            raise self._content_failure(key, f"its manifest cannot be verified here: {exc}") from None
        promised = tuple((item.name, item.size) for item in record.files)
        if tuple((entry.name, entry.size) for entry in manifest.files) != promised:
            raise self._content_failure(key, "the manifest's files and sizes differ from the descriptor's")
        return manifest

    def _layout_by_file(self, key: str, manifest: WeightManifest) -> dict[str, tuple[TensorManifestEntry, ...]]:
        """Each file's tensors in offset order, refused unless this store's writer would lay them out the same."""
        by_file: dict[str, list[TensorManifestEntry]] = {entry.name: [] for entry in manifest.files}
        for tensor in manifest.tensors:
            by_file[tensor.file].append(tensor)
        result: dict[str, tuple[TensorManifestEntry, ...]] = {}
        order: list[str] = []
        for entry in manifest.files:
            tensors = tuple(sorted(by_file[entry.name], key=lambda t: (t.data_offsets[0], t.data_offsets[1])))
            position = 0
            previous_itemsize: int | None = None
            for tensor in tensors:
                itemsize = dtype_itemsize(dtype_from_code(tensor.dtype))
                shrinking = previous_itemsize is None or itemsize <= previous_itemsize
                if tensor.data_offsets[0] != position or not shrinking:
                    raise self._content_failure(
                        key,
                        f"{entry.name} is not laid out as this store writes files (tensor {tensor.name}); it was "
                        "not produced by host-weight-runtime",
                    )
                position = tensor.data_offsets[1]
                previous_itemsize = itemsize
            if entry.header_size + position != entry.size or entry.tensors != tuple(t.name for t in tensors):
                raise self._content_failure(key, f"{entry.name}: its manifest entry does not match its tensors")
            order.extend(t.name for t in tensors)
            result[entry.name] = tensors
        if order != [tensor.name for tensor in manifest.tensors]:
            raise self._content_failure(key, "its manifest lists tensors out of file and offset order")
        return result

    def _fetch_file(
        self,
        key: str,
        file: FileManifestEntry,
        tensors: tuple[TensorManifestEntry, ...],
        writer: ArtifactWriter,
        *,
        pool: ThreadPoolExecutor,
        lanes: HashLanes,
    ) -> None:
        """Import one payload file by ranged reads."""
        specs = tuple(spec_of(entry) for entry in tensors)
        relative = f"{key}/{file.name}"
        plan = plan_ranges(file, tensors, self._chunk_bytes)
        staging = isinstance(writer, StagingArtifactWriter)
        read = self._read_bytes if staging else functools.partial(self._read_range, buffers=lanes.buffers)
        ranges = self._stream(relative, plan, pool, read)
        with contextlib.closing(ranges):  # no read outlives a failed write
            next(ranges)  # the first reads start now, while the writer preallocates the file
            if isinstance(writer, StagingArtifactWriter):
                file_writer: TensorFileWriter = writer.open_tensor_file(
                    file.name, specs, ordered=True, caller_hashes=True
                )
            else:
                file_writer = writer.open_tensor_file(file.name, specs, ordered=True)
            reports_digests = isinstance(file_writer, StagingTensorFileWriter) and not staging
            hashers = None if reports_digests else lanes.open_file(tensors)
            for item in ranges:
                assert item is not None
                window_range, data = item
                fault_point("remote.fetch.chunk")
                if staging:  # the bytes as read, written and hashed with no copy of our own
                    assert isinstance(file_writer, StagingTensorFileWriter) and hashers is not None
                    file_writer.write_data(data)
                    lanes.hash_stored(hashers, memoryview(data), window_range.writes)
                    continue
                assert isinstance(data, bytearray)
                for write in window_range.writes:
                    tensor = tensor_from(data, write)
                    if write.start_row is None:
                        file_writer.write_tensor(write.spec.name, tensor)
                    else:
                        file_writer.write_rows(write.spec.name, write.start_row, tensor)
                if hashers is not None:
                    lanes.hash_behind(hashers, data, window_range.writes)  # then the buffer goes back to the pool
                else:
                    lanes.buffers.give(data)
        if hashers is None:
            file_writer.close()
            self._compare_written(key, file, tensors, file_writer)
            return
        lanes.drain()
        digests = tuple(hashers[tensor.name].hexdigest() for tensor in tensors)
        if staging:
            assert isinstance(file_writer, StagingTensorFileWriter)
            file_writer.close_hashed(digests)
            self._compare_written(key, file, tensors, file_writer)
        else:
            file_writer.close()
            self._compare_hashed(key, file, tensors, digests)

    def _short_read(self, relative: str, item: ReadRange, count: int) -> HostWeightError:
        return remote_failed(
            f"{relative} at {self._provider_id} returned {count} bytes for a read of "
            f"{item.end - item.start} at offset {item.start}: the object is truncated or the server "
            "ignores ranges",
            retryable=False,
            provider_id=self._provider_id,
            object=relative,
            offset=item.start,
        )

    def _read_bytes(self, relative: str, item: ReadRange) -> tuple[bytes, int]:
        """One ranged read, kept as the backend returned it (written and hashed from it, never copied)."""
        data = self._location.read(relative, item.start, item.end)
        return data, len(data)

    def _read_range(self, relative: str, item: ReadRange, buffers: RangeBuffers) -> tuple[bytearray, int]:
        """One ranged read into a (reused) writable buffer, on a reading thread (tensors view it)."""
        buffer = buffers.take(item.end - item.start)
        return buffer, self._location.read_into(relative, item.start, item.end, buffer)

    def _stream(
        self,
        relative: str,
        ranges: list[ReadRange],
        pool: ThreadPoolExecutor,
        read: Callable[[str, ReadRange], tuple[bytes | bytearray, int]],
    ) -> Generator[tuple[ReadRange, bytes | bytearray] | None, None, None]:
        """Yield None once the first reads are submitted, then each range's bytes in order, keeping up to
        `max_concurrency` reads in flight."""
        window: collections.deque[tuple[ReadRange, Future[tuple[bytes | bytearray, int]]]] = collections.deque()
        upcoming = iter(ranges)
        try:
            for item in upcoming:
                window.append((item, pool.submit(read, relative, item)))
                if len(window) >= self._concurrency:
                    break
            yield None
            while window:
                item, future = window.popleft()
                data, count = future.result()
                if count != item.end - item.start:
                    raise self._short_read(relative, item, count)
                following = next(upcoming, None)
                if following is not None:
                    window.append((following, pool.submit(read, relative, following)))
                yield item, data
        finally:
            for _, future in window:
                future.cancel()
            for _, future in window:
                if not future.cancelled():
                    future.exception()  # wait, so no read outlives the fetch

    def _compare_written(
        self,
        key: str,
        file: FileManifestEntry,
        tensors: tuple[TensorManifestEntry, ...],
        file_writer: TensorFileWriter,
    ) -> None:
        assert isinstance(file_writer, StagingTensorFileWriter)
        written = file_writer.result
        if written is None:  # pragma: no cover - close() raised otherwise
            raise self._content_failure(key, f"{file.name} was not completed by the writer")
        local = {entry.name: entry.digest for entry in written.tensors}
        for tensor in tensors:
            if local.get(tensor.name) != tensor.digest:
                raise self._content_failure(
                    key,
                    f"tensor {tensor.name} in {file.name} hashes differently from the remote manifest: the object "
                    "is corrupt or was tampered with; push the artifact again from a verified node",
                    object=file.name,
                    tensor=tensor.name,
                )
        if (written.size, written.header_size, written.digest) != (file.size, file.header_size, file.digest):
            raise self._content_failure(
                key,
                f"{file.name}: its header differs from what this store writes for the same tensors",
                object=file.name,
            )

    def _compare_hashed(
        self,
        key: str,
        file: FileManifestEntry,
        tensors: tuple[TensorManifestEntry, ...],
        digests: tuple[str, ...],
    ) -> None:
        """For a writer that reports no digests: compare the digests computed on the way in."""
        for tensor, digest in zip(tensors, digests, strict=True):
            if digest != tensor.digest:
                raise self._content_failure(
                    key,
                    f"tensor {tensor.name} in {file.name} hashes differently from the remote manifest: the object "
                    "is corrupt or was tampered with; push the artifact again from a verified node",
                    object=file.name,
                    tensor=tensor.name,
                )

    def _content_failure(self, key: str, problem: str, **details: JsonValue) -> HostWeightError:
        """A bad artifact on the remote: not retryable, a retry reads the same bytes."""
        return remote_failed(
            f"the remote artifact {key[:16]}... at {self._provider_id} cannot be imported: {problem}",
            retryable=False,
            provider_id=self._provider_id,
            key=key,
            **details,
        )

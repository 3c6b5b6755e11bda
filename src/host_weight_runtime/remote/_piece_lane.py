"""A `file://` import's hashing: each piece the writer stored is hashed, in order, on the copying thread between
pieces or (with cores to spare) on one thread behind the next piece's copy.

On the copying thread a piece is read into a small buffer, written from it and hashed from it while it is still
in the core's cache: 0.21 s of CPU per 321 MiB here, against 0.34 s for a kernel copy plus hashing the stored
pages through a mapping (which faults them in). With a hash thread, the copying thread copies each piece in the
kernel (`sendfile`, as a plain copy does) and the hash thread reads it back from the stored file into its own
buffer: the copying thread's share is then a plain copy's, so the copy ends sooner (node B's prewarm of 321 MiB
1.30-1.34x a plain copy against 1.42-1.55x with buffers handed to the hash thread), for about 45 ms more CPU
per 321 MiB (the read-back) on the core that would otherwise idle.
Either way what is hashed is what was stored. A file's tensors are contiguous in offset order, so its hash state
is its tensors' tree hashers and where the next byte goes; no per-range plan is built.
"""

from __future__ import annotations

import errno
import os
import queue
import threading
from collections.abc import Sequence

from .._digest import DigestAlgorithm, TreeHasher
from .._faults import fault_point
from ..failures import HostWeightError, ResolutionStage
from ..filesystem import failure_from_os_error

__all__ = ["PIECE_BYTES", "FileHashes", "PieceLane", "hash_on_a_lane", "lane_pays"]

PIECE_BYTES = 1 << 20
"""A piece: small enough to stay in a core's cache between its read, its write and its hash."""
_SLOTS = 4


def hash_on_a_lane() -> bool:
    """Whether the pieces are hashed on a thread of their own (else on the copying thread, between pieces)."""
    try:
        load = os.getloadavg()[0]
    except OSError:  # no load average to read: count the cores only
        load = float("inf")
    return lane_pays(len(os.sched_getaffinity(0)), load)


def lane_pays(cores: int, load: float) -> bool:
    """A hash thread only pays where a core is free for it: with three cores or more, or with two while the
    node's load (this process's own share included) leaves one idle. On two busy cores its hand-offs cost more
    than the overlap gains (measured, loaded: 2.62x a plain copy against 1.64x hashing between pieces)."""
    return cores >= 3 or (cores == 2 and load < 1.5)


class FileHashes:
    """One payload file's tensor hashers (`sizes`: each tensor's bytes, in offset order), fed its data section in
    order, piece after piece."""

    __slots__ = ("_hashers", "_index", "_left", "_sizes", "done")

    def __init__(self, sizes: Sequence[int], chunk_bytes: int, algorithm: DigestAlgorithm) -> None:
        self._hashers = [TreeHasher(chunk_bytes, algorithm) for _ in sizes]
        self._sizes = list(sizes)
        self._index = 0
        self._left = self._sizes[0] if sizes else 0
        self.done = threading.Event()

    def feed(self, view: memoryview) -> None:
        position, count = 0, len(view)
        while position < count:
            while not self._left:  # empty tensors take no bytes
                self._index += 1
                self._left = self._sizes[self._index]
            take = min(self._left, count - position)
            self._hashers[self._index].update(view[position : position + take])
            position += take
            self._left -= take

    def digests(self) -> tuple[str, ...]:
        return tuple(hasher.hexdigest() for hasher in self._hashers)


_Stored = tuple[FileHashes, memoryview, int]
"""A piece in a lent buffer: the hashes it feeds, the buffer, its byte count (-1: the file's end)."""
_Sent = tuple[FileHashes, int, int, int]
"""A piece copied in the kernel: the hashes it feeds, a reader of the stored file, its file offset and bytes."""


class PieceLane:
    """What hashes a file's stored pieces, in order: the copying thread itself (`threaded=False`) or one hash
    thread behind it. A piece comes either in a buffer the lane lent (`take`, then `stored`: the writer's
    `DataPieces`), or as a range of the stored file that the lane reads back (`next_piece`, then `sent`: the
    writer's `SentPieces`, for a file opened with the reader its writer gave).

    On the thread a failed hash is kept and raised by the next `take`, `next_piece` or `finish`, and the thread
    keeps handing buffers back, so nothing waits on it forever. `close` stops it (the first stored piece starts
    it) and closes the readers.
    """

    def __init__(self, piece_bytes: int, *, threaded: bool) -> None:
        self._threaded = threaded
        self._piece_bytes = piece_bytes
        self._slots = _SLOTS if threaded else 1
        self._made = 0  # buffers lent so far: made on demand, so a lane that only reads back makes one
        self._free: queue.SimpleQueue[memoryview] = queue.SimpleQueue()
        self._work: queue.SimpleQueue[_Stored | _Sent | None] = queue.SimpleQueue()
        self._back: memoryview | None = None  # what stored pieces are read back into
        self._file: FileHashes | None = None
        self._reader = -1
        self._readers: list[int] = []
        self._first = False
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    @property
    def threaded(self) -> bool:
        return self._threaded

    def open_file(self, hashes: FileHashes, *, reader: int = -1) -> None:
        """The pieces stored from now on belong to `hashes` (until the next `open_file`); `reader`, a descriptor
        of the stored file that `sent` pieces are read back from, is the lane's to close. The caller passed the
        seam of its first piece (`remote.fetch.chunk`) before it opened the source."""
        if reader >= 0:
            self._readers.append(reader)
        self._file = hashes
        self._reader = reader
        self._first = True

    def take(self) -> memoryview:
        self._next()
        if self._made < self._slots and self._free.empty():
            self._made += 1
            return memoryview(bytearray(self._piece_bytes))
        return self._free.get()

    def next_piece(self) -> int:
        """The bytes of the next piece to copy in the kernel (raises what a hash raised)."""
        self._next()
        return self._piece_bytes

    def stored(self, buffer: memoryview, count: int) -> None:
        assert self._file is not None, "open_file first"
        if not self._threaded:
            try:
                if count:
                    self._file.feed(buffer[:count])
            finally:
                self._free.put(buffer)
            return
        self._hand_over((self._file, buffer, count))

    def sent(self, file_offset: int, count: int) -> None:
        """The stored file holds `count` more bytes at `file_offset`: read them back and hash them."""
        assert self._file is not None and self._reader >= 0, "open_file with a reader first"
        if not self._threaded:
            self._read_back(self._file, self._reader, file_offset, count)
            return
        self._hand_over((self._file, self._reader, file_offset, count))

    def end_file(self) -> None:
        """Mark the current file's last piece: its `done` is set once every piece before was hashed."""
        assert self._file is not None
        if self._thread is None:  # a file with no data bytes
            self._file.done.set()
        else:
            self._work.put((self._file, memoryview(b""), -1))
        self._file = None
        self._reader = -1

    def finish(self, hashes: FileHashes) -> tuple[str, ...]:
        """Wait for the file's last hash; its tensor digests in layout order (raises what a hash raised)."""
        hashes.done.wait()
        self._raise_failure()
        return hashes.digests()

    def close(self) -> None:
        if self._thread is not None:
            self._work.put(None)
            self._thread.join()
            self._thread = None
        readers, self._readers = self._readers, []
        for reader in readers:
            os.close(reader)

    def _next(self) -> None:
        if not self._first:
            fault_point("remote.fetch.chunk")
        self._first = False
        self._raise_failure()

    def _hand_over(self, item: _Stored | _Sent) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="hwr-remote-hash", daemon=True)
            self._thread.start()
        self._work.put(item)

    def _read_back(self, hashes: FileHashes, reader: int, offset: int, count: int) -> None:
        if self._back is None:
            self._back = memoryview(bytearray(self._piece_bytes))
        end = offset + count
        while offset < end:
            try:
                fault_point("remote.read_back")
                got = os.preadv(reader, [self._back[: min(len(self._back), end - offset)]], offset)
                if not got:
                    raise OSError(errno.EIO, f"the stored file ends at byte {offset}, before the {end - offset} stored")
            except OSError as exc:  # typed here: the copying thread raises it from its next piece or from finish
                what = f"reading back the stored bytes at offset {offset}"
                raise HostWeightError(failure_from_os_error(exc, stage=ResolutionStage.PRODUCTION, what=what)) from exc
            hashes.feed(self._back[:got])
            offset += got

    def _raise_failure(self) -> None:
        if self._error is not None:
            raise self._error

    def _run(self) -> None:
        while (item := self._work.get()) is not None:
            if len(item) == 4:
                hashes, reader, offset, count = item
                try:
                    if self._error is None:
                        self._read_back(hashes, reader, offset, count)
                except BaseException as exc:  # kept for the copying thread, which raises it
                    self._error = exc
                continue
            hashes, buffer, count = item
            if count < 0:
                hashes.done.set()
                continue
            try:
                if self._error is None and count:
                    hashes.feed(buffer[:count])
            except BaseException as exc:  # kept for the copying thread, which raises it
                self._error = exc
            finally:
                self._free.put(buffer)

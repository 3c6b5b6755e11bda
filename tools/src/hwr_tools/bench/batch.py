"""Fresh worker processes for benchmark runs: started together, imported before any is told to go.

By default each worker is a new interpreter (`python -m ...worker`). With `preimported=True` it is
forked from a server that imported torch and our library once (tools/preimported.py): still a separate
process, reached over the same pipes, that loads its weights only when told to go; what differs is
that its interpreter pages are shared with the server, so only the weights' PSS stays comparable.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import subprocess
import time
from collections.abc import Sequence
from multiprocessing import reduction
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import IO, Any

from ..preimported import preimported_context
from .measure import RowSpec
from .worker import preimported_worker, worker_arguments, worker_command, worker_environment

__all__ = ["WorkerBatch", "evict_from_page_cache"]


def evict_from_page_cache(paths: Sequence[Path]) -> None:
    """Drop the clean page-cache pages of these files (POSIX_FADV_DONTNEED), so the next read comes from disk."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


class WorkerBatch:
    """Fresh worker processes, one per run, started together and all imported before any is told to go."""

    def __init__(
        self, specs: Sequence[RowSpec], *, hold: bool, log: IO[bytes], timeout_s: float, preimported: bool = False
    ) -> None:
        self._deadline = time.monotonic() + timeout_s
        self._processes: list[subprocess.Popen[bytes] | _ForkedWorker] = []
        self._buffers: list[bytes] = []
        try:
            for spec in specs:
                if preimported:
                    self._processes.append(_ForkedWorker(spec, hold=hold, log=log))
                else:
                    self._processes.append(
                        subprocess.Popen(
                            worker_command(spec, hold=hold),
                            stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE,
                            stderr=log,
                            env=worker_environment(spec),
                        )
                    )
                self._buffers.append(b"")
            for index in range(len(self._processes)):
                self._message(index)
        except BaseException:
            self.close()
            raise

    def _message(self, index: int) -> dict[str, Any]:
        """The next JSON line from worker `index`, within the batch's deadline."""
        process = self._processes[index]
        assert process.stdout is not None
        fd = process.stdout.fileno()
        while b"\n" not in self._buffers[index]:
            remaining = self._deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"benchmark worker {process.pid} did not answer before the deadline")
            readable, _, _ = select.select([fd], [], [], remaining)
            if readable:
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    raise RuntimeError(f"benchmark worker {process.pid} exited (status {process.wait()}); see its log")
                self._buffers[index] += chunk
        line, _, self._buffers[index] = self._buffers[index].partition(b"\n")
        message: dict[str, Any] = json.loads(line)
        if "error" in message:
            raise RuntimeError(f"benchmark run failed:\n{message['error']}")
        return message

    def _send(self, index: int, word: str) -> None:
        stdin = self._processes[index].stdin
        assert stdin is not None
        stdin.write(word.encode() + b"\n")
        stdin.flush()

    def go(self, indices: Sequence[int]) -> tuple[list[dict[str, Any]], float]:
        """Start these workers together; return their rows and the wall time until the last was ready."""
        started = time.perf_counter()
        for index in indices:
            self._send(index, "go")
        rows = [self._message(index)["row"] for index in indices]
        return rows, (time.perf_counter() - started) * 1000.0

    def pid(self, index: int) -> int:
        return self._processes[index].pid

    def release(self, indices: Sequence[int]) -> None:
        for index in indices:
            self._send(index, "release")

    def finish(self, indices: Sequence[int]) -> None:
        """Wait until these workers have exited, so their teardown (unmapping, freeing) never overlaps a run."""
        for index in indices:
            process = self._processes[index]
            if process.stdin is not None and not process.stdin.closed:
                with contextlib.suppress(BrokenPipeError):
                    process.stdin.close()
            try:
                process.wait(timeout=max(1.0, self._deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            if process.stdout is not None:
                process.stdout.close()

    def close(self) -> None:
        """Wait for every worker to exit (killing any that outlive the deadline)."""
        self.finish(range(len(self._processes)))


class _PassedFd:
    """A file descriptor a fork-server child receives while it starts (pickled as a duplicate for it)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple[Any, tuple[Any]]:
        return _received_fd, (reduction.DupFd(self.fd),)


def _received_fd(duplicate: Any) -> int:
    fd: int = duplicate.detach()
    return fd


class _ForkedWorker:
    """A worker forked from the preimported server, with the stdin, stdout, wait and kill that the batch uses."""

    def __init__(self, spec: RowSpec, *, hold: bool, log: IO[bytes]) -> None:
        stdin_read, stdin_write = os.pipe()
        stdout_read, stdout_write = os.pipe()
        try:
            fds = (_PassedFd(stdin_read), _PassedFd(stdout_write), _PassedFd(log.fileno()))
            arguments = (worker_arguments(spec, hold=hold), worker_environment(spec), *fds)
            self._process: BaseProcess = preimported_context().Process(target=preimported_worker, args=arguments)
            self._process.start()
        except BaseException:
            for fd in (stdin_read, stdin_write, stdout_read, stdout_write):
                os.close(fd)
            raise
        os.close(stdin_read)
        os.close(stdout_write)
        self.stdin: IO[bytes] | None = os.fdopen(stdin_write, "wb")
        self.stdout: IO[bytes] | None = os.fdopen(stdout_read, "rb")

    @property
    def pid(self) -> int:
        return self._process.pid or 0

    def wait(self, timeout: float | None = None) -> int | None:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(f"benchmark worker {self.pid}", timeout or 0.0)
        return self._process.exitcode

    def kill(self) -> None:
        self._process.kill()

"""`hwr demo`: one process publishes, three fresh processes lease the same pages.

The demo creates a private tmpfs domain under /dev/shm and removes it at the end
(also on error or Ctrl-C). Every child process runs the same code a real worker
would: `HostWeightRuntime(config).resolve(identity, producer)`. The first child
finds nothing, runs the producer and publishes (LOCAL_PRODUCTION); the workers
started afterwards find the published artifact (LOCAL_HIT). Each child touches one
byte in every 4 KiB page of every tensor, then reports its RSS and PSS while it
still holds its lease.

Children talk to the parent in JSON lines over their stdin/stdout pipes:

    child  -> {"event": "ready"}            resolved, leased and touched
    parent -> "measure"                     sent once every child of the group is ready
    child  -> {"event": "row", "row": {...}} memory read while every lease is held
    parent -> "release"                     the child closes its lease and exits 0

so the workers' PSS is read while all of them hold their leases at once, with no
sleeps. Every wait on a child has a deadline and every child is reaped.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from host_weight_runtime import (
    IDENTITY_SCHEMA_VERSION,
    AdaptationIdentity,
    ArtifactWriter,
    CanonicalJson,
    ComponentIdentity,
    HostWeightLease,
    HostWeightRuntime,
    HostWeightRuntimeConfig,
    LookupPhase,
    ProducerIdentity,
    ProductionMetadata,
    ProductionSourceMode,
    ResolutionOutcome,
    RuntimeMode,
    RuntimeWeightLayout,
    StorageClass,
    TensorWriteSpec,
    WeightArtifactIdentity,
    WeightProductionSpec,
    WeightRepresentation,
    WeightSourceIdentity,
)

from .common import JsonValue, remove_tree
from .memory import mapped_memory, memory_rollup

__all__ = [
    "DEFAULT_SIZE_MIB",
    "DEFAULT_WORKERS",
    "DemoProducer",
    "DemoReport",
    "DemoRow",
    "demo_identity",
    "demo_tensor_specs",
    "run_demo",
]

MIB = 1 << 20
PAGE_BYTES = 4096
DEFAULT_SIZE_MIB = 512
DEFAULT_WORKERS = 3
DEMO_SEED = 1234
WIDTH = 1024  # columns of every 2-D demo tensor
BLOCK_MIB = 32  # about this much bf16 per transformer block
CHUNK_ROWS = 4096  # rows generated and written per write_rows call (8 MiB of bf16)
CHILD_TIMEOUT_S = 300.0
SHM = Path("/dev/shm")

_MODEL_ID = "hwr-demo/synthetic-dit"
_PRODUCER_ID = "hwr-demo-synthetic-producer"
_MANIFEST_SCHEMA = "hwr-demo-manifest-v1"
_RESTORER_SCHEMA = "hwr-demo-restorer-v1"
_FILE_NAME = "model-00001-of-00001.safetensors"


class DemoError(Exception):
    """The demo could not run; the message says what to do."""


# --------------------------------------------------------------------------- what is published


def demo_tensor_specs(size_mib: int) -> tuple[TensorWriteSpec, ...]:
    """A DiT-like state dict of about `size_mib` MiB: bf16 linear weights plus a few fp32 tensors.

    FP32 tensors come first: the writer places tensors largest element size first, so
    this order is also the file's offset order, the order an ordered file is written in.
    """
    if type(size_mib) is not int or size_mib < 1:
        raise ValueError(f"size_mib must be a positive integer, got {size_mib!r}")
    blocks = max(1, size_mib // BLOCK_MIB)
    fp32: list[TensorWriteSpec] = [TensorWriteSpec("pos_embed", (64, WIDTH), torch.float32)]
    fp32 += [TensorWriteSpec(f"blocks.{index}.norm.weight", (WIDTH,), torch.float32) for index in range(blocks)]
    fp32.append(TensorWriteSpec("final_norm.weight", (WIDTH,), torch.float32))
    fp32_bytes = sum(spec.nbytes for spec in fp32)
    bf16_rows = max(blocks, (size_mib * MIB - fp32_bytes) // (WIDTH * 2))
    per_block, extra = divmod(bf16_rows, blocks)
    bf16 = [
        TensorWriteSpec(
            f"blocks.{index}.linear.weight", (per_block + (1 if index < extra else 0), WIDTH), torch.bfloat16
        )
        for index in range(blocks)
    ]
    return (*fp32, *bf16)


def demo_identity(size_mib: int, seed: int = DEMO_SEED) -> WeightArtifactIdentity:
    """The exact identity of the demo artifact; the size and seed are part of it (they change the bytes)."""
    recipe = {"size_mib": size_mib, "seed": seed, "width": WIDTH, "chunk_rows": CHUNK_ROWS}
    fingerprint = hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()
    implementation = hashlib.sha256(f"{_PRODUCER_ID}/1/{_MANIFEST_SCHEMA}".encode()).hexdigest()
    return WeightArtifactIdentity(
        schema_version=IDENTITY_SCHEMA_VERSION,
        source=WeightSourceIdentity(
            model_id=_MODEL_ID,
            revision="synthetic",
            fingerprint=fingerprint,
            metadata=CanonicalJson.from_value(dict(recipe)),
        ),
        component=ComponentIdentity(name="transformer", ownership="complete"),
        representation=WeightRepresentation(name="final-layout-bf16", dtype="torch.bfloat16"),
        layout=RuntimeWeightLayout(name="single-device"),
        adaptation=AdaptationIdentity(),
        producer=ProducerIdentity(
            producer_id=_PRODUCER_ID,
            version="1",
            implementation_fingerprint=implementation,
            manifest_schema=_MANIFEST_SCHEMA,
            restorer_schema=_RESTORER_SCHEMA,
        ),
    )


class DemoProducer:
    """A PRE_LOAD_SAFE producer that streams generated tensors through the store's writer.

    Rows are generated and written `CHUNK_ROWS` at a time, so the publisher never holds
    more than one chunk besides the small random pool the chunks are derived from.
    The bytes depend only on the size and the seed.
    """

    def __init__(self, identity: WeightArtifactIdentity, size_mib: int, *, seed: int = DEMO_SEED) -> None:
        self._specs = demo_tensor_specs(size_mib)
        self._seed = seed
        self._spec = WeightProductionSpec(
            producer_id=_PRODUCER_ID,
            outputs=(identity,),
            source_mode=ProductionSourceMode.CHECKPOINT_STREAM,
            lookup_phase=LookupPhase.PRE_LOAD_SAFE,
        )

    @property
    def spec(self) -> WeightProductionSpec:
        return self._spec

    def produce(self, writer: ArtifactWriter) -> ProductionMetadata:
        generator = torch.Generator().manual_seed(self._seed)
        # One random pool; each chunk is the pool scaled by a per-chunk factor. Drawing
        # fresh normals for every chunk would make the demo mostly a randn benchmark.
        pool = torch.randn(CHUNK_ROWS, WIDTH, generator=generator).to(torch.bfloat16)
        file_writer = writer.open_tensor_file(_FILE_NAME, self._specs, ordered=True)
        chunk_index = 0
        for spec in self._specs:
            if spec.dtype == torch.float32:
                file_writer.write_tensor(spec.name, torch.randn(spec.shape, generator=generator))
                continue
            rows = spec.shape[0]
            for start in range(0, rows, CHUNK_ROWS):
                count = min(CHUNK_ROWS, rows - start)
                chunk_index += 1
                chunk = torch.mul(pool[:count], 1.0 + chunk_index / 1024.0)
                file_writer.write_rows(spec.name, start, chunk)
        file_writer.close()
        return ProductionMetadata(producer_schema=_MANIFEST_SCHEMA, restorer_schema=_RESTORER_SCHEMA)


# --------------------------------------------------------------------------- one process's report


@dataclass(frozen=True, slots=True)
class DemoRow:
    """What one child process saw: the outcome, how long until its tensors were usable, its memory."""

    process: str
    pid: int
    outcome: str
    lease_source: str | None
    time_to_ready_ms: float
    rss_bytes: int
    pss_bytes: int
    artifact_rss_bytes: int
    artifact_pss_bytes: int
    artifact_bytes: int
    touched_pages: int
    failure: str | None = None

    def to_dict(self) -> dict[str, JsonValue]:
        return {
            "process": self.process,
            "pid": self.pid,
            "outcome": self.outcome,
            "lease_source": self.lease_source,
            "time_to_ready_ms": self.time_to_ready_ms,
            "rss_bytes": self.rss_bytes,
            "pss_bytes": self.pss_bytes,
            "artifact_rss_bytes": self.artifact_rss_bytes,
            "artifact_pss_bytes": self.artifact_pss_bytes,
            "artifact_bytes": self.artifact_bytes,
            "touched_pages": self.touched_pages,
            "failure": self.failure,
        }

    @classmethod
    def from_dict(cls, value: object) -> DemoRow:
        if not isinstance(value, dict):
            raise DemoError(f"a child sent a malformed row: {value!r}")
        try:
            return cls(
                process=str(value["process"]),
                pid=int(value["pid"]),
                outcome=str(value["outcome"]),
                lease_source=None if value["lease_source"] is None else str(value["lease_source"]),
                time_to_ready_ms=float(value["time_to_ready_ms"]),
                rss_bytes=int(value["rss_bytes"]),
                pss_bytes=int(value["pss_bytes"]),
                artifact_rss_bytes=int(value["artifact_rss_bytes"]),
                artifact_pss_bytes=int(value["artifact_pss_bytes"]),
                artifact_bytes=int(value["artifact_bytes"]),
                touched_pages=int(value["touched_pages"]),
                failure=None if value["failure"] is None else str(value["failure"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise DemoError(f"a child sent a malformed row ({exc}): {value!r}") from exc


@dataclass(frozen=True, slots=True)
class DemoReport:
    """The whole demo: the artifact and one row per process (publisher first)."""

    key: str
    root: str
    artifact_bytes: int
    rows: tuple[DemoRow, ...]

    @property
    def workers(self) -> tuple[DemoRow, ...]:
        return self.rows[1:]

    @property
    def ok(self) -> bool:
        publisher_ok = bool(self.rows) and self.rows[0].outcome == ResolutionOutcome.LOCAL_PRODUCTION.value
        workers_ok = all(row.outcome == ResolutionOutcome.LOCAL_HIT.value for row in self.workers)
        return publisher_ok and workers_ok

    def to_dict(self) -> dict[str, JsonValue]:
        return {
            "key": self.key,
            "root": self.root,
            "artifact_bytes": self.artifact_bytes,
            "workers_pss_bytes": sum(row.pss_bytes for row in self.workers),
            "workers_artifact_pss_bytes": sum(row.artifact_pss_bytes for row in self.workers),
            "ok": self.ok,
            "rows": [row.to_dict() for row in self.rows],
        }


# --------------------------------------------------------------------------- the child side


def _memory_rollup() -> tuple[int, int]:
    """(RSS, PSS) of this process in bytes; a kernel without smaps_rollup is a DemoError that says so."""
    try:
        return memory_rollup()
    except OSError as exc:
        raise DemoError(f"cannot read /proc/self/smaps_rollup ({exc}); the demo needs Linux 4.14 or later") from exc


def _touch_pages(lease: HostWeightLease) -> int:
    """Read one byte in every 4 KiB page of every tensor (and each tensor's last byte); return pages touched."""
    touched = 0
    for tensor in lease.tensors.values():
        if tensor.numel() == 0:
            continue
        flat = tensor.reshape(-1).view(torch.uint8)
        sample = flat[::PAGE_BYTES]
        int(sample.sum()) + int(flat[-1])  # the reads fault the pages in
        touched += sample.numel()
    return touched


def _send(message: dict[str, JsonValue]) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def _expect(command: str) -> None:
    line = sys.stdin.readline()
    if line.strip() != command:
        raise DemoError(f"expected {command!r} from the parent, got {line.strip()!r}")


def child_main(process: str, root: Path, size_mib: int) -> int:
    """Resolve, touch, report when told, release when told. Runs in a fresh process."""
    identity = demo_identity(size_mib)
    producer = DemoProducer(identity, size_mib)
    config = HostWeightRuntimeConfig(mode=RuntimeMode.PREFERRED, root=root, storage_class=StorageClass.TMPFS)
    started = time.perf_counter()
    resolution = HostWeightRuntime(config).resolve(identity, producer)
    lease = resolution.lease
    touched = _touch_pages(lease) if lease is not None else 0
    ready_ms = (time.perf_counter() - started) * 1000.0
    try:
        _send({"event": "ready"})
        _expect("measure")
        rss, pss = _memory_rollup()
        artifact_rss = artifact_pss = artifact_bytes = 0
        if lease is not None:
            regions = [(region.address, region.length) for region in lease.mapped_regions]
            artifact_rss, artifact_pss = mapped_memory(regions)
            artifact_bytes = sum(entry.size for entry in lease.manifest.files)
        problem = resolution.report.failure
        row = DemoRow(
            process=process,
            pid=os.getpid(),
            outcome=resolution.outcome.value,
            lease_source=None if lease is None else lease.provenance.source.value,
            time_to_ready_ms=ready_ms,
            rss_bytes=rss,
            pss_bytes=pss,
            artifact_rss_bytes=artifact_rss,
            artifact_pss_bytes=artifact_pss,
            artifact_bytes=artifact_bytes,
            touched_pages=touched,
            failure=None if problem is None else f"[{problem.code.value}] {problem.message}",
        )
        _send({"event": "row", "row": row.to_dict()})
        _expect("release")
    finally:
        if lease is not None:
            lease.close()
    return 0


# --------------------------------------------------------------------------- the parent side


class _Child:
    """One child process and its line channel; every read has a deadline."""

    def __init__(self, process: str, command: Sequence[str]) -> None:
        self.process = process
        self._popen = subprocess.Popen(list(command), stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0)
        self._buffer = b""

    def receive(self, deadline: float) -> dict[str, JsonValue]:
        stdout = self._popen.stdout
        assert stdout is not None
        while b"\n" not in self._buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise DemoError(
                    f"{self.process} (pid {self._popen.pid}) did not answer within {CHILD_TIMEOUT_S:.0f} s; "
                    "is the machine overloaded? Its stderr is above"
                )
            readable, _, _ = select.select([stdout], [], [], remaining)
            if not readable:
                continue
            data = os.read(stdout.fileno(), 65536)
            if not data:
                code = self._popen.wait(timeout=CHILD_TIMEOUT_S)
                raise DemoError(f"{self.process} exited with status {code} before reporting; its stderr is above")
            self._buffer += data
        line, _, self._buffer = self._buffer.partition(b"\n")
        try:
            message = json.loads(line)
        except ValueError as exc:
            raise DemoError(f"{self.process} wrote something that is not a protocol line: {line!r}") from exc
        if not isinstance(message, dict):
            raise DemoError(f"{self.process} wrote an unexpected message: {message!r}")
        return message

    def send(self, command: str) -> None:
        stdin = self._popen.stdin
        assert stdin is not None
        stdin.write(command.encode() + b"\n")
        stdin.flush()

    def finish(self, deadline: float) -> None:
        """Wait for a clean exit; a non-zero status is an error."""
        code = self._popen.wait(timeout=max(0.0, deadline - time.monotonic()))
        if code != 0:
            raise DemoError(f"{self.process} exited with status {code}; its stderr is above")

    def reap(self) -> None:
        """Kill the child if it still runs and collect it (idempotent)."""
        for stream in (self._popen.stdin, self._popen.stdout):
            if stream is not None and not stream.closed:
                stream.close()
        if self._popen.poll() is None:
            self._popen.kill()
        self._popen.wait()


def _child_command(process: str, root: Path, size_mib: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "hwr_tools.demo_store",
        "--child",
        process,
        "--root",
        str(root),
        "--size-mib",
        str(size_mib),
    ]


def _run_group(names: Sequence[str], root: Path, size_mib: int) -> list[DemoRow]:
    """Start one child per name; measure them while all hold their leases; release them."""
    rows = _run_child_group([(name, _child_command(name, root, size_mib)) for name in names])
    return [DemoRow.from_dict(row) for row in rows]


def _await_ready(child: _Child, deadline: float) -> None:
    message = child.receive(deadline)
    if message.get("event") != "ready":
        raise DemoError(f"{child.process} sent {message!r} instead of ready")


def _run_child_group(
    commands: Sequence[tuple[str, Sequence[str]]], *, one_at_a_time: bool = False
) -> list[JsonValue]:
    """Run the ready -> measure -> row -> release protocol with one child per (name, command); return the rows.

    With `one_at_a_time` each child starts only once the previous one is ready, so every
    load runs alone (its time to ready is not inflated by the others' start-up); the rows
    are still read while every child holds what it loaded.
    """
    deadline = time.monotonic() + CHILD_TIMEOUT_S
    children: list[_Child] = []
    try:
        for name, command in commands:
            children.append(_Child(name, command))
            if one_at_a_time:
                _await_ready(children[-1], deadline)
        if not one_at_a_time:
            for child in children:
                _await_ready(child, deadline)
        for child in children:
            child.send("measure")
        rows: list[JsonValue] = []
        for child in children:
            message = child.receive(deadline)
            if message.get("event") != "row":
                raise DemoError(f"{child.process} sent {message!r} instead of its row")
            rows.append(message.get("row"))
        for child in children:
            child.send("release")
        for child in children:
            child.finish(deadline)
        return rows
    finally:
        for child in children:
            child.reap()


@contextlib.contextmanager
def _terminate_as_exit() -> Iterator[None]:
    """Turn SIGTERM into SystemExit while the children run, so the domain is removed and children reaped."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def terminate(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _remove_domain(root: Path) -> None:
    """Remove the demo domain, including its read-only published directories."""
    remove_tree(root)


def run_demo(*, size_mib: int = DEFAULT_SIZE_MIB, workers: int = DEFAULT_WORKERS) -> DemoReport:
    """Publish once in a fresh process, then lease from `workers` fresh processes; always remove the domain."""
    if type(size_mib) is not int or size_mib < 1:
        raise ValueError(f"--size-mib must be a positive integer, got {size_mib!r}")
    if type(workers) is not int or workers < 1:
        raise ValueError(f"--workers must be a positive integer, got {workers!r}")
    if not SHM.is_dir() or not os.access(SHM, os.W_OK):
        raise DemoError(f"{SHM} is missing or not writable; the demo needs a tmpfs at {SHM}")
    root = Path(tempfile.mkdtemp(prefix="hwr-demo-", dir=SHM))
    try:
        with _terminate_as_exit():
            publisher = _run_group(["publisher"], root, size_mib)
            worker_rows = _run_group([f"worker {index}" for index in range(1, workers + 1)], root, size_mib)
    finally:
        _remove_domain(root)
    rows = tuple(publisher + worker_rows)
    return DemoReport(
        key=demo_identity(size_mib).key,
        root=str(root),
        artifact_bytes=max(row.artifact_bytes for row in rows),
        rows=rows,
    )


def _mib(value: float) -> float:
    return value / MIB


def summary_line(report: DemoReport) -> str:
    """The footer: the workers' summed PSS against the size of one copy of the artifact."""
    workers = report.workers
    total_pss = sum(row.pss_bytes for row in workers)
    artifact_pss = sum(row.artifact_pss_bytes for row in workers)
    size = report.artifact_bytes
    copies = artifact_pss / size if size else math.nan
    return (
        f"{len(workers)} workers: summed PSS {_mib(total_pss):.1f} MiB, of which the artifact's mappings "
        f"{_mib(artifact_pss):.1f} MiB = {copies:.2f}x one {_mib(size):.1f} MiB artifact "
        f"(private copies would be {len(workers)}x)"
    )


def _parse_child_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m hwr_tools.demo_store", description="hwr demo child process"
    )
    parser.add_argument("--child", required=True, help="the process name to report")
    parser.add_argument("--root", required=True, type=Path)
    parser.add_argument("--size-mib", required=True, type=int)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of a demo child (`python -m hwr_tools.demo_store --child ...`)."""
    args = _parse_child_args(argv)
    return child_main(args.child, args.root, args.size_mib)


if __name__ == "__main__":
    sys.exit(main())

"""Shared test helpers: identities, deterministic tensors, a real producer, child processes."""

from __future__ import annotations

import multiprocessing
import multiprocessing.process
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from multiprocessing.connection import Connection
from pathlib import Path

import torch

from host_weight_runtime import BuildRequest, FilesystemHostWeightStore, StoreStatus, ValidationLevel
from host_weight_runtime._digest import DigestAlgorithm
from host_weight_runtime.canonical_json import CanonicalJson
from host_weight_runtime.identity import (
    IDENTITY_SCHEMA_VERSION,
    AdaptationIdentity,
    ComponentIdentity,
    ProducerIdentity,
    RuntimeWeightLayout,
    WeightArtifactIdentity,
    WeightRepresentation,
    WeightSourceIdentity,
)
from host_weight_runtime.protocols import (
    ArtifactWriter,
    CoordinationScope,
    LookupPhase,
    ProductionMetadata,
    ProductionSourceMode,
    TensorWriteSpec,
    WeightProductionSpec,
)
from hwr_tools.preimported import preimported_context

MANIFEST_SCHEMA = "hwr-test-manifest-v1"
RESTORER_SCHEMA = "hwr-test-restorer-v1"
CHILD_TIMEOUT_S = 120.0


def make_identity(
    *,
    model_id: str = "test-org/test-model",
    fingerprint: str = "a" * 64,
    tp_size: int = 1,
    tp_rank: int = 0,
    sp_size: int = 1,
    sp_backend: str = "none",
    adaptation: AdaptationIdentity | None = None,
    tag: str = "",
    manifest_schema: str = MANIFEST_SCHEMA,
    restorer_schema: str = RESTORER_SCHEMA,
) -> WeightArtifactIdentity:
    """A complete identity; `tag` makes otherwise equal identities distinct."""
    return WeightArtifactIdentity(
        schema_version=IDENTITY_SCHEMA_VERSION,
        source=WeightSourceIdentity(
            model_id=model_id,
            revision="main",
            fingerprint=fingerprint,
            metadata=CanonicalJson.from_value({"tag": tag} if tag else {}),
        ),
        component=ComponentIdentity(name="transformer", ownership="complete"),
        representation=WeightRepresentation(name="test-final-layout", dtype="torch.bfloat16"),
        layout=RuntimeWeightLayout(
            name="test-layout",
            tensor_parallel_size=tp_size,
            tensor_parallel_rank=tp_rank,
            sequence_parallel_size=sp_size,
            sequence_parallel_backend=sp_backend,
        ),
        adaptation=adaptation or AdaptationIdentity(),
        producer=ProducerIdentity(
            producer_id="hwr-test-producer",
            version="1",
            implementation_fingerprint="b" * 64,
            manifest_schema=manifest_schema,
            restorer_schema=restorer_schema,
        ),
    )


def make_tensors(seed: int = 0, *, scale: int = 1) -> dict[str, torch.Tensor]:
    """A small mixed-dtype state dict; the same seed always gives the same bytes."""
    generator = torch.Generator().manual_seed(seed)
    return {
        "blocks.0.weight": torch.randn(64 * scale, 32, generator=generator).to(torch.bfloat16),
        "blocks.0.bias": torch.randn(64 * scale, generator=generator).to(torch.bfloat16),
        "blocks.1.weight": torch.randn(32, 64 * scale, generator=generator),
        "norm.scale": torch.randn(33, generator=generator).to(torch.float16),
        "embed.positions": torch.arange(7 * scale, dtype=torch.int64),
        "mask": torch.rand(5, generator=generator) > 0.5,
    }


class SyntheticProducer:
    """A real producer that writes given tensors through the store's writer.

    It records every call in `calls`, and when `counter_path` is set also appends a
    line to that file, so tests can count productions across processes.
    """

    def __init__(
        self,
        identity: WeightArtifactIdentity,
        tensors: Mapping[str, torch.Tensor],
        *,
        files: int = 1,
        ordered: bool = True,
        lookup_phase: LookupPhase = LookupPhase.PRE_LOAD_SAFE,
        source_mode: ProductionSourceMode = ProductionSourceMode.CHECKPOINT_STREAM,
        scope: CoordinationScope = CoordinationScope.SINGLE_PROCESS,
        counter_path: Path | None = None,
        before_write: Callable[[], None] | None = None,
        producer_schema: str | None = None,
        restorer_schema: str | None = None,
        digest_algorithm: DigestAlgorithm = DigestAlgorithm.SHA256_TREE_V1,
    ) -> None:
        self.identity = identity
        self.tensors = dict(tensors)
        self.files = files
        self.ordered = ordered
        self.counter_path = counter_path
        self.before_write = before_write
        self.producer_schema = producer_schema or identity.producer.manifest_schema
        self.restorer_schema = restorer_schema or identity.producer.restorer_schema
        self.calls = 0
        self._spec = WeightProductionSpec(
            producer_id=identity.producer.producer_id,
            outputs=(identity,),
            source_mode=source_mode,
            lookup_phase=lookup_phase,
            coordination_scope=scope,
            digest_algorithm=digest_algorithm,
        )

    @property
    def spec(self) -> WeightProductionSpec:
        return self._spec

    def produce(self, writer: ArtifactWriter) -> ProductionMetadata:
        self.calls += 1
        if self.counter_path is not None:
            with self.counter_path.open("a") as counter:
                counter.write("produced\n")
        if self.before_write is not None:
            self.before_write()
        names = sorted(self.tensors)
        groups = [names[index :: self.files] for index in range(self.files)]
        for index, group in enumerate(groups):
            specs = tuple(
                TensorWriteSpec(name=name, shape=tuple(self.tensors[name].shape), dtype=self.tensors[name].dtype)
                for name in group
            )
            file_writer = writer.open_tensor_file(
                f"model-{index + 1:05d}-of-{self.files:05d}.safetensors", specs, ordered=self.ordered
            )
            layout = getattr(file_writer, "layout", specs)
            for spec in layout:
                file_writer.write_tensor(spec.name, self.tensors[spec.name])
            file_writer.close()
        return ProductionMetadata(producer_schema=self.producer_schema, restorer_schema=self.restorer_schema)


def artifact_keys(root: Path) -> list[str]:
    """The keys of the artifacts published under the domain `root`, sorted."""
    artifacts = root / "artifacts"
    return sorted(path.name for path in artifacts.iterdir()) if artifacts.is_dir() else []


def production_count(counter_path: Path) -> int:
    if not counter_path.exists():
        return 0
    return len(counter_path.read_text().splitlines())


SPAWN = preimported_context()


@contextmanager
def spawned_child(target: Callable[..., None], *args: object) -> Iterator[Connection]:
    """Run `target(*args, conn)` in a spawned child; yield our end of the pipe; always reap it."""
    parent_conn, child_conn = SPAWN.Pipe()
    process = SPAWN.Process(target=target, args=(*args, child_conn), daemon=True)
    process.start()
    child_conn.close()
    try:
        yield parent_conn
    finally:
        process.join(CHILD_TIMEOUT_S)
        if process.is_alive():
            process.kill()
            process.join(CHILD_TIMEOUT_S)
        parent_conn.close()
    assert process.exitcode == 0, f"child exited with {process.exitcode}"


def recv_within(conn: Connection, timeout_s: float = CHILD_TIMEOUT_S) -> object:
    """Receive one message, failing the test (not hanging) if the child says nothing in time."""
    assert conn.poll(timeout_s), "child did not answer in time"
    return conn.recv()


@contextmanager
def reaped_children() -> Iterator[list[multiprocessing.process.BaseProcess]]:
    """Collect child processes; on exit, join them with a deadline and kill stragglers."""
    children: list[multiprocessing.process.BaseProcess] = []
    try:
        yield children
    finally:
        for child in children:
            child.join(timeout=CHILD_TIMEOUT_S)
            if child.is_alive():
                child.kill()
                child.join(timeout=10)


def publish_standard_artifact(store: FilesystemHostWeightStore) -> str:
    """Publish the standard test artifact (two payload files) at metadata level, close the builder's lease,
    and return its key: the fixture most CLI and store tests start from."""
    identity = make_identity()
    result = store.get_or_build(
        BuildRequest(identity),
        SyntheticProducer(identity, make_tensors(), files=2),
        validation=ValidationLevel.MANIFEST_AND_METADATA,
        deadline=time.monotonic() + 60.0,
    )
    assert result.status is StoreStatus.BUILT and result.lease is not None, result.failure
    result.lease.close()
    return identity.key

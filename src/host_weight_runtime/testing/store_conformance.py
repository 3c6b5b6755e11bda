"""A reusable conformance suite for `HostWeightStore` implementations.

Every store (the filesystem store today, others later) subclasses
`HostWeightStoreConformance` in its own test module and provides `make_store`::

    from host_weight_runtime.testing.store_conformance import HostWeightStoreConformance

    class TestMyStoreConformance(HostWeightStoreConformance):
        def make_store(self, tmp_path):
            return MyStore(tmp_path / "store")

pytest then collects every `test_*` method of the base class for that store. The
base class name has no `Test` prefix, so it is never collected by itself.

The suite uses only the `HostWeightStore` protocol (`lookup`, `get_or_build`) and
the `StoreResult` / `HostWeightLease` semantics every store must honour; it never
touches a store's files, locks or inspection API. Store-specific behaviour
(permissions, deny markers, cleanup, crash recovery) belongs in that store's own tests.

This module imports pytest at import time. pytest is a test extra, not a runtime
dependency; that is acceptable only because this module lives in
`host_weight_runtime.testing`, which users import from their tests and nothing in the
library imports. `host_weight_runtime` and `host_weight_runtime.testing` themselves
import without pytest.

It also ships what the suite needs to drive a store: `conformance_identity(tag)`,
`conformance_tensors(seed)` and `TensorDictProducer`, a small producer that writes a
given dict of tensors through the store's `ArtifactWriter` in one or more files and
can be told to fail.
"""

from __future__ import annotations

import pickle
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest
import torch

from ..canonical_json import CanonicalJson
from ..failures import FailureCode, HostWeightError
from ..identity import (
    IDENTITY_SCHEMA_VERSION,
    AdaptationIdentity,
    ComponentIdentity,
    ProducerIdentity,
    RuntimeWeightLayout,
    WeightArtifactIdentity,
    WeightRepresentation,
    WeightSourceIdentity,
)
from ..lease import HostWeightLease
from ..outcomes import StoreResult, StoreStatus
from ..protocols import (
    ArtifactWriter,
    BuildRequest,
    CoordinationScope,
    HostWeightStore,
    LookupPhase,
    ProductionMetadata,
    ProductionSourceMode,
    TensorWriteSpec,
    WeightProducer,
    WeightProductionSpec,
)
from ..tensors import ValidationLevel

__all__ = [
    "CONFORMANCE_MANIFEST_SCHEMA",
    "CONFORMANCE_RESTORER_SCHEMA",
    "HostWeightStoreConformance",
    "ProducerFailedError",
    "TensorDictProducer",
    "assert_same_bytes",
    "conformance_identity",
    "conformance_tensors",
]

CONFORMANCE_MANIFEST_SCHEMA = "hwr-conformance-manifest-v1"
CONFORMANCE_RESTORER_SCHEMA = "hwr-conformance-restorer-v1"
_PRODUCER_ID = "hwr-conformance-producer"

META = ValidationLevel.MANIFEST_AND_METADATA
FULL = ValidationLevel.FULL_CHECKSUM


def conformance_identity(tag: str = "") -> WeightArtifactIdentity:
    """A complete, valid identity; different tags give different keys, equal tags equal keys."""
    return WeightArtifactIdentity(
        schema_version=IDENTITY_SCHEMA_VERSION,
        source=WeightSourceIdentity(
            model_id="hwr-conformance/model",
            revision="main",
            fingerprint="c" * 64,
            metadata=CanonicalJson.from_value({"tag": tag}),
        ),
        component=ComponentIdentity(name="transformer", ownership="complete"),
        representation=WeightRepresentation(name="conformance-layout", dtype="torch.bfloat16"),
        layout=RuntimeWeightLayout(name="conformance-layout"),
        adaptation=AdaptationIdentity(),
        producer=ProducerIdentity(
            producer_id=_PRODUCER_ID,
            version="1",
            implementation_fingerprint="d" * 64,
            manifest_schema=CONFORMANCE_MANIFEST_SCHEMA,
            restorer_schema=CONFORMANCE_RESTORER_SCHEMA,
        ),
    )


def conformance_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    """A tiny mixed-dtype state dict; the same seed always gives the same bytes."""
    generator = torch.Generator().manual_seed(seed)
    return {
        "layers.0.weight": torch.randn(8, 4, generator=generator).to(torch.bfloat16),
        "layers.0.bias": torch.randn(8, generator=generator).to(torch.bfloat16),
        "layers.1.weight": torch.randn(4, 8, generator=generator),
        "norm.scale": torch.randn(5, generator=generator).to(torch.float16),
        "positions": torch.arange(seed, seed + 3, dtype=torch.int64),
        "codes": torch.randint(0, 256, (6,), dtype=torch.uint8, generator=generator),
        "mask": torch.rand(7, generator=generator) > 0.5,
    }


def assert_same_bytes(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Assert equal dtype, shape and bit pattern (NaN-safe, -0.0-safe)."""
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    assert tuple(actual.shape) == tuple(expected.shape), (tuple(actual.shape), tuple(expected.shape))
    left = actual.contiguous().reshape(-1).view(torch.uint8)
    right = expected.contiguous().reshape(-1).view(torch.uint8)
    assert torch.equal(left, right), "tensor bytes differ"


class ProducerFailedError(RuntimeError):
    """What a `TensorDictProducer` told to fail raises (a plain exception, as a buggy producer would)."""


class TensorDictProducer:
    """A `WeightProducer` that writes a given dict of tensors through the store's writer.

    Tensor names are sorted and dealt round-robin into `files` payload files named
    ``part-00001-of-0000N.safetensors``. Only the `ArtifactWriter` / `TensorFileWriter`
    protocols are used: files are unordered unless `ordered=True`, in which case the
    writer's `layout` order is followed when the writer exposes one.

    `fail_after`: when set, `produce` raises `ProducerFailedError` after writing that many
    complete files (0 fails before writing anything). `outputs`: the identities the
    spec declares; by default exactly the one identity given. `calls` counts `produce`.
    The spec is PRE_LOAD_SAFE, CHECKPOINT_STREAM and SINGLE_PROCESS.
    """

    def __init__(
        self,
        identity: WeightArtifactIdentity,
        tensors: Mapping[str, torch.Tensor],
        *,
        files: int = 1,
        ordered: bool = False,
        fail_after: int | None = None,
        outputs: tuple[WeightArtifactIdentity, ...] | None = None,
    ) -> None:
        if files < 1:
            raise ValueError("files must be at least 1")
        if files > max(len(tensors), 1):
            raise ValueError("files must not exceed the number of tensors (every file holds at least one)")
        self.identity = identity
        self.tensors = dict(tensors)
        self.files = files
        self.ordered = ordered
        self.fail_after = fail_after
        self.calls = 0
        self._spec = WeightProductionSpec(
            producer_id=identity.producer.producer_id,
            outputs=(identity,) if outputs is None else outputs,
            source_mode=ProductionSourceMode.CHECKPOINT_STREAM,
            lookup_phase=LookupPhase.PRE_LOAD_SAFE,
            coordination_scope=CoordinationScope.SINGLE_PROCESS,
        )

    @property
    def spec(self) -> WeightProductionSpec:
        return self._spec

    def produce(self, writer: ArtifactWriter) -> ProductionMetadata:
        self.calls += 1
        names = sorted(self.tensors)
        groups = [names[index :: self.files] for index in range(self.files)]
        for index, group in enumerate(groups):
            if self.fail_after is not None and index >= self.fail_after:
                raise ProducerFailedError(f"told to fail after {self.fail_after} file(s)")
            specs = tuple(
                TensorWriteSpec(name=name, shape=tuple(self.tensors[name].shape), dtype=self.tensors[name].dtype)
                for name in group
            )
            file_writer = writer.open_tensor_file(
                f"part-{index + 1:05d}-of-{self.files:05d}.safetensors", specs, ordered=self.ordered
            )
            order: tuple[TensorWriteSpec, ...] = getattr(file_writer, "layout", specs) if self.ordered else specs
            for spec in order:
                file_writer.write_tensor(spec.name, self.tensors[spec.name])
            file_writer.close()
        if self.fail_after is not None:
            raise ProducerFailedError(f"told to fail after {self.fail_after} file(s)")
        return ProductionMetadata(
            producer_schema=self.identity.producer.manifest_schema,
            restorer_schema=self.identity.producer.restorer_schema,
        )


class HostWeightStoreConformance:
    """Tests every `HostWeightStore` must pass. Subclass it as ``Test...`` and implement `make_store`.

    Hooks: `make_store(tmp_path)` (required) builds a fresh, empty store for one test;
    `close_store(store)` (optional) tears it down after every lease the test obtained
    has been closed. Results obtained through `self.call_get_or_build` / `self.call_lookup`
    have their leases closed at teardown even when an assertion fails midway.
    """

    deadline_s: float = 60.0

    # ------------------------------------------------------------------ hooks

    def make_store(self, tmp_path: Path) -> HostWeightStore:
        """Return a fresh, empty store rooted under `tmp_path` (or anywhere the subclass cleans up)."""
        raise NotImplementedError(f"{type(self).__name__} must implement make_store(tmp_path)")

    def close_store(self, store: HostWeightStore) -> None:
        """Release what `make_store` created; called after the test's leases are closed."""

    # ------------------------------------------------------------------ fixtures and helpers

    @pytest.fixture
    def store(self, tmp_path: Path) -> Iterator[HostWeightStore]:
        self._leases: list[HostWeightLease] = []
        store = self.make_store(tmp_path)
        try:
            yield store
        finally:
            leases, self._leases = self._leases, []
            try:
                for lease in leases:
                    lease.close()
            finally:
                self.close_store(store)

    def _track(self, result: StoreResult) -> StoreResult:
        assert isinstance(result, StoreResult), f"a store returned {type(result).__name__}, not StoreResult"
        if result.lease is not None:
            self._leases.append(result.lease)
        return result

    def call_get_or_build(
        self,
        store: HostWeightStore,
        producer: WeightProducer,
        *,
        identity: WeightArtifactIdentity | None = None,
        validation: ValidationLevel = META,
    ) -> StoreResult:
        """get_or_build `identity` (default: the producer's first declared output) with a fresh deadline."""
        wanted = producer.spec.outputs[0] if identity is None else identity
        result = self._track(
            store.get_or_build(
                BuildRequest(wanted),
                producer,
                validation=validation,
                deadline=time.monotonic() + self.deadline_s,
            )
        )
        assert result.identity == wanted
        return result

    def call_lookup(
        self, store: HostWeightStore, identity: WeightArtifactIdentity, *, validation: ValidationLevel = META
    ) -> StoreResult:
        """lookup with a fresh deadline; a lease it returns is closed at teardown."""
        result = self._track(store.lookup(identity, validation=validation, deadline=time.monotonic() + self.deadline_s))
        assert result.identity == identity
        return result

    @staticmethod
    def leased(result: StoreResult) -> HostWeightLease:
        """The result's lease, asserting it has one."""
        assert result.lease is not None, (result.status, result.failure)
        return result.lease

    @staticmethod
    def assert_tensors(lease: HostWeightLease, expected: Mapping[str, torch.Tensor]) -> None:
        tensors = lease.tensors
        assert set(tensors) == set(expected)
        for name, tensor in expected.items():
            assert tensors[name].device.type == "cpu"
            assert_same_bytes(tensors[name], tensor)

    @staticmethod
    def assert_miss(result: StoreResult) -> None:
        assert result.status is StoreStatus.MISS, (result.status, result.failure)
        assert result.lease is None and not result.ok
        assert result.failure is None and result.publication_id is None

    # ------------------------------------------------------------------ the contract

    @pytest.mark.parametrize("validation", [META, FULL])
    def test_lookup_of_an_empty_store_is_a_miss(self, store: HostWeightStore, validation: ValidationLevel) -> None:
        """An empty store has nothing: lookup is a MISS with no lease, no failure and no publication."""
        self.assert_miss(self.call_lookup(store, conformance_identity("empty"), validation=validation))

    @pytest.mark.parametrize(("files", "ordered"), [(1, False), (3, False), (2, True)])
    def test_build_gives_a_lease_of_what_the_producer_wrote(
        self, store: HostWeightStore, files: int, ordered: bool
    ) -> None:
        """A missing key is BUILT once; the lease's tensors are exactly the producer's, however split."""
        identity = conformance_identity("build")
        tensors = conformance_tensors(1)
        producer = TensorDictProducer(identity, tensors, files=files, ordered=ordered)
        result = self.call_get_or_build(store, producer)
        assert result.status is StoreStatus.BUILT, (result.status, result.failure)
        assert result.ok and result.failure is None
        lease = self.leased(result)
        assert producer.calls == 1
        assert not lease.closed
        assert lease.identity == identity
        assert result.publication_id is not None and result.publication_id == lease.publication_id
        self.assert_tensors(lease, tensors)

    def test_second_get_or_build_is_a_hit_without_the_producer(self, store: HostWeightStore) -> None:
        """Once published, get_or_build is a HIT of the same publication and never calls a producer."""
        identity = conformance_identity("hit")
        tensors = conformance_tensors(2)
        built = self.call_get_or_build(store, TensorDictProducer(identity, tensors))
        assert built.status is StoreStatus.BUILT, (built.status, built.failure)
        self.leased(built).close()
        # A producer that would fail and would write other bytes: a HIT proves it never ran.
        untouched = TensorDictProducer(identity, conformance_tensors(3), fail_after=0)
        again = self.call_get_or_build(store, untouched)
        assert again.status is StoreStatus.HIT, (again.status, again.failure)
        assert untouched.calls == 0
        assert again.publication_id == built.publication_id == self.leased(again).publication_id
        self.assert_tensors(self.leased(again), tensors)

    def test_lookup_gives_the_publication_that_was_built(self, store: HostWeightStore) -> None:
        """lookup after a build is a HIT with the same publication id; both leases read the same tensors."""
        identity = conformance_identity("same-publication")
        tensors = conformance_tensors(4)
        built = self.call_get_or_build(store, TensorDictProducer(identity, tensors, files=2))
        assert built.status is StoreStatus.BUILT, (built.status, built.failure)
        found = self.call_lookup(store, identity)
        assert found.status is StoreStatus.HIT, (found.status, found.failure)
        assert found.publication_id == built.publication_id
        assert self.leased(found).publication_id == self.leased(built).publication_id
        self.assert_tensors(self.leased(found), tensors)
        self.assert_tensors(self.leased(built), tensors)

    @pytest.mark.parametrize("fail_after", [0, 1])
    def test_failing_producer_is_failed_and_leaves_a_miss(self, store: HostWeightStore, fail_after: int) -> None:
        """A producer that raises gives FAILED/PRODUCER_FAILED, not retryable; nothing is published or cached."""
        identity = conformance_identity("failing")
        producer = TensorDictProducer(identity, conformance_tensors(5), files=2, fail_after=fail_after)
        result = self.call_get_or_build(store, producer)
        assert result.status is StoreStatus.FAILED
        assert result.lease is None and not result.ok and result.publication_id is None
        assert result.failure is not None
        assert result.failure.code is FailureCode.PRODUCER_FAILED
        assert result.failure.retryable is False
        assert producer.calls == 1
        self.assert_miss(self.call_lookup(store, identity))
        self.assert_miss(self.call_lookup(store, identity, validation=FULL))
        # The failure is not remembered: a good producer builds the key next time.
        good = TensorDictProducer(identity, conformance_tensors(5), files=2)
        rebuilt = self.call_get_or_build(store, good)
        assert rebuilt.status is StoreStatus.BUILT, (rebuilt.status, rebuilt.failure)
        assert good.calls == 1

    def test_lease_close_is_idempotent(self, store: HostWeightStore) -> None:
        """close() twice is fine; a closed lease refuses tensor access with a typed error; `with` closes."""
        identity = conformance_identity("close")
        built = self.call_get_or_build(store, TensorDictProducer(identity, conformance_tensors(6)))
        lease = self.leased(built)
        lease.close()
        assert lease.closed
        lease.close()
        assert lease.closed
        with pytest.raises(HostWeightError):
            lease.tensors  # noqa: B018 - the property access is what is tested
        found = self.call_lookup(store, identity)
        assert found.status is StoreStatus.HIT, (found.status, found.failure)
        with self.leased(found) as entered:
            assert entered is found.lease
            self.assert_tensors(entered, conformance_tensors(6))
        assert entered.closed
        entered.close()

    def test_lease_refuses_pickling(self, store: HostWeightStore) -> None:
        """A lease owns mappings and a lock of this process: pickling it raises TypeError."""
        identity = conformance_identity("pickle")
        lease = self.leased(self.call_get_or_build(store, TensorDictProducer(identity, conformance_tensors(7))))
        for protocol in range(pickle.HIGHEST_PROTOCOL + 1):
            with pytest.raises(TypeError):
                pickle.dumps(lease, protocol=protocol)
        assert not lease.closed
        self.assert_tensors(lease, conformance_tensors(7))

    def test_lease_tensors_are_a_read_only_mapping(self, store: HostWeightStore) -> None:
        """lease.tensors cannot be rebound or extended by a consumer."""
        identity = conformance_identity("read-only-mapping")
        lease = self.leased(self.call_get_or_build(store, TensorDictProducer(identity, conformance_tensors(8))))
        tensors = lease.tensors
        with pytest.raises(TypeError):
            tensors["positions"] = torch.zeros(3, dtype=torch.int64)  # type: ignore[index]
        with pytest.raises(TypeError):
            del tensors["positions"]  # type: ignore[attr-defined]
        self.assert_tensors(lease, conformance_tensors(8))

    def test_leases_of_different_identities_are_independent(self, store: HostWeightStore) -> None:
        """Different keys have different publications and bytes; closing one key's lease leaves the other intact."""
        first_identity, second_identity = conformance_identity("first"), conformance_identity("second")
        assert first_identity.key != second_identity.key
        first_tensors, second_tensors = conformance_tensors(10), conformance_tensors(11)
        first = self.call_get_or_build(store, TensorDictProducer(first_identity, first_tensors))
        self.assert_miss(self.call_lookup(store, second_identity))
        second = self.call_get_or_build(store, TensorDictProducer(second_identity, second_tensors, files=2))
        assert first.status is StoreStatus.BUILT and second.status is StoreStatus.BUILT
        assert first.publication_id != second.publication_id
        self.assert_tensors(self.leased(first), first_tensors)
        self.assert_tensors(self.leased(second), second_tensors)
        self.leased(first).close()
        self.assert_tensors(self.leased(second), second_tensors)
        again = self.call_lookup(store, first_identity)
        assert again.status is StoreStatus.HIT and again.publication_id == first.publication_id
        self.assert_tensors(self.leased(again), first_tensors)
        self.leased(second).close()
        self.assert_tensors(self.leased(again), first_tensors)
        other = self.call_lookup(store, second_identity)
        assert other.status is StoreStatus.HIT and other.publication_id == second.publication_id
        self.assert_tensors(self.leased(other), second_tensors)

    def test_full_checksum_lookup_of_a_good_artifact_hits(self, store: HostWeightStore) -> None:
        """FULL_CHECKSUM re-hashes an intact artifact and hits, in lookup and in get_or_build."""
        identity = conformance_identity("full")
        tensors = conformance_tensors(12)
        built = self.call_get_or_build(store, TensorDictProducer(identity, tensors, files=2), validation=FULL)
        assert built.status is StoreStatus.BUILT, (built.status, built.failure)
        self.leased(built).close()
        found = self.call_lookup(store, identity, validation=FULL)
        assert found.status is StoreStatus.HIT, (found.status, found.failure)
        assert found.publication_id == built.publication_id
        self.assert_tensors(self.leased(found), tensors)
        again = self.call_get_or_build(store, TensorDictProducer(identity, tensors, fail_after=0), validation=FULL)
        assert again.status is StoreStatus.HIT, (again.status, again.failure)
        assert again.publication_id == built.publication_id

    def test_producer_that_does_not_declare_the_identity_fails_typed(self, store: HostWeightStore) -> None:
        """A producer whose spec does not list the requested identity is refused before it runs."""
        wanted, declared = conformance_identity("wanted"), conformance_identity("declared")
        producer = TensorDictProducer(declared, conformance_tensors(13))
        result = self.call_get_or_build(store, producer, identity=wanted)
        assert result.status is StoreStatus.FAILED
        assert result.lease is None and result.failure is not None
        assert result.failure.code is FailureCode.INVALID_CONFIGURATION
        assert result.failure.retryable is False
        assert producer.calls == 0
        self.assert_miss(self.call_lookup(store, wanted))
        self.assert_miss(self.call_lookup(store, declared))

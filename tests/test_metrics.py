"""Prometheus metrics over real HTTP, in a caller's registry and in multiprocess mode; one structured log per resolve."""

from __future__ import annotations

import json
import logging
import os
import re
import urllib.request
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from host_weight_runtime import FailureCode, HostWeightError, ResolutionStage, register_metrics
from host_weight_runtime._resolution.resolve_reports import REPORT_ATTRIBUTE, RESOLVE_LOGGER
from host_weight_runtime.config import HostWeightRuntimeConfig
from host_weight_runtime.failures import failure
from host_weight_runtime.metrics import record_restore
from host_weight_runtime.protocols import HostWeightStore
from host_weight_runtime.runtime import HostWeightRuntime

from . import _ops_children
from ._ops_children import model_identity, model_producer
from .support import recv_within
from .test_eviction import child

Labels = frozenset[tuple[str, str]]
_KEY = re.compile(r"^[0-9a-f]{64}$")


def hwr_samples(text: str) -> dict[tuple[str, Labels], float]:
    """Every hwr_* sample of an exposition, by (sample name, labels); `_created` timestamps and buckets left out."""
    found: dict[tuple[str, Labels], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not sample.name.startswith("hwr_") or sample.name.endswith(("_created", "_bucket")):
                continue
            found[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return found


def all_samples(text: str) -> Iterator[Sample]:
    for family in text_string_to_metric_families(text):
        yield from family.samples


def label_problems(samples: Iterable[Sample], forbidden: Iterable[str]) -> list[str]:
    """Label values that are keys (64 hex), paths, or one of `forbidden` (model ids, roots)."""
    banned = set(forbidden)
    problems = []
    for sample in samples:
        for name, value in sample.labels.items():
            if _KEY.match(value) or "/" in value or value in banned:
                problems.append(f"{sample.name}{{{name}={value!r}}}")
    return problems


def L(**labels: str) -> Labels:  # noqa: N802  (reads like a label set)
    return frozenset(labels.items())


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as response:
        assert response.status == 200
        return str(response.read().decode("utf-8"))


def payload_bytes(root: Path) -> int:
    artifact = root / "artifacts" / model_identity(0).key
    return sum(os.path.getsize(artifact / name) for name in os.listdir(artifact) if name.endswith(".safetensors"))


def counts(samples: dict[tuple[str, Labels], float], suffix: str) -> dict[tuple[str, Labels], float]:
    return {key: value for key, value in samples.items() if key[0].endswith(suffix)}


def test_metrics_endpoint_after_a_miss_a_build_and_a_hit(tmp_path: Path) -> None:
    """A worker configured by HWR_METRICS_PORT serves /metrics over HTTP; after a miss, a build and a hit (lease kept)
    the hwr_* counters, histogram counts and gauges have exactly the expected values and label sets, and no label
    value anywhere in the exposition is a key, a path or a model id."""
    root = tmp_path / "domain"
    with child(_ops_children.metrics_endpoint_worker, str(root)) as (conn, _):
        address = recv_within(conn)
        assert isinstance(address, tuple) and address[0] == "127.0.0.1"
        port = int(address[1])
        outcomes = []
        texts = []
        for step in ("miss", "build", "hit"):
            conn.send(step)
            outcomes.append(recv_within(conn))
            texts.append(scrape(port))
        assert outcomes == ["canonical_fallback", "local_production", "local_hit"]
        published = payload_bytes(root)
        conn.send("exit")

    after_miss = hwr_samples(texts[0])
    assert counts(after_miss, "_total") == {
        ("hwr_resolutions_total", L(outcome="canonical_fallback", failure_code="none")): 1.0,
        ("hwr_resolution_attempts_total", L(stage="lookup", outcome="miss", failure_code="none")): 1.0,
        ("hwr_resolution_attempts_total", L(stage="production", outcome="skipped", failure_code="none")): 1.0,
    }

    final = hwr_samples(texts[2])
    assert counts(final, "_total") == {
        ("hwr_resolutions_total", L(outcome="canonical_fallback", failure_code="none")): 1.0,
        ("hwr_resolutions_total", L(outcome="local_production", failure_code="none")): 1.0,
        ("hwr_resolutions_total", L(outcome="local_hit", failure_code="none")): 1.0,
        ("hwr_resolution_attempts_total", L(stage="lookup", outcome="miss", failure_code="none")): 2.0,
        ("hwr_resolution_attempts_total", L(stage="production", outcome="skipped", failure_code="none")): 1.0,
        ("hwr_resolution_attempts_total", L(stage="production", outcome="built", failure_code="none")): 1.0,
        ("hwr_resolution_attempts_total", L(stage="lookup", outcome="hit", failure_code="none")): 1.0,
        ("hwr_published_bytes_total", L(storage_class="disk")): float(published),
    }
    assert counts(final, "_count") == {
        ("hwr_resolution_seconds_count", L(outcome="canonical_fallback")): 1.0,
        ("hwr_resolution_seconds_count", L(outcome="local_production")): 1.0,
        ("hwr_resolution_seconds_count", L(outcome="local_hit")): 1.0,
        ("hwr_build_seconds_count", L(stage="production")): 1.0,
        ("hwr_import_seconds_count", L()): 0.0,  # no remote provider: an unlabelled histogram shows zero
    }
    gauges = {key: value for key, value in final.items() if not key[0].endswith(("_total", "_count", "_sum"))}
    total, free = (
        gauges[("hwr_store_total_bytes", L(storage_class="disk"))],
        gauges[("hwr_store_free_bytes", L(storage_class="disk"))],
    )
    assert 0 < free <= total
    assert {
        key: value for key, value in gauges.items() if key[0] not in ("hwr_store_total_bytes", "hwr_store_free_bytes")
    } == {
        ("hwr_live_leases", L()): 1.0,
        ("hwr_store_artifacts", L(storage_class="disk")): 1.0,
        ("hwr_store_leased_artifacts", L(storage_class="disk")): 1.0,
        ("hwr_store_leases", L(storage_class="disk")): 1.0,
        ("hwr_store_min_free_bytes", L(storage_class="disk")): 0.0,
        ("hwr_store_bytes", L(storage_class="disk")): gauges[("hwr_store_bytes", L(storage_class="disk"))],
    }
    assert gauges[("hwr_store_bytes", L(storage_class="disk"))] >= published
    identity = model_identity(0)
    forbidden = (identity.source.model_id, identity.key, str(root))
    for text in texts:
        assert label_problems(all_samples(text), forbidden) == []


def test_label_hygiene_check_catches_keys_paths_and_model_ids() -> None:
    """The hygiene check itself: a key, a path or a model id as a label value is reported."""
    identity = model_identity(0)
    bad = [
        Sample("hwr_x", {"stage": identity.key}, 1.0),
        Sample("hwr_x", {"stage": "/dev/shm/domain"}, 1.0),
        Sample("hwr_x", {"outcome": "my-model"}, 1.0),
        Sample("hwr_x", {"outcome": "local_hit", "storage_class": "tmpfs"}, 1.0),
    ]
    assert len(label_problems(bad, ("my-model",))) == 3


def test_register_metrics_into_a_callers_registry(tmp_path: Path) -> None:
    """A serving process adds our metrics to its own CollectorRegistry; registering twice counts once; restore
    seconds recorded by adapters and store gauges for the runtime's domain appear there."""
    registry = CollectorRegistry()
    runtime = HostWeightRuntime(HostWeightRuntimeConfig(root=tmp_path / "domain"))
    first = register_metrics(registry, runtime=runtime)
    assert register_metrics(registry, runtime=runtime) is first
    built = runtime.resolve(model_identity(0), model_producer(0))
    assert built.lease is not None
    built.lease.close()
    hit = runtime.resolve(model_identity(0))
    assert hit.lease is not None
    record_restore(0.25, ok=True)
    samples = hwr_samples(generate_latest(registry).decode())
    hit.lease.close()
    assert counts(samples, "resolutions_total") == {
        ("hwr_resolutions_total", L(outcome="local_production", failure_code="none")): 1.0,
        ("hwr_resolutions_total", L(outcome="local_hit", failure_code="none")): 1.0,
    }
    assert samples[("hwr_restore_seconds_count", L(outcome="ok"))] == 1.0
    assert samples[("hwr_restore_seconds_sum", L(outcome="ok"))] == 0.25
    assert samples[("hwr_store_artifacts", L(storage_class="disk"))] == 1.0
    assert samples[("hwr_store_leases", L(storage_class="disk"))] == 1.0
    assert label_problems(all_samples(generate_latest(registry).decode()), (str(tmp_path),)) == []


def test_multiprocess_workers_are_summed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With PROMETHEUS_MULTIPROC_DIR, two worker processes each resolve a hit and hold the lease: a
    MultiProcessCollector sees both resolutions and two live leases (livesum); a worker marked dead drops out."""
    root = tmp_path / "domain"
    setup = HostWeightRuntime(HostWeightRuntimeConfig(root=root)).resolve(model_identity(0), model_producer(0))
    assert setup.lease is not None
    setup.lease.close()
    multiproc = tmp_path / "prometheus"
    multiproc.mkdir()
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(multiproc))
    with (
        child(_ops_children.multiprocess_worker, str(root), str(multiproc)) as (one, first),
        child(_ops_children.multiprocess_worker, str(root), str(multiproc)) as (two, second),
    ):
        assert recv_within(one) == recv_within(two) == "local_hit"
        samples = hwr_samples(generate_latest(registry).decode())
        assert samples[("hwr_resolutions_total", L(outcome="local_hit", failure_code="none"))] == 2.0
        assert samples[("hwr_live_leases", L())] == 2.0
        for conn in (one, two):
            conn.send("close")
            assert recv_within(conn) == "closed"
        for process in (first, second):
            process.join(120)  # type: ignore[attr-defined]
            mark_process_dead(process.pid, str(multiproc))  # type: ignore[attr-defined]
    samples = hwr_samples(generate_latest(registry).decode())
    assert ("hwr_live_leases", L()) not in samples
    assert samples[("hwr_resolutions_total", L(outcome="local_hit", failure_code="none"))] == 2.0


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def resolve_records() -> Iterator[list[logging.LogRecord]]:
    handler = _Records()
    logger = logging.getLogger(RESOLVE_LOGGER)
    previous = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield handler.records
    finally:
        logger.removeHandler(handler)
        logger.setLevel(previous)


def test_one_structured_log_record_per_resolve(tmp_path: Path, resolve_records: list[logging.LogRecord]) -> None:
    """Each resolve logs exactly one record on host_weight_runtime.resolve, carrying the report as JSON-safe data."""
    runtime = HostWeightRuntime(HostWeightRuntimeConfig(root=tmp_path / "domain"))
    leases = []
    for producer in (None, model_producer(0), None):
        resolution = runtime.resolve(model_identity(0), producer)
        if resolution.lease is not None:
            leases.append(resolution.lease)
    for lease in leases:
        lease.close()
    assert len(resolve_records) == 3
    reports = [getattr(record, REPORT_ATTRIBUTE) for record in resolve_records]
    assert [report["outcome"] for report in reports] == ["canonical_fallback", "local_production", "local_hit"]
    assert [record.levelno for record in resolve_records] == [logging.INFO] * 3
    for report in reports:
        assert json.loads(json.dumps(report)) == report
        assert report["identity_key"] == model_identity(0).key and report["mode"] == "preferred"
        assert set(report) == {"resolution_id", "identity_key", "mode", "outcome", "attempts", "elapsed_s", "failure", "publication_id"}
    assert [attempt["stage"] for attempt in reports[1]["attempts"]] == ["lookup", "production"]


def test_resolve_log_redacts_credentials(tmp_path: Path, resolve_records: list[logging.LogRecord]) -> None:
    """A failure whose details carry storage options or tokens (or a URL with user-info) is logged redacted."""

    def failing_store(config: HostWeightRuntimeConfig) -> HostWeightStore:
        raise HostWeightError(
            failure(
                ResolutionStage.DOMAIN,
                FailureCode.STORE_INIT_FAILED,
                "cannot open",
                storage_options={"key": "AKIA-secret"},
                token="hf_secret",
                url="s3://user:pw@bucket/prefix",
            )
        )

    runtime = HostWeightRuntime(HostWeightRuntimeConfig(root=tmp_path / "domain"), store_factory=failing_store)
    runtime.resolve(model_identity(0))
    (record,) = resolve_records
    assert record.levelno == logging.WARNING
    text = json.dumps(getattr(record, REPORT_ATTRIBUTE))
    assert "AKIA-secret" not in text and "hf_secret" not in text and "user:pw" not in text
    assert "<redacted>" in text


def test_metrics_settings_from_the_environment() -> None:
    """HWR_METRICS_PORT (0 picks a free port) and HWR_METRICS_ADDR; a bad port names the variable to fix."""
    config = HostWeightRuntimeConfig.from_env({"HWR_METRICS_PORT": "9464", "HWR_METRICS_ADDR": "0.0.0.0"})
    assert (config.metrics_port, config.metrics_addr) == (9464, "0.0.0.0")
    assert HostWeightRuntimeConfig.from_env({}).metrics_port is None
    for bad in ("http", "70000", "-1"):
        with pytest.raises(ValueError, match="HWR_METRICS_PORT"):
            HostWeightRuntimeConfig.from_env({"HWR_METRICS_PORT": bad})

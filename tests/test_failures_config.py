"""Failures that cross processes, configuration from the environment, and artifact digests."""

from __future__ import annotations

import hashlib
import itertools
import pickle
import random
from array import array
from pathlib import Path
from typing import Any

import pytest

from host_weight_runtime._digest import (
    DIGEST_ALGORITHM,
    TreeHasher,
    content_digest,
    tree_digest,
    tree_digests_parallel,
)
from host_weight_runtime.canonical_json import CanonicalJson, encode_canonical
from host_weight_runtime.config import (
    BackgroundVerifyMode,
    CapacityPolicy,
    HostWeightRuntimeConfig,
    RuntimeMode,
    StorageClass,
)
from host_weight_runtime.failures import (
    FailureCode,
    HostWeightError,
    HostWeightFailure,
    ResolutionStage,
    failure,
    raise_failure,
)
from host_weight_runtime.filesystem._prefault import prefault_enabled
from host_weight_runtime.filesystem.store import FilesystemHostWeightStore
from host_weight_runtime.tensors import ValidationLevel
from hwr_tools.preimported import preimported_context

CHILD_TIMEOUT_S = 120.0
SPAWN = preimported_context()


def sample_failure() -> HostWeightFailure:
    return HostWeightFailure(
        stage=ResolutionStage.LOOKUP,
        code=FailureCode.CHECKSUM_MISMATCH,
        retryable=False,
        message="payload model.safetensors does not match its digest; the artifact was denied and will be rebuilt",
        details=CanonicalJson.from_value({"file": "model.safetensors", "offset": 4096, "ratio": 0.5, "ok": None}),
    )


# --- HostWeightError and HostWeightFailure ---------------------------------------------------


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_host_weight_error_pickles_with_an_equal_failure(protocol: int) -> None:
    """HostWeightError survives pickling with an equal failure, the same type, code and message."""
    error = HostWeightError(sample_failure())
    again = pickle.loads(pickle.dumps(error, protocol=protocol))
    assert type(again) is HostWeightError
    assert again.failure == error.failure
    assert again.code is FailureCode.CHECKSUM_MISMATCH
    assert again.retryable is False
    assert str(again) == str(error)
    assert again.args == error.args


def test_host_weight_failure_pickles() -> None:
    """HostWeightFailure (a frozen, slotted dataclass) pickles to an equal value."""
    value = sample_failure()
    assert pickle.loads(pickle.dumps(value)) == value


def _raise_in_child(failure_dict: dict[str, Any]) -> None:
    raise HostWeightError(HostWeightFailure.from_dict(failure_dict))


def _send_error_from_child(queue: Any, failure_dict: dict[str, Any]) -> None:
    try:
        _raise_in_child(failure_dict)
    except HostWeightError as exc:
        queue.put(exc)


def test_host_weight_error_crosses_a_spawned_pool() -> None:
    """An error raised in a spawned pool worker arrives in the parent as an equal HostWeightError."""
    expected = sample_failure()
    with SPAWN.Pool(1) as pool:
        pending = pool.apply_async(_raise_in_child, (expected.to_dict(),))
        with pytest.raises(HostWeightError) as caught:
            pending.get(timeout=CHILD_TIMEOUT_S)
        pool.close()
        pool.join()
    assert caught.value.failure == expected
    assert caught.value.code is expected.code


def test_host_weight_error_crosses_a_spawned_process_queue() -> None:
    """An error put on a queue by a spawned child unpickles in the parent with an equal failure."""
    expected = sample_failure()
    queue = SPAWN.Queue()
    child = SPAWN.Process(target=_send_error_from_child, args=(queue, expected.to_dict()))
    child.start()
    try:
        received = queue.get(timeout=CHILD_TIMEOUT_S)
    finally:
        child.join(timeout=CHILD_TIMEOUT_S)
        if child.is_alive():
            child.kill()
            child.join(timeout=CHILD_TIMEOUT_S)
        queue.close()
        queue.join_thread()
    assert child.exitcode == 0
    assert type(received) is HostWeightError
    assert received.failure == expected


def test_failure_to_dict_from_dict_round_trips() -> None:
    """HostWeightFailure.from_dict(to_dict()) is equal, and to_dict is canonical-JSON safe."""
    value = sample_failure()
    as_dict = value.to_dict()
    assert HostWeightFailure.from_dict(as_dict) == value
    assert as_dict["stage"] == "lookup"
    assert as_dict["code"] == "checksum_mismatch"
    data = encode_canonical(as_dict)
    assert HostWeightFailure.from_dict(CanonicalJson(data).to_value()) == value


def test_failure_helpers_build_equal_values() -> None:
    """failure() and raise_failure() produce the failure their arguments describe."""
    built = failure(ResolutionStage.DOMAIN, FailureCode.NO_SPACE, "free space", retryable=True, path="/x", need=5)
    assert built == HostWeightFailure(
        ResolutionStage.DOMAIN, FailureCode.NO_SPACE, True, "free space", CanonicalJson.from_value({"path": "/x", "need": 5})
    )
    error = raise_failure(ResolutionStage.DOMAIN, FailureCode.NO_SPACE, "free space", retryable=True, path="/x", need=5)
    assert isinstance(error, HostWeightError)
    assert error.failure == built
    assert built.with_stage(ResolutionStage.LOOKUP).stage is ResolutionStage.LOOKUP
    assert built.with_stage(ResolutionStage.LOOKUP).code is FailureCode.NO_SPACE


@pytest.mark.parametrize(
    ("key", "bad"),
    [
        ("stage", "nowhere"),
        ("stage", 1),
        ("code", "bad_code"),
        ("code", None),
        ("retryable", "true"),
        ("retryable", 1),
        ("message", 5),
        ("details", []),
        ("details", "{}"),
    ],
    ids=str,
)
def test_failure_from_dict_rejects_bad_values(key: str, bad: Any) -> None:
    """HostWeightFailure.from_dict rejects unknown enum values and coerced types."""
    data = sample_failure().to_dict()
    data[key] = bad
    with pytest.raises(ValueError):
        HostWeightFailure.from_dict(data)


def test_failure_from_dict_rejects_unknown_and_missing_keys() -> None:
    """HostWeightFailure.from_dict requires exactly its five keys."""
    data = sample_failure().to_dict()
    with pytest.raises(ValueError):
        HostWeightFailure.from_dict({**data, "extra": 1})
    for key in data:
        partial = {k: v for k, v in data.items() if k != key}
        with pytest.raises(ValueError):
            HostWeightFailure.from_dict(partial)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"stage": "lookup"},
        {"code": "io_error"},
        {"retryable": 1},
        {"message": None},
        {"details": {"a": 1}},
        {"details": CanonicalJson.from_value([1, 2])},
    ],
    ids=str,
)
def test_failure_constructor_rejects_bad_fields(kwargs: dict[str, Any]) -> None:
    """A HostWeightFailure that could not round-trip through to_dict/from_dict cannot be built."""
    base: dict[str, Any] = {
        "stage": ResolutionStage.LOOKUP,
        "code": FailureCode.IO_ERROR,
        "retryable": True,
        "message": "m",
        "details": CanonicalJson.empty(),
    }
    with pytest.raises(ValueError):
        HostWeightFailure(**{**base, **kwargs})


# --- configuration ----------------------------------------------------------------------------


def test_from_env_reads_every_variable(tmp_path: Path) -> None:
    """from_env maps each HWR_* variable onto the config it describes."""
    env = {
        "HWR_MODE": "required",
        "HWR_ROOT": str(tmp_path / "domain"),
        "HWR_VALIDATION": "full_checksum",
        "HWR_STORAGE_CLASS": "tmpfs",
        "HWR_ALLOW_LOCAL_BUILD": "0",
        "HWR_ALLOW_POST_LOAD_PUBLISH": "false",
        "HWR_LOCK_TIMEOUT_S": "2.5",
        "HWR_MAX_ARTIFACT_BYTES": "1000",
        "HWR_MAX_STORE_BYTES": "5_000",
        "HWR_MIN_FREE_BYTES": "10",
        "HWR_PREFAULT": "off",
        "HWR_BACKGROUND_VERIFY": "OFF",
        "UNRELATED": "ignored",
    }
    config = HostWeightRuntimeConfig.from_env(env)
    assert config == HostWeightRuntimeConfig(
        mode=RuntimeMode.REQUIRED,
        root=tmp_path / "domain",
        validation=ValidationLevel.FULL_CHECKSUM,
        storage_class=StorageClass.TMPFS,
        allow_local_build=False,
        allow_post_load_publish=False,
        lock_timeout_s=2.5,
        capacity=CapacityPolicy(max_artifact_bytes=1000, max_store_bytes=5000, min_free_bytes=10),
        prefault=False,
        background_verify=BackgroundVerifyMode.OFF,
    )
    assert config.resolved_root == tmp_path / "domain"
    assert not (tmp_path / "domain").exists()


def test_from_env_defaults_and_blank_values() -> None:
    """An empty environment, or blank values, give the defaults."""
    assert HostWeightRuntimeConfig.from_env({}) == HostWeightRuntimeConfig()
    assert HostWeightRuntimeConfig.from_env({"HWR_MODE": "  ", "HWR_ROOT": ""}) == HostWeightRuntimeConfig()
    assert HostWeightRuntimeConfig().mode is RuntimeMode.PREFERRED
    assert HostWeightRuntimeConfig().capacity is None


@pytest.mark.parametrize(
    ("value", "expected"),
    [("DISABLED", RuntimeMode.DISABLED), (" preferred ", RuntimeMode.PREFERRED), ("Required", RuntimeMode.REQUIRED)],
)
def test_from_env_mode_is_case_insensitive(value: str, expected: RuntimeMode) -> None:
    """HWR_MODE accepts each mode in any case with surrounding spaces."""
    assert HostWeightRuntimeConfig.from_env({"HWR_MODE": value}).mode is expected


@pytest.mark.parametrize(
    ("value", "expected"), [("1", True), ("yes", True), ("ON", True), ("0", False), ("no", False), ("off", False)]
)
def test_from_env_booleans(value: str, expected: bool) -> None:
    """Boolean variables accept the usual spellings."""
    config = HostWeightRuntimeConfig.from_env({"HWR_ALLOW_LOCAL_BUILD": value, "HWR_ALLOW_POST_LOAD_PUBLISH": value})
    assert config.allow_local_build is expected
    assert config.allow_post_load_publish is expected


def test_the_lease_variables_go_through_from_env_and_reach_the_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """HWR_PREFAULT and HWR_BACKGROUND_VERIFY are parsed by from_env like every other variable (a bad value is
    a ValueError naming the variable); a config that leaves them None lets the store read the environment."""
    with pytest.raises(ValueError, match="HWR_PREFAULT='maybe' is invalid: prefault must be a boolean"):
        HostWeightRuntimeConfig.from_env({"HWR_PREFAULT": "maybe"})
    with pytest.raises(ValueError, match=r"HWR_BACKGROUND_VERIFY='twice' is invalid: .*set it to 'once'"):
        HostWeightRuntimeConfig.from_env({"HWR_BACKGROUND_VERIFY": "twice"})
    assert HostWeightRuntimeConfig.from_env({}).prefault is None
    assert prefault_enabled({}) is True
    assert prefault_enabled({"HWR_PREFAULT": "no"}) is False
    monkeypatch.setenv("HWR_PREFAULT", "0")
    assert prefault_enabled() is False
    monkeypatch.setenv("HWR_PREFAULT", "sometimes")
    with pytest.raises(ValueError, match="HWR_PREFAULT"):
        FilesystemHostWeightStore(tmp_path / "domain")
    store = FilesystemHostWeightStore.from_config(HostWeightRuntimeConfig(root=tmp_path / "domain", prefault=True))
    assert store._lookup._prefault is True


def test_from_env_reads_os_environ_by_default(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Without an explicit mapping, from_env reads the process environment."""
    monkeypatch.setenv("HWR_MODE", "disabled")
    monkeypatch.setenv("HWR_ROOT", str(tmp_path))
    config = HostWeightRuntimeConfig.from_env()
    assert config.mode is RuntimeMode.DISABLED
    assert config.root == tmp_path


@pytest.mark.parametrize(
    ("variable", "value", "must_mention"),
    [
        ("HWR_MODE", "sometimes", ["disabled", "preferred", "required"]),
        ("HWR_VALIDATION", "paranoid", ["manifest_and_metadata", "full_checksum"]),
        ("HWR_STORAGE_CLASS", "nfs", ["auto", "tmpfs", "disk"]),
        ("HWR_ALLOW_LOCAL_BUILD", "maybe", ["true", "false"]),
        ("HWR_ALLOW_POST_LOAD_PUBLISH", "2", ["true", "false"]),
        ("HWR_LOCK_TIMEOUT_S", "soon", []),
        ("HWR_LOCK_TIMEOUT_S", "-1", []),
        ("HWR_LOCK_TIMEOUT_S", "nan", []),
        ("HWR_LOCK_TIMEOUT_S", "inf", []),
        ("HWR_MAX_ARTIFACT_BYTES", "12x", []),
        ("HWR_MAX_ARTIFACT_BYTES", "0", []),
        ("HWR_MAX_ARTIFACT_BYTES", "1.5", []),
        ("HWR_MAX_STORE_BYTES", "-5", []),
        ("HWR_MIN_FREE_BYTES", "-1", []),
        ("HWR_ROOT", "relative/dir", ["absolute"]),
    ],
)
def test_from_env_rejects_bad_values_naming_the_variable(variable: str, value: str, must_mention: list[str]) -> None:
    """A bad value is a ValueError whose message names the variable and, for choices, the allowed values."""
    with pytest.raises(ValueError) as caught:
        HostWeightRuntimeConfig.from_env({"HWR_MODE": "preferred", variable: value})
    message = str(caught.value)
    assert variable in message
    for word in must_mention:
        assert word in message


def test_from_env_names_only_the_bad_variable() -> None:
    """With several variables set, the error names the bad one and not the good ones."""
    with pytest.raises(ValueError) as caught:
        HostWeightRuntimeConfig.from_env({"HWR_MODE": "required", "HWR_VALIDATION": "bogus"})
    assert "HWR_VALIDATION" in str(caught.value)
    assert "HWR_MODE" not in str(caught.value)


@pytest.mark.parametrize("root", [Path("relative"), Path("."), Path("")])
def test_config_rejects_a_relative_root(root: Path) -> None:
    """The configured root must be absolute, in code and via from_dict."""
    with pytest.raises(ValueError):
        HostWeightRuntimeConfig(root=root)
    with pytest.raises(ValueError):
        HostWeightRuntimeConfig.from_dict({"root": str(root)})


@pytest.mark.parametrize(
    "kwargs",
    [
        {"mode": "preferred"},
        {"validation": "full_checksum"},
        {"storage_class": "tmpfs"},
        {"root": "/abs"},
        {"allow_local_build": 1},
        {"lock_timeout_s": True},
        {"lock_timeout_s": float("nan")},
        {"lock_timeout_s": -0.5},
        {"capacity": {"max_artifact_bytes": 1}},
    ],
    ids=str,
)
def test_config_constructor_rejects_untyped_values(kwargs: dict[str, Any]) -> None:
    """The dataclass itself takes typed values only; strings go through from_dict/from_env."""
    with pytest.raises(ValueError):
        HostWeightRuntimeConfig(**kwargs)


def test_from_dict_rejects_unknown_keys() -> None:
    """from_dict refuses keys it does not know instead of ignoring a typo."""
    with pytest.raises(ValueError):
        HostWeightRuntimeConfig.from_dict({"mdoe": "required"})


@pytest.mark.parametrize(
    "kwargs",
    [{"max_artifact_bytes": 0}, {"max_store_bytes": True}, {"min_free_bytes": -1}, {"max_artifact_bytes": 1.0}],
    ids=str,
)
def test_capacity_policy_rejects_bad_limits(kwargs: dict[str, Any]) -> None:
    """Capacity limits are positive ints (or None); min_free_bytes is a non-negative int."""
    with pytest.raises(ValueError):
        CapacityPolicy(**kwargs)


# --- digests ----------------------------------------------------------------------------------

CHUNK = 1024
SIZES = [0, 1, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 5]


def _data(size: int) -> bytes:
    return random.Random(size).randbytes(size)


def _feed_odd_pieces(data: bytes, chunk_bytes: int) -> str:
    hasher = TreeHasher(chunk_bytes)
    position = 0
    for step in itertools.cycle([1, 7, 333, chunk_bytes - 1, chunk_bytes + 1, 0, 2 * chunk_bytes + 3]):
        if position >= len(data):
            break
        hasher.update(memoryview(data)[position : position + step])
        position += step
    return hasher.hexdigest()


def _spec_digest(data: bytes, chunk_bytes: int) -> str:
    """The documented construction, written out independently of the module."""
    pieces = [data[i : i + chunk_bytes] for i in range(0, len(data), chunk_bytes)] or [b""]
    outer = hashlib.sha256(b"hwr/sha256-tree-v1\x00")
    outer.update(len(data).to_bytes(8, "little"))
    for piece in pieces:
        outer.update(hashlib.sha256(piece).digest())
    return outer.hexdigest()


@pytest.mark.parametrize("size", SIZES)
def test_tree_digest_agrees_across_incremental_whole_and_parallel(size: int) -> None:
    """Odd-sized incremental updates, one-shot and multi-threaded hashing give the same digest."""
    data = _data(size)
    whole = tree_digest(data, chunk_bytes=CHUNK)
    assert _feed_odd_pieces(data, CHUNK) == whole
    assert whole == _spec_digest(data, CHUNK)
    buffers = [memoryview(_data(s)) for s in SIZES]
    index = SIZES.index(size)
    for threads in (1, 2, 4, 7):
        assert tree_digests_parallel(buffers, chunk_bytes=CHUNK, threads=threads)[index] == whole


def test_tree_digests_are_distinct_and_not_plain_sha256() -> None:
    """Different lengths give different digests, and the tree digest is not sha256 of the bytes."""
    digests = [tree_digest(_data(size), chunk_bytes=CHUNK) for size in SIZES]
    assert len(set(digests)) == len(SIZES)
    assert tree_digest(b"abc", chunk_bytes=CHUNK) != hashlib.sha256(b"abc").hexdigest()
    assert DIGEST_ALGORITHM == "sha256-tree-v1"


def test_tree_digest_golden_values() -> None:
    """The tree digest format is pinned for the empty buffer and a short one."""
    assert tree_digest(b"", chunk_bytes=CHUNK) == "8875f50a72107a07dc2cacaef7f024b2ddca2f7a13c4b4c6f83125a7980d2dc0"
    assert tree_digest(b"abc", chunk_bytes=2) == "33c0561d4a13434567f1567340e4410b9e81f1f31c3eb438a0743c6a80a77be8"


def test_tree_digest_accepts_typed_memoryviews() -> None:
    """A memoryview over multi-byte items is hashed as its raw bytes."""
    values = array("f", [1.0, 2.0, 3.5] * 500)
    raw = values.tobytes()
    expected = tree_digest(raw, chunk_bytes=CHUNK)
    assert tree_digest(memoryview(values), chunk_bytes=CHUNK) == expected
    assert tree_digests_parallel([memoryview(values)], chunk_bytes=CHUNK, threads=3) == [expected]


@pytest.mark.parametrize("chunk_bytes", [0, -1, True, 1.5])
def test_tree_digest_rejects_a_bad_chunk_size(chunk_bytes: Any) -> None:
    """A chunk size that is not a positive int is a ValueError, never a hang or a wrong digest."""
    with pytest.raises(ValueError):
        TreeHasher(chunk_bytes)
    with pytest.raises(ValueError):
        tree_digests_parallel([memoryview(b"abc")], chunk_bytes=chunk_bytes)


def test_content_digest_is_independent_of_entry_order() -> None:
    """content_digest depends on the set of (name, dtype, shape, digest), not on order or file split."""
    entries = [
        ("layer.0.weight", "BF16", (4, 4), "1" * 64),
        ("layer.0.bias", "BF16", (4,), "2" * 64),
        ("layer.1.weight", "F32", (4, 4), "3" * 64),
        ("scale", "F32", (), "4" * 64),
    ]
    reference = content_digest(entries)
    for permutation in itertools.permutations(entries):
        assert content_digest(permutation) == reference
    assert content_digest(iter(entries)) == reference


@pytest.mark.parametrize("field", range(4))
def test_content_digest_changes_with_every_field(field: int) -> None:
    """Changing a name, dtype, shape or digest changes the content digest."""
    entries = [("a", "F32", (2, 3), "1" * 64), ("b", "F32", (3,), "2" * 64)]
    reference = content_digest(entries)
    changed = list(entries[0])
    changed[field] = {0: "a2", 1: "F16", 2: (3, 2), 3: "9" * 64}[field]
    assert content_digest([tuple(changed), entries[1]]) != reference  # type: ignore[list-item]


@pytest.mark.parametrize("size", SIZES)
def test_tree_hasher_with_executor_matches_the_spec(size: int) -> None:
    """The writer's parallel incremental path (whole chunks on a pool, partial ones inline) gives the same digest."""
    from concurrent.futures import ThreadPoolExecutor

    from host_weight_runtime._digest import TreeHasher

    data = _data(size)
    with ThreadPoolExecutor(max_workers=3) as pool:
        for piece_size in (1, CHUNK - 3, CHUNK, 2 * CHUNK + 1, 5 * CHUNK):
            hasher = TreeHasher(CHUNK)
            for start in range(0, len(data), piece_size):
                hasher.update(data[start : start + piece_size], executor=pool)
            assert hasher.hexdigest() == _spec_digest(data, CHUNK)

"""X03: vLLM-Omni's reference Host Weight Runtime API on this runtime, and its own adapters on this store.

The surface tests read the installed reference (vllm-omni 0.30.0, a test dependency installed without its
dependencies) as source, never importing it, and hold `host_weight_runtime.compat.vllm_omni` to every public
name, enum member, field and signature in it. The adapter tests run vLLM-Omni's own final-layout identity,
producer and restorer, unmodified, in spawned processes through `install()`.
"""

from __future__ import annotations

import ast
import dataclasses
import enum
import importlib
import importlib.machinery
import inspect
import os
import time
from pathlib import Path

import pytest
import torch

from host_weight_runtime.compat import vllm_omni as compat
from hwr_tools.synthetic_models import build_model, save_model_folder

from . import _vllm_omni
from .support import recv_within, spawned_child

# The reference's public modules, as `install()` aliases them (the package itself is "").
PUBLIC_MODULES = (
    "",
    "config",
    "errors",
    "identity",
    "inspection",
    "lease",
    "manifest",
    "outcomes",
    "protocols",
    "runtime",
    "filesystem",
    "filesystem.locks",
    "filesystem.store",
)

# Records whose fields are this runtime's own on purpose (docs/vllm-omni.md says why): the lease's provenance
# keeps this runtime's fields (with the reference's names as properties); every other record has the reference's.
OWN_FIELDS = frozenset({"LeaseProvenance"})


def _reference_root() -> Path:
    found = importlib.machinery.PathFinder.find_spec("vllm_omni")
    assert found is not None and found.submodule_search_locations, "vllm-omni==0.30.0 is a test dependency (make setup)"
    return Path(next(iter(found.submodule_search_locations))) / "host_weight_runtime"


def _reference_tree(module: str) -> ast.Module:
    base = _reference_root().joinpath(*module.split(".")) if module else _reference_root()
    path = base / "__init__.py" if base.is_dir() else base.with_suffix(".py")
    return ast.parse(path.read_text(encoding="utf-8"))


def _compat_module(module: str) -> object:
    return importlib.import_module(f"{compat.__name__}.{module}" if module else compat.__name__)


def _reference_all(tree: ast.Module) -> list[str]:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            value = ast.literal_eval(node.value)
            assert isinstance(value, list)
            return [str(name) for name in value]
    return []


def _classes(tree: ast.Module) -> list[ast.ClassDef]:
    return [node for node in tree.body if isinstance(node, ast.ClassDef)]


def _base_names(node: ast.ClassDef) -> set[str]:
    return {base.id if isinstance(base, ast.Name) else getattr(base, "attr", "") for base in node.bases}


def _is_dataclass(node: ast.ClassDef) -> bool:
    return any("dataclass" in ast.unparse(decorator) for decorator in node.decorator_list)


def _annotated_fields(node: ast.ClassDef) -> list[str]:
    return [
        item.target.id for item in node.body if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)
    ]


@pytest.mark.parametrize("module", PUBLIC_MODULES)
def test_every_public_name_of_the_reference_exists(module: str) -> None:
    """X03: each public module of vllm_omni.host_weight_runtime 0.30.0 has its compat module with every name."""
    names = _reference_all(_reference_tree(module))
    assert names, f"the reference's {module or 'package'} lists no names"
    missing = [name for name in names if not hasattr(_compat_module(module), name)]
    assert missing == []


@pytest.mark.parametrize("module", [m for m in PUBLIC_MODULES if m and m != "filesystem"])
def test_enum_members_and_record_fields_match_the_reference(module: str) -> None:
    """X03: every enum member of the reference exists (same value where this runtime reports it), and every
    record has the reference's fields (the deliberate exceptions are listed in OWN_FIELDS)."""
    ours = _compat_module(module)
    problems: list[str] = []
    for node in _classes(_reference_tree(module)):
        mine = getattr(ours, node.name, None)
        if mine is None:
            continue
        if _base_names(node) & {"Enum", "str"} == {"Enum", "str"} or "Enum" in _base_names(node):
            assert isinstance(mine, enum.EnumMeta), node.name
            for item in node.body:
                if isinstance(item, ast.Assign) and isinstance(item.targets[0], ast.Name):
                    member = item.targets[0].id
                    if not hasattr(mine, member):
                        problems.append(f"{node.name}.{member} is missing")
        elif _is_dataclass(node) and node.name not in OWN_FIELDS:
            wanted = _annotated_fields(node)
            have = [field.name for field in dataclasses.fields(mine)] if dataclasses.is_dataclass(mine) else []
            absent = [name for name in wanted if name not in have and not hasattr(mine, name)]
            problems.extend(f"{node.name}.{name} is missing" for name in absent)
    assert problems == []


def _reference_signature(module: str, qualname: str) -> list[tuple[str, str, str | None]]:
    class_name, _, method = qualname.partition(".")
    for node in _classes(_reference_tree(module)):
        if node.name != class_name:
            continue
        for item in node.body:
            if isinstance(item, ast.FunctionDef) and item.name == method:
                arguments = item.args
                positional = [*arguments.posonlyargs, *arguments.args]
                defaults: list[ast.expr | None] = [None] * (len(positional) - len(arguments.defaults))
                defaults += list(arguments.defaults)
                made = [
                    (a.arg, "positional", None if d is None else ast.unparse(d))
                    for a, d in zip(positional, defaults, strict=True)
                ]
                made += [
                    (a.arg, "keyword", None if d is None else ast.unparse(d))
                    for a, d in zip(arguments.kwonlyargs, arguments.kw_defaults, strict=True)
                ]
                return [entry for entry in made if entry[0] not in ("self", "cls")]
    raise AssertionError(f"the reference has no {qualname} in {module}")


def _our_signature(function: object) -> list[tuple[str, str, str | None]]:
    made: list[tuple[str, str, str | None]] = []
    for parameter in inspect.signature(function).parameters.values():  # type: ignore[arg-type]
        if parameter.name in ("self", "cls"):
            continue
        kind = "keyword" if parameter.kind is inspect.Parameter.KEYWORD_ONLY else "positional"
        default = None if parameter.default is inspect.Parameter.empty else parameter.default
        shown = None if default is None and parameter.default is inspect.Parameter.empty else _spell(default)
        made.append((parameter.name, kind, shown))
    return made


def _spell(value: object) -> str:
    if isinstance(value, enum.Enum):
        return f"{type(value).__name__}.{value.name}"
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return f"{type(value).__name__}()"
    return repr(value)


@pytest.mark.parametrize(
    ("module", "qualname"),
    [
        ("runtime", "HostWeightRuntime.__init__"),
        ("runtime", "HostWeightRuntime.from_config"),
        ("runtime", "HostWeightRuntime.resolve"),
        ("runtime", "HostWeightRuntime.publish_after_load"),
        ("filesystem.store", "FilesystemHostWeightStore.__init__"),
        ("filesystem.store", "FilesystemHostWeightStore.lookup"),
        ("filesystem.store", "FilesystemHostWeightStore.get_or_build"),
        ("filesystem.store", "FilesystemHostWeightStore.cleanup"),
        ("filesystem.store", "FilesystemHostWeightStore.inspect_artifact"),
        ("filesystem.locks", "FileLock.__init__"),
    ],
)
def test_signatures_and_defaults_match_the_reference(module: str, qualname: str) -> None:
    """X03: the reference's entry points take the same parameters, in the same kinds, with the same defaults."""
    class_name, _, method = qualname.partition(".")
    ours = getattr(getattr(_compat_module(module), class_name), method)
    assert _our_signature(ours) == _reference_signature(module, qualname)


def test_install_makes_the_reference_names_this_runtime() -> None:
    """X03: after install() (twice) every `vllm_omni.host_weight_runtime` import is the compat module, the
    vllm_omni package's own __init__ (which needs vLLM) never runs, vLLM-Omni's adapters bind this runtime's
    types, and the reference's private modules are refused rather than mixed in."""
    with spawned_child(_vllm_omni.install_facts_in_child) as conn:
        facts = recv_within(conn)
    assert isinstance(facts, dict)
    assert facts["same_module"] is True
    assert facts["locks"] == f"{compat.__name__}.filesystem.locks"
    assert facts["finders"] == 1
    assert facts["package_init_ran"] is False and facts["vllm_loaded"] is False
    assert facts["adapters_see"] == "host_weight_runtime.failures"
    assert "private module" in facts["private"]


def test_install_after_the_reference_runtime_is_refused() -> None:
    """X03: a process that already holds the reference's runtime module is told to call install() first."""
    with spawned_child(_vllm_omni.install_after_reference_in_child) as conn:
        message = recv_within(conn)
    assert isinstance(message, str) and "call install() first" in message


def test_vllm_omni_adapters_publish_and_restore_bit_exact_on_this_store(tmp_path: Path) -> None:
    """X03: vLLM-Omni's own identity adapter and FinalLayoutBF16Producer publish a real diffusers DiT's final
    layout on this store in one process; in another, its FinalLayoutTensorRestorer restores it into a fresh
    skeleton with other values: every tensor bit-exact, viewing the lease's mapped pages."""
    checkpoint = save_model_folder(build_model("flux", seed=0), tmp_path / "checkpoint")
    root, cache = tmp_path / "hwr", tmp_path / "source-digests"
    with spawned_child(_vllm_omni.publish_in_child, str(root), str(checkpoint), str(cache)) as conn:
        published = recv_within(conn)
    assert isinstance(published, dict)
    assert (published["outcome"], published["failure"]) == ("published", None)
    assert (root / "artifacts" / published["key"]).is_dir()

    with spawned_child(_vllm_omni.restore_in_child, str(root), str(checkpoint), str(cache)) as conn:
        restored = recv_within(conn)
    assert isinstance(restored, dict)
    assert restored["outcome"] == "local_hit"
    assert restored["key"] == published["key"]
    assert restored["before"] != published["digests"]  # the skeleton's own values differed everywhere it counts
    assert restored["restored"] == published["digests"]
    assert restored["shares_lease_memory"] is True


# ----------------------------------------------------------------------------- translations in the reference's words


def _ref_identity(rank: int = 0) -> compat.WeightArtifactIdentity:
    return compat.WeightArtifactIdentity(
        schema_version=1,
        source=compat.WeightSourceIdentity("org/compat-model", "rev-1", "files-sha"),
        component=compat.ComponentIdentity("transformer", "diffusion.dit"),
        representation=compat.WeightRepresentation("runtime-bf16", "torch.bfloat16"),
        layout=compat.RuntimeWeightLayout("final-module-layout", tensor_parallel_rank=rank),
        adaptation=compat.AdaptationIdentity(),
        producer=compat.ProducerIdentity("compat.test", "1", "impl-sha", "producer-v1", "restorer-v1"),
    )


class _OneTensor:
    """A producer written the reference's way: one BF16 tensor through the writer used as a context manager."""

    def __init__(self, identity: compat.WeightArtifactIdentity, *, post_load: bool = False) -> None:
        self.calls = 0
        phase = compat.LookupPhase.POST_LOAD_ONLY if post_load else compat.LookupPhase.PRE_LOAD_SAFE
        self._spec = compat.WeightProductionSpec(
            "compat.test", (identity,), compat.ProductionSourceMode.FINALIZED_MODEL, phase
        )

    @property
    def spec(self) -> compat.WeightProductionSpec:
        return self._spec

    def produce(self, writer: compat.ArtifactWriter) -> compat.ProductionMetadata:
        self.calls += 1
        spec = compat.TensorWriteSpec("w", (4,), torch.bfloat16)
        with writer.open_tensor_file("weights.safetensors", (spec,)) as output:
            output.write_tensor("w", torch.arange(4, dtype=torch.float32).to(torch.bfloat16))
        return compat.ProductionMetadata("producer-v1", "restorer-v1")


def _ref_store(root: Path) -> compat.filesystem.FilesystemHostWeightStore:
    domain = compat.StorageDomainPolicy(root=root, storage_class=compat.filesystem.detect_storage_class(root.parent))
    return compat.filesystem.FilesystemHostWeightStore(domain, compat.CapacityPolicy(), compat.IntegrityPolicy())


def _built(store: compat.filesystem.FilesystemHostWeightStore) -> compat.HostWeightLease:
    identity = _ref_identity()
    result = store.get_or_build(
        compat.BuildRequest(identity),
        _OneTensor(identity),
        validation=compat.ValidationLevel.FULL_CHECKSUM,
        deadline=time.monotonic() + 30,
    )
    assert result.status is compat.StoreStatus.BUILT and result.lease is not None
    return result.lease


def test_manifest_records_have_the_reference_shape_and_translate_this_runtimes(tmp_path: Path) -> None:
    """X03: the reference's manifest records round-trip through its dict form and refuse what it refuses;
    an artifact on this store reads back in its words: the same tensors, files and digests as on disk."""
    store = _ref_store(tmp_path / "store")
    lease = _built(store)
    native = lease.manifest
    lease.close()
    inspected = store.inspect_artifact(_ref_identity(), validation=compat.ValidationLevel.FULL_CHECKSUM)
    manifest = inspected.manifest
    assert isinstance(manifest, compat.WeightManifest)
    assert manifest == compat.WeightManifest.from_native(native)
    assert manifest.artifact_key == native.identity.key and manifest.identity == native.identity
    (tensor,) = manifest.tensors
    assert (tensor.name, tensor.file_name, tensor.storage_key) == ("w", "weights.safetensors", "w")
    assert (tensor.dtype, tensor.shape, tensor.stride, tensor.nbytes) == ("torch.bfloat16", (4,), (1,), 8)
    assert tensor.sha256 == native.tensor("w").digest
    assert [(f.file_name, f.size, f.sha256) for f in manifest.files] == [
        (f.name, f.size, f.digest) for f in native.files
    ]
    assert manifest.artifact_content_sha256 == native.content_digest
    assert compat.WeightManifest.from_dict(manifest.to_dict()) == manifest

    document = manifest.to_dict()
    document["extra"] = 1
    with pytest.raises(compat.ManifestValidationError, match="unexpected=\\['extra'\\]"):
        compat.WeightManifest.from_dict(document)
    with pytest.raises(compat.ManifestValidationError, match="safe relative basename"):
        compat.FileManifestEntry(file_name="../weights.safetensors", size=1, sha256="0" * 64)
    marker = compat.PublicationMarker.from_native(
        _native_marker(store, manifest.artifact_key), integrity_mode="full_checksum"
    )
    assert marker.publication_id == inspected.publication_id
    assert compat.PublicationMarker.from_dict(marker.to_dict()) == marker
    # on disk nothing changed: the artifact's manifest.json is still this runtime's format
    on_disk = (store.artifacts_dir / manifest.artifact_key / "manifest.json").read_bytes()
    assert b"digest_algorithm" in on_disk and b"artifact_content_sha256" not in on_disk


def _native_marker(store: compat.filesystem.FilesystemHostWeightStore, key: str) -> object:
    from host_weight_runtime.manifest import PublicationMarker

    return PublicationMarker.from_bytes((store.artifacts_dir / key / "READY.json").read_bytes())


def test_provenance_names_the_domain_as_the_reference_does(tmp_path: Path) -> None:
    """X03: a lease's provenance carries the domain's id under the reference's name too (`domain_uuid`)."""
    store = _ref_store(tmp_path / "store")
    lease = _built(store)
    try:
        assert lease.provenance.domain_uuid == lease.provenance.domain_id == store.domain_uuid
        assert store.inspect_domain().domain_uuid == lease.provenance.domain_uuid
    finally:
        lease.close()


def test_a_payload_that_is_not_what_the_manifest_says_is_manifest_corrupt(tmp_path: Path) -> None:
    """X03: a payload file replaced by a symlink is the reference's MANIFEST_CORRUPT through the compat store
    (natively PAYLOAD_INVALID): nothing is followed, nothing is served."""
    store = _ref_store(tmp_path / "store")
    _built(store).close()
    artifact = store.artifacts_dir / _ref_identity().key
    payload = artifact / "weights.safetensors"
    os.chmod(artifact, 0o700)
    target = tmp_path / "elsewhere.safetensors"
    target.write_bytes(payload.read_bytes())
    payload.unlink()
    payload.symlink_to(target)
    found = store.lookup(_ref_identity(), validation=compat.ValidationLevel.MANIFEST_AND_METADATA)
    assert found.status is compat.StoreStatus.INVALID and found.lease is None
    assert found.failure is not None and found.failure.code is compat.FailureCode.MANIFEST_CORRUPT


@pytest.mark.parametrize("mode", [compat.RuntimeMode.PREFERRED, compat.RuntimeMode.REQUIRED])
def test_a_provider_id_that_is_not_a_url_is_unsupported_before_any_build(
    tmp_path: Path, mode: compat.RuntimeMode
) -> None:
    """X03: a remote provider given by id (not a URL) keeps the reference's meaning: after a local miss the
    remote stage fails UNSUPPORTED, in every mode, and the producer never runs."""
    identity = _ref_identity()
    producer = _OneTensor(identity)
    domain = compat.StorageDomainPolicy(
        root=tmp_path / "store", storage_class=compat.filesystem.detect_storage_class(tmp_path)
    )
    remote = compat.RemoteImportPolicy(on_local_miss=compat.RemoteOnMiss.TRY, providers=("mooncake",))
    runtime = compat.HostWeightRuntime.from_config(
        compat.HostWeightRuntimeConfig(mode=mode, domain=domain, remote=remote)
    )
    resolution = runtime.resolve(identity, producer=producer)
    report = resolution.report
    assert resolution.lease is None and producer.calls == 0
    assert report.outcome is compat.ResolutionOutcome.FAILED
    assert [attempt.stage for attempt in report.attempts] == [
        compat.ResolutionStage.LOOKUP,
        compat.ResolutionStage.REMOTE,
    ]
    failure = report.attempts[-1].failure
    assert failure is not None and failure.code is compat.FailureCode.UNSUPPORTED and "mooncake" in failure.message
    assert report.attempts[-1].action is compat.ResolutionAction.FAIL_STARTUP


def test_a_filesystem_that_is_not_node_local_is_refused_before_the_root_exists(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """X03: the compat store asks its module's `detect_filesystem_type` (the reference's public function, which
    its users substitute) and refuses a network filesystem as DOMAIN_POLICY_MISMATCH, creating nothing."""
    store_module = importlib.import_module(f"{compat.__name__}.filesystem.store")
    monkeypatch.setattr(store_module, "detect_filesystem_type", lambda _path: "nfs4")
    root = tmp_path / "store"
    domain = compat.StorageDomainPolicy(root=root, storage_class=compat.StorageClass.DISK)
    with pytest.raises(compat.HostWeightError) as raised:
        compat.filesystem.FilesystemHostWeightStore(domain, compat.CapacityPolicy(), compat.IntegrityPolicy())
    assert raised.value.failure.code is compat.FailureCode.DOMAIN_POLICY_MISMATCH
    assert "nfs4" in raised.value.failure.message and not root.exists()


class _OwnLease:
    """A lease object of a store written to the reference's protocol (anything with close())."""

    def __init__(self, fail: bool = False) -> None:
        self.fail, self.closed = fail, 0

    def close(self) -> None:
        self.closed += 1
        if self.fail:
            raise RuntimeError("close failed")


class _ProtocolStore:
    """A store written to the reference's protocol whose get_or_build answers with its own lease object."""

    def __init__(self, status: compat.StoreStatus, lease: _OwnLease) -> None:
        self.status, self.lease = status, lease

    def lookup(self, identity: object, *, validation: object, deadline: float | None = None) -> compat.StoreResult:
        return compat.StoreResult(compat.StoreStatus.MISS)

    def get_or_build(
        self, request: object, producer: object, *, validation: object, deadline: float
    ) -> compat.StoreResult:
        return compat.StoreResult(self.status, lease=self.lease)  # type: ignore[arg-type]


def _protocol_runtime(tmp_path: Path, store: _ProtocolStore) -> compat.HostWeightRuntime:
    domain = compat.StorageDomainPolicy(root=tmp_path / "unused", storage_class=compat.StorageClass.DISK)
    config = compat.HostWeightRuntimeConfig(
        mode=compat.RuntimeMode.PREFERRED,
        domain=domain,
        production=compat.ProductionPolicy(allow_post_load_publish=True),
    )
    return compat.HostWeightRuntime(config, store)


def test_post_load_publication_closes_a_protocol_stores_own_lease(tmp_path: Path) -> None:
    """X03: a post-load publication only closes the store's lease, so a reference-protocol store's own lease
    object is accepted there and closed once; a close that raises is the reference's PUBLICATION_FAILED."""
    identity = _ref_identity()
    joined = _OwnLease()
    report = _protocol_runtime(tmp_path, _ProtocolStore(compat.StoreStatus.JOINED, joined)).publish_after_load(
        identity, producer=_OneTensor(identity, post_load=True)
    )
    assert report.outcome is compat.PostLoadPublicationOutcome.JOINED and joined.closed == 1

    failing = _OwnLease(fail=True)
    report = _protocol_runtime(tmp_path, _ProtocolStore(compat.StoreStatus.BUILT, failing)).publish_after_load(
        identity, producer=_OneTensor(identity, post_load=True)
    )
    assert report.outcome is compat.PostLoadPublicationOutcome.FAILED and failing.closed == 1
    assert report.failure is not None
    assert (report.failure.stage, report.failure.code) == (
        compat.ResolutionStage.LIFECYCLE,
        compat.FailureCode.PUBLICATION_FAILED,
    )
    assert report.failure.details.to_value() == {"exception_type": "RuntimeError", "store_outcome": "built"}


def test_resolve_closes_and_refuses_a_lease_that_is_not_this_runtimes(tmp_path: Path) -> None:
    """X03: resolve never hands a caller a lease it has not checked: a reference-protocol store's own lease
    object is closed and the build is a typed failure, not a crash and not a served lease."""
    identity = _ref_identity()
    own = _OwnLease()
    resolution = _protocol_runtime(tmp_path, _ProtocolStore(compat.StoreStatus.BUILT, own)).resolve(
        identity, producer=_OneTensor(identity)
    )
    assert resolution.lease is None and own.closed == 1
    assert resolution.report.outcome is compat.ResolutionOutcome.FAILED
    failure = resolution.report.attempts[-1].failure
    assert failure is not None and failure.code is compat.FailureCode.UNEXPECTED_STATUS
    assert "_OwnLease" in failure.message


def test_get_or_build_asks_the_stores_own_lookup_first(tmp_path: Path) -> None:
    """X03: as in the reference, the compat store's get_or_build goes through its own public `lookup` first,
    so a subclass's lookup is asked (and a hit it answers is what the build returns, with no producer run)."""
    asked: list[compat.StoreStatus] = []

    class Counting(compat.filesystem.FilesystemHostWeightStore):
        def lookup(
            self,
            identity: compat.WeightArtifactIdentity,
            *,
            validation: compat.ValidationLevel,
            deadline: float | None = None,
        ) -> compat.StoreResult:
            found = super().lookup(identity, validation=validation, deadline=deadline)
            asked.append(found.status)
            return found

    root = tmp_path / "store"
    domain = compat.StorageDomainPolicy(root=root, storage_class=compat.filesystem.detect_storage_class(tmp_path))
    store = Counting(domain, compat.CapacityPolicy(), compat.IntegrityPolicy())
    identity = _ref_identity()
    producer = _OneTensor(identity)
    for expected in (compat.StoreStatus.BUILT, compat.StoreStatus.HIT):
        result = store.get_or_build(
            compat.BuildRequest(identity),
            producer,
            validation=compat.ValidationLevel.FULL_CHECKSUM,
            deadline=time.monotonic() + 30,
        )
        assert result.status is expected and result.lease is not None
        result.lease.close()
    assert asked == [compat.StoreStatus.MISS, compat.StoreStatus.HIT]
    assert producer.calls == 1

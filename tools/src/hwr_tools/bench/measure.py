"""One benchmark run inside one fresh process: load one way, touch every page, read the process's memory.

Every row ends the same way: a diffusers model whose weights are usable, then the same
touch pass (one byte in every 4 KiB page of every parameter and buffer), so page faults
and page-table setup count for every row and memory bandwidth counts for none.
"""

from __future__ import annotations

import datetime
import enum
import itertools
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from host_weight_runtime import (
    FsspecArtifactProvider,
    HostWeightRuntime,
    HostWeightRuntimeConfig,
    RuntimeMode,
    StorageClass,
)
from host_weight_runtime.diffusion import (
    FinalLayoutParallelIdentity,
    LoadedComponent,
    build_skeleton,
    load_component,
)

from ..common import JsonValue
from ..memory import memory_rollup, merged_spans
from .peers import PeerLoad, load_peer, peer_named
from .steal import cpu_line, steal_ticks

__all__ = [
    "PAGE_BYTES",
    "LoadKind",
    "RowSpec",
    "join_group",
    "leave_group",
    "peak_rss",
    "reset_peak_rss",
    "run_row",
    "touch_model",
    "weight_spans",
]

PAGE_BYTES = 4096
_GROUP_TIMEOUT_S = 600.0
_MODEL_CLASS = "FluxTransformer2DModel"


class LoadKind(str, enum.Enum):
    """How a row gets its model."""

    CANONICAL = "canonical"  # diffusers from_pretrained(torch_dtype=bfloat16) from the FP32 checkpoint
    HWR = "hwr"  # load_component through a runtime on a domain
    PEER = "peer"  # a peer loader reads the final-layout BF16 file, the skeleton assigns its tensors


@dataclass(frozen=True, slots=True)
class RowSpec:
    """Everything a fresh process needs to load one row's model; crosses the process boundary as JSON."""

    name: str
    kind: LoadKind
    pipeline: str  # a folder, or a repo id in the Hugging Face cache `cache_dir`
    subfolder: str
    root: str | None = None  # HWR: the domain root
    cache_dir: str | None = None  # CANONICAL, HWR: the Hugging Face cache holding `pipeline` (a repo id)
    stream_on_miss: bool = False  # HWR: stream the checkpoint into the artifact on a miss
    publish_in_background: bool = False  # HWR: return the canonical model, publish on a thread
    peer: str | None = None  # PEER: the peer's name
    peer_file: str | None = None  # PEER: the final-layout file it reads
    remote_url: str | None = None  # HWR: a remote (HWR_REMOTE) the runtime imports from after a local miss
    remote_options: dict[str, Any] | None = None  # HWR: its fsspec storage options (a local endpoint, no secret)
    background_verify: str | None = None  # HWR: HWR_BACKGROUND_VERIFY in the worker (None: inherited)
    tensor_parallel_size: int = 1  # HWR: > 1 loads one rank of a gloo group of this size
    tensor_parallel_rank: int = 0  # HWR: this worker's rank in its group
    rendezvous: str | None = None  # HWR with TP: the group's init_method (a file:// URL, one per group)

    def to_dict(self) -> dict[str, JsonValue]:
        return {
            "name": self.name,
            "kind": self.kind.value,
            "pipeline": self.pipeline,
            "subfolder": self.subfolder,
            "root": self.root,
            "cache_dir": self.cache_dir,
            "stream_on_miss": self.stream_on_miss,
            "publish_in_background": self.publish_in_background,
            "peer": self.peer,
            "peer_file": self.peer_file,
            "remote_url": self.remote_url,
            "remote_options": self.remote_options,
            "background_verify": self.background_verify,
            "tensor_parallel_size": self.tensor_parallel_size,
            "tensor_parallel_rank": self.tensor_parallel_rank,
            "rendezvous": self.rendezvous,
        }

    @classmethod
    def from_dict(cls, value: dict[str, Any]) -> RowSpec:
        return cls(
            name=str(value["name"]),
            kind=LoadKind(value["kind"]),
            pipeline=str(value["pipeline"]),
            subfolder=str(value["subfolder"]),
            root=None if value.get("root") is None else str(value["root"]),
            cache_dir=None if value.get("cache_dir") is None else str(value["cache_dir"]),
            stream_on_miss=bool(value.get("stream_on_miss", False)),
            publish_in_background=bool(value.get("publish_in_background", False)),
            peer=None if value.get("peer") is None else str(value["peer"]),
            peer_file=None if value.get("peer_file") is None else str(value["peer_file"]),
            remote_url=None if value.get("remote_url") is None else str(value["remote_url"]),
            remote_options=None if value.get("remote_options") is None else dict(value["remote_options"]),
            background_verify=None if value.get("background_verify") is None else str(value["background_verify"]),
            tensor_parallel_size=int(value.get("tensor_parallel_size", 1)),
            tensor_parallel_rank=int(value.get("tensor_parallel_rank", 0)),
            rendezvous=None if value.get("rendezvous") is None else str(value["rendezvous"]),
        )


# --------------------------------------------------------------------------- memory readings


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field} line")


def reset_peak_rss() -> None:
    """Reset this process's VmHWM to its current RSS, so the peak measures this run only (Linux 4.0+)."""
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")


def peak_rss() -> int:
    """VmHWM in bytes: the most resident memory since the last reset."""
    return _status_kib("VmHWM") * 1024


# --------------------------------------------------------------------------- the touch pass


def _model_tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    """Every parameter and buffer once (by data pointer), detached; a tensor-parallel DTensor as its local shard."""
    seen: set[int] = set()
    tensors: list[torch.Tensor] = []
    for found in itertools.chain(model.parameters(), model.buffers()):
        to_local = getattr(found, "to_local", None)
        tensor: torch.Tensor = found if to_local is None else to_local()
        if tensor.numel() == 0 or tensor.data_ptr() in seen:
            continue
        seen.add(tensor.data_ptr())
        tensors.append(tensor.detach())
    return tensors


def weight_spans(model: torch.nn.Module) -> list[JsonValue]:
    """[address, length] of the memory holding every weight (merged), so another process can read its PSS."""
    spans = merged_spans((t.data_ptr(), t.numel() * t.element_size()) for t in _model_tensors(model))
    return [[address, length] for address, length in spans]


def touch_model(model: torch.nn.Module) -> tuple[int, int]:
    """Read one byte in every 4 KiB page of every weight and each tensor's last byte.

    Returns (pages read, checksum of the bytes read): rows that loaded the same bytes give
    the same checksum, a cheap check that no row measured a wrong or partial load.
    """
    pages = checksum = 0
    with torch.inference_mode():
        for tensor in _model_tensors(model):
            flat = tensor.reshape(-1).view(torch.uint8)
            sample = flat[::PAGE_BYTES]
            checksum += int(sample.sum(dtype=torch.int64)) + int(flat[-1])
            pages += sample.numel()
    return pages, checksum


# --------------------------------------------------------------------------- the loads


def model_class() -> Any:
    """The diffusers model class, imported before any clock starts, with progress bars and logs quiet.

    Typed Any: diffusers is untyped.
    """
    import accelerate  # noqa: F401  (the skeleton needs it; import it outside the timed load)
    import diffusers
    from diffusers.utils import logging as diffusers_logging

    diffusers_logging.set_verbosity_error()
    diffusers_logging.disable_progress_bar()
    return getattr(diffusers, _MODEL_CLASS)


@dataclass(slots=True)
class _Loaded:
    model: torch.nn.Module
    component: LoadedComponent | None = None
    peer_load: PeerLoad | None = None

    def close(self) -> None:
        if self.component is not None:
            self.component.close()
        if self.peer_load is not None:
            self.peer_load.close()


def _runtime(root: str, spec: RowSpec) -> HostWeightRuntime:
    """The row's runtime: PREFERRED on a tmpfs domain, importing from the row's remote when it has one."""
    config = HostWeightRuntimeConfig(mode=RuntimeMode.PREFERRED, root=Path(root), storage_class=StorageClass.TMPFS)
    if spec.remote_url is None:
        return HostWeightRuntime(config)
    provider = FsspecArtifactProvider(spec.remote_url, storage_options=spec.remote_options or {})
    return HostWeightRuntime(config, remote_providers=[provider])


def _load(spec: RowSpec, flux_class: Any) -> _Loaded:
    # A repo id in a local cache: offline as a cluster worker runs (diffusers asks the Hub for a sharded
    # checkpoint's file list unless local_files_only, even with HF_HUB_OFFLINE=1).
    hub: dict[str, Any] = {} if spec.cache_dir is None else {"cache_dir": spec.cache_dir, "local_files_only": True}
    if spec.kind is LoadKind.CANONICAL:
        model = flux_class.from_pretrained(spec.pipeline, subfolder=spec.subfolder, torch_dtype=torch.bfloat16, **hub)
        return _Loaded(model)
    if spec.kind is LoadKind.HWR:
        if spec.root is None:
            raise ValueError(f"row {spec.name}: an HWR row needs a domain root")
        if spec.tensor_parallel_size > 1:
            return _load_rank(spec)
        component = load_component(
            spec.pipeline,
            subfolder=spec.subfolder,
            runtime=_runtime(spec.root, spec),
            stream_on_miss=spec.stream_on_miss,
            publish_in_background=spec.publish_in_background,
            **hub,
        )
        return _Loaded(component.model, component=component)
    if spec.peer is None or spec.peer_file is None:
        raise ValueError(f"row {spec.name}: a peer row needs a peer and its file")
    folder = Path(spec.pipeline) / spec.subfolder
    # The file first: a peer that fills page tables on a thread overlaps the skeleton, the best a bare loader can do.
    peer_load = load_peer(peer_named(spec.peer), Path(spec.peer_file))
    try:
        model = build_skeleton(flux_class, folder, str(folder))
        model.load_state_dict(peer_load.tensors, strict=True, assign=True)
    except BaseException:
        peer_load.close()
        raise
    return _Loaded(model, peer_load=peer_load)


def join_group(spec: RowSpec) -> None:
    """A tensor-parallel row's worker joins its gloo group (off the clock: before it says ready)."""
    if spec.tensor_parallel_size <= 1:
        return
    import torch.distributed as dist

    if spec.rendezvous is None:
        raise ValueError(f"row {spec.name}: a tensor-parallel row needs a rendezvous")
    dist.init_process_group(
        "gloo",
        init_method=spec.rendezvous,
        rank=spec.tensor_parallel_rank,
        world_size=spec.tensor_parallel_size,
        timeout=datetime.timedelta(seconds=_GROUP_TIMEOUT_S),
    )


def leave_group(spec: RowSpec) -> None:
    if spec.tensor_parallel_size > 1:
        import torch.distributed as dist

        dist.destroy_process_group()


def _load_rank(spec: RowSpec) -> _Loaded:
    """One rank of a warm TP group: the group resolves together, this rank restores its own artifact."""
    import torch.distributed as dist

    assert spec.root is not None
    parallel = FinalLayoutParallelIdentity(
        tensor_parallel_size=spec.tensor_parallel_size, tensor_parallel_rank=spec.tensor_parallel_rank
    )
    component = load_component(
        spec.pipeline,
        subfolder=spec.subfolder,
        runtime=_runtime(spec.root, spec),
        parallel=parallel,
        process_group=dist.group.WORLD,
    )
    return _Loaded(component.model, component=component)


def _component_facts(component: LoadedComponent | None) -> dict[str, JsonValue]:
    if component is None:
        return {
            "outcome": None,
            "attempts": [],
            "load_path": "canonical",
            "identity_key": None,
            "publication": None,
            "publication_ms": None,
            "failure": None,
        }
    publication = component.publication
    failure = next(
        (
            problem
            for problem in (
                component.identity_failure,
                component.restore_failure,
                component.resolution.failure,
                None if publication is None else publication.failure,
            )
            if problem is not None
        ),
        None,
    )
    return {
        "outcome": component.outcome.value,
        "attempts": [attempt.result.value for attempt in component.resolution.attempts],
        "load_path": component.load_path.value,
        "identity_key": component.identity_key or None,
        "publication": None if publication is None else publication.status.value,
        "publication_ms": None if publication is None else publication.elapsed_s * 1000.0,
        "failure": None if failure is None else f"[{failure.code.value}] {failure.message}",
    }


def run_row(spec: RowSpec, flux_class: Any) -> tuple[dict[str, JsonValue], _Loaded]:
    """Load, touch and measure one row in this process; the caller holds the result until memory is read."""
    reset_peak_rss()
    baseline_rss, baseline_pss = memory_rollup()
    stat_before = cpu_line()
    started = time.perf_counter()
    loaded = _load(spec, flux_class)
    loaded_at = time.perf_counter()
    pages, checksum = touch_model(loaded.model)
    ready_at = time.perf_counter()
    stat_after = cpu_line()
    rss, pss = memory_rollup()
    peak = peak_rss()  # before any background publication adds its buffers
    published_ms: float | None = None
    background = None if loaded.component is None else loaded.component.background_publication
    if background is not None:
        background.wait()
        if background.failure is not None:
            raise RuntimeError(f"background publication failed: {background.failure.message}")
        assert background.elapsed_s is not None
        published_ms = (time.perf_counter() - started) * 1000.0
    lease = None if loaded.component is None else loaded.component.lease
    verification = None if lease is None else lease.verification
    if verification is not None:  # after the clock stopped: the worker is ready while it runs
        verification.wait()
    row: dict[str, JsonValue] = {
        "name": spec.name,
        "pid": os.getpid(),
        "time_to_ready_ms": (ready_at - started) * 1000.0,
        "load_ms": (loaded_at - started) * 1000.0,
        "touch_ms": (ready_at - loaded_at) * 1000.0,
        "steal_ticks": steal_ticks(stat_after) - steal_ticks(stat_before),  # the hypervisor's, until ready
        "pages": pages,
        "checksum": checksum,
        "baseline_rss_bytes": baseline_rss,
        "baseline_pss_bytes": baseline_pss,
        "peak_rss_bytes": peak,
        "rss_bytes": rss,
        "pss_bytes": pss,
        "weight_spans": weight_spans(loaded.model),  # whoever reads the weights' PSS reads it in these mappings
        "published_ms": published_ms,
        "verification_s": None if verification is None else verification.elapsed_s,
        "verification": None if verification is None else verification.state.value,
        **_component_facts(loaded.component),
    }
    return row, loaded

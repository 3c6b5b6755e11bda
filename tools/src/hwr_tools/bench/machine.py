"""A description of the machine a benchmark ran on."""

from __future__ import annotations

import os
import platform
import subprocess
from importlib import metadata
from pathlib import Path

import torch

from ..common import JsonValue

__all__ = ["describe_machine", "filesystem_type"]


def _cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.partition(":")[2].strip()
    return platform.processor() or "unknown"


def _version(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def filesystem_type(path: Path) -> str:
    """The filesystem's type name as `stat -f` reports it (tmpfs, ext2/ext3, xfs, ...)."""
    done = subprocess.run(["stat", "-f", "-c", "%T", str(path)], capture_output=True, text=True, check=False)
    return done.stdout.strip() or "unknown"


def describe_machine(disk_dir: Path, domain_dir: Path) -> dict[str, JsonValue]:
    """What a reader needs to compare results: CPU, memory, kernel, versions, filesystems, shmem THP."""
    memory_kib = next(
        int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines() if line.startswith("MemTotal:")
    )
    shmem_thp = Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled")
    return {
        "host": platform.node(),
        "cpu": _cpu_model(),
        "cpus": os.cpu_count(),
        "memory_gib": round(memory_kib / (1 << 20), 1),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "diffusers": _version("diffusers"),
        "safetensors": _version("safetensors"),
        "tensorizer": _version("tensorizer"),
        "runai-model-streamer": _version("runai-model-streamer"),
        "fastsafetensors": _version("fastsafetensors"),
        "checkpoint_filesystem": filesystem_type(disk_dir),
        "domain_filesystem": filesystem_type(domain_dir),
        "shmem_thp": shmem_thp.read_text().strip() if shmem_thp.exists() else None,
    }

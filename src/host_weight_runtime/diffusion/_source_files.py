"""Which weight files in a model folder the ordinary diffusers loader reads (single file or index shards)."""

from __future__ import annotations

from pathlib import Path, PurePosixPath

from ..canonical_json import decode_json
from ._weight_source import MAX_LISTED, relative_parts

_INDEX_LIMIT_BYTES = 64 * 1024 * 1024

# Weight files in the order the ordinary loader prefers them: (name, is_index, use_safetensors).
WEIGHT_CANDIDATES: tuple[tuple[str, bool, bool], ...] = (
    ("diffusion_pytorch_model.safetensors", False, True),
    ("diffusion_pytorch_model.safetensors.index.json", True, True),
    ("model.safetensors", False, True),
    ("model.safetensors.index.json", True, True),
    ("diffusion_pytorch_model.bin", False, False),
    ("diffusion_pytorch_model.bin.index.json", True, False),
)


def _read_index(index: Path) -> list[str]:
    """Shard names from a `*.index.json` weight map (deduplicated, in the index's order of first use)."""
    with open(index, "rb") as stream:
        data = stream.read(_INDEX_LIMIT_BYTES + 1)
    if len(data) > _INDEX_LIMIT_BYTES:
        raise ValueError(f"{index} is larger than {_INDEX_LIMIT_BYTES} bytes")
    value = decode_json(data)
    weight_map = value.get("weight_map") if isinstance(value, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(f"{index} has no non-empty 'weight_map' object")
    shards: dict[str, None] = {}
    for shard in weight_map.values():
        if not isinstance(shard, str):
            raise ValueError(f"{index} maps a tensor to {shard!r}, not a file name")
        relative_parts(shard, f"shard name in {index}")
        shards[shard] = None
    return list(shards)


def select_weight_files(root: Path) -> tuple[tuple[Path, ...], bool]:
    """The files the ordinary loader would read from `root`; ValueError saying what is missing."""
    for name, is_index, use_safetensors in WEIGHT_CANDIDATES:
        candidate = root / name
        if not candidate.is_file():
            continue
        if not is_index:
            return (candidate,), use_safetensors
        try:
            shards = _read_index(candidate)
        except OSError as exc:
            raise ValueError(f"cannot read the weight index {candidate}: {exc}") from exc
        files = [root / Path(*PurePosixPath(shard).parts) for shard in shards]
        missing = sorted(str(path) for path in files if not path.is_file())
        if missing:
            raise ValueError(
                f"the weight index {candidate} names shard(s) that do not exist: {missing[:MAX_LISTED]}; "
                f"download or copy the missing shards"
            )
        return tuple(sorted(set(files))), use_safetensors
    names = ", ".join(name for name, _is_index, _safe in WEIGHT_CANDIDATES)
    raise ValueError(f"{root} holds no weight file the loader reads (looked for {names})")

"""Which weight files in a model folder diffusers' or transformers' loader reads (one file or index shards)."""

from __future__ import annotations

import re
from pathlib import Path, PurePosixPath

from ..canonical_json import decode_json
from ..failures import ArgumentHint, usage_error
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
    ("pytorch_model.bin", False, False),  # transformers' pickle checkpoints (its safetensors names are above)
    ("pytorch_model.bin.index.json", True, False),
)


def _read_index(index: Path) -> list[str]:
    """Shard names from a `*.index.json` weight map (deduplicated, in the index's order of first use)."""
    with open(index, "rb") as stream:
        data = stream.read(_INDEX_LIMIT_BYTES + 1)
    if len(data) > _INDEX_LIMIT_BYTES:
        raise ValueError(f"{index} is larger than {_INDEX_LIMIT_BYTES} bytes")
    try:
        value = decode_json(data)
    except ValueError as exc:
        raise ValueError(f"{index} is not a valid weight index: {exc}; re-download it") from None
    weight_map = value.get("weight_map") if isinstance(value, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(f"{index} has no non-empty 'weight_map' object")
    shards: dict[str, None] = {}
    for shard in weight_map.values():
        if shard in shards:
            continue  # a few shards name thousands of tensors: check each distinct name once
        if not isinstance(shard, str):
            raise ValueError(f"{index} maps a tensor to {shard!r}, not a file name")
        relative_parts(shard, f"shard name in {index}")
        shards[shard] = None
    return list(shards)


def _variant_name(name: str, variant: str | None) -> str:
    """diffusers' spelling of a variant file: the variant goes before the last suffix (`x.fp16.safetensors`)."""
    if variant is None:
        return name
    head, _, suffix = name.rpartition(".")
    return f"{head}.{variant}.{suffix}"


def _variant_files(root: Path) -> list[str]:
    """Names in `root` that are some variant of a weight file the loader reads, e.g. `*.fp16.safetensors`."""
    patterns = [
        re.compile(re.escape(head) + r"\.[^./]+\." + re.escape(suffix))
        for head, _, suffix in (name.rpartition(".") for name, _is_index, _safe in WEIGHT_CANDIDATES)
    ]
    try:
        names = sorted(entry.name for entry in root.iterdir())
    except OSError:
        return []
    return [name for name in names if any(pattern.fullmatch(name) for pattern in patterns)]


def _holds_plain_weights(root: Path, use_safetensors: bool | None) -> bool:
    """Whether `root` holds weights without a variant (for the hint of a variant that is not there)."""
    try:
        select_weight_files(root, None, use_safetensors)
    except ValueError:
        return False
    return True


def select_weight_files(
    root: Path, variant: str | None = None, use_safetensors: bool | None = None
) -> tuple[tuple[Path, ...], bool]:
    """The files the ordinary loader would read from `root`; ValueError saying what is missing (a
    `HostWeightUsageError` with an `ArgumentHint` when another `variant` argument would find weights).

    `variant` and `use_safetensors` choose among them as diffusers' `from_pretrained` does.
    """
    candidates = [
        (_variant_name(name, variant), is_index, safe)
        for name, is_index, safe in WEIGHT_CANDIDATES
        if use_safetensors is None or safe is use_safetensors
    ]
    for name, is_index, safe in candidates:
        candidate = root / name
        if not candidate.is_file():
            continue
        if not is_index:
            return (candidate,), safe
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
        return tuple(sorted(set(files))), safe
    names = ", ".join(name for name, _is_index, _safe in candidates)
    problem = f"{root} holds no weight file the loader reads (looked for {names})"
    variants = _variant_files(root)
    if variants:
        found = sorted({name.split(".")[-2] for name in variants})
        raise usage_error(
            f"{problem}; it holds variant weight files {variants[:MAX_LISTED]}",
            hint=ArgumentHint(use=tuple(("variant", name) for name in found)),
        )
    if variant is not None and _holds_plain_weights(root, use_safetensors):
        raise usage_error(
            f"{problem}; it holds weights without a variant", hint=ArgumentHint(drop=(("variant", variant),))
        )
    raise ValueError(problem)

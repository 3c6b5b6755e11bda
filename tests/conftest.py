"""Test-wide settings: Hypothesis keeps no example database, so tests never write into the checkout.

The background full verification (HWR_BACKGROUND_VERIFY, default `once`) is an asynchronous actor
that may deny a corrupted artifact at any moment after its first lease; the tests that pin down what
each validation level does on its own (S07-S10) would race with it. So the suite runs with it off
(spawned children inherit this), and `tests/test_background_verify.py` and the soak test switch it on.

The longest files are collected first, so `make test`'s two workers start on them (LONGEST_FILES_FIRST).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from hypothesis import settings

if TYPE_CHECKING:
    from .remote_support import Remote

os.environ["HWR_BACKGROUND_VERIFY"] = "off"

settings.register_profile("hwr", database=None)
settings.load_profile("hwr")


# The files that take longest (whole benchmarks, demos, groups of fresh processes), longest first. With
# `make test` (two workers, one file at a time, --no-loadscope-reorder) they start first and the short
# files fill in around them, so neither worker ends the run alone on a long file; other files keep
# their order. Without this, xdist starts the files with the most tests first, which puts the long
# files of one to seven tests near the end. Figures: each file's seconds in a one-process run on 2
# quiet cores (about 25 minutes in all); keep the list roughly sorted when adding a long file.
LONGEST_FILES_FIRST = (
    "test_bench.py",  # ~295 s: one whole tiny benchmark in its module fixture
    "test_diffusion_tp_group.py",  # ~125 s
    "test_bench_pipeline.py",  # ~95 s (estimated: ten rows of fresh workers, from the folder and the hub cache)
    "test_transformers_components.py",  # ~75 s
    "test_diffusion_demo.py",  # ~70 s
    "test_pipeline_loader.py",  # ~55 s
    "test_serve_example.py",  # ~45 s
    "test_readme_diffusers.py",  # ~40 s
    "test_diffusion_tp_pss.py",  # ~35 s
    "test_cli_remote_targets.py",  # ~30 s
    "test_bench_store_peer.py",  # ~30 s: ten fresh processes, this runtime's store and vLLM-Omni's
    "test_first_worker.py",  # ~40 s: held publications, killed publishers and arriving workers in child processes
    "test_warm_pipeline.py",  # ~30 s (estimated: a prewarm, then a fresh worker's two warm loads and a canonical one)
    "test_cli_remote.py",  # ~25 s
    "test_adoption_arguments.py",  # ~25 s
    "test_adoption_background.py",  # ~25 s
    "test_remote_load_component.py",  # ~20 s
    "test_vllm_omni_compat.py",  # ~20 s
    "test_store_stateful.py",  # ~20 s
    "test_diffusion_tp.py",  # ~20 s
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Put the longest files first (a stable sort: the tests of a file, and the other files, keep their order)."""
    folder = Path(__file__).parent
    missing = [name for name in LONGEST_FILES_FIRST if not (folder / name).is_file()]
    if missing:
        raise pytest.UsageError(f"tests/conftest.py LONGEST_FILES_FIRST names files that do not exist: {missing}")
    rank = {name: index for index, name in enumerate(LONGEST_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


@pytest.fixture(params=["file", "s3"])
def pushed(
    request: pytest.FixtureRequest, node_a: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Remote]:
    """For the load-by-name tests: a fresh `file://` or S3 remote holding every artifact of the module's `node_a`
    (its `root` and `keys`), S3 being the module's `moto`; this process (and its children) is then node B, its
    Hugging Face cache empty. A test takes one kind with `@pytest.mark.parametrize("pushed", [KIND], indirect=True)`."""
    from .remote_support import MotoEndpoint, node_b_with_pushed_remote  # torch and fsspec: only where used

    moto: MotoEndpoint | None = request.getfixturevalue("moto") if request.param == "s3" else None
    keys = list(node_a.keys.values())
    with node_b_with_pushed_remote(
        request.param, node_a.root, keys, tmp_path=tmp_path, monkeypatch=monkeypatch, moto=moto
    ) as remote:
        yield remote

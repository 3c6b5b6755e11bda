"""A warm whole pipeline at its limit (X01): each skeleton built once, nothing cacheable done twice in a process.

A tiny Flux pipeline (diffusers transformer and VAE, transformers CLIP and T5 encoders) is
prewarmed; one fresh spawned worker then runs two warm `load_pipeline` calls. Model
constructions are counted with torch's global submodule-registration hook, the per-process work
(checkpoint bindings, tensor ownership, manifest parses, manifest checks) with the runtime's own
counters; the images are compared bit for bit with canonical `from_pretrained` in the same worker.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from host_weight_runtime.diffusion import prewarm_pipeline
from host_weight_runtime.diffusion._binding_plans import BINDING_PLANS
from host_weight_runtime.diffusion._load_options import LoadOptions
from host_weight_runtime.diffusion.component_source import ComponentLocation
from host_weight_runtime.diffusion.contracts import FinalLayoutParallelIdentity
from host_weight_runtime.diffusion.skeleton import prepare_skeleton
from host_weight_runtime.diffusion.source_identity import NodeSourceDigestCache
from hwr_tools.synthetic_pipelines import pipeline_kind, save_tiny_pipeline

from ._pipelines import runtime_at
from ._warm_pipeline_child import first_then_warm, two_warm_loads
from .support import recv_within, spawned_child

SERVED = {
    "transformer": "FluxTransformer2DModel",
    "vae": "AutoencoderKL",
    "text_encoder": "CLIPTextModel",
    "text_encoder_2": "T5EncoderModel",
}


def test_a_warm_pipeline_builds_each_skeleton_once_and_repeats_no_cacheable_work(tmp_path: Path) -> None:
    """X01: each warm load constructs exactly one model per served component (its `meta` skeleton, which the
    restore fills: transformers encoders included, no second model); the second load in the process computes
    no checkpoint bindings, tensor ownership, manifest parse or manifest check again; both images equal
    canonical `from_pretrained` bit for bit (P01). The node's records of the encoders' bindings (written by the
    prewarm) spare even the first load in a fresh process transformers' conversion mapping."""
    folder = save_tiny_pipeline(tmp_path / "flux", "flux")
    store = tmp_path / "domain"
    prewarm_pipeline(folder, torch_dtype=pipeline_kind("flux").torch_dtype, runtime=runtime_at(store))
    classes = sorted(SERVED.values())
    with spawned_child(two_warm_loads, str(folder), str(store), classes) as conn:
        loads: Any = recv_within(conn, 600.0)
    assert len(loads) == 2
    one_each = dict.fromkeys(classes, 1)
    for load in loads:
        assert load["outcomes"] == dict.fromkeys(SERVED, "local_hit")
        assert load["models_constructed"] == one_each
        assert load["skeletons_built"] == one_each
        assert load["image_equal"]
    first, second = (load["repeated"] for load in loads)
    assert first["binding_computations"] == 2  # the two transformers encoders, each read from the node's record
    assert first["binding_renamings"] == 0  # the prewarm recorded both: no conversion mapping is built
    assert first["ownership_discoveries"] == first["manifest_parses"] == first["layout_checks"] == len(SERVED)
    assert second == dict.fromkeys(first, 0)


def test_the_first_worker_builds_one_model_per_component_and_publishes_the_keys_a_warm_load_finds(
    tmp_path: Path,
) -> None:
    """X02/X01: the first worker on an empty domain constructs exactly one model per served component (the one
    `from_pretrained` builds, described for its publication: no `meta` skeleton beside it) and serves it
    canonically; every background publication completes, and the next load in the process, whose skeletons
    are built and identified the usual way, finds every component's artifact under the same key (a local
    hit). Both images equal canonical `from_pretrained` bit for bit (P01)."""
    folder = save_tiny_pipeline(tmp_path / "flux", "flux")
    classes = sorted(SERVED.values())
    with spawned_child(first_then_warm, str(folder), str(tmp_path / "domain"), classes) as conn:
        first, warm = recv_within(conn, 600.0)
    one_each = dict.fromkeys(classes, 1)
    assert first["outcomes"] == dict.fromkeys(SERVED, "canonical_fallback")
    assert first["models_constructed"] == one_each
    assert first["skeletons_built"] == {}
    assert first["published"] == [True] * len(SERVED)
    assert warm["outcomes"] == dict.fromkeys(SERVED, "local_hit")
    assert warm["models_constructed"] == warm["skeletons_built"] == one_each
    assert first["image_equal"] and warm["image_equal"]


def test_a_node_record_of_bindings_is_believed_only_when_it_fits_the_skeleton(tmp_path: Path) -> None:
    """X01: a worker reads a transformers skeleton's bindings from the node's record instead of renaming again;
    a record that does not bind exactly the skeleton's tensors to the checkpoint's keys (tampered, foreign,
    truncated) is ignored, the bindings computed afresh equal the true ones, and the record is rewritten."""
    folder = save_tiny_pipeline(tmp_path / "flux", "flux")
    records = NodeSourceDigestCache(tmp_path / "domain")
    location = ComponentLocation(folder, "text_encoder_2")  # T5: a declared tie, so aliases are recorded too

    def bindings() -> tuple[dict[str, str], dict[str, str]]:
        BINDING_PLANS.clear()
        skeleton = prepare_skeleton(location, LoadOptions(), FinalLayoutParallelIdentity(), records=records)
        return dict(skeleton.checkpoint_keys), dict(skeleton.aliases)

    renamings = BINDING_PLANS.renamings
    expected = bindings()
    assert expected[1] and BINDING_PLANS.renamings == renamings + 1
    (record,) = records.derived.iterdir()
    assert bindings() == expected and BINDING_PLANS.renamings == renamings + 1  # read from the record
    value = json.loads(record.read_bytes())
    owner = next(iter(value["value"]["aliases"].values()))
    for bad in (
        {**value, "value": {**value["value"], "aliases": {}}},  # an alias dropped: a tensor left unbound
        {**value, "value": {"keys": {**value["value"]["keys"], owner: "not.in.checkpoint"}, "aliases": {}}},
        {**value, "key": "0" * 64},  # another key's record
    ):
        record.write_bytes(json.dumps(bad).encode())
        before = BINDING_PLANS.renamings
        assert bindings() == expected and BINDING_PLANS.renamings == before + 1
        assert json.loads(record.read_bytes()) == value  # rewritten with the true bindings
    record.write_bytes(record.read_bytes()[:20])
    assert bindings() == expected

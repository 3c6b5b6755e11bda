"""Bundle build time for TP=N versus one TP=1 publication of the same checkpoint (streaming, one pass each).

    PYTHONPATH=src python -m hwr_tools.studies.tp_bundle --bytes 256000000 --tp 2 4

Prints one line per TP size: seconds for TP=1, seconds for the TP=N bundle, and their ratio
(goal <= 1.2x). The lead turns these into `hwr bench` rows.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import hashlib
import tempfile
import time
from pathlib import Path

from host_weight_runtime.diffusion import (
    FINAL_LAYOUT_BF16_POLICY,
    FinalLayoutLoaderIdentity,
    FinalLayoutParallelIdentity,
    FinalLayoutRequest,
    ImplementationIdentity,
    build_final_layout_identity,
    build_skeleton,
    prepare_weight_source,
)
from host_weight_runtime.diffusion.parallel.bundle import FinalLayoutBF16BundleProducer
from host_weight_runtime.diffusion.parallel.ranks import identify_ranks
from host_weight_runtime.diffusion.producers.checkpoint_stream import FinalLayoutBF16CheckpointProducer
from host_weight_runtime.diffusion.skeleton import ComponentHolder
from host_weight_runtime.filesystem.store import FilesystemHostWeightStore
from host_weight_runtime.protocols import BuildRequest, WeightProducer
from host_weight_runtime.tensors import ValidationLevel
from hwr_tools.synthetic_models import save_flux_pipeline_folder

_DIGEST = hashlib.sha256(b"benchmarks/tp_bundle").hexdigest()
_LOADER = FinalLayoutLoaderIdentity(ImplementationIdentity("benchmarks.tp_bundle", "1", _DIGEST), _DIGEST, _DIGEST)


def _build_seconds(root: Path, producer: WeightProducer) -> float:
    store = FilesystemHostWeightStore(root)
    identity = producer.spec.outputs[0]
    gc.collect()  # the imports' (and the build before's) collector debt, paid off the clock by every build alike
    started = time.perf_counter()
    result = store.get_or_build(
        BuildRequest(identity),
        producer,
        validation=ValidationLevel.MANIFEST_AND_METADATA,
        deadline=time.monotonic() + 600,
    )
    elapsed = time.perf_counter() - started
    if result.lease is None:
        raise RuntimeError(f"build failed: {result.failure}")
    result.lease.close()
    return elapsed


def bundle_vs_tp1(folder: Path, tp: int, work: Path) -> tuple[float, float]:
    """(seconds for the TP=1 streaming publication, seconds for the TP=`tp` bundle) on fresh domains."""
    source = prepare_weight_source(folder, subfolder="transformer", prefix="transformer.")
    import diffusers

    model_class = diffusers.FluxTransformer2DModel
    request = FinalLayoutRequest(model_id="bench", loader=_LOADER)
    skeleton = build_skeleton(model_class, source.resolved_root, str(folder))
    holder = ComponentHolder()
    holder.add_module("transformer", skeleton)
    tp1 = build_final_layout_identity(
        holder,
        dit_modules=[("transformer", skeleton)],
        prepared_sources=[source],
        request=request,
        policy=FINAL_LAYOUT_BF16_POLICY,
    )
    single = _build_seconds(work / f"tp1-{tp}", FinalLayoutBF16CheckpointProducer(tp1))
    skeleton = build_skeleton(model_class, source.resolved_root, str(folder))
    holder = ComponentHolder()
    holder.add_module("transformer", skeleton)
    contexts = identify_ranks(
        holder,
        dit_name="transformer",
        skeleton=skeleton,
        prepared_sources=[source],
        request=dataclasses.replace(request, parallel=FinalLayoutParallelIdentity(tensor_parallel_size=tp)),
        policy=FINAL_LAYOUT_BF16_POLICY,
        ranks=list(range(tp)),
    )
    bundle = _build_seconds(work / f"bundle-{tp}", FinalLayoutBF16BundleProducer(contexts))
    return single, bundle


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--bytes", type=int, default=256_000_000, help="FP32 bytes of the synthetic Flux")
    parser.add_argument("--tp", type=int, nargs="+", default=[2, 4])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir="/dev/shm") as scratch:
        work = Path(scratch)
        folder = save_flux_pipeline_folder(work / "flux", target_bytes=args.bytes)
        for tp in args.tp:
            single, bundle = bundle_vs_tp1(folder, tp, work)
            print(f"tp={tp} tp1_publish_s={single:.3f} bundle_s={bundle:.3f} ratio={bundle / single:.2f}")


if __name__ == "__main__":
    main()

"""Typed diffusion adapters for runtime-ready final-layout artifacts.

Most users need one call, `load_component` (a bad argument or model folder raises
`HostWeightUsageError`); the rest is the adapter API that `load_component` is built from,
for loaders that assemble pipelines themselves.
"""

from ..failures import HostWeightUsageError
from . import contracts, fp8, identity_adapter, producers, restorer, source_identity, tensor_layout
from .background import BackgroundPublication
from .contracts import (
    FINAL_LAYOUT_BF16_POLICY,
    FINAL_LAYOUT_BF16_SPEC,
    FinalLayoutArtifactSpec,
    FinalLayoutBF16Policy,
    FinalLayoutLoaderIdentity,
    FinalLayoutModelContract,
    FinalLayoutParallelIdentity,
    FinalLayoutRequest,
    FinalLayoutTensorPolicy,
    ImplementationIdentity,
    implementation_abi_fingerprint,
)
from .family_diffusers import build_skeleton
from .fp8 import (
    FINAL_LAYOUT_FP8_POLICY,
    FINAL_LAYOUT_FP8_SPEC,
    FinalLayoutFP8Policy,
    FinalLayoutFP8Producer,
    FinalLayoutFP8Restorer,
    FP8Linear,
)
from .identity_adapter import FinalLayoutIdentityContext, build_final_layout_identity
from .load_reports import ComponentLoadPath, PrewarmResult
from .loaded import LoadedComponent
from .loader import load_component
from .model_contracts import FIRST_CLASS_CONTRACTS, ModelNotReadyError, contract_for_model
from .parallel.bundle import FinalLayoutBF16BundleProducer
from .parallel.fp8_bundle import FinalLayoutFP8BundleProducer
from .parallel.loader import prewarm_tensor_parallel
from .parallel.plan import (
    FIRST_CLASS_TENSOR_PARALLEL_PLANS,
    MLP_ONLY_TENSOR_PARALLEL_PLANS,
    ShardStyle,
    TensorParallelPlan,
    TensorParallelRule,
    TensorShard,
    plan_for_model,
    register_tensor_parallel_plan,
    resolve_tensor_shards,
)
from .parallel.ranks import identify_ranks
from .pipeline_loader import (
    ComponentHandling,
    LoadedPipeline,
    PipelineComponentRecord,
    PipelinePrewarmResult,
    load_pipeline,
    prewarm_pipeline,
)
from .prewarm_step import prewarm_component
from .producers import FinalLayoutBF16CheckpointProducer, FinalLayoutBF16Producer
from .producers.fp8_checkpoint import FinalLayoutFP8CheckpointProducer
from .producers.fp8_stream import FP8StreamCast
from .restorer import FinalLayoutTensorRestorePlan, FinalLayoutTensorRestorer
from .source_identity import NodeSourceDigestCache, PreparedWeightSource, WeightSourceKind, prepare_weight_source
from .tensor_layout import FinalLayoutTensor, TensorOwnership, discover_tensor_ownership

__all__ = [
    "prewarm_pipeline",
    "load_pipeline",
    "PipelinePrewarmResult",
    "PipelineComponentRecord",
    "LoadedPipeline",
    "ComponentHandling",
    "BackgroundPublication",
    "FINAL_LAYOUT_BF16_POLICY",
    "FINAL_LAYOUT_BF16_SPEC",
    "FINAL_LAYOUT_FP8_POLICY",
    "FINAL_LAYOUT_FP8_SPEC",
    "FIRST_CLASS_CONTRACTS",
    "FIRST_CLASS_TENSOR_PARALLEL_PLANS",
    "MLP_ONLY_TENSOR_PARALLEL_PLANS",
    "ComponentLoadPath",
    "FinalLayoutArtifactSpec",
    "FinalLayoutBF16BundleProducer",
    "FinalLayoutBF16CheckpointProducer",
    "FinalLayoutBF16Policy",
    "FinalLayoutBF16Producer",
    "FP8Linear",
    "FP8StreamCast",
    "FinalLayoutFP8BundleProducer",
    "FinalLayoutFP8Policy",
    "FinalLayoutFP8CheckpointProducer",
    "FinalLayoutFP8Producer",
    "FinalLayoutFP8Restorer",
    "FinalLayoutIdentityContext",
    "FinalLayoutLoaderIdentity",
    "FinalLayoutModelContract",
    "FinalLayoutParallelIdentity",
    "FinalLayoutRequest",
    "FinalLayoutTensor",
    "FinalLayoutTensorPolicy",
    "FinalLayoutTensorRestorePlan",
    "FinalLayoutTensorRestorer",
    "HostWeightUsageError",
    "ImplementationIdentity",
    "LoadedComponent",
    "ModelNotReadyError",
    "NodeSourceDigestCache",
    "PreparedWeightSource",
    "PrewarmResult",
    "ShardStyle",
    "TensorOwnership",
    "TensorParallelPlan",
    "TensorParallelRule",
    "TensorShard",
    "WeightSourceKind",
    "build_final_layout_identity",
    "build_skeleton",
    "contract_for_model",
    "contracts",
    "discover_tensor_ownership",
    "fp8",
    "identify_ranks",
    "identity_adapter",
    "implementation_abi_fingerprint",
    "load_component",
    "plan_for_model",
    "prepare_weight_source",
    "prewarm_component",
    "prewarm_tensor_parallel",
    "producers",
    "register_tensor_parallel_plan",
    "resolve_tensor_shards",
    "restorer",
    "source_identity",
    "tensor_layout",
]

"""First-class tensor-parallel plans for SD3, Wan and MiniMax-H3: attention heads and MLPs split, or MLPs only.

Each plan is plain data, `(module pattern, "colwise" | "rowwise", blocks)`, which `plan.py`
turns into a `TensorParallelPlan` (this module imports nothing from it, so there is no
import circle). Every query, key and value projection (and the added projections of the
joint and image attentions) is split by output features, so rank r holds whole heads
r*H/N .. (r+1)*H/N - 1; each attention's output projection is split by input features and
its partial sums are all-reduced. `attention_heads.py` gives each split attention module its
rank's head count (the processors reshape by `attn.heads`) and, for Wan's query/key norms,
which normalize across all heads, a norm that sums its squares over the group.

What stays replicated (every rank holds the whole tensor), and why:
- patch and position embeddings, timestep/text/image condition embedders, the final norm
  and output projection: they run once per token on the full hidden size and are small;
  splitting them would add a collective for little memory.
- every norm and modulation table (AdaLN linears `norm1.linear`, `norm1_context.linear`,
  Wan's `scale_shift_table`, MiniMax-H3's `adaln_proj`): their outputs scale the full
  hidden state on every rank, so each rank needs all of it.
- the q/k RMSNorm weights: per-head norms (SD3, MiniMax-H3) are shared by every head;
  Wan's across-head norm weights are read as slices of the whole vector (no copy).
At full size (counted on `meta` skeletons at TP=2) that leaves 1.7% of Wan 2.1 14B replicated,
but 34% of SD3.5-large: its per-block AdaLN linears (`norm1.linear`, `norm1_context.linear`)
alone are 33%. Splitting them needs an all-gather of their output in every block (a colwise
split whose output is gathered), which the plan format does not express yet.

Each model also has an MLP-only plan (attention replicated), for TP sizes that do not divide
its head count (SD3.5-large's 38 heads at TP=4 or 8): `plan.py` picks it by default there.
"""

from __future__ import annotations

__all__ = ["ATTENTION_SPLIT_PLANS", "MLP_ONLY_PLANS", "PlanEntry"]

PlanEntry = tuple[str, str, tuple[int, ...]]
"""(module pattern with at most one `*`, "colwise" or "rowwise", proportional blocks or ())."""


def _attention(prefix: str, *, inputs: tuple[str, ...], outputs: tuple[str, ...]) -> tuple[PlanEntry, ...]:
    colwise = tuple((f"{prefix}.{name}", "colwise", ()) for name in inputs)
    rowwise = tuple((f"{prefix}.{name}", "rowwise", ()) for name in outputs)
    return colwise + rowwise


def _mlp(prefix: str, blocks: tuple[int, ...] = ()) -> tuple[PlanEntry, ...]:
    """A diffusers FeedForward: `net.0.proj` colwise (gated activations: one block per half), `net.2` rowwise."""
    return ((f"{prefix}.net.0.proj", "colwise", blocks), (f"{prefix}.net.2", "rowwise", ()))


_QKV = ("to_q", "to_k", "to_v")

_SD3_MLPS = (*_mlp("transformer_blocks.*.ff"), *_mlp("transformer_blocks.*.ff_context"))
_WAN_MLPS = _mlp("blocks.*.ffn")
# MiniMax-H3's FeedForward is SwiGLU: net.0.proj holds [value; gate], each half split separately.
_MINIMAX_H3_MLPS = (*_mlp("transformer_blocks.*.ff", (1, 1)), *_mlp("token_refiner.refiner_blocks.*.ff", (1, 1)))

_SD3: tuple[PlanEntry, ...] = (
    # joint attention: the image stream (to_*) and the text stream (add_*_proj) share the heads
    *_attention(
        "transformer_blocks.*.attn",
        inputs=(*_QKV, "add_q_proj", "add_k_proj", "add_v_proj"),
        outputs=("to_out.0", "to_add_out"),  # the last block has no to_add_out: the rule then matches nothing
    ),
    # SD3.5's second (image-only) self-attention in the dual-attention blocks
    *_attention("transformer_blocks.*.attn2", inputs=_QKV, outputs=("to_out.0",)),
    *_SD3_MLPS,
)

_WAN: tuple[PlanEntry, ...] = (
    *_attention("blocks.*.attn1", inputs=_QKV, outputs=("to_out.0",)),
    # cross-attention; I2V models add image key/value projections over the same heads
    *_attention("blocks.*.attn2", inputs=(*_QKV, "add_k_proj", "add_v_proj"), outputs=("to_out.0",)),
    *_WAN_MLPS,
)

_MINIMAX_H3: tuple[PlanEntry, ...] = (
    *_attention("transformer_blocks.*.attn", inputs=_QKV, outputs=("to_out.0",)),
    *_attention("token_refiner.refiner_blocks.*.attn", inputs=_QKV, outputs=("to_out.0",)),
    *_MINIMAX_H3_MLPS,
)

ATTENTION_SPLIT_PLANS: dict[str, tuple[str, tuple[PlanEntry, ...]]] = {
    "SD3Transformer2DModel": ("sd3-attention-mlp-v1", _SD3),
    "WanTransformer3DModel": ("wan-attention-mlp-v1", _WAN),
    "MiniMaxH3Transformer3DModel": ("minimax-h3-attention-mlp-v1", _MINIMAX_H3),
}
"""Model class name -> (plan name, entries); the plan name enters every rank artifact's key."""

MLP_ONLY_PLANS: dict[str, tuple[str, tuple[PlanEntry, ...]]] = {
    "SD3Transformer2DModel": ("sd3-mlp-v1", _SD3_MLPS),
    "WanTransformer3DModel": ("wan-mlp-v1", _WAN_MLPS),
    # v2: its SwiGLU projection is split per half (v1 cut [value; gate] as one block)
    "MiniMaxH3Transformer3DModel": ("minimax-h3-mlp-v2", _MINIMAX_H3_MLPS),
}
"""Model class name -> (plan name, entries) of the MLP-only plan, the default where the heads do not divide."""

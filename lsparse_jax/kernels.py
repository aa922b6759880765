"""What each kernel op runs for ``EngineConfig.implementation``: one table, read where the
engine's layers call an op.

  "xla"         every op's XLA twin;
  "triton"      each op's Pallas-Triton kernel (``topk``: its two-launch "triton_fused");
  "jax_triton"  "triton", with ``pq_topc``'s plain Triton kernel through jax-triton (GPU only);
  "mosaic"      "triton", with ``sparse_attention``'s Mosaic GPU kernel (GPU only; bf16 rows);
  None          each op's fastest on a GPU, XLA elsewhere (the op decides).
``EngineConfig`` accepts these five only; an op called directly (kernel tests, kernel_compare)
takes its own implementation names and rejects the others.
"""

from __future__ import annotations

OPS = ("topk", "candidate_topk", "miss_filter", "pq_topc", "index_scores", "index_logits",
       "hot_resolve", "gather_rows", "sparse_attention")
FAMILIES = {  # family -> the ops whose implementation is not their "triton"
    "triton": {"topk": "triton_fused"},
    "jax_triton": {"topk": "triton_fused", "pq_topc": "jax_triton"},
    "mosaic": {"topk": "triton_fused", "sparse_attention": "mosaic"},
}
ENGINE_IMPLEMENTATIONS = (None, "xla", *FAMILIES)


def for_op(op: str, implementation: str | None) -> str | None:
    """The implementation ``op`` runs when a layer is asked for ``implementation``: an engine
    family ("triton", "jax_triton", "mosaic") maps by ``FAMILIES``; None, "xla" and an op's
    own names (a test driving a layer with one kernel variant, e.g. hot_resolve's
    "triton_copy") pass through, and the op checks them. Raises ValueError for an unknown op.
    """
    if op not in OPS:
        raise ValueError(f"kernels.for_op: unknown op {op!r}; ops: {OPS}")
    if implementation in FAMILIES:
        return FAMILIES[implementation].get(op, "triton")
    return implementation

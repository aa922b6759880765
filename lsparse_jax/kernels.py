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

import functools
import importlib

ACCEPTS = {  # op -> where its api lists the implementations it takes
    "topk": ("pallas_kernels.topk.api", "AVAILABLE"),
    "candidate_topk": ("pallas_kernels.topk.api", "CANDIDATE_AVAILABLE"),
    "miss_filter": ("pallas_kernels.miss_filter.api", "AVAILABLE"),
    "pq_topc": ("pallas_kernels.pq_topc.api", "AVAILABLE"),
    "index_scores": ("pallas_kernels.index_scores.api", "AVAILABLE"),
    "index_scores_paged": ("pallas_kernels.index_scores.api", "PAGED_AVAILABLE"),
    "index_logits": ("pallas_kernels.index_logits.api", "AVAILABLE"),
    "hot_resolve": ("pallas_kernels.hot_resolve.api", "AVAILABLE"),
    "gather_rows": ("pallas_kernels.gather_rows.api", "AVAILABLE"),
    "sparse_attention": ("pallas_kernels.sparse_attention.api", "AVAILABLE"),
}
OPS = tuple(ACCEPTS)
FAMILIES = {  # family -> the ops whose implementation is not their "triton"
    "triton": {"topk": "triton_fused"},
    "jax_triton": {"topk": "triton_fused", "pq_topc": "jax_triton"},
    "mosaic": {"topk": "triton_fused", "sparse_attention": "mosaic"},
}
ENGINE_IMPLEMENTATIONS = (None, "xla", *FAMILIES)


@functools.cache
def accepted(op: str) -> tuple[str, ...]:
    """The implementation names ``op``'s api takes (imported on first use)."""
    module, name = ACCEPTS[op]
    return tuple(getattr(importlib.import_module(module), name))


def for_op(op: str, implementation: str | None) -> str | None:
    """The implementation ``op`` runs when a layer is asked for ``implementation``: an engine
    family ("triton", "jax_triton", "mosaic") maps by ``FAMILIES``; None, "xla" and an op's
    own names (a test driving a layer with one kernel variant, e.g. hot_resolve's
    "triton_copy") pass through. Raises ValueError for an unknown op or a name that is neither
    (a layer that would run XLA for a name it does not know must not do so silently).
    """
    if op not in ACCEPTS:
        raise ValueError(f"kernels.for_op: unknown op {op!r}; ops: {OPS}")
    got = FAMILIES[implementation].get(op, "triton") if implementation in FAMILIES \
        else implementation
    if got is not None and got not in accepted(op):
        raise ValueError(f"{op}: implementation={implementation!r} is unknown; allowed: an "
                         f"engine implementation {ENGINE_IMPLEMENTATIONS} or one of the op's "
                         f"{accepted(op)}")
    return got

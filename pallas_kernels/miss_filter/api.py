"""Public entry point of ``miss_filter``: LeanSparse's filter of uncached coarse candidates
(Section 5, step 2).

Notation: B requests, C coarse candidates each; s their coarse scores (canonical: NaN -> -inf,
-0.0 -> +0.0), valid ones only count; s_(k) the k-th largest valid score (the smallest valid
one if fewer than k are valid); sigma the sample standard deviation (ddof = 1) of the valid
scores.
Rule: keep = valid & (cached | s >= s_(k) - offset * sigma): every cached candidate stays, an
uncached one only if its score is near the top k.

Implementations: "xla" (``reference.py``), "triton" (``triton.py``: one program a request,
the scores in registers; interpret mode without a GPU; its float sums may move the threshold
in the last bits) or None (triton on a GPU, xla elsewhere).
"""

from __future__ import annotations

import math

import jax.numpy as jnp

from pallas_kernels import common

OP = "miss_filter"
AVAILABLE = ("xla", "triton")


def miss_filter(scores, valid, cached, *, k: int, offset: float,
                implementation: str | None = None):
    """scores [B, C] f32 (anything, NaN poison included, where not valid); valid, cached
    [B, C] bool; k static int >= 1; offset a static finite float -> keep [B, C] bool."""
    impl = common.choose(OP, implementation, AVAILABLE, fastest_on_gpu="triton")
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"{OP}: k must be a static int >= 1, got {k!r}")
    if isinstance(offset, bool) or not isinstance(offset, (int, float)) \
            or not math.isfinite(offset):
        raise ValueError(f"{OP}: offset must be a static finite float, got {offset!r}")
    scores, valid, cached = (jnp.asarray(a) for a in (scores, valid, cached))
    if scores.ndim != 2 or valid.shape != scores.shape or cached.shape != scores.shape:
        raise ValueError(f"{OP}: scores, valid and cached must all be [B, C], got shapes "
                         f"{scores.shape}, {valid.shape}, {cached.shape}")
    if scores.dtype != jnp.float32:
        raise ValueError(f"{OP}: scores must be float32, got {scores.dtype}")
    if valid.dtype != jnp.bool_ or cached.dtype != jnp.bool_:
        raise ValueError(f"{OP}: valid and cached must be bool, got {valid.dtype}, "
                         f"{cached.dtype}")
    if scores.size == 0:
        return jnp.zeros(scores.shape, bool)
    if impl == "triton":
        from pallas_kernels.miss_filter.triton import miss_filter_triton

        return miss_filter_triton(scores, valid, cached, k=k, offset=float(offset))
    from pallas_kernels.miss_filter.reference import miss_filter_xla

    return miss_filter_xla(scores, valid, cached, k=k, offset=float(offset))

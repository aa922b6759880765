"""Top-k selection of eligible positions with the project's tie and padding rule (the XLA
reference of the ``topk`` op is its definition), and the same selection through the op's
kernels."""

import jax
import jax.numpy as jnp

from lsparse_jax.kernels import for_op
from pallas_kernels.common import on_gpu
from pallas_kernels.topk.api import topk
from pallas_kernels.topk.reference import canonical_scores, topk_positions

__all__ = ["topk_positions", "select_topk"]



def select_topk(scores, eligible, k: int, implementation: str | None = "xla"):
    """``topk_positions`` of the canonical scores (NaN -> -inf, -0.0 -> +0.0, the ``topk`` op's
    rule), best first, lower position first among equal scores, -1 padded, computed by the
    ``topk`` op's ``implementation``: every implementation gives the same entries.

    scores [T, N] f32, eligible [T, N] bool (any mask, not only a prefix) -> (positions [T, k]
    int32, values [T, k] f32). A kernel sees the scores with ineligible entries set to -inf and
    every row's length N and returns its top-k set in any order; the set is put best first by a
    sort of its k entries on (score descending, position ascending), and entries that are not
    eligible become -1 (-inf), as ``topk_positions`` pads.
    """
    implementation = for_op("topk", implementation)  # a kernel family: "triton_fused"
    if implementation is None and not on_gpu():
        implementation = "xla"  # None: the fastest available, as every op's api chooses
    scores = canonical_scores(scores.astype(jnp.float32))
    if implementation == "xla":
        return topk_positions(scores, eligible, k)
    rows, n = scores.shape
    masked = jnp.where(eligible, scores, -jnp.inf)
    positions, values = topk(masked, jnp.full((rows,), n, jnp.int32), k,
                             implementation=implementation)
    neg, positions = jax.lax.sort((-values, positions), num_keys=2)
    taken = (positions >= 0) & jnp.take_along_axis(eligible, jnp.maximum(positions, 0), axis=-1)
    return jnp.where(taken, positions, -1), jnp.where(taken, -neg, -jnp.inf)

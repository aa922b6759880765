"""XLA implementation of ``topk``: the project's ``topk_positions`` over a length mask.

Scores are canonicalised first, the same way the Triton implementation does it, so that both
follow one rule: NaN inside a row's length counts as -inf (NaN there is not supported input;
this only keeps the two implementations consistent), and -0.0 counts as +0.0 (``lax.top_k``
orders -0.0 below +0.0, while the tie rule speaks of equal values).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from lsparse_jax.indexing import topk_positions


def canonical_scores(scores: jnp.ndarray) -> jnp.ndarray:
    """NaN -> -inf and -0.0 -> +0.0, elementwise and usable inside Pallas kernels too.

    -0.0 is found by its bits, not by ``== 0``: XLA:CPU compares with denormals flushed, which
    would turn every denormal into a zero here while ``lax.top_k`` still orders them.
    """
    bits = jax.lax.bitcast_convert_type(scores, jnp.int32)
    scores = jnp.where(bits == jnp.int32(-(2**31)), jnp.zeros_like(scores), scores)
    return jnp.where(scores != scores, -jnp.inf, scores)


@functools.partial(jax.jit, static_argnames=("k",))
def topk_xla(scores: jnp.ndarray, lengths: jnp.ndarray, k: int):
    """Top-k eligible positions of each row: scores [B, N] f32, lengths [B] int ->
    (positions [B, k] int32 best-first, -1 padded; values [B, k] f32, -inf padded).
    Position n of row b is eligible when n < lengths[b]; equal scores go to the lower
    position."""
    n = scores.shape[-1]
    eligible = jnp.arange(n, dtype=jnp.int32)[None, :] < lengths.astype(jnp.int32)[:, None]
    return topk_positions(canonical_scores(scores), eligible, k)

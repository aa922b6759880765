"""XLA implementation of ``topk``: ``topk_positions`` (the project's selection rule, used by
every layer above) over a length mask.

Scores are canonicalised first, the same way the Triton implementation does it, so that both
follow one rule: NaN inside a row's length counts as -inf (NaN there is not supported input;
this only keeps the two implementations consistent), and -0.0 counts as +0.0 (``lax.top_k``
orders -0.0 below +0.0, while the tie rule speaks of equal values).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def topk_positions(scores: jnp.ndarray, eligible: jnp.ndarray, k: int):
    """Top-k eligible positions of each score row.

    scores [..., N] f32, eligible [..., N] bool -> (positions [..., k] int32, values [..., k]).
    Rule: higher score first; equal scores go to the lower position; when fewer than k positions
    are eligible the rest of the row is -1 (value -inf). Positions are returned best-first.
    If k > N the row is padded to k.
    """
    n = scores.shape[-1]
    masked = jnp.where(eligible, scores.astype(jnp.float32), -jnp.inf)
    kk = min(k, n)
    # lax.top_k is stable (lower index first among equal values), which is our tie rule.
    values, positions = jax.lax.top_k(masked, kk)
    taken = jnp.take_along_axis(eligible, positions, axis=-1)
    positions = jnp.where(taken, positions, -1).astype(jnp.int32)
    values = jnp.where(taken, values, -jnp.inf)
    if kk < k:
        pad = [(0, 0)] * (scores.ndim - 1) + [(0, k - kk)]
        positions = jnp.pad(positions, pad, constant_values=-1)
        values = jnp.pad(values, pad, constant_values=-jnp.inf)
    return positions, values


def canonical_scores(scores: jnp.ndarray) -> jnp.ndarray:
    """NaN -> -inf and -0.0 -> +0.0, elementwise and usable inside Pallas kernels too.

    -0.0 is found by its bits, not by ``== 0``: XLA:CPU compares with denormals flushed, which
    would turn every denormal into a zero here while ``lax.top_k`` still orders them.
    """
    bits = jax.lax.bitcast_convert_type(scores, jnp.int32)
    scores = jnp.where(bits == jnp.int32(-(2**31)), jnp.zeros_like(scores), scores)
    return jnp.where(scores != scores, -jnp.inf, scores)


def order_keys(x: jnp.ndarray) -> jnp.ndarray:
    """Order-preserving int32 keys of canonical f32 scores (signed comparison of keys = float
    comparison, denormals included): negative floats get their 31 magnitude bits flipped."""
    bits = jax.lax.bitcast_convert_type(x, jnp.int32)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


def from_order_keys(key: jnp.ndarray) -> jnp.ndarray:
    """Inverse of ``order_keys``: the f32 score of an int32 key (the map is an involution)."""
    return jax.lax.bitcast_convert_type(key ^ ((key >> 31) & 0x7FFFFFFF), jnp.float32)


@functools.partial(jax.jit, static_argnames=("k",))
def topk_xla(scores: jnp.ndarray, lengths: jnp.ndarray, k: int):
    """Top-k eligible positions of each row: scores [B, N] f32, lengths [B] int ->
    (positions [B, k] int32 best-first, -1 padded; values [B, k] f32, -inf padded).
    Position n of row b is eligible when n < lengths[b]; equal scores go to the lower
    position."""
    n = scores.shape[-1]
    eligible = jnp.arange(n, dtype=jnp.int32)[None, :] < lengths.astype(jnp.int32)[:, None]
    return topk_positions(canonical_scores(scores), eligible, k)


@functools.partial(jax.jit, static_argnames=("k",))
def candidate_topk_xla(scores: jnp.ndarray, ids: jnp.ndarray, k: int):
    """Top-k of rows of scored ids: scores [B, R] f32, ids [B, R] int32 (-1 = none; the others
    distinct within a row) -> (ids [B, k] int32 best first, -1 padded; values [B, k] f32,
    -inf padded). Higher canonical score first; equal scores go to the lower id. One two-key
    sort of each row on (score descending, id ascending), the scores compared as
    ``order_keys`` (as the kernel does: no float compare, which XLA:CPU makes with denormals
    flushed to zero)."""
    big = jnp.iinfo(jnp.int32).max
    valid = ids >= 0
    score = canonical_scores(scores.astype(jnp.float32))
    key = jnp.where(valid, ~order_keys(score), big)  # ~: descending, no overflow
    _, ordered, value = jax.lax.sort((key, jnp.where(valid, ids, big), score), dimension=-1,
                                     num_keys=2)
    pad = [(0, 0), (0, max(0, k - ids.shape[-1]))]
    ordered = jnp.pad(ordered[:, :k], pad, constant_values=big)
    value = jnp.pad(value[:, :k], pad)
    taken = ordered != big
    return jnp.where(taken, ordered, -1), jnp.where(taken, value, -jnp.inf)

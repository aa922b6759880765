"""Top-k selection of eligible positions with the project's tie and padding rule."""

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

"""XLA implementation of ``miss_filter`` (the rule's definition; ``api.py`` states it)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.topk.reference import canonical_scores, from_order_keys, order_keys


def kth_largest(scores, valid, k: int):
    """s_(k) of each row: the k-th largest valid canonical score (the smallest valid one if
    fewer are valid; +inf if none), found among ``order_keys`` (exact, denormals included).
    scores, valid [B, C] -> [B] f32."""
    key = jnp.where(valid, order_keys(canonical_scores(scores)), jnp.iinfo(jnp.int32).max)
    n = jnp.sum(valid, axis=-1)
    asc = jnp.sort(key, axis=-1)  # valid keys ascending, then the fill
    at = jnp.clip(n - jnp.minimum(k, n), 0, key.shape[-1] - 1)
    kth = from_order_keys(jnp.take_along_axis(asc, at[:, None], axis=-1)[:, 0])
    return jnp.where(n > 0, kth, jnp.inf)


@functools.partial(jax.jit, static_argnames=("k", "offset"))
def miss_filter_xla(scores, valid, cached, *, k: int, offset: float):
    """keep [B, C] bool of ``api.miss_filter``: s_(k) by ``kth_largest``, mean and ddof-1
    variance of the valid scores in f32."""
    scores = canonical_scores(scores.astype(jnp.float32))
    n = jnp.sum(valid, axis=-1, keepdims=True)
    mean = jnp.sum(jnp.where(valid, scores, 0.0), -1, keepdims=True) / jnp.maximum(n, 1)
    dev = jnp.where(valid, scores - mean, 0.0)
    var = jnp.sum(dev * dev, -1, keepdims=True) / jnp.maximum(n - 1, 1)
    threshold = kth_largest(scores, valid, k)[:, None] - offset * jnp.sqrt(var)
    return valid & (cached | (scores >= threshold))

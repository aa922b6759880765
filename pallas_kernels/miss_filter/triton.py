"""Pallas-Triton ``miss_filter``: the whole filter of one request in one program, its C coarse
scores in registers (before session 30: a sort of the scores and XLA reductions around it).

Notation: C candidates (CP = NBLK * BC >= C), m = min(k, #valid), T = the m-th largest
``order_keys`` key of the valid scores (``topk.triton.radix_search``: 32 steps of
a 1-bit count over the flattened row, session 44; before, 16 steps of a [NBLK, BC, 4] count),
s_(k) its score, mu and sigma^2 the mean and ddof-1 variance of the valid
scores (two passes over the registers).
keep = valid & (cached | score >= s_(k) - offset * sigma), written as int8.
The kernel sums in a different order than XLA: its threshold may differ from the twin's in the
last bits (a candidate within ~1e-6 of it relative may flip; tests allow that, nothing else).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels import common
from pallas_kernels.topk.candidates import pow2, total
from pallas_kernels.topk.reference import canonical_scores, from_order_keys, order_keys
from pallas_kernels.topk.triton import INT32_MIN, radix_search


def _kernel(x_ref, valid_ref, cached_ref, keep_ref, *, k, offset):
    # inputs  x_ref [NBLK, BC] f32 coarse scores (NaN poison where not valid), valid_ref /
    #         cached_ref [NBLK, BC] bool; output keep_ref [NBLK, BC] int8
    valid = valid_ref[...]
    x = canonical_scores(x_ref[...])
    keys = jnp.where(valid, order_keys(x), INT32_MIN)
    n = total(valid.astype(jnp.int32))

    flat = keys.reshape(keys.size)

    def at_least(thr_u):  # #{key >= T} (unsigned u <-> signed u ^ MIN)
        return jnp.sum((flat >= (thr_u ^ INT32_MIN)).astype(jnp.int32))

    kth = from_order_keys(radix_search(at_least, jnp.minimum(k, n)) ^ INT32_MIN)
    nf = n.astype(jnp.float32)
    mean = total(jnp.where(valid, x, 0.0)) / jnp.maximum(nf, 1.0)
    dev = jnp.where(valid, x - mean, 0.0)
    var = total(dev * dev) / jnp.maximum(nf - 1.0, 1.0)
    threshold = kth - offset * jnp.sqrt(var)
    keep_ref[...] = (valid & (cached_ref[...] | (x >= threshold))).astype(jnp.int8)


@functools.partial(jax.jit, static_argnames=("k", "offset", "block_c", "num_warps"))
def miss_filter_triton(scores, valid, cached, *, k: int, offset: float, block_c: int = 128,
                       num_warps: int = 8):
    """keep [B, C] bool (arguments checked by ``api.miss_filter``)."""
    b, c = scores.shape
    bc = min(block_c, pow2(c))
    nblk = pow2(-(-c // bc))
    cp = nblk * bc
    if cp != c:
        pad = ((0, 0), (0, cp - c))
        scores, valid, cached = (jnp.pad(a, pad) for a in (scores, valid, cached))
    spec = pl.BlockSpec((None, nblk, bc), lambda i: (i, 0, 0))
    keep = pl.pallas_call(
        functools.partial(_kernel, k=k, offset=float(offset)),
        out_shape=jax.ShapeDtypeStruct((b, nblk, bc), jnp.int8),
        grid=(b,), in_specs=[spec] * 3, out_specs=spec,
        compiler_params=plt.CompilerParams(num_warps=num_warps),
        interpret=common.interpret(), name="miss_filter",
    )(*(a.reshape(b, nblk, bc) for a in (scores, valid, cached)))
    return keep.reshape(b, cp)[:, :c] != 0

"""Pallas-Triton ``index_topk``: fp8 x fp8 index scores and their top-k in one kernel.

Notation:
  B requests, H heads (HP padded), D head dim, C candidates (CP = NBLK * BC >= C, BC rows per
  block), NB scale blocks per key (BS = D / NB values each), k winners (KP = next pow2 >= k),
  key(x) = the order-preserving int32 key of a canonical score (``topk.triton.order_keys``),
  m = min(k, #valid candidates) of a request, T = the m-th largest key.

Design: grid (B,), one program per request (the top-k needs all C scores of a request):
  1. for each block of BC candidates (a loop): FP8 keys [BC, D] dot FP8 queries [HP, D]
     (``reference.quantize_queries``: the query scale is in the head weight) on the tensor
     cores in f32, times each key's scale, ReLU, weighted head sum -> [BC] scores, written out
     (-inf for invalid) and kept in registers as keys [NBLK, BC] (INT32_MIN when invalid);
  2. T by a 2-bit radix search from the top bit (16 steps, each one count of 4 thresholds
     over the NBLK x BC keys), then keys > T and the first (in candidate order) keys == T up
     to m, compacted by prefix sums into positions / values; slots [m, KP) get -1 / -inf.
Equal scores go to the lower candidate index, as ``topk_positions``; positions come out in
candidate order, not best-first. Twin: ``reference.index_topk_xla(..., fp8=True)``.
Split form (``index_topk_split``, to compare): the "triton_fp8" score kernel (many programs per
request), then ``short_rows_topk`` (step 2 alone, one program per row on its [C] scores).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels import common
from pallas_kernels.index_scores.reference import quantize_queries
from pallas_kernels.index_scores.triton import check_triton_shapes, padded_heads
from pallas_kernels.topk.reference import canonical_scores
from pallas_kernels.topk.triton import INT32_MIN, order_keys

RADIX_BITS = 2


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _total(x):  # sum of a 2-D block, one axis at a time (Triton reduces one axis per op)
    return jnp.sum(jnp.sum(x, axis=1), axis=0)


def _kernel(q_ref, w_ref, kv_ref, ks_ref, valid_ref, scores_ref, pos_ref, val_ref, *, nb, bs,
            bc, nblk, c, k):
    # inputs  q_ref [HP, D] fp8, w_ref [HP] f32, kv_ref [CP, D] fp8, ks_ref [CP] (NB = 1) or
    #         [CP, NB] f32, valid_ref [CP] bool (rows past C: masked loads, never used)
    # outputs scores_ref [CP] f32 (-inf invalid), pos_ref / val_ref [KP] winners
    cols = [pl.ds(j * bs, bs) for j in range(nb)]
    qs = [q_ref[:, col] for col in cols]
    w = w_ref[...]
    lane = lax.broadcasted_iota(jnp.int32, (bc,), 0)
    blk_of = lax.broadcasted_iota(jnp.int32, (nblk, bc), 0)

    def block(t, carry):
        keys, vals = carry
        start = pl.multiple_of(t * bc, bc)
        rows = pl.ds(start, bc)
        dots = None
        for j, col in enumerate(cols):
            part = lax.dot_general(kv_ref[rows, col], qs[j], (((1,), (1,)), ((), ())),
                                   preferred_element_type=jnp.float32)  # [BC, HP]
            part = part * (ks_ref[rows] if nb == 1 else ks_ref[rows, j])[:, None]
            dots = part if dots is None else dots + part
        ok = valid_ref[rows] & (start + lane < c)
        sc = jnp.where(ok, jnp.sum(jnp.maximum(dots, 0.0) * w[None, :], axis=1), -jnp.inf)
        scores_ref[rows] = sc
        sc = canonical_scores(sc)
        key = jnp.where(ok, order_keys(sc), INT32_MIN)
        here = blk_of == t
        return jnp.where(here, key[None, :], keys), jnp.where(here, sc[None, :], vals)

    keys, vals = lax.fori_loop(0, nblk, block, (jnp.full((nblk, bc), INT32_MIN, jnp.int32),
                                                jnp.full((nblk, bc), -jnp.inf, jnp.float32)))
    _select(keys, vals, pos_ref, val_ref, k=k, bc=bc)


def _select(keys, vals, pos_ref, val_ref, *, k, bc):
    """Top-k of keys [NBLK, BC] (INT32_MIN = not eligible; candidate n = row * BC + lane):
    positions / values into pos_ref / val_ref [KP], -1 / -inf after the m winners."""
    nblk = keys.shape[0]
    blk_of = lax.broadcasted_iota(jnp.int32, (nblk, bc), 0)
    m = jnp.minimum(_total((keys != INT32_MIN).astype(jnp.int32)), k)
    kp = pos_ref.shape[0]
    slots = lax.broadcasted_iota(jnp.int32, (kp,), 0)
    pad = slots >= m
    plt.store(pos_ref, jnp.full((kp,), -1, jnp.int32), mask=pad)
    plt.store(val_ref, jnp.full((kp,), -jnp.inf, jnp.float32), mask=pad)

    @pl.when(m > 0)
    def _pick():
        digits = lax.broadcasted_iota(jnp.int32, (1 << RADIX_BITS,), 0)

        def step(p, t_u):  # keep #{key >= T} >= m; unsigned u <-> signed u ^ MIN
            shift = 32 - RADIX_BITS * (p + 1)
            thr = (t_u | (digits << shift)) ^ INT32_MIN
            ge = (keys[:, :, None] >= thr[None, None, :]).astype(jnp.int32)
            count = jnp.sum(jnp.sum(ge, axis=1), axis=0)  # [4]
            return t_u | ((jnp.sum((count >= m).astype(jnp.int32)) - 1) << shift)

        t = lax.fori_loop(0, 32 // RADIX_BITS, step, jnp.int32(0)) ^ INT32_MIN
        ties = m - _total((keys > t).astype(jnp.int32))

        def before(x):  # exclusive prefix sum in candidate (row-major) order
            row = jnp.sum(x, axis=1)
            return jnp.cumsum(x, axis=1) - x + (jnp.cumsum(row) - row)[:, None]

        tie = (keys == t).astype(jnp.int32)
        keep = (keys > t) | ((tie != 0) & (before(tie) < ties))
        keep_i = keep.astype(jnp.int32)
        flat = blk_of * bc + lax.broadcasted_iota(jnp.int32, (nblk, bc), 1)
        slot = jnp.where(keep, before(keep_i), kp + flat)  # distinct slots past KP when not kept
        plt.store(pos_ref.at[slot], flat, mask=keep)
        plt.store(val_ref.at[slot], vals, mask=keep)


def _rows_kernel(x_ref, valid_ref, pos_ref, val_ref, *, k):
    # inputs  x_ref [NBLK, BC] f32 scores of one row, valid_ref [NBLK, BC] bool
    # outputs pos_ref / val_ref [KP]
    x = canonical_scores(x_ref[...])
    keys = jnp.where(valid_ref[...], order_keys(x), INT32_MIN)
    _select(keys, x, pos_ref, val_ref, k=k, bc=x.shape[1])


@functools.partial(jax.jit, static_argnames=("k", "block_c", "num_warps"))
def short_rows_topk(scores, valid, *, k: int, block_c: int = 128, num_warps: int = 8):
    """Top-k of short rows in one kernel, one program per row holding the row in registers
    (the split form's second kernel). scores [B, C] f32, valid [B, C] bool -> (positions
    [B, k] in row order, values [B, k]), -1 / -inf padded; C up to a few thousand."""
    b, c = scores.shape
    bc = min(block_c, _pow2(c))
    nblk = _pow2(-(-c // bc))
    cp, kp = nblk * bc, _pow2(k)
    if cp != c:
        scores = jnp.pad(scores, ((0, 0), (0, cp - c)))
        valid = jnp.pad(valid, ((0, 0), (0, cp - c)))
    pos, val = pl.pallas_call(
        functools.partial(_rows_kernel, k=k),
        out_shape=[jax.ShapeDtypeStruct((b, kp), jnp.int32),
                   jax.ShapeDtypeStruct((b, kp), jnp.float32)],
        grid=(b,),
        in_specs=[pl.BlockSpec((None, nblk, bc), lambda i: (i, 0, 0)),
                  pl.BlockSpec((None, nblk, bc), lambda i: (i, 0, 0))],
        out_specs=[pl.BlockSpec((None, kp), lambda i: (i, 0)),
                   pl.BlockSpec((None, kp), lambda i: (i, 0))],
        compiler_params=plt.CompilerParams(num_warps=num_warps),
        interpret=common.interpret(),
        name="short_rows_topk",
    )(scores.reshape(b, nblk, bc), valid.reshape(b, nblk, bc))
    return pos[:, :k], val[:, :k]


def index_topk_split(q, weights, key_values, key_scales, valid, *, k: int):
    """The split form of ``index_topk_triton``: the fp8 score kernel (``index_scores``
    "triton_fp8", many programs per request), then ``short_rows_topk``. Same outputs."""
    from pallas_kernels.index_scores.triton import index_scores_triton

    scores = index_scores_triton(q, weights, key_values, key_scales, valid, fp8=True)
    pos, val = short_rows_topk(scores, valid, k=k)
    return pos, val, scores


@functools.partial(jax.jit, static_argnames=("k", "block_c", "num_warps"))
def index_topk_triton(q, weights, key_values, key_scales, valid, *, k: int,
                      block_c: int = 128, num_warps: int = 8):
    """Fused fp8 scores + top-k (shapes checked by ``api.index_topk``).

    Returns (positions [B, k] int32 in candidate order, -1 padded; values [B, k] f32, -inf
    padded; scores [B, C] f32, -inf invalid).
    """
    b, h, d = q.shape
    c, nb = key_values.shape[1], key_scales.shape[2]
    check_triton_shapes("index_topk", d, nb, fp8=True)
    q8, w8 = quantize_queries(q, weights)
    hp = padded_heads(h)
    if hp != h:
        q8 = jnp.pad(q8, ((0, 0), (0, hp - h), (0, 0)))
        w8 = jnp.pad(w8, ((0, 0), (0, hp - h)))
    bc = min(block_c, _pow2(c))
    nblk = _pow2(-(-c // bc))
    cp, kp = nblk * bc, _pow2(k)
    scale_block = (None, cp, None if nb == 1 else nb)
    scores, pos, val = pl.pallas_call(
        functools.partial(_kernel, nb=nb, bs=d // nb, bc=bc, nblk=nblk, c=c, k=k),
        out_shape=[jax.ShapeDtypeStruct((b, c), jnp.float32),
                   jax.ShapeDtypeStruct((b, kp), jnp.int32),
                   jax.ShapeDtypeStruct((b, kp), jnp.float32)],
        grid=(b,),
        in_specs=[pl.BlockSpec((None, hp, d), lambda i: (i, 0, 0)),
                  pl.BlockSpec((None, hp), lambda i: (i, 0)),
                  pl.BlockSpec((None, cp, d), lambda i: (i, 0, 0)),
                  pl.BlockSpec(scale_block, lambda i: (i, 0, 0)),
                  pl.BlockSpec((None, cp), lambda i: (i, 0))],
        out_specs=[pl.BlockSpec((None, cp), lambda i: (i, 0)),
                   pl.BlockSpec((None, kp), lambda i: (i, 0)),
                   pl.BlockSpec((None, kp), lambda i: (i, 0))],
        compiler_params=plt.CompilerParams(num_warps=num_warps),
        interpret=common.interpret(),
        name="index_topk_fp8",
    )(q8, w8, key_values, key_scales, valid)
    return pos[:, :k], val[:, :k], scores

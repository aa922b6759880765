"""Pallas-Triton ``index_topk``: fp8 x fp8 index scores and their top-k in one kernel.

Notation:
  B requests, H heads (HP padded), D head dim, C candidates (CP = NBLK * BC >= C, BC rows per
  block), NB scale blocks per key (BS = D / NB values each), k winners (KP = next pow2 >= k),
  key(x) = the order-preserving int32 key of a canonical score (``topk.reference.order_keys``),
  m = min(k, #valid candidates) of a request, T = the m-th largest key.

Design: grid (B,), one program per request (the top-k needs all C scores of a request):
  1. for each block of BC candidates (a loop): FP8 keys [BC, D] dot FP8 queries [HP, D]
     (quantized in-kernel, ``reference.quantize_rows``: the query scale is in the head weight)
     on the tensor cores in f32, times each key's scale, ReLU, weighted head sum -> [BC]
     scores, written out (-inf for invalid) and kept in registers as keys [NBLK, BC]
     (INT32_MIN when invalid);
  2. ``topk.candidates.select_rows`` on them: T by a radix search from the top bit (1 bit a
     step, one count over the keys flattened, stopping once a prefix holds exactly m keys;
     before session 44, 16 steps of 4 thresholds over the NBLK x BC keys), then keys > T and
     the first (in candidate order) keys == T up to m, compacted by prefix sums into
     positions / values; slots [m, KP) get -1 / -inf.
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
from pallas_kernels.fp8_dot import dot_f32
from pallas_kernels.index_scores.reference import quantize_rows
from pallas_kernels.index_scores.triton import check_triton_shapes, kernel_queries
from pallas_kernels.topk.candidates import candidate_topk_triton, pow2, select_rows
from pallas_kernels.topk.reference import canonical_scores, order_keys
from pallas_kernels.topk.triton import INT32_MIN, check_search


def _kernel(q_ref, w_ref, kv_ref, ks_ref, valid_ref, scores_ref, pos_ref, val_ref, *, nb, bs,
            bc, nblk, c, k, search):
    # inputs  q_ref [HP, D] f32 / bf16 (quantized here: ``reference.quantize_rows``), w_ref
    #         [HP] f32, kv_ref [CP, D] fp8, ks_ref [CP] (NB = 1) or
    #         [CP, NB] f32, valid_ref [CP] bool (rows past C: masked loads, never used)
    # outputs scores_ref [CP] f32 (-inf invalid), pos_ref / val_ref [KP] winners
    cols = [pl.ds(j * bs, bs) for j in range(nb)]
    qs, w = quantize_rows([q_ref[:, col].astype(jnp.float32) for col in cols], w_ref[...])
    lane = lax.broadcasted_iota(jnp.int32, (bc,), 0)
    blk_of = lax.broadcasted_iota(jnp.int32, (nblk, bc), 0)

    def block(t, carry):
        keys, vals = carry
        start = pl.multiple_of(t * bc, bc)
        rows = pl.ds(start, bc)
        dots = None
        for j, col in enumerate(cols):
            part = dot_f32(kv_ref[rows, col], qs[j], (((1,), (1,)), ((), ())))  # [BC, HP]
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
    select_rows(keys, vals, pos_ref, val_ref, k=k, search=search)


def short_rows_topk(scores, valid, *, k: int, block_c: int = 128, num_warps: int = 8,
                    search: str = "bits"):
    """Top-k of short rows in one kernel, one program per row holding the row in registers
    (the split form's second kernel): ``topk.candidates.candidate_topk_triton`` with each
    valid entry's index as its id (ties to the lower index; ``valid`` passed as is, so no ids
    array is made). scores [B, C] f32, valid [B, C] bool -> (positions [B, k] in row order,
    values [B, k]), -1 / -inf padded; C up to a few thousand."""
    return candidate_topk_triton(scores, valid.astype(jnp.bool_), k=k, block_c=block_c,
                                 num_warps=num_warps, search=search)


def index_topk_split(q, weights, key_values, key_scales, valid, *, k: int,
                     search: str = "bits"):
    """The split form of ``index_topk_triton``: the fp8 score kernel (``index_scores``
    "triton_fp8", many programs per request), then ``short_rows_topk`` (search: its T's
    search). Same outputs."""
    from pallas_kernels.index_scores.triton import index_scores_triton

    scores = index_scores_triton(q, weights, key_values, key_scales, valid, fp8=True)
    pos, val = short_rows_topk(scores, valid, k=k, search=search)
    return pos, val, scores


@functools.partial(jax.jit, static_argnames=("k", "block_c", "num_warps", "search"))
def index_topk_triton(q, weights, key_values, key_scales, valid, *, k: int,
                      block_c: int = 128, num_warps: int = 8, search: str = "bits"):
    """Fused fp8 scores + top-k (shapes checked by ``api.index_topk``); search: T's search
    (``topk.candidates.select_rows``).

    Returns (positions [B, k] int32 in candidate order, -1 padded; values [B, k] f32, -inf
    padded; scores [B, C] f32, -inf invalid).
    """
    b, h, d = q.shape
    c, nb = key_values.shape[1], key_scales.shape[2]
    check_triton_shapes("index_topk", d, nb, fp8=True)
    q, weights = kernel_queries(q, weights.astype(jnp.float32))
    hp = q.shape[1]
    bc = min(block_c, pow2(c))
    nblk = pow2(-(-c // bc))
    cp, kp = nblk * bc, pow2(k)
    scale_block = (None, cp, None if nb == 1 else nb)
    scores, pos, val = pl.pallas_call(
        functools.partial(_kernel, nb=nb, bs=d // nb, bc=bc, nblk=nblk, c=c, k=k,
                          search=check_search(search, cp, "index_topk")),
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
    )(q, weights, key_values, key_scales, valid)
    return pos[:, :k], val[:, :k], scores

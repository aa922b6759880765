"""Pallas-Triton ``candidate_topk``: the top-k of short rows of scored ids, one program per row
holding the row in registers (no sort).

Notation:
  R entries per row (RP = NBLK * BC >= R, BC lanes per register row), KP = next pow2 >= k,
  key(x) = the order-preserving int32 key of a canonical score (``topk.reference.order_keys``),
  INT32_MIN for entries not eligible, m = min(k, #eligible entries), T = the m-th largest key,
  t = m - #{key > T} the winners still needed among the keys equal to T.

Rule (``reference.candidate_topk_xla``): higher score first; among equal scores the lower id
(``ids``) wins, or, without ids, the earlier entry of the row.

Selection (``select_rows``), all counts over the row in registers:
  1. T by a radix search from the top bit, 1 bit a step, each step one sum over the row
     flattened to 1D, stopping once a prefix holds exactly m keys (then T is that prefix:
     ``radix_search``; session 44, 17.1 -> 6.5 us at B 64, R 2048 on an H100; before, 16
     steps of a [NBLK, BC, 4] count of 4 thresholds);
  2. the t tied winners: with ids, U = the t-th smallest id among entries with key == T by a
     second radix search over the (non-negative) ids (no early stop), run only when some tied entry
     loses (else U = INT32_MAX); without ids, the first t tied entries of the row by a prefix
     count;
  3. winners (key > T, or key == T and id <= U / among the first t) compacted, in row order,
     by prefix sums into KP output slots; slots [m, KP) get -1 / -inf.
This replaces the XLA sorts of LeanSparse's miss filter and rerank (session 29's H200 profile
at 128K: ~20 us and ~44 us a CSA layer, whatever the batch).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels import common
from pallas_kernels.topk.reference import canonical_scores, order_keys
from pallas_kernels.topk.triton import INT32_MAX, INT32_MIN, check_search, radix_search, top_key


def pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def total(x):  # sum over a block's two axes, one at a time (Triton reduces one axis per op)
    return jnp.sum(jnp.sum(x, axis=1), axis=0)


def select_rows(keys, vals, pos_ref, val_ref, *, k, ids=None, search: str = "bits"):
    """Top-k of one row held as keys [NBLK, BC] (INT32_MIN = not eligible; entry n of the row
    = row * BC + lane) with values ``vals`` alike: the winners' ids (``ids`` [NBLK, BC]
    int32, >= 0 where eligible, distinct; None: the entry n) and values into pos_ref / val_ref
    [KP] in row order, -1 / -inf after the m winners. search: T's search, "bits"
    (``radix_search``) or "thirds" (``thirds_search``, two counts a reduction; rows of fewer
    than 2^16 entries), both with the early stop."""
    nblk, bc = keys.shape
    blk_of = lax.broadcasted_iota(jnp.int32, (nblk, bc), 0)
    flat = blk_of * bc + lax.broadcasted_iota(jnp.int32, (nblk, bc), 1)
    m = jnp.minimum(total((keys != INT32_MIN).astype(jnp.int32)), k)
    kp = pos_ref.shape[0]
    slots = lax.broadcasted_iota(jnp.int32, (kp,), 0)
    pad = slots >= m
    plt.store(pos_ref, jnp.full((kp,), -1, jnp.int32), mask=pad)
    plt.store(val_ref, jnp.full((kp,), -jnp.inf, jnp.float32), mask=pad)

    def before(x):  # exclusive prefix sum in row (row-major) order
        row = jnp.sum(x, axis=1)
        return jnp.cumsum(x, axis=1) - x + (jnp.cumsum(row) - row)[:, None]

    def count_ge(x, u_u, among=None):  # #{x >= u} over the row flattened (unsigned u)
        ge = x.reshape(nblk * bc) >= (u_u ^ INT32_MIN)
        return jnp.sum((ge if among is None else ge & among).astype(jnp.int32))

    @pl.when(m > 0)
    def _pick():
        t = top_key(keys.reshape(nblk * bc), m, 0, 0, stop_early=True, search=search)[0]
        ties = m - total((keys > t).astype(jnp.int32))
        tie = keys == t
        if ids is None:
            won = tie & (before(tie.astype(jnp.int32)) < ties)
            out = flat
        else:
            n_tie = total(tie.astype(jnp.int32))
            # the largest u with #{tied ids >= u} >= n_tie - ties + 1 is the ties-th smallest
            # (ids >= 0: compared as unsigned as the radix builds u); searched only when some
            # tied entries lose (rare with continuous scores); the else branch computes
            # INT32_MAX from a traced value: Pallas-Triton's cond cannot yield a constant
            flat_tie = tie.reshape(nblk * bc)
            u = lax.cond(n_tie > ties,
                         lambda: radix_search(lambda u: count_ge(ids ^ INT32_MIN, u, flat_tie),
                                              n_tie - ties + 1),
                         lambda: jnp.maximum(ties, INT32_MAX))
            won = tie & (ids <= u)
            out = ids
        keep = (keys > t) | won
        slot = jnp.where(keep, before(keep.astype(jnp.int32)), kp + flat)  # past KP: dropped
        plt.store(pos_ref.at[slot], out, mask=keep)
        plt.store(val_ref.at[slot], vals, mask=keep)


def _kernel(x_ref, ids_ref, pos_ref, val_ref, *, k, search):
    # inputs  x_ref [NBLK, BC] f32 scores of one row, ids_ref [NBLK, BC] int32 (-1 = none),
    #         or a bool [NBLK, BC] (eligible; an entry's id is its index in the row)
    # outputs pos_ref / val_ref [KP]
    x = canonical_scores(x_ref[...])
    if ids_ref.dtype == jnp.bool_:
        select_rows(jnp.where(ids_ref[...], order_keys(x), INT32_MIN), x, pos_ref, val_ref, k=k,
                    search=search)
        return
    ids = ids_ref[...]
    keys = jnp.where(ids >= 0, order_keys(x), INT32_MIN)
    select_rows(keys, x, pos_ref, val_ref, k=k, ids=ids, search=search)


@functools.partial(jax.jit, static_argnames=("k", "block_c", "num_warps", "search"))
def candidate_topk_triton(scores, ids, *, k: int, block_c: int = 256, num_warps: int = 8,
                          search: str = "bits"):
    """scores [B, R] f32, ids [B, R] int32 -> (ids [B, k] of the winners in row order, values
    [B, k]), -1 / -inf padded (shapes checked by ``api.candidate_topk``). ids may instead be
    a [B, R] bool (eligible): each entry's index in its row is its id, read in-kernel (no
    [B, R] int32 of ids made and read). search: ``select_rows``'s."""
    b, r = scores.shape
    bc = min(block_c, pow2(r))
    nblk = pow2(-(-r // bc))
    rp, kp = nblk * bc, pow2(k)
    if rp != r:
        scores = jnp.pad(scores, ((0, 0), (0, rp - r)))
        ids = jnp.pad(ids, ((0, 0), (0, rp - r)),
                      constant_values=False if ids.dtype == jnp.bool_ else -1)
    spec = pl.BlockSpec((None, nblk, bc), lambda i: (i, 0, 0))
    out = pl.BlockSpec((None, kp), lambda i: (i, 0))
    pos, val = pl.pallas_call(
        functools.partial(_kernel, k=k, search=check_search(search, rp, "candidate top-k")),
        out_shape=[jax.ShapeDtypeStruct((b, kp), jnp.int32),
                   jax.ShapeDtypeStruct((b, kp), jnp.float32)],
        grid=(b,),
        in_specs=[spec, spec],
        out_specs=[out, out],
        compiler_params=plt.CompilerParams(num_warps=num_warps),
        interpret=common.interpret(),
        name="candidate_topk",
    )(scores.reshape(b, nblk, bc), ids.reshape(b, nblk, bc))
    return pos[:, :k], val[:, :k]

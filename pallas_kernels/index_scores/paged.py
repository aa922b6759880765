"""Pallas (Triton lowering) kernel of ``index_scores_paged``: exact index scores of FP8 keys
read in place from a pool of pages through each request's page table.

Notation:
  B requests, H indexer heads (HP: padded to a power of two >= 16), D head dim, NB scale
  blocks per key (BS = D / NB values each), R pool rows, P rows per page, MP page-table
  entries per request, N positions per request; BC positions per block, STEPS blocks per
  program (``triton.default_config``), NPAD = N rounded up to whole programs.

Math: position n of request b is row n - t[b] of its tail (T rows outside the pool, e.g. the
page being filled) when t[b] <= n < t[b] + T, else pool row page_table[b, n // P] * P + n % P;
its score is index_scores' sum_h w[b, h] ReLU(q[b, h] . dequant(key)), -inf where the
position is invalid or, outside the tail, its page is unmapped (-1, or n // P >= MP). A pool
per request ([B, R, D], ``reference.one_pool``) is read as one pool with offset tables.

Design: grid (B, NPAD / (STEPS * BC)). Program (b, i) loads q[b] once (``triton.query_parts``)
and for each block of BC positions looks up their pages in the page table, gathers the BC key
rows and their scales from the pool (masked loads: invalid positions and unmapped pages are
never read, so no poison or out-of-bounds row reaches the dot); the one or two blocks that
meet the tail take those rows from it (a branch on the block, so the others load once). It
scores them with the
contiguous kernel's arithmetic (``triton.block_scores``): a key gets the same score here as
in ``index_scores`` at the same launch parameters. The pool, the tails and the page table
are whole arrays (``memory_space=ANY``); q, weights, validity and scores are per-program
blocks. Validity is padded to whole programs (N bytes), so no program is partial.
Why: a decode step over device page pools (``CacheConfig.device_pages``) otherwise gathers a
request's N keys into a contiguous copy first (XLA: read 132 B a key, write it, read it again),
~3x the key bytes of scoring them where they lie.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels import common
from pallas_kernels.index_scores.reference import one_pool
from pallas_kernels.index_scores.triton import (
    block_scores,
    check_triton_shapes,
    kernel_queries,
    query_parts,
    resolve_config,
)


def _kernel(q_ref, w_ref, pt_ref, kv_ref, ks_ref, tv_ref, ts_ref, t0_ref, valid_ref, out_ref,
            *, nb: int, bs: int, bc: int, steps: int, page: int, max_pages: int,
            tail_rows: int, fp8: bool, barrier: bool):
    # inputs
    #   q_ref      [HP, D]           f32 or bf16 (request b; fp8: quantized in the kernel or,
    #                                past ``IN_KERNEL_QUANT_PROGRAMS`` programs, e4m3)
    #   w_ref      [HP]              f32
    #   pt_ref     [B * MP]          int32 page tables, flattened (whole array, ANY)
    #   kv_ref     [R, D]            uint8 bits of the e4m3 pool values (ANY)
    #   ks_ref     [R * NB]          f32 pool scales, flattened (ANY)
    #   tv_ref     [B * T, D]        uint8 bits of the e4m3 tail values (ANY)
    #   ts_ref     [B * T * NB]      f32 tail scales, flattened (ANY)
    #   t0_ref     [B]               int32 first position of each request's tail (ANY)
    #   valid_ref  [steps * BC]      bool (positions of program i)
    # outputs
    #   out_ref    [steps * BC]      f32
    b, base = pl.program_id(0), pl.program_id(1) * (steps * bc)
    parts, w = query_parts(q_ref, w_ref[...].astype(jnp.float32), nb, bs, fp8)  # w [HP]
    offs = jax.lax.broadcasted_iota(jnp.int32, (bc,), 0)
    cols = jax.lax.broadcasted_iota(jnp.int32, (1, bs), 1)
    tail0 = plt.load(t0_ref.at[b])                                 # scalar

    def gather(vref, sref, rows, mask):
        """Loaders of rows [BC] of a values / flattened scales pair: value bits [BC, BS] uint8
        and scales [BC] of scale block j (masked lanes read nothing and give 0)."""
        return (lambda j: plt.load(vref.at[rows[:, None], cols + j * bs], mask=mask[:, None],
                                   other=0),
                lambda j: plt.load(sref.at[rows * nb + j], mask=mask, other=0.0))

    def e4m3(bits):  # [BC, BS] uint8 -> the e4m3 values they hold
        return lambda j: jax.lax.bitcast_convert_type(bits(j), jnp.float8_e4m3fn)

    def score_block(start):
        pos = base + start + offs                                  # [BC] positions
        logical = pos // page
        phys = plt.load(pt_ref.at[b * max_pages + jnp.minimum(logical, max_pages - 1)])
        in_tail = (pos >= tail0) & (pos < tail0 + tail_rows)
        pooled = valid_ref[pl.ds(start, bc)] & ~in_tail & (logical < max_pages) & (phys >= 0)
        tailed = valid_ref[pl.ds(start, bc)] & in_tail
        pool_keys, pool_scale = gather(kv_ref, ks_ref,
                                       jnp.where(pooled, phys * page + pos % page, 0), pooled)

        def from_pool():
            return block_scores(e4m3(pool_keys), pool_scale, parts, w, nb, barrier)

        def with_tail():  # the block meets the tail: each row from where it lies (bits)
            tail_keys, tail_scale = gather(tv_ref, ts_ref,
                                           jnp.where(tailed, b * tail_rows + pos - tail0, 0),
                                           tailed)
            return block_scores(
                e4m3(lambda j: jnp.where(in_tail[:, None], tail_keys(j), pool_keys(j))),
                lambda j: jnp.where(in_tail, tail_scale(j), pool_scale(j)),
                parts, w, nb, barrier)

        first = base + start
        scores = jax.lax.cond((first < tail0 + tail_rows) & (first + bc > tail0), with_tail,
                              from_pool)
        out_ref[pl.ds(start, bc)] = jnp.where(pooled | tailed, scores, -jnp.inf)

    common.each_block(steps, bc, score_block)


@functools.partial(jax.jit, static_argnames=("page", "block_c", "steps", "num_warps",
                                             "num_stages", "fp8"))
def index_scores_paged_triton(q, weights, pool_values, pool_scales, page_table, tail_values,
                              tail_scales, tail_start, valid, *, page: int,
                              block_c: int | None = None, steps: int | None = None,
                              num_warps: int | None = None, num_stages: int | None = None,
                              fp8: bool = False) -> jnp.ndarray:
    """Pallas-Triton ``index_scores_paged`` for B requests (interpret mode without a GPU);
    fp8=True: the fp8 x fp8 form (twin ``reference.index_scores_paged_xla(..., fp8=True)``).

    Inputs (checked by ``api.index_scores_paged``): q [B, H, D] f32/bf16, weights [B, H] f32,
    pool_values [R, D] float8_e4m3fn, pool_scales [R, NB] f32 (or [B, R, ...]: per-request
    pools, ``reference.one_pool``), page_table [B, MP] int32,
    tail_values [B, T, D] e4m3, tail_scales [B, T, NB] f32, tail_start [B] int32, valid [B, N]
    bool; page P static. Output: scores [B, N] f32, -inf where invalid or unmapped. Tuning as
    ``triton.index_scores_triton`` (None: ``triton.default_config`` for a request's N
    positions, the launch the contiguous kernel gets for N keys).
    """
    pool_values, pool_scales, page_table = one_pool(pool_values, pool_scales, page_table, page)
    b, h, d = q.shape
    n, nb = valid.shape[1], pool_scales.shape[1]
    check_triton_shapes("index_scores_paged", d, nb, fp8)
    common.check_offsets("index_scores_paged", pool_values=pool_values)
    block_c, steps, num_warps = resolve_config(b, h, n, block_c, steps, num_warps)
    rows = block_c * steps                                         # positions per program
    q, weights = kernel_queries(q, weights, fp8, -(-n // rows))
    hp = q.shape[1]
    npad = -(-n // rows) * rows
    valid = jnp.pad(valid, ((0, 0), (0, npad - n)))
    max_pages = page_table.shape[1]
    tail_rows = tail_values.shape[1]
    kernel = functools.partial(_kernel, nb=nb, bs=d // nb, bc=block_c, steps=steps, page=page,
                               max_pages=max_pages, tail_rows=tail_rows, fp8=fp8,
                               barrier=common.interpret())
    any_ = pl.BlockSpec(memory_space=pl.ANY)
    bits = lambda x: jax.lax.bitcast_convert_type(x, jnp.uint8)  # noqa: E731
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((b, npad), jnp.float32),
        grid=(b, npad // rows),
        in_specs=[
            pl.BlockSpec((None, hp, d), lambda i, j: (i, 0, 0)),   # q
            pl.BlockSpec((None, hp), lambda i, j: (i, 0)),         # weights
            *[any_] * 6,                                            # page table, pool, tail
            pl.BlockSpec((None, rows), lambda i, j: (i, j)),       # valid
        ],
        out_specs=pl.BlockSpec((None, rows), lambda i, j: (i, j)),
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=common.interpret(),
        name="index_scores_paged",
    )(q, weights.astype(jnp.float32), page_table.reshape(-1), bits(pool_values),
      pool_scales.reshape(-1), bits(tail_values).reshape(b * tail_rows, d),
      tail_scales.reshape(-1),
      tail_start, valid)
    return out[:, :n]

"""Pallas Mosaic GPU kernel of ``sparse_attention`` (Hopper: TMA row copies + wgmma).

Notation:
  S requests, H heads (HP: padded to a multiple of 64, the wgmma M), D head dim (a multiple of
  128, at most 512), DH = D / 2 output columns per program, K selected rows, W window rows,
  BK rows per block (a multiple of 64), NB blocks per program, T = NB BK row codes,
  P programs (splits) per request and column half.

Design: grid (2 HP / 64, P, S), one warpgroup per program; program (c, j, s) serves heads
64 (c // 2) .. + 63 and output columns DH (c % 2) .. + DH - 1 of request s, over share j of its
rows. In XLA, each request's W window rows then K selected rows become row codes (table row
r >= 0; window row w: -(w + 2); none: -1), cut into P contiguous shares of NB blocks.
The program copies q [64, D] (swizzled, the wgmma operand) and its codes to shared memory,
then per block: every row is one TMA copy (the row viewed as D / 256 rows of 256 values, a TMA
box limit; free reshapes in XLA) into a plain [BK, D] staging buffer, from the table, the window
or a zero row for -1 (one branch per row, uniform over the warpgroup: one copy and one arrival
per row on the block's barrier; poison is never read). The staging buffer is relaid through
registers into a swizzled [BK, D] wgmma buffer (TMA cannot write one row of an 8-row swizzled
tile), and the next block's copies run while this one is computed:
  lg = q . rows^T log2(e) / sqrt(D) [64, BK] (wgmma, f32; -inf where the code is -1),
  m' = max(m, max lg), p = 2^(lg - m'), den' = den 2^(m - m') + sum p,
  acc' = acc 2^(m - m') + p . rows[:, half] (wgmma, p in bf16; [64, DH] f32 accumulator).
m starts at the sink logit and den at 1 in split 0 (the sink's exp), 0 in the others; every
program writes (acc, m, den) and ``triton.combine`` merges the P splits in XLA. The logits are
computed by both column halves (the rows' second read hits L2): a [64, 512] f32 accumulator
would not fit one warpgroup's registers.
Rows and q go to the tensor cores as bf16 (q cast); f32 tables are rejected, and FP8 rows are
not read yet (their 448-byte nope rows are not a whole number of the 128-byte units a
warpgroup copy splits into): use "triton". No GPU interpreter run: it has no wgmma (jax 0.12);
the CPU checks lower the kernel for CUDA.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import common
from pallas_kernels.sparse_attention import rows as rowfmt

LOG2E = math.log2(math.e)
WG_M = 64  # wgmma rows: heads per program
NONE_CODE = -1
TARGET_PROGRAMS = 132
CODES_CHUNK = 64  # row codes a copy moves (BK is a multiple of 64)
RELAYOUT_COLS = 128  # columns of the staging -> wgmma buffer copy per register round trip


def _plgpu():
    from jax.experimental.pallas import mosaic_gpu as plgpu

    return plgpu


def check_shapes(op: str, table) -> None:
    """Raises ValueError unless the table is bf16 with D a multiple of 128, at most 512."""
    if rowfmt.is_fp8(table):
        raise ValueError(f"{op}: implementation='mosaic' reads bf16 rows only (FP8 rows: use "
                         "implementation='triton' or 'xla')")
    if table.dtype != jnp.bfloat16:
        raise ValueError(f"{op}: implementation='mosaic' reads bf16 rows only, got "
                         f"{table.dtype}; use implementation='triton' or 'xla'")
    d = table.shape[-1]
    if d % 128 or d > 512:
        raise ValueError(f"{op}: implementation='mosaic' needs D a multiple of 128 and <= 512, "
                         f"got D={d}; use implementation='triton' or 'xla'")


def row_codes(slots, window_mask, block_k: int, splits: int):
    """codes [S, P, T] int32 of each program's rows: the W window rows (-(w + 2) where valid),
    then the K selected rows (their table row), -1 for none and for padding."""
    s, w = window_mask.shape
    wcodes = jnp.where(window_mask, -(jnp.arange(w, dtype=jnp.int32) + 2), NONE_CODE)
    codes = jnp.concatenate([wcodes, jnp.where(slots >= 0, slots, NONE_CODE)], axis=1)
    blocks = -(-codes.shape[1] // block_k)
    per = -(-blocks // splits)
    pad = splits * per * block_k - codes.shape[1]
    codes = jnp.pad(codes, ((0, 0), (0, pad)), constant_values=NONE_CODE)
    return codes.reshape(s, splits, per * block_k).astype(jnp.int32)


def default_config(s: int, h: int, k: int, w: int, *, block_k: int | None = None,
                   splits: int | None = None, num_slots: int | None = None,
                   row_loop: bool = True) -> dict:
    """BK = 64 rows a block (a [64, 512] bf16 buffer is 64 KB: q, staging and wgmma buffers
    are 192 KB of the 227 KB), one staging buffer, P about one wave of programs. row_loop
    (default): a block's row copies are issued by a loop over its BK rows instead of BK
    unrolled copies (the unrolled kernel waited on instruction fetch most; H200, Nsight
    Compute, B 64: 164 us unrolled, 113 us looped, session 27)."""
    block_k = 64 if block_k is None else block_k
    if block_k % 64 or block_k > 256:
        raise ValueError(f"sparse_attention: mosaic block_k={block_k} must be a multiple of 64 "
                         "(the wgmma layout of the row relayout) and <= 256")
    blocks = max(1, -(-(k + w) // block_k))
    if splits is None:
        programs = s * 2 * -(-h // WG_M)
        splits = max(1, min(blocks, TARGET_PROGRAMS // max(programs, 1)))
    num_slots = 1 if num_slots is None else num_slots
    return dict(block_k=block_k, splits=max(1, min(splits, blocks)), num_slots=num_slots,
                row_loop=bool(row_loop))


def _body(q_ref, sink_ref, codes_ref, table_ref, window_ref, zero_ref,
          acc_ref, m_ref, den_ref, *, bk: int, nb: int, nslot: int, d: int, qk_scale: float,
          row_loop: bool):
    # inputs (GMEM): q [S, HP, D] bf16, sink [S, HP] f32, codes [S, P, T] int32,
    #   table [S, R, D] bf16, window [S, W', D] bf16, zero [1, D] bf16 (a zero row)
    # outputs (GMEM): acc [S, P, HP, D] f32, m [S, P, HP] f32 (log2 units), den [S, P, HP] f32
    # program (c, j, s): heads c // 2, output columns half c % 2
    plgpu = _plgpu()
    c, j, s = lax.axis_index("cols"), lax.axis_index("split"), lax.axis_index("req")
    dh = d // 2
    cw = 256 if d % 256 == 0 else 128  # columns of a part
    parts = d // cw
    heads = pl.ds(lax.div(c, 2) * WG_M, WG_M)
    half = lax.rem(c, 2)
    swizzle = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    row_layout = plgpu.Layout.WGMMA.reduce(1)  # [64] per head
    col_layout = plgpu.Layout.WGMMA.reduce(0)  # [BK] per row

    def copy(src, dst, bar, pred):
        """The copy of the one source ``pred`` picks (codes are uniform over the warpgroup):
        exactly one copy, so one arrival, per row."""
        pl.when(pred)(lambda: plgpu.copy_gmem_to_smem(src, dst, bar))

    def main(q_smem, stage_smem, rows_smem, codes_smem, sink_smem, q_bar, codes_bar, stage_bar):
        plgpu.copy_gmem_to_smem(q_ref.at[s, heads], q_smem, q_bar.at[0])
        for t0 in range(0, nb * bk, CODES_CHUNK):  # <= 256 values a copy
            plgpu.copy_gmem_to_smem(codes_ref.at[s, j, pl.ds(t0, CODES_CHUNK)],
                                    codes_smem.at[pl.ds(t0, CODES_CHUNK)], codes_bar)
        plgpu.copy_gmem_to_smem(sink_ref.at[s, heads], sink_smem, q_bar.at[1])
        plgpu.barrier_wait(codes_bar)

        def fetch(b):  # block b's rows, one TMA copy each, into staging buffer b % NSLOT
            slot = lax.rem(b, nslot)
            bar = stage_bar.at[slot]
            def row(r, carry):  # a row is `parts` rows of <= 256 values (a TMA box limit)
                code = codes_smem[b * bk + r]
                t_row, w_row = jnp.maximum(code, 0) * parts, jnp.maximum(-code - 2, 0) * parts
                dst = stage_smem.at[slot, pl.ds(r * parts, parts)]
                copy(table_ref.at[s, pl.ds(t_row, parts)], dst, bar, code >= 0)
                copy(window_ref.at[s, pl.ds(w_row, parts)], dst, bar, code <= -2)
                copy(zero_ref.at[pl.ds(0, parts)], dst, bar, code == NONE_CODE)
                return carry

            if row_loop:
                lax.fori_loop(0, bk, row, 0)
            else:
                for r in range(bk):
                    row(r, 0)

        for b in range(min(nslot, nb)):
            fetch(b)
        plgpu.barrier_wait(q_bar.at[0])
        plgpu.barrier_wait(q_bar.at[1])
        m0 = plgpu.load(sink_smem, layout=row_layout) * LOG2E
        den0 = plgpu.layout_cast(  # the sink's 2^(sink - m) = 1, in split 0 only
            jnp.full((WG_M,), 1.0, jnp.float32) * (j == 0).astype(jnp.float32), row_layout)
        acc0 = plgpu.layout_cast(jnp.zeros((WG_M, dh), jnp.float32), plgpu.Layout.WGMMA)

        def step(b, carry):
            acc, m, den = carry
            slot = lax.rem(b, nslot)
            plgpu.barrier_wait(stage_bar.at[slot])
            stage = stage_smem.at[slot].reshape(bk, d)
            for c0 in range(0, d, RELAYOUT_COLS):  # [BK, 128] bf16 at a time: 32 registers
                cols = pl.ds(c0, RELAYOUT_COLS)
                rows_smem.at[:, cols][...] = plgpu.load(
                    stage.at[:, cols], layout=plgpu.Layout.WGMMA, optimized=False)
            plgpu.commit_smem()

            @pl.when(b + nslot < nb)
            def _():
                fetch(b + nslot)

            def qk_fn(qk_ref):
                plgpu.wgmma(qk_ref, q_smem, rows_smem.transpose((1, 0)))
                return qk_ref[...]
            lg = pl.run_scoped(qk_fn, plgpu.ACC((WG_M, bk), jnp.float32))
            codes = plgpu.load(codes_smem.at[pl.ds(b * bk, bk)], layout=col_layout)
            valid = lax.broadcast_in_dim(codes != NONE_CODE, (WG_M, bk), [1])
            lg = jnp.where(valid, lg * qk_scale, -jnp.inf)
            m_new = jnp.maximum(m, lg.max(axis=1))
            alpha = jnp.exp2(m - m_new)
            p = jnp.exp2(lg - lax.broadcast_in_dim(m_new, lg.shape, [0]))
            den = den * alpha + p.sum(axis=1)
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
            p16 = p.astype(jnp.bfloat16)

            def pv_fn(acc_ref):
                for hv in (0, 1):  # static column slices of the swizzled buffer
                    pl.when(half == hv)(functools.partial(
                        plgpu.wgmma, acc_ref, p16, rows_smem.at[:, pl.ds(hv * dh, dh)]))
            acc = pl.run_state(pv_fn)(plgpu.ACC.init(acc))
            return acc, m_new, den

        return lax.fori_loop(0, nb, step, (acc0, m0, den0))

    acc, m, den = pl.run_scoped(
        main,
        plgpu.SMEM((WG_M, d), jnp.bfloat16, transforms=swizzle),
        plgpu.SMEM((nslot, bk * parts, cw), jnp.bfloat16),
        plgpu.SMEM((bk, d), jnp.bfloat16, transforms=swizzle),
        plgpu.SMEM((nb * bk,), jnp.int32),
        plgpu.SMEM((WG_M,), jnp.float32),
        plgpu.Barrier(num_barriers=2),
        plgpu.Barrier(num_arrivals=nb * bk // CODES_CHUNK),
        plgpu.Barrier(num_arrivals=bk, num_barriers=nslot),
    )

    def write(o_smem, v_smem):
        o_smem[...] = acc
        v_smem[0] = m
        v_smem[1] = den
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, acc_ref.at[s, j, heads, pl.ds(half * dh, dh)])

        @pl.when(half == 0)
        def _():
            plgpu.copy_smem_to_gmem(v_smem.at[0], m_ref.at[s, j, heads])
            plgpu.copy_smem_to_gmem(v_smem.at[1], den_ref.at[s, j, heads])
        plgpu.wait_smem_to_gmem(0)
    f32_swizzle = (plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(128))
    pl.run_scoped(write, plgpu.SMEM((WG_M, dh), jnp.float32, transforms=f32_swizzle),
                  plgpu.SMEM((2, WG_M), jnp.float32))


@functools.partial(jax.jit, static_argnames=("block_k", "splits", "num_slots", "row_loop"))
def sparse_attention_mosaic(q, table, slots, window, window_mask, sink, *,
                            block_k: int | None = None, splits: int | None = None,
                            num_slots: int | None = None, row_loop: bool = True) -> jnp.ndarray:
    """Mosaic GPU ``sparse_attention`` (runs on a GPU only; lowers for CUDA anywhere).

    Inputs as ``api.sparse_attention`` (bf16 table and window; q cast to bf16; sink [H] or
    [S, H]). Output out [S, H, D] f32. Tuning: block_k (BK), splits (P), num_slots, row_loop
    (``default_config``).
    """
    plgpu = _plgpu()
    check_shapes("sparse_attention", table)
    s, h, d = q.shape
    k, w = slots.shape[1], window.shape[1]
    cfg = default_config(s, h, k, w, block_k=block_k, splits=splits, num_slots=num_slots,
                         row_loop=row_loop)
    bk, p = cfg["block_k"], cfg["splits"]
    hp = -(-h // WG_M) * WG_M
    codes = row_codes(slots, window_mask, bk, p)                  # [S, P, T]
    nb = codes.shape[2] // bk
    q = jnp.pad(q.astype(jnp.bfloat16), ((0, 0), (0, hp - h), (0, 0)))
    sink = jnp.pad(jnp.broadcast_to(sink.astype(jnp.float32), (s, h)), ((0, 0), (0, hp - h)))
    if w == 0:  # a never-read stand-in (no window codes)
        window = jnp.zeros((s, 1, d), jnp.bfloat16)
    zero = jnp.zeros((1, d), jnp.bfloat16)
    cw = 256 if d % 256 == 0 else 128  # rows as `parts` rows of cw values (free reshapes)
    table, window, zero = (a.reshape(a.shape[:-2] + (-1, cw)) for a in (table, window, zero))
    if common.interpret():
        raise ValueError("sparse_attention: implementation='mosaic' needs a CUDA GPU (the Mosaic "
                         "GPU interpreter has no wgmma); lowering it for CUDA works without one "
                         "(common.lower_for_cuda)")
    body = functools.partial(_body, bk=bk, nb=nb, nslot=cfg["num_slots"], d=d,
                             qk_scale=LOG2E / math.sqrt(d), row_loop=cfg["row_loop"])
    f32 = jnp.float32
    acc, m, den = plgpu.kernel(
        body,
        out_type=(jax.ShapeDtypeStruct((s, p, hp, d), f32), jax.ShapeDtypeStruct((s, p, hp), f32),
                  jax.ShapeDtypeStruct((s, p, hp), f32)),
        grid=(2 * (hp // WG_M), p, s),
        grid_names=("cols", "split", "req"),
        compiler_params=plgpu.CompilerParams(approx_math=True,
                                            lowering_semantics=plgpu.LoweringSemantics.Lane),
    )(q, sink, codes, table, window.astype(jnp.bfloat16), zero)
    from pallas_kernels.sparse_attention.triton import combine

    return combine(acc, m, den)[:, :h]

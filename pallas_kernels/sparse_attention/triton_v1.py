"""Pallas (Triton lowering) kernel of ``sparse_attention``, version 1 (issue 6; kept for comparison:
``triton.py`` is the current one): gathered-row decode attention over head blocks.

Notation:
  S requests, H query heads (HP: padded to a multiple of BH), D head dim (a power of two),
  R table rows, K selected rows (slot -1 = none), W window rows per request,
  BH heads per program, BK rows per block (powers of two >= 16, the smallest Triton dot),
  NK = cdiv(K, BK) selected blocks, NW = cdiv(W, BK) window blocks, P = splits per request.

Design: grid (HP / BH, P, S), head blocks fastest, so the programs that read the same rows of
a request run side by side and all but one find them in L2. Program (h, j, s) loads q[s, heads
h] [BH, D] once and walks its share (contiguous, ~(NK + NW) / P blocks) of the NK selected
blocks, then the NW window blocks. A selected block loads BK slot ids, then gathers those rows
of table[s] in place (the table is a whole-array ``pl.ANY`` ref indexed by the ids:
table[slots] is never written to HBM); a window block is a contiguous [BK, D] slice. Invalid
rows (slot -1, positions >= K or >= W, masked window rows) are masked loads (never read: NaN
poison stays in memory) that yield 0, and get a -inf logit. Per block, an online softmax in
log2 units: logits = q . rows^T * log2(e) / sqrt(D) [BH, BK] (tensor cores, f32 accumulation),
m' = max(m, max logits), den' = den 2^(m - m') + sum 2^(logits - m'),
acc' = acc 2^(m - m') + 2^(logits - m') . rows [BH, D] (probabilities rounded to the rows'
dtype for the second dot). m starts at the sink logit (log2 units), so it is always finite
(no -inf - -inf) and the sink's exp(sink_h) enters the denominator as den = 1 (in split 0
only; the other splits start at den = 0). P = 1 writes out = acc / den; P > 1 writes each
split's (acc, m, den) and ``combine`` merges them in XLA
(out = sum_j 2^(m_j - M) acc_j / sum_j 2^(m_j - M) den_j, M = max_j m_j): the row loop is split
across programs when S x HP / BH alone would leave most of the 132 SMs idle (the partials,
P S HP D f32, are small exactly then).

Traffic: every selected and window row is read from HBM about once ((K + W) D itemsize bytes a
request); FLOPs 4 S H (K + W) D. Slots >= R (undefined input) are clamped to R - 1.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels import common
from pallas_kernels.sparse_attention.triton import combine  # the same partial-softmax merge

MIN_DOT = 16  # smallest dimension of a Triton tl.dot
LOG2E = math.log2(math.e)
TARGET_PROGRAMS = 128  # ~one wave on the H200's 132 SMs before the row loop is split


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def check_triton_shapes(op: str, d: int) -> None:
    """The kernel's blocks are [*, D]: D must be a power of two >= 16."""
    if not _pow2(d) or d < MIN_DOT:
        raise ValueError(f"{op}: head dim D={d} (q, table and window) must be a power of two "
                         f">= {MIN_DOT} for the Triton kernel; use implementation='xla'")


def default_config(s: int, h: int, d: int, k: int, w: int, itemsize: int, *,
                   block_h: int | None = None, block_k: int | None = None,
                   splits: int | None = None, num_warps: int | None = None,
                   num_stages: int | None = None) -> dict:
    """Launch parameters: the given ones, a first guess for the rest (tune with
    benchmarks/sparse_attention_gpu.py). Raises ValueError for bad given ones.

    BH = 32 heads (16 when H <= 16): with 8 warps at D = 512 the [BH, D] f32 accumulator is 64
    registers a thread (ptxas, sm_90, triton 3.6: ~180 registers, no spills). BK = 32 rows: a
    [32, 512] bf16 block is 32 KB of shared memory per pipeline stage. P splits the row loop
    when S x HP / BH < TARGET_PROGRAMS (batch 1: P up to the number of blocks).
    """
    block_h = min(32, max(MIN_DOT, _next_pow2(h))) if block_h is None else block_h
    block_k = 32 if block_k is None else block_k
    for name, val in (("block_h", block_h), ("block_k", block_k)):
        if not _pow2(val) or val < MIN_DOT:
            raise ValueError(f"sparse_attention: {name}={val} must be a power of two >= "
                             f"{MIN_DOT}")
    blocks = -(-k // block_k) + -(-w // block_k)
    if splits is None:
        programs = s * -(-h // block_h)
        splits = max(1, min(blocks, -(-TARGET_PROGRAMS // max(programs, 1))))
    if splits < 1:
        raise ValueError(f"sparse_attention: splits={splits} must be >= 1")
    if num_warps is None:
        num_warps = 8 if block_h * d >= 16384 else 4
    if num_stages is None:
        num_stages = 3 if block_k * d * itemsize <= 32768 else 2
    return dict(block_h=block_h, block_k=block_k, splits=splits, num_warps=num_warps,
                num_stages=num_stages)


def _kernel(q_ref, sink_ref, slots_ref, table_ref, window_ref, wmask_ref, *out_refs,
            bk: int, nk: int, nw: int, per: int, splits: int, k: int, w: int, num_rows: int,
            qk_scale: float):
    # inputs
    #   q_ref      [BH, D]     f32 / bf16 (request s, heads of block h)
    #   sink_ref   [BH]        f32
    #   slots_ref  [S, K]      int32 (whole array, memory_space=ANY)
    #   table_ref  [S, R, D]   f32 / bf16 (whole array, ANY; gathered by slot id in place)
    #   window_ref [S, W, D]   table's dtype (whole array, ANY)
    #   wmask_ref  [S, W]      bool (whole array, ANY)
    # outputs
    #   P = 1: out_ref [BH, D] f32 (normalized)
    #   P > 1: acc_ref [BH, D], m_ref [BH], den_ref [BH] f32 (this split's partial softmax)
    # scratch: none
    j, s = pl.program_id(1), pl.program_id(2)
    dtype = table_ref.dtype
    q = q_ref[...].astype(dtype)                                   # [BH, D]
    bh, d = q.shape
    # f32 rows: IEEE f32 dots (Pallas-Triton maps the default precision to TF32)
    prec = jax.lax.Precision.HIGHEST if dtype == jnp.float32 else None
    cols = jax.lax.broadcasted_iota(jnp.int32, (1, d), 1)          # [1, D]
    offs = jax.lax.broadcasted_iota(jnp.int32, (bk,), 0)           # [BK]
    m = sink_ref[...].astype(jnp.float32) * LOG2E                  # [BH] log2 units
    den = jnp.full((bh,), 1.0, jnp.float32) * (j == 0).astype(jnp.float32)  # 2^(sink - m), P0
    acc = jnp.zeros((bh, d), jnp.float32)

    def attend(carry, rows, valid):                                # rows [BK, D], valid [BK]
        m, den, acc = carry
        lg = jax.lax.dot_general(q, rows, (((1,), (1,)), ((), ())), precision=prec,
                                 preferred_element_type=jnp.float32) * qk_scale  # [BH, BK]
        lg = jnp.where(valid[None, :], lg, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(lg, axis=1))                # >= sink: finite
        alpha = jnp.exp2(m - m_new)                                # [BH]
        p = jnp.exp2(lg - m_new[:, None])                          # [BH, BK], 0 where invalid
        den = den * alpha + jnp.sum(p, axis=1)
        pv = jax.lax.dot_general(p.astype(dtype), rows, (((1,), (0,)), ((), ())),
                                 precision=prec, preferred_element_type=jnp.float32)  # [BH, D]
        return m_new, den, acc * alpha[:, None] + pv

    def selected_block(i, carry):
        start = pl.multiple_of(i * bk, bk)
        pos = start + offs
        ids = plt.load(slots_ref.at[s, pl.ds(start, bk)], mask=pos < k, other=-1)  # [BK]
        valid = ids >= 0
        ids = jnp.clip(ids, 0, num_rows - 1)
        rows = plt.load(table_ref.at[s, ids[:, None], cols], mask=valid[:, None],
                        other=0)                                   # [BK, D] gathered in place
        return attend(carry, rows, valid)

    def window_block(i, carry):
        start = pl.multiple_of(i * bk, bk)
        inside = start + offs < w
        valid = plt.load(wmask_ref.at[s, pl.ds(start, bk)], mask=inside, other=False) & inside
        rows = plt.load(window_ref.at[s, pl.ds(start, bk), :], mask=valid[:, None],
                        other=0)                                   # [BK, D]
        return attend(carry, rows, valid)

    # this split's blocks [lo, hi) of the NK selected then NW window blocks
    if splits == 1:
        sel, win = (0, nk), (0, nw)
    else:
        lo = j * per
        hi = jnp.minimum(lo + per, nk + nw)
        sel = (jnp.minimum(lo, nk), jnp.minimum(hi, nk))
        win = (jnp.maximum(lo, nk) - nk, jnp.maximum(hi, nk) - nk)
    carry = (m, den, acc)
    if nk:
        carry = jax.lax.fori_loop(sel[0], sel[1], selected_block, carry)
    if nw:
        carry = jax.lax.fori_loop(win[0], win[1], window_block, carry)
    m, den, acc = carry
    if splits == 1:
        (out_ref,) = out_refs
        out_ref[...] = acc / den[:, None]                          # den >= 1 (the sink)
    else:
        acc_ref, m_ref, den_ref = out_refs
        acc_ref[...] = acc
        m_ref[...] = m
        den_ref[...] = den


@functools.partial(jax.jit, static_argnames=("block_h", "block_k", "splits", "num_warps",
                                             "num_stages"))
def sparse_attention_triton(q: jnp.ndarray, table: jnp.ndarray, slots: jnp.ndarray,
                            window: jnp.ndarray, window_mask: jnp.ndarray, sink: jnp.ndarray,
                            *, block_h: int | None = None, block_k: int | None = None,
                            splits: int | None = None, num_warps: int | None = None,
                            num_stages: int | None = None) -> jnp.ndarray:
    """Pallas-Triton ``sparse_attention`` (interpret mode without a GPU).

    Inputs: q [S, H, D] f32/bf16 (cast to table's dtype), table [S, R, D] f32/bf16,
    slots [S, K] int32 (-1 = none), window [S, W, D] table's dtype, window_mask [S, W] bool,
    sink [H] f32 (checked by ``api.sparse_attention``). Output: out [S, H, D] f32.
    Tuning (None = ``default_config``): block_h (BH), block_k (BK), powers of two >= 16;
    splits (P >= 1, row-loop splits per request); num_warps; num_stages.
    """
    (s, h, d), (num_rows, k), w = q.shape, (table.shape[1], slots.shape[1]), window.shape[1]
    check_triton_shapes("sparse_attention", d)
    cfg = default_config(s, h, d, k, w, jnp.dtype(table.dtype).itemsize, block_h=block_h,
                         block_k=block_k, splits=splits, num_warps=num_warps,
                         num_stages=num_stages)
    block_h, block_k, splits = cfg["block_h"], cfg["block_k"], cfg["splits"]
    nk, nw = -(-k // block_k), -(-w // block_k)
    splits = max(1, min(splits, nk + nw))
    per = -(-(nk + nw) // splits)
    hp = -(-h // block_h) * block_h
    sink = sink.astype(jnp.float32)
    if k == 0:  # Pallas rejects zero-size operands: a never-read stand-in (nk = 0)
        slots = jnp.full((s, 1), -1, jnp.int32)
    if w == 0:  # likewise (nw = 0)
        window = jnp.zeros((s, 1, d), table.dtype)
        window_mask = jnp.zeros((s, 1), jnp.bool_)
    if hp != h:  # zero queries with a zero sink: finite, sliced off below
        q = jnp.pad(q, ((0, 0), (0, hp - h), (0, 0)))
        sink = jnp.pad(sink, (0, hp - h))
    kernel = functools.partial(_kernel, bk=block_k, nk=nk, nw=nw, per=per, splits=splits, k=k,
                               w=w, num_rows=num_rows, qk_scale=LOG2E / math.sqrt(d))
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    acc_spec = pl.BlockSpec((None, None, block_h, d), lambda i, j, r: (r, j, i, 0))
    if splits == 1:
        out_shape = [jax.ShapeDtypeStruct((s, 1, hp, d), jnp.float32)]
        out_specs = [acc_spec]
    else:
        vec_spec = pl.BlockSpec((None, None, block_h), lambda i, j, r: (r, j, i))
        out_shape = [jax.ShapeDtypeStruct((s, splits, hp, d), jnp.float32),
                     jax.ShapeDtypeStruct((s, splits, hp), jnp.float32),
                     jax.ShapeDtypeStruct((s, splits, hp), jnp.float32)]
        out_specs = [acc_spec, vec_spec, vec_spec]
    outs = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(hp // block_h, splits, s),
        in_specs=[
            pl.BlockSpec((None, block_h, d), lambda i, j, r: (r, i, 0)),   # q
            pl.BlockSpec((block_h,), lambda i, j, r: (i,)),                # sink
            any_spec, any_spec, any_spec, any_spec,                        # slots .. mask
        ],
        out_specs=out_specs,
        compiler_params=plt.CompilerParams(num_warps=cfg["num_warps"],
                                           num_stages=cfg["num_stages"]),
        interpret=common.interpret(),
        name="sparse_attention",
    )(q, sink, slots, table, window, window_mask)
    out = outs[0][:, 0] if splits == 1 else combine(*outs)
    return out[:, :h]

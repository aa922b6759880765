"""Pallas (Triton lowering) kernel of ``sparse_attention``, version 2: every head of a request
in one program, the rows split across programs, rows read in their stored format.

Notation:
  S requests, H query heads (HP: padded to a power of two >= 16), D head dim, R table rows,
  K selected rows (slot -1 = none), W window rows per request; BH heads per program (HP by
  default: all of them), BK rows per block, NK = cdiv(K, BK) selected and NW = cdiv(W, BK)
  window blocks, P programs (splits) per request and head block.
  Column chunks: D is cut into chunks c = [c0, c0 + w) (width ``block_d``, D by default:
  one chunk; FP8 rows with block_d = 64, the only form when D is not a power of two: the
  nb = n / 64 scale blocks of the non-RoPE part, then the RoPE part).

Design: grid (HP / BH, P, S). A program loads q[s, heads] [BH, D] once (as chunks) and walks
its contiguous share of the NK + NW blocks, so each selected row is read from HBM once for all
heads (BH = H) while P programs share the request's rows. A selected block loads BK slot ids and
gathers those rows of table[s] (table[0] when one table is shared by all requests) in place
(whole-array ``pl.ANY`` refs, masked loads: rows no slot names are never read), chunk by chunk;
a window block is a contiguous slice.
Per block, an online softmax in log2 units with f32 accumulators acc_c [BH, w] per chunk:
  lg = sum_c (q_c . rows_c^T) sigma_c * log2(e) / sqrt(D)     [BH, BK] (-inf where invalid)
  m' = max(m, max lg), alpha = 2^(m - m'), p = 2^(lg - m'), den' = den alpha + sum p,
  acc_c' = acc_c alpha + (p sigma_c) . rows_c
with sigma_c [BK] the rows' FP8 scales of chunk c in the 64-wide form (1 otherwise): there an
FP8 row is never dequantized elementwise, its e4m3 values go to the tensor cores as bf16
(exact) and the power-of-two scale multiplies the logits and the probabilities. In the
whole-row form (default) a block's FP8 rows are gathered as one [BK, D] tile from the three
leaves (nope bits, per-column scale bits, rope; masked by column) and dequantized in registers
(e4m3 x 2^e is exact in bf16): then the dense path's two dots.
Slot ids are loaded one block ahead (loop-carried), so a block's gather waits on no load of
its own iteration. ``col_splits`` = C > 1 cuts the output columns over C programs (grid axis 0:
head blocks x C): each computes all logits but accumulates only [BH, D / C] (the [64, 512] f32
accumulator is 128 registers a thread at 8 warps), re-gathering its value columns (L1/L2).
m starts at the sink logit (finite, no -inf - -inf) and den at 1 in split 0 (the sink's
exp(sink_h)), 0 in the others. P = 1 writes out = acc / den; P > 1 writes (acc, m, den) per split
and ``combine`` merges them (log-sum-exp) after the kernel, or with ``fused_combine`` the last
split of each request to finish merges them inside it (``_combine_last``). Dots: bf16
operands for bf16 and FP8 rows (q and p rounded to bf16), f32 rows as 3-pass TF32 on the GPU
(IEEE f32 in interpret mode).

Traffic: each valid row once, (K + W) row_bytes a request; FLOPs 4 S H (K + W) D.
Slots >= R (undefined input) are clamped to R - 1.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels import common
from pallas_kernels.sparse_attention import rows as rowfmt

MIN_DOT = 16  # smallest dimension of a Triton tl.dot
LOG2E = math.log2(math.e)
TARGET_PROGRAMS = 132  # the H200's SMs: splits fill about one wave
E8M0_NAN = 255
# f32 rows: the D columns in chunks of this width. Why (the H200's session-7 decode profile:
# V4 CSA, S = 64, H = 64, D = 512, K + W = 640, one chunk of D, BH = BK = 16: 7.1 ms a launch,
# 85x the bf16 rows' 0.083 ms). 3-pass TF32 has no wgmma form at M = BH = 16 (wgmma needs
# M = 64 a warpgroup), so Triton lowers each dot to mma.sync (MMAv2), whose operands live in
# registers: the [BH, D] = [16, 512] f32 query as the A operand of one dot is 16 x 512 / 32 =
# 256 registers a thread in every warp, twice (its TF32 high and low parts), and the [512, 16]
# row block as B another 2 x 128: ~770 registers a thread against the 255 that exist, so
# (our reading of the lowering, not yet a measurement: benchmarks/attention_precision_gpu.py
# sweeps block_d for f32 rows) the operands spill to local memory at each of a program's 40
# row blocks.
# Arithmetic: the launch moves (K + W) rows x 2 KB x S = 84 MB (x4 head blocks, mostly from
# L2) and does 3 x 4 S H (K + W) D = 16 GFLOP of TF32: ~0.07 ms of HBM, ~0.05 ms of TF32
# tensor cores; the measured 7.1 ms = 256 programs (2 a SM: 96 KB shared memory, 25%
# occupancy, about one wave) x 40 blocks of 16 rows = ~310,000 cycles (1.75 GHz) a block of
# 16 rows, i.e. neither bandwidth nor FLOPs but the spilled operands. In 64-wide chunks each
# dot's operands are 2 x 32 (A) + 2 x 16 (B) registers a thread and the [16, 64] accumulator
# per chunk 4: the sum over chunks of the logits is the same arithmetic in 8 dots.
F32_BLOCK_D = 64


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _fp8_chunkable(table) -> bool:
    """FP8 rows the 64-wide chunked form reads: n a multiple of 64, r a power of two >= 16."""
    n, r = table[0].shape[-1], table[2].shape[-1]
    return n % rowfmt.FP8_BLOCK == 0 and _pow2(r) and r >= MIN_DOT


def check_triton_shapes(op: str, table) -> None:
    """Dense rows: D a power of two >= 16. FP8 rows: D a power of two >= 16 (whole rows), or
    n a multiple of 64 and r a power of two >= 16 (64-wide chunks). Raises ValueError (naming
    the fix) otherwise."""
    if rowfmt.is_fp8(table):
        n, r = table[0].shape[-1], table[2].shape[-1]
        if not (_pow2(n + r) and n + r >= MIN_DOT) and not _fp8_chunkable(table):
            raise ValueError(f"{op}: FP8 rows need D = n + r a power of two >= {MIN_DOT}, or n "
                             f"(nope dims) a multiple of {rowfmt.FP8_BLOCK} and r (rope dims) a "
                             f"power of two >= {MIN_DOT}, for the Triton kernel, got n={n}, "
                             f"r={r}; use implementation='xla'")
        return
    d = table.shape[-1]
    if not _pow2(d) or d < MIN_DOT:
        raise ValueError(f"{op}: head dim D={d} (q, table and window) must be a power of two "
                         f">= {MIN_DOT} for the Triton kernel; use implementation='xla'")


# The largest block of rows (BK x row bytes) that default_config gives 3 stages, by row format.
# bf16: 32 KB blocks (BK 32 at D 512) took 0.937x / 0.928x of the 2-stage time at B 64, k 512
# in two H100 runs of interleaved rounds (14 of 15, 19 of 25 rounds faster, outputs equal;
# session 39, benchmarks/launch_variants_gpu.py, results/launch_variants_s39/); FP8 / f32: the
# sessions-20s sweeps' 16 KB (2 stages at their BK 32 / 16 blocks).
STAGE3_BLOCK_BYTES = {"bf16": 32768, "fp8": 16384, "f32": 16384}


def default_config(s: int, h: int, d: int, k: int, w: int, row_bytes: int, fp8: bool = False,
                   f32: bool = False, *, block_h: int | None = None, block_k: int | None = None,
                   block_d: int | None = None, splits: int | None = None,
                   num_warps: int | None = None, num_stages: int | None = None) -> dict:
    """Launch parameters: the given ones, a first guess for the rest (tune with
    benchmarks/sparse_attention_v2_gpu.py). Raises ValueError for bad given ones.

    BH = HP (all heads: rows read once). BK = 32 rows. block_d = D: one chunk (FP8 rows:
    whole rows dequantized in registers; block_d = 64 reads them in their scale blocks, the
    only form when D is not a power of two). P = TARGET_PROGRAMS // (S HP / BH), at most the
    number of blocks: about one wave of programs (B = 64: 2, B = 8: 16). 8 warps (f32: 4); 3
    stages of rows when a block of rows is at most ``STAGE3_BLOCK_BYTES`` (bf16 32 KB, FP8
    and f32 16 KB), else 2. f32 rows: BH = 16, BK = 16 and
    D cut into F32_BLOCK_D = 64-wide chunks (``F32_BLOCK_D`` says why).
    """
    hp = max(MIN_DOT, _next_pow2(h))
    block_h = (min(16, hp) if f32 else hp) if block_h is None else block_h
    block_k = (16 if f32 else 32) if block_k is None else block_k
    if f32 and block_d is None:
        block_d = min(F32_BLOCK_D, d)
    if fp8 and block_d not in (None, d, rowfmt.FP8_BLOCK):
        raise ValueError(f"sparse_attention: FP8 rows are read whole (block_d=D={d}) or in "
                         f"their {rowfmt.FP8_BLOCK}-wide scale blocks, got block_d={block_d}")
    if block_d is None:
        block_d = d if (not fp8 or _pow2(d)) else rowfmt.FP8_BLOCK
    for name, val in (("block_h", block_h), ("block_k", block_k), ("block_d", block_d)):
        if not _pow2(val) or val < MIN_DOT:
            raise ValueError(f"sparse_attention: {name}={val} must be a power of two >= "
                             f"{MIN_DOT}")
    if block_h > hp:
        raise ValueError(f"sparse_attention: block_h={block_h} must be <= HP={hp} (H={h} "
                         "padded to a power of two >= 16)")
    if block_d > d or (not fp8 and d % block_d):
        raise ValueError(f"sparse_attention: block_d={block_d} must divide D={d}")
    blocks = -(-k // block_k) + -(-w // block_k)
    if splits is None:
        programs = s * (hp // block_h)
        splits = max(1, min(blocks, TARGET_PROGRAMS // max(programs, 1)))
    if splits < 1:
        raise ValueError(f"sparse_attention: splits={splits} must be >= 1")
    if num_warps is None:  # f32: 4 warps 0.66 ms vs 8 warps 1.03 ms (H200, B 64, k 512)
        num_warps = 4 if f32 else 8
    if num_stages is None:  # 3 stages while a block of rows is at most STAGE3_BLOCK_BYTES
        num_stages = 3 if block_k * row_bytes <= STAGE3_BLOCK_BYTES[
            "fp8" if fp8 else "f32" if f32 else "bf16"] else 2
    return dict(block_h=block_h, block_k=block_k, block_d=block_d, splits=splits,
                num_warps=num_warps, num_stages=num_stages)


def _chunks(table, d: int, block_d: int) -> list[tuple[int, int, str, int]]:
    """Column chunks (c0, width, leaf, index): dense rows cut at ``block_d``; FP8 rows whole
    (leaf "fp8", block_d = D) or in the 64-wide scale blocks of nope (leaf "nope", index =
    scale block), then "rope"."""
    if not rowfmt.is_fp8(table):
        return [(c0, block_d, "dense", 0) for c0 in range(0, d, block_d)]
    if block_d == d:
        return [(0, d, "fp8", 0)]
    n, r = table[0].shape[-1], table[2].shape[-1]
    fb = rowfmt.FP8_BLOCK
    return [(c0, fb, "nope", c0 // fb) for c0 in range(0, n, fb)] + [(n, r, "rope", 0)]


def _kernel(q_ref, sink_ref, slots_ref, *refs, chunks, fp8: bool, bk: int, nk: int, nw: int,
            per: int, splits: int, k: int, w: int, num_rows: int, qk_scale: float,
            cdtype, prec, fp8_n: int, d_model: int, csplit: int, shared: bool,
            fused: bool = False, interpret: bool = False):
    # inputs
    #   q_ref      [BH, D]     f32 / bf16 (request s, heads of block h)
    #   sink_ref   [BH]        f32
    #   slots_ref  [S, K]      int32 (whole array, memory_space=ANY)
    #   table refs (ANY): dense [S, R, D]; FP8 nope [S, R, n] uint8 (the e4m3 bits),
    #              scales [S, R, nb] uint8 (the e8m0 bits), rope [S, R, r] bf16; shared:
    #              [1, R, ...], one table for every request
    #   window_ref [S, W, D]   f32 / bf16 (ANY);  wmask_ref [S, W] bool (ANY)
    # outputs
    #   P = 1: out_ref [BH, D / C] f32 (normalized; C = col_splits column parts of the output)
    #   P > 1: acc_ref [BH, D / C], m_ref [BH], den_ref [BH] f32 (this split's partial softmax)
    #   P > 1, fused: acc_all [S, P, A, BH, D / C], m_all / den_all [S, P, A, BH] f32 (ANY;
    #          A = grid axis 0: every program's partial), out_ref [BH, D / C] f32 (written by
    #          the last split of (s, i) to finish), cnt_ref [S, A] int32 (ANY, zeros on entry:
    #          the splits that finished)
    # scratch: none
    ntab = 3 if fp8 else 1
    # (the input refs after the window: the fused form's zero counters, aliased to cnt_ref)
    if fused:
        refs = refs[:ntab + 2] + refs[ntab + 3:]
    tab = dict(zip(("nope", "scales", "rope") if fp8 else ("dense",), refs[:ntab]))
    window_ref, wmask_ref = refs[ntab:ntab + 2]
    out_refs = refs[ntab + 2:]
    j, s = pl.program_id(1), pl.program_id(2)
    ts = 0 if shared else s  # the request's table
    bh = q_ref.shape[0]
    qc = [q_ref[:, pl.ds(c0, cw)].astype(cdtype) for c0, cw, _, _ in chunks]  # [BH, w] each
    offs = jax.lax.broadcasted_iota(jnp.int32, (bk,), 0)           # [BK]
    m = sink_ref[...].astype(jnp.float32) * LOG2E                  # [BH] log2 units
    den = jnp.full((bh,), 1.0, jnp.float32) * (j == 0).astype(jnp.float32)  # 2^(sink - m), P0
    accs = tuple(jnp.zeros((bh, cw), jnp.float32) for _, cw, _, _ in chunks)
    dh = d_model // csplit
    pv_c0 = jax.lax.rem(pl.program_id(0), csplit) * dh             # this program's columns
    pv_cols = pv_c0 + jax.lax.broadcasted_iota(jnp.int32, (1, dh), 1)
    if csplit > 1:  # the logits from all D columns, the output only for [pv_c0, pv_c0 + dh)
        accs = (jnp.zeros((bh, dh), jnp.float32),)

    def attend(carry, rows, sigmas, valid, pv_rows=None):
        # rows: list of [BK, w] (cdtype); sigmas: list of [BK] f32 or None; valid [BK];
        # pv_rows [BK, D / C]: the value columns (C > 1), else the chunks are the values
        m, den, accs = carry
        lg = None
        for q_c, rows_c, sig in zip(qc, rows, sigmas):
            part = jax.lax.dot_general(q_c, rows_c, (((1,), (1,)), ((), ())), precision=prec,
                                       preferred_element_type=jnp.float32)  # [BH, BK]
            part = part if sig is None else part * sig[None, :]
            lg = part if lg is None else lg + part
        lg = jnp.where(valid[None, :], lg * qk_scale, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(lg, axis=1))                # >= sink: finite
        alpha = jnp.exp2(m - m_new)                                # [BH]
        p = jnp.exp2(lg - m_new[:, None])                          # [BH, BK], 0 where invalid
        den = den * alpha + jnp.sum(p, axis=1)
        if pv_rows is not None:
            pv = jax.lax.dot_general(p.astype(cdtype), pv_rows, (((1,), (0,)), ((), ())),
                                     precision=prec, preferred_element_type=jnp.float32)
            return m_new, den, (accs[0] * alpha[:, None] + pv,)
        new = []
        for acc, rows_c, sig in zip(accs, rows, sigmas):
            pc = (p if sig is None else p * sig[None, :]).astype(cdtype)
            pv = jax.lax.dot_general(pc, rows_c, (((1,), (0,)), ((), ())), precision=prec,
                                     preferred_element_type=jnp.float32)  # [BH, w]
            new.append(acc * alpha[:, None] + pv)
        return m_new, den, tuple(new)

    def e8m0(e):  # e8m0 bits E (int32) -> 2^(E - 127) exactly (E = 255: NaN)
        sig = jax.lax.bitcast_convert_type(jnp.maximum(e, 1) << 23, jnp.float32)
        sig = jnp.where(e == 0, 2.0 ** -127, sig)
        return jnp.where(e == E8M0_NAN, jnp.nan, sig)

    def fp8_rows(ids, valid, cols=None):
        # rows [BK, w] = concat(nope * scale per 64, rope)[:, cols]: three masked gathers of one
        # row tile (columns < n from nope and its scales, the rest from rope), combined in f32
        n = fp8_n
        if cols is None:
            cols = jax.lax.broadcasted_iota(jnp.int32, (1, d_model), 1)
        nope_c, rows_v = cols < n, valid[:, None]
        bits = plt.load(tab["nope"].at[ts, ids[:, None], cols], mask=rows_v & nope_c, other=0)
        e = plt.load(tab["scales"].at[ts, ids[:, None], cols // rowfmt.FP8_BLOCK],
                     mask=rows_v & nope_c, other=127).astype(jnp.int32)
        rope = plt.load(tab["rope"].at[ts, ids[:, None], cols - n], mask=rows_v & ~nope_c,
                        other=0)
        nope = jax.lax.bitcast_convert_type(bits, jnp.float8_e4m3fn).astype(jnp.float32)
        return jnp.where(nope_c, nope * e8m0(e), rope.astype(jnp.float32)).astype(cdtype)

    def slot_ids(i):  # block i's slot ids [BK] (-1 past K); a traced start even for i static
        start = pl.multiple_of(i * bk + 0 * j, bk)  # (interpret mode bounds-checks static ones)
        return plt.load(slots_ref.at[s, pl.ds(start, bk)], mask=start + offs < k, other=-1)

    def selected_block(i, carry):
        # the ids were loaded one block ahead (a loop-carried value: the row gather does not
        # wait on an id load in its own iteration, so it can be pipelined)
        *carry, ids = carry
        nxt = slot_ids(i + 1)
        valid = ids >= 0
        ids = jnp.clip(ids, 0, num_rows - 1)
        rows, sigmas = [], []
        for c0, cw, leaf, idx in chunks:
            if leaf == "fp8":  # the whole row, dequantized in registers (exact in bf16)
                rows.append(fp8_rows(ids, valid))
                sigmas.append(None)
                continue
            if leaf == "dense":
                cols = c0 + jax.lax.broadcasted_iota(jnp.int32, (1, cw), 1)
            else:  # nope block idx or the rope part: columns of its own leaf
                cols = (idx * cw if leaf == "nope" else 0) + jax.lax.broadcasted_iota(
                    jnp.int32, (1, cw), 1)
            r = plt.load(tab[leaf].at[ts, ids[:, None], cols], mask=valid[:, None],
                         other=0)                                  # [BK, w] gathered in place
            if leaf == "nope":  # loaded as its bits (a masked fp8 load has no zero to fill)
                r = jax.lax.bitcast_convert_type(r, jnp.float8_e4m3fn)
            rows.append(r.astype(cdtype))
            sig = None
            if leaf == "nope":  # this block's scale of each row
                sig = e8m0(plt.load(tab["scales"].at[ts, ids, idx], mask=valid,
                                    other=127).astype(jnp.int32))   # [BK]
            sigmas.append(sig)
        pv_rows = None
        if csplit > 1:  # the value columns again (an L1/L2 hit)
            pv_rows = (fp8_rows(ids, valid, pv_cols) if fp8 else plt.load(
                tab["dense"].at[ts, ids[:, None], pv_cols], mask=valid[:, None],
                other=0).astype(cdtype))
        return (*attend(carry, rows, sigmas, valid, pv_rows), nxt)

    def window_block(i, carry):
        start = pl.multiple_of(i * bk, bk)
        inside = start + offs < w
        valid = plt.load(wmask_ref.at[s, pl.ds(start, bk)], mask=inside, other=False) & inside
        rows = [plt.load(window_ref.at[s, pl.ds(start, bk), pl.ds(c0, cw)],
                         mask=valid[:, None], other=0).astype(cdtype)
                for c0, cw, _, _ in chunks]                        # [BK, w] each
        pv_rows = None
        if csplit > 1:
            pv_rows = plt.load(window_ref.at[s, pl.ds(start, bk), pl.ds(pv_c0, dh)],
                               mask=valid[:, None], other=0).astype(cdtype)
        return attend(carry, rows, [None] * len(chunks), valid, pv_rows)

    # this split's blocks [lo, hi) of the NK selected then NW window blocks
    if splits == 1:
        sel, win = (0, nk), (0, nw)
    else:
        lo = j * per
        hi = jnp.minimum(lo + per, nk + nw)
        sel = (jnp.minimum(lo, nk), jnp.minimum(hi, nk))
        win = (jnp.maximum(lo, nk) - nk, jnp.maximum(hi, nk) - nk)
    carry = (m, den, accs)
    if nk:
        carry = jax.lax.fori_loop(sel[0], sel[1], selected_block,
                                  (*carry, slot_ids(sel[0])))[:3]
    if nw:
        carry = jax.lax.fori_loop(win[0], win[1], window_block, carry)
    m, den, accs = carry
    parts = [(c0, cw) for c0, cw, _, _ in chunks] if csplit == 1 else [(0, dh)]
    if splits == 1:
        (out_ref,) = out_refs
        for (c0, cw), acc in zip(parts, accs):
            out_ref[:, pl.ds(c0, cw)] = acc / den[:, None]         # den >= 1 (the sink)
    elif fused:
        _combine_last(out_refs, parts, accs, m, den, splits=splits, interpret=interpret)
    else:
        acc_ref, m_ref, den_ref = out_refs
        for (c0, cw), acc in zip(parts, accs):
            acc_ref[:, pl.ds(c0, cw)] = acc
        m_ref[...] = m
        den_ref[...] = den


def _combine_last(out_refs, parts, accs, m, den, *, splits: int, interpret: bool):
    """fused_combine: program (i, j, s) publishes its partial (acc, m, den) and counts itself
    done on cnt[s, i]; the last of the P splits to finish merges all P partials as
    ``combine`` does (in split order: the same sums whichever finishes last) and writes out.
    Publication: every thread's stores, a CTA barrier, then one acq_rel atomic at GPU scope
    (cumulative: it releases the barrier-ordered stores of the whole program); the last
    program's atomic acquires them, and a barrier after it puts every thread's loads of the
    partials after the acquire (PTX's memory model: those loads must see the released
    stores). Plain loads: jax 0.11.2's Triton lowering cannot spell ``.cg`` (it looks up
    ".cg" in a table keyed "cg": KeyError, H100, session 52)."""
    acc_all, m_all, den_all, out_ref, cnt_ref = out_refs
    i, j, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    for (c0, cw), acc in zip(parts, accs):
        acc_all[s, j, i, :, pl.ds(c0, cw)] = acc
    m_all[s, j, i, :] = m
    den_all[s, j, i, :] = den
    if not interpret:  # (the interpreter runs the programs one after another)
        plt.debug_barrier()
    done = plt.atomic_add(cnt_ref, (s, i), jnp.ones((), jnp.int32))

    @pl.when(done == splits - 1)
    def _():
        def part(ref, jj, *cols):  # split jj's [BH] (m, den) or [BH, w] (acc columns)
            return plt.load(ref.at[(s, jj, i, slice(None), *cols)])

        mx = jax.lax.fori_loop(1, splits, lambda jj, mx: jnp.maximum(mx, part(m_all, jj)),
                               part(m_all, jnp.int32(0)))          # M = max_j m_j
        wgt = lambda jj: jnp.exp2(part(m_all, jj) - mx)            # noqa: E731
        total = jax.lax.fori_loop(0, splits, lambda jj, t: t + wgt(jj) * part(den_all, jj),
                                  jnp.zeros_like(mx))
        for c0, cw in parts:
            cols = pl.ds(c0, cw)

            def add(jj, t, cols=cols):
                return t + wgt(jj)[:, None] * part(acc_all, jj, cols)

            num = jax.lax.fori_loop(0, splits, add, jnp.zeros((mx.shape[0], cw), jnp.float32))
            out_ref[:, cols] = num / total[:, None]


def combine(acc: jnp.ndarray, m: jnp.ndarray, den: jnp.ndarray) -> jnp.ndarray:
    """Merges P partial softmaxes: acc [S, P, H, D], m and den [S, P, H] (m in log2 units) ->
    out [S, H, D] = sum_j 2^(m_j - M) acc_j / sum_j 2^(m_j - M) den_j, M = max_j m_j."""
    wgt = jnp.exp2(m - jnp.max(m, axis=1, keepdims=True))         # [S, P, H]
    num = jnp.sum(wgt[..., None] * acc, axis=1)                    # [S, H, D]
    return num / jnp.sum(wgt * den, axis=1)[..., None]


def row_bytes(table) -> int:
    """Bytes of one stored row."""
    leaves = table if rowfmt.is_fp8(table) else (table,)
    return sum(leaf.shape[-1] * leaf.dtype.itemsize for leaf in leaves)


@functools.partial(jax.jit, static_argnames=("block_h", "block_k", "block_d", "splits",
                                             "num_warps", "num_stages", "col_splits",
                                             "fused_combine"))
def sparse_attention_triton(q: jnp.ndarray, table, slots: jnp.ndarray, window: jnp.ndarray,
                            window_mask: jnp.ndarray, sink: jnp.ndarray, *,
                            block_h: int | None = None, block_k: int | None = None,
                            block_d: int | None = None, splits: int | None = None,
                            num_warps: int | None = None, num_stages: int | None = None,
                            col_splits: int = 1, fused_combine: bool = False) -> jnp.ndarray:
    """Pallas-Triton ``sparse_attention`` (interpret mode without a GPU).

    Inputs: q [S, H, D] f32/bf16; table [S, R, D] f32/bf16 or the FP8 leaves (nope, scales,
    rope) of ``rows.py`` ([1, R, ...]: shared by the S requests, read in place); slots
    [S, K] int32 (-1 = none); window [S, W, D] f32/bf16 (the table's dtype for dense
    tables); window_mask [S, W] bool; sink [H] or [S, H] f32 (checked
    by ``api.sparse_attention``). Output: out [S, H, D] f32.
    Tuning (None = ``default_config``): block_h (BH), block_k (BK), block_d (dense chunk
    width), powers of two >= 16; splits (P >= 1); num_warps; num_stages; col_splits (C: the
    output columns cut over C programs, each computing all logits: a [BH, D / C] accumulator,
    rows read C times, C - 1 of them from L2; not with FP8 rows in 64-wide blocks);
    fused_combine (P > 1: the last split of a request to finish merges the P partials in the
    kernel, ``_combine_last``, instead of ``combine`` in XLA after it).
    """
    fp8 = rowfmt.is_fp8(table)
    table = tuple(table) if fp8 else table
    s, h, d = q.shape
    num_rows, k, w = rowfmt.leading(table)[1], slots.shape[1], window.shape[1]
    check_triton_shapes("sparse_attention", table)
    common.check_offsets("sparse_attention", table=table)  # FP8 rows: whole-array refs
    f32 = not fp8 and table.dtype == jnp.float32
    cfg = default_config(s, h, d, k, w, row_bytes(table), fp8, f32, block_h=block_h,
                         block_k=block_k, block_d=block_d, splits=splits, num_warps=num_warps,
                         num_stages=num_stages)
    if fp8 and cfg["block_d"] == rowfmt.FP8_BLOCK != d and not _fp8_chunkable(table):
        raise ValueError("sparse_attention: block_d=64 reads FP8 rows in scale blocks: needs n "
                         "a multiple of 64 and r a power of two >= 16")
    block_h, block_k, splits = cfg["block_h"], cfg["block_k"], cfg["splits"]
    csplit = col_splits
    if csplit not in (1, 2, 4) or d % (csplit * MIN_DOT) or (
            csplit > 1 and (not _pow2(d) or cfg["block_d"] != d)):
        raise ValueError(f"sparse_attention: col_splits={csplit} must be 1, 2 or 4 with D={d} "
                         f"a power of two read in one chunk (block_d = D)")
    if col_splits > 1 and cfg["splits"] > 1 and splits is None:  # C times the programs
        splits = max(1, cfg["splits"] // csplit)
    nk, nw = -(-k // block_k), -(-w // block_k)
    splits = max(1, min(splits, nk + nw))
    per = -(-(nk + nw) // splits)
    hp = max(MIN_DOT, _next_pow2(h))
    cdtype = jnp.float32 if (not fp8 and table.dtype == jnp.float32) else jnp.bfloat16
    interpret = common.interpret()
    if cdtype == jnp.bfloat16:
        prec = None
    else:  # f32 rows: IEEE in interpret mode (exact reference), 3-pass TF32 tensor cores on GPU
        prec = (jax.lax.Precision.HIGHEST if interpret
                else jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3)
    sink = jnp.broadcast_to(sink.astype(jnp.float32), (s, h))  # [H] or per request [S, H]
    if k == 0:  # Pallas rejects zero-size operands: a never-read stand-in (nk = 0)
        slots = jnp.full((s, 1), -1, jnp.int32)
    if w == 0:  # likewise (nw = 0)
        window = jnp.zeros((s, 1, d), window.dtype)
        window_mask = jnp.zeros((s, 1), jnp.bool_)
    if hp != h:  # zero queries with a zero sink: finite, sliced off below
        q = jnp.pad(q, ((0, 0), (0, hp - h), (0, 0)))
        sink = jnp.pad(sink, ((0, 0), (0, hp - h)))
    bits = functools.partial(jax.lax.bitcast_convert_type, new_dtype=jnp.uint8)
    leaves = (bits(table[0]), bits(table[1]), table[2]) if fp8 else (table,)
    chunks = _chunks(table, d, cfg["block_d"])
    fused = fused_combine and splits > 1
    kernel = functools.partial(
        _kernel, chunks=chunks, fp8=fp8, bk=block_k, nk=nk, nw=nw, per=per, splits=splits,
        k=k, w=w, num_rows=num_rows, qk_scale=LOG2E / math.sqrt(d), cdtype=cdtype, prec=prec,
        fp8_n=table[0].shape[-1] if fp8 else d, d_model=d, csplit=csplit,
        shared=rowfmt.shared(table, s), fused=fused, interpret=interpret)
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    dh = d // csplit  # grid axis 0: head blocks x column parts
    acc_spec = pl.BlockSpec((None, None, block_h, dh),
                            lambda i, j, r: (r, j, i // csplit, i % csplit))
    extra_in, aliases = [], {}
    if splits == 1:
        out_shape = [jax.ShapeDtypeStruct((s, 1, hp, d), jnp.float32)]
        out_specs = [acc_spec]
    elif fused:  # every program's partial (ANY), the output, the counters (zeros, aliased)
        a = hp // block_h * csplit
        out_shape = [jax.ShapeDtypeStruct((s, splits, a, block_h, dh), jnp.float32),
                     jax.ShapeDtypeStruct((s, splits, a, block_h), jnp.float32),
                     jax.ShapeDtypeStruct((s, splits, a, block_h), jnp.float32),
                     jax.ShapeDtypeStruct((s, 1, hp, d), jnp.float32),
                     jax.ShapeDtypeStruct((s, a), jnp.int32)]
        out_specs = [any_spec] * 3 + [pl.BlockSpec(
            (None, None, block_h, dh), lambda i, j, r: (r, 0, i // csplit, i % csplit)),
            any_spec]
        extra_in = [jnp.zeros((s, a), jnp.int32)]
        aliases = {5 + len(leaves): 4}  # q, sink, slots, leaves, window, mask
    else:
        vec_spec = pl.BlockSpec((None, None, block_h), lambda i, j, r: (r, j, i // csplit))
        out_shape = [jax.ShapeDtypeStruct((s, splits, hp, d), jnp.float32),
                     jax.ShapeDtypeStruct((s, splits, hp), jnp.float32),
                     jax.ShapeDtypeStruct((s, splits, hp), jnp.float32)]
        out_specs = [acc_spec, vec_spec, vec_spec]
    outs = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(hp // block_h * csplit, splits, s),
        in_specs=[
            pl.BlockSpec((None, block_h, d), lambda i, j, r: (r, i // csplit, 0)),   # q
            pl.BlockSpec((None, block_h), lambda i, j, r: (r, i // csplit)),         # sink
            any_spec,                                                      # slots
            *[any_spec] * len(leaves),                                     # table leaves
            any_spec, any_spec,                                            # window, mask
            *[any_spec] * len(extra_in),                                   # fused: counters
        ],
        input_output_aliases=aliases,
        out_specs=out_specs,
        compiler_params=plt.CompilerParams(num_warps=cfg["num_warps"],
                                           num_stages=cfg["num_stages"]),
        interpret=interpret,
        name="sparse_attention_v2",
    )(q, sink, slots, *leaves, window, window_mask, *extra_in)
    out = outs[0][:, 0] if splits == 1 else outs[3][:, 0] if fused else combine(*outs)
    return out[:, :h]

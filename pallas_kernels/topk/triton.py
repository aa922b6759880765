"""Exact top-k of long score rows in Pallas-Triton: threshold search by counting, then compaction.

No in-kernel sort and no atomics. Scores are mapped to order-preserving int32 keys; the k-th
largest key of a row is bracketed by counting passes, and the winners are written out by a
compaction kernel whose in-block ranks come from a prefix sum (``jnp.cumsum``, a Triton scan).

Notation:
  B rows, N positions per row, L[b] = min(lengths[b], N) eligible positions (n < L[b]),
  m[b] = min(k, L[b]) winners, key(x) the order-preserving int32 key of a canonical score,
  c(t) = #{eligible n : key_n >= t} (non-increasing in t),
  [lo, hi) the current key bracket of a row, with c(hi) < m <= c(lo) (when m >= 1),
  KP = next power of two >= min(k, N) (output row), CAP = candidate buffer row (>= KP),
  NT = 2**digit_bits thresholds per counting pass, BLOCK positions per grid block.

Stage 1 (the long rows, HBM-bound), a fixed launch sequence (no XLA while loop or cond: the
host never waits on a device value inside the op):
  1. Thresholds of the first pass come from a strided sample of each row (sorted in XLA): NT
     keys around the sample rank of the m-th largest, spaced so that one bracket holds about
     CAP / 4 positions.
  2. Counting kernel, grid (B, N / BLOCK): per block and threshold the count of eligible keys
     >= t. XLA sums the blocks, picks the new bracket, keeps its per-block counts. Rows with
     L <= CAP need no pass at all (their programs return at once).
  2b. Refine kernel, grid (B,), always launched: a row is active when its bracket still holds
     c(lo) - c(hi) > CAP keys over more than one key (rare after a sampled first pass). An
     active row's program runs further counting passes over its whole row in an in-kernel loop
     (thresholds lo + 1, then [lo, hi) split evenly in key space: digit_bits bits per pass,
     at most 32 / digit_bits passes), then writes the final bracket's per-block counts; the
     programs of the other rows return at once (the per-row "done" flag is an input).
  3. Selection kernel, same grid: keys >= hi are winners, written at [0, c(hi)) of the output
     row; keys in [lo, hi) are candidates, the first CAP of them in position order written to a
     candidate row. Offsets: exclusive prefix over blocks (XLA) + in-block prefix sum.
Stage 2 (rows of CAP candidates, one program per row): radix search of the r-th largest
  candidate key T (r = m - c(hi)), digit_bits bits per step from the first digit that the
  bracket's keys do not all share; then the candidates > T and the first (in position order)
  candidates == T until r are taken, written after the stage-1 winners; slots >= m get -1 /
  -inf.

One read (``topk_triton(..., one_read=True)``, opt-in until timed on the GPU): the row is read
once in the common case.
  1. A floor key t per row from the strided sample (``sample_floor``): the sample key Z = 4
     standard deviations of the sample count below the expected rank of the m-th largest, so
     that c(t) >= m almost always while about (rank + 1) * stride positions are >= t.
  2. Segment selection kernel, grid (B, N / BLOCK) (>= 2 programs per row for N > BLOCK):
     each block writes its keys >= t, in position order, into its own segment of SEG slots
     (unused slots: position -1) and its count; no offsets from other blocks are needed.
  3. Per-row finish, grid (B,): a row is ok when c(t) >= m and no block overflowed its
     segment; stage 2 above then runs on the segments (r = m, no stage-1 winners; slots with
     position -1 are skipped), and the tie rule holds because segments keep position order.
  4. Fallback, same launches always made: the two-read sequence above from the bracket the
     floor gives ([t, INT32_MAX) when c(t) >= m, else [key(-inf), t); the segment kernel
     counted c(t) per block, so no counting pass): refine, select, finish, with every program
     of an ok row returning at once; XLA keeps each row's result from its path. A floor above
     the m-th key or a crowded block (e.g. ascending scores) only costs time.

Entry points: ``topk_triton`` runs all of the above. ``topk_after_first_pass`` enters after
the first counting pass, for a producer of the score rows that counted pass 1 itself while
writing them (the fused ``pallas_kernels.pq_topc``): it gives thresholds (``sample_thresholds``
on its own sample) and per-block counts (``count_at_least`` of ``eligible_keys``) on a grid of
``config(...).block`` positions; further passes, selection and stage 2 are shared code.

Tie rule: among equal scores the lower positions win, which holds because candidates keep
position order. Scores are canonicalised (NaN -> -inf, -0.0 -> +0.0) as in reference.py; NaN
inside a row's length is unsupported input. Positions past a row's length never influence
anything (their keys are replaced before any comparison).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import common
from pallas_kernels.topk.reference import canonical_scores, order_keys

INT32_MIN = -(2**31)
INT32_MAX = 2**31 - 1
# key(-inf): the smallest key of an eligible (canonical) score; INT32_MIN marks ineligible.
KEY_NEG_INF = -2139095041  # 0x807FFFFF

DEFAULT_BLOCK = 4096        # positions per grid block (power of two, <= 32768)
DEFAULT_DIGIT_BITS = 4      # NT = 16 thresholds per counting pass, 4-bit radix in stage 2
DEFAULT_CAP = 4096          # candidate buffer per row (raised to KP when k is larger)
DEFAULT_SAMPLE = 1024       # strided sample per row for the first thresholds
DEFAULT_CHUNK = 256         # positions per inner-loop step of the counting loops
DEFAULT_NUM_WARPS = 4       # counting and stage-2 kernels
DEFAULT_SELECT_WARPS = 8    # selection kernel (BLOCK / (32 * warps) positions per thread)
REGISTER_FINISH_MAX = 16384  # finish_in_registers only for candidate rows up to this size
ONE_READ_Z = 4.0            # one-read floor: sample rank q + Z sqrt(q + 1) + 1 (see sample_floor)


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def eligible_keys(x, start, length):
    """Keys of a block of raw scores starting at position ``start``; INT32_MIN past length."""
    pos = start + lax.broadcasted_iota(jnp.int32, x.shape, 0)
    key = order_keys(canonical_scores(x))
    return pos, jnp.where(pos < length, key, INT32_MIN)


def count_at_least(key, thr):
    """[chunk, NT] int32 indicators key[i] >= thr[t] (summed over i by the caller, once)."""
    return (key[:, None] >= thr[None, :]).astype(jnp.int32)


# ----------------------------------------------------------------------------- kernels


def _count_kernel(row_ref, thr_ref, x_ref, cnt_ref, *, block, chunk):
    """Per block, how many eligible keys are >= each threshold.

    Refs: inputs  row_ref [2] int32 (length, active), thr_ref [NT] int32 ascending,
                  x_ref [BLOCK] f32 (scores; the last block may run past N)
          outputs cnt_ref [NT] int32 (written only for active rows)
    """
    j = pl.program_id(1)

    @pl.when(row_ref[1] != 0)
    def _():
        length = row_ref[0]
        thr = thr_ref[...]

        def step(i, acc):
            start = pl.multiple_of(i * chunk, chunk)
            _, key = eligible_keys(x_ref[pl.ds(start, chunk)], j * block + start, length)
            return acc + count_at_least(key, thr)

        acc = lax.fori_loop(0, block // chunk, step,
                            jnp.zeros((chunk, thr.shape[0]), jnp.int32))
        cnt_ref[...] = jnp.sum(acc, axis=0)


def even_thresholds(lo, hi, digit_bits):
    """NT thresholds inside (lo, hi), ascending, for a bracket with hi >= lo + 2: lo + 1 (a
    bracket often starts at a heavily tied key), then lo + j * ceil((hi - lo) / NT) for j = 1
    .. NT - 1 (clipped below hi), so the next bracket is at most ceil((hi - lo) / NT) keys
    wide: 32 / digit_bits passes narrow any bracket to one key. lo, hi: int32 scalars (in a
    kernel) or [B] arrays (then [B, NT]). int32 only (Triton-friendly): hi - lo may exceed
    INT32_MAX, so offsets wrap and are compared as unsigned (x ^ INT32_MIN, signed)."""
    nt = 1 << digit_bits
    lo, hi = jnp.asarray(lo)[..., None], jnp.asarray(hi)[..., None]
    d = hi - lo  # unsigned in [2, 2^32)
    step = lax.shift_right_logical(d, jnp.int32(digit_bits)) + (d & (nt - 1) != 0).astype(
        jnp.int32)  # ceil(d / NT) <= 2^(32 - digit_bits)
    j = lax.broadcasted_iota(jnp.int32, (*d.shape[:-1], nt), d.ndim - 1)
    off = jnp.where(j == 0, 1, j * step)  # unsigned, may wrap past INT32_MAX
    off = jnp.where((off ^ INT32_MIN) < ((d - 1) ^ INT32_MIN), off, d - 1)
    return lo + off


def _refine_kernel(row_ref, x_ref, br_ref, blk_ref, *, block, chunk, digit_bits, cap,
                   max_passes):
    """Fallback narrowing of one row, after the first pass: rows flagged active (bracket
    [lo, hi) still holds > CAP keys over > 1 key) run counting passes over their whole row
    until it holds <= CAP keys or one key; all other rows return at once (an early exit, so
    the launch is always made and the host never waits on a device value).

    Refs: inputs  row_ref [8] int32 (length, m, active, lo, hi, c(lo), c(hi), unused),
                  x_ref [NP] f32 (the whole row; NP = 2^ceil(log2 N), loads past N masked)
          outputs br_ref [2] int32 (new lo, hi), blk_ref [2, NBP] int32 (per block of BLOCK
                  positions: c(lo), c(hi) of the new bracket; NBP = 2^ceil(log2 nblk), blocks
                  past the row's length count 0). Written for active rows only.
    Notation as in the module docstring; each pass counts NT = 2^digit_bits thresholds from
    ``even_thresholds`` and keeps the tightest [t, t') with c(t) >= m > c(t') (thresholds
    ascend, so c descends: the largest t with c(t) >= m and the smallest t' with c(t') < m).
    """
    @pl.when(row_ref[2] != 0)
    def _():
        length, m = row_ref[0], row_ref[1]
        nt = 1 << digit_bits
        live = (length + chunk - 1) // chunk  # chunks holding eligible positions

        def count_row(thr):  # [NT] -> [NT] counts over the row's eligible positions
            def step(i, acc):
                start = pl.multiple_of(i * chunk, chunk)
                _, key = eligible_keys(x_ref[pl.ds(start, chunk)], start, length)
                return acc + count_at_least(key, thr)

            acc = lax.fori_loop(0, live, step, jnp.zeros((chunk, nt), jnp.int32))
            return jnp.sum(acc, axis=0)

        def cond(s):
            it, lo, hi, c_lo, c_hi = s
            return (c_lo - c_hi > cap) & (lo + 1 < hi) & (it < max_passes)

        def body(s):
            it, lo, hi, c_lo, c_hi = s
            thr = even_thresholds(lo, hi, digit_bits)
            cnt = count_row(thr)
            ge = cnt >= m
            return (it + 1, jnp.max(jnp.where(ge, thr, lo)), jnp.min(jnp.where(ge, hi, thr)),
                    jnp.min(jnp.where(ge, cnt, c_lo)), jnp.max(jnp.where(ge, c_hi, cnt)))

        s = (jnp.int32(0), row_ref[3], row_ref[4], row_ref[5], row_ref[6])
        _, lo, hi, _, _ = lax.while_loop(cond, body, s)
        two = lax.broadcasted_iota(jnp.int32, (2,), 0)
        bounds = jnp.where(two == 0, lo, hi)
        br_ref[...] = bounds

        # Per-block c(lo), c(hi) of the final bracket (the selection kernel's offsets).
        nbp = blk_ref.shape[1]
        blk_id = lax.broadcasted_iota(jnp.int32, (2, nbp), 1)

        def per_block(jb, acc):
            def step(i, a):
                start = pl.multiple_of(jb * block + i * chunk, chunk)
                _, key = eligible_keys(x_ref[pl.ds(start, chunk)], start, length)
                return a + count_at_least(key, bounds)

            c = jnp.sum(lax.fori_loop(0, block // chunk, step,
                                      jnp.zeros((chunk, 2), jnp.int32)), axis=0)  # [2]
            return jnp.where(blk_id == jb, c[:, None], acc)

        blk_ref[...] = lax.fori_loop(0, (length + block - 1) // block, per_block,
                                     jnp.zeros((2, nbp), jnp.int32))


def _select_kernel(row_ref, off_ref, x_ref, wpos_ref, wval_ref, cpos_ref, cval_ref, *, block):
    """Compaction of one block: winners (key >= hi) and candidates (lo <= key < hi).

    Refs: inputs  row_ref [4] int32 (length, lo, hi, skip: 1 = return at once),
                  off_ref [2] int32 (winners, candidates) of the row before this block,
                  x_ref [BLOCK] f32
          outputs wpos_ref / wval_ref [KP] (whole row; this block writes its winners),
                  cpos_ref / cval_ref [CAP] (whole row; candidates past CAP are dropped)
    Stores are scatters at computed slots; lanes that store nothing point past the row (masked
    on the GPU, dropped in interpret mode) so that no two lanes share a slot.
    """
    j = pl.program_id(1)  # outside pl.when: interpret mode needs it at the kernel's top level

    @pl.when(row_ref[3] == 0)
    def _():
        x = x_ref[...]
        pos, key = eligible_keys(x, j * block, row_ref[0])
        is_win = key >= row_ref[2]
        is_cand = (key >= row_ref[1]) & jnp.logical_not(is_win)  # INT32_MIN < lo: never eligible
        # One scan for both ranks: winners in the low 16 bits, candidates in the high bits.
        packed = is_win.astype(jnp.int32) + (is_cand.astype(jnp.int32) << 16)
        before = jnp.cumsum(packed) - packed
        lane = lax.broadcasted_iota(jnp.int32, x.shape, 0)
        value = canonical_scores(x)

        kp, cap = wpos_ref.shape[0], cpos_ref.shape[0]
        w_slot = jnp.where(is_win, off_ref[0] + (before & 0xFFFF), kp + lane)
        plgpu.store(wpos_ref.at[w_slot], pos, mask=is_win)
        plgpu.store(wval_ref.at[w_slot], value, mask=is_win)
        c_slot = off_ref[1] + (before >> 16)
        c_ok = is_cand & (c_slot < cap)
        c_slot = jnp.where(c_ok, c_slot, cap + lane)
        plgpu.store(cpos_ref.at[c_slot], pos, mask=c_ok)
        plgpu.store(cval_ref.at[c_slot], value, mask=c_ok)


def _select_seg_kernel(row_ref, x_ref, pos_ref, val_ref, cnt_ref, *, block):
    """One-read selection of one block: every eligible key >= t (the row's sampled floor) is a
    candidate, written in position order into this block's own segment of SEG slots, so no
    offsets from other blocks are needed; unused slots get position -1.

    Refs: inputs  row_ref [2] int32 (length, t), x_ref [BLOCK] f32
          outputs pos_ref / val_ref [SEG] (this block's segment; candidates past SEG dropped),
                  cnt_ref [2] int32 (the block's candidate count, > SEG on overflow; 0)
    """
    j = pl.program_id(1)
    x = x_ref[...]
    pos, key = eligible_keys(x, j * block, row_ref[0])
    is_c = key >= row_ref[1]  # t >= key(-inf) > INT32_MIN: ineligible never counts
    ci = is_c.astype(jnp.int32)
    rank = jnp.cumsum(ci) - ci
    seg = pos_ref.shape[0]
    lane = lax.broadcasted_iota(jnp.int32, x.shape, 0)
    ok = is_c & (rank < seg)
    slot = jnp.where(ok, rank, seg + lane)
    plgpu.store(pos_ref.at[slot], pos, mask=ok)
    plgpu.store(val_ref.at[slot], canonical_scores(x), mask=ok)
    count = jnp.sum(ci)
    unused = lax.broadcasted_iota(jnp.int32, (seg,), 0) >= count
    plgpu.store(pos_ref, jnp.full((seg,), -1, jnp.int32), mask=unused)
    cnt_ref[...] = jnp.where(lax.broadcasted_iota(jnp.int32, (2,), 0) == 0, count, 0)


def _finish_kernel(row_ref, cpos_ref, cval_ref, wpos_in_ref, wval_in_ref, wpos_ref, wval_ref, *,
                   digit_bits, chunk, by_pos=False, in_registers=False):
    """Stage 2 of one row: the r best candidates appended after the stage-1 winners.

    Refs: inputs  row_ref [8] int32 (n candidates, r wanted, c = stage-1 winners, m, p0,
                  u0 = the digits above step p0 shared by the whole stage-1 bracket,
                  skip (1: return at once, the outputs are not this launch's), 0),
                  cpos_ref / cval_ref [CAP] candidates in position order (first n valid;
                  by_pos: of those, only slots with cpos >= 0),
                  wpos_in_ref / wval_in_ref [KP] aliased to the outputs (not read)
          outputs wpos_ref / wval_ref [KP]: slots [0, c) hold the stage-1 winners already;
                  this writes [c, m) and fills [m, KP) with -1 / -inf.

    Notation: u(key) = key ^ INT32_MIN orders keys as unsigned; T = the r-th largest candidate
    key, built from the top digit down starting at step p0 with T_u = u0: at step p (shift
    s = 32 - digit_bits (p + 1)), T_u | (d << s) for the largest digit d with
    #{candidates, u >= T_u | (d << s)} >= r.
    """
    del wpos_in_ref, wval_in_ref
    if in_registers:
        pl.when(row_ref[6] == 0)(functools.partial(
            _finish_row_registers, row_ref, cpos_ref, cval_ref, wpos_ref, wval_ref,
            digit_bits=digit_bits, by_pos=by_pos))
        return
    pl.when(row_ref[6] == 0)(functools.partial(
        _finish_row, row_ref, cpos_ref, cval_ref, wpos_ref, wval_ref, digit_bits=digit_bits,
        chunk=chunk, by_pos=by_pos))


def _finish_row_registers(row_ref, cpos_ref, cval_ref, wpos_ref, wval_ref, *, digit_bits,
                          by_pos):
    """``_finish_row`` with the candidate keys loaded once and kept in registers (CAP or
    NBLK * SEG of them, a few KB a row): T is found one bit at a time (a count over the
    registers per bit, from the first bit the bracket does not fix), with no memory traffic
    per step; the take pass is one prefix sum. Same refs, rule and outputs as ``_finish_row``.

    Notation as in ``_finish_kernel``: u(key) = key ^ INT32_MIN; bit i (31 = top) is set in
    T_u when #{candidates with u >= T_u | 2^i} >= r.
    """
    n, r, c, m = row_ref[0], row_ref[1], row_ref[2], row_ref[3]
    kp = wpos_ref.shape[0]
    slots = lax.broadcasted_iota(jnp.int32, (kp,), 0)
    pad = slots >= m
    plgpu.store(wpos_ref, jnp.full((kp,), -1, jnp.int32), mask=pad)
    plgpu.store(wval_ref, jnp.full((kp,), -jnp.inf, jnp.float32), mask=pad)
    cval = cval_ref[...]
    cpos = cpos_ref[...]
    _, key = eligible_keys(cval, 0, n)  # [size]
    if by_pos:
        key = jnp.where(cpos >= 0, key, INT32_MIN)
    take_top_registers(key, cpos, cval, r, c, row_ref[4] * digit_bits, row_ref[5], wpos_ref,
                       wval_ref)


def radix_search(count_at, m, stop_at_m: bool = False, first_bit=0, u0=0,
                 with_stop: bool = False):
    """The largest int32 u (as unsigned bits, MSB first) with count_at(u) >= m for a count that
    falls as u grows (count_at(u), a scalar threshold -> the scalar count of keys >= u): one
    bit a step from bit 31 - first_bit down, the bits above it taken from u0 (a bracket's
    shared digits; 0 and 0 for none), each step one count. A caller's count is one reduction
    of its row flattened to 1D (session 44: before, candidate_topk counted 4 thresholds over
    a [NBLK, BC, 4] broadcast of the row, which Triton reduced through layout conversions; at
    B 64, R 2048: 17.1 -> 7.5 us on an H100, 2 bits a step as 1D counts slower than 1).
    stop_at_m: stop at the first step whose chosen prefix has exactly m keys >= it; the result
    is then that prefix, not the m-th key itself, but the keys >= it are exactly the m largest,
    and a caller that takes keys > it plus ties == it still takes those m: either no key equals
    the prefix, or every key equal to it is a winner. For distinct keys the search ends after
    the bits that separate the m-th key from the (m + 1)-th (candidate_topk 7.5 -> 6.5 us
    above). Not for a caller that needs the m-th key's value (``miss_filter``) or the m-th id
    (candidate_topk's tie search). with_stop (stop_at_m only): (u, whether the search stopped
    early, i.e. exactly m keys are >= u)."""
    def body(state):
        p, u, _ = state
        c = u | lax.shift_left(jnp.int32(1), 31 - p)
        n = count_at(c)
        return p + 1, jnp.where(n >= m, c, u), (n == m) & stop_at_m

    first_bit, u0 = jnp.int32(first_bit), jnp.int32(u0)
    if not stop_at_m:
        return lax.fori_loop(first_bit, 32, lambda p, u: body((p, u, False))[1], u0)
    _, u, stopped = lax.while_loop(lambda s: (s[0] < 32) & jnp.logical_not(s[2]), body,
                                   (first_bit, u0, jnp.bool_(False)))
    return (u, stopped) if with_stop else u


def thirds_search(count2, m, stop_at_m: bool = False, lo=0, w=0xFFFFFFFF, stop_width=0):
    """``radix_search``'s answer by thirds: the largest u (uint32) in [lo, lo + w] with
    count(u) >= m, given count(lo) >= m, for a count that falls as u grows. count2(a, b):
    a pair of uint32 thresholds -> (#keys >= a, #keys >= b), one reduction for both (two
    16-bit counts in one int32: keys fewer than 2^16). Each step cuts the range to a third
    (log_3 2 = 0.63 of a bit step's reductions). stop_at_m: stop at a threshold with
    exactly m keys >= it (as ``radix_search``). stop_width: stop once the range's width w
    (its size - 1) is at most this (the result is then within w of the answer, below it).
    Returns (u, whether it stopped at exactly m).

    Notation: the range [lo, lo + w]; s = w // 3 + 1, thresholds a = lo + s,
    b = lo + min(2 s, w) (lo < a <= b <= lo + w for w >= 1)."""
    u32 = jnp.uint32

    def body(state):
        lo, w, _ = state
        s = w // u32(3) + u32(1)
        a, b = lo + s, lo + jnp.minimum(s + s, w)
        ca, cb = count2(a, b)
        up, mid = cb >= m, ca >= m
        new_lo = jnp.where(up, b, jnp.where(mid, a, lo))
        new_w = jnp.where(up, w - (b - lo), jnp.where(mid, b - a - u32(1), s - u32(1)))
        exact = stop_at_m & ((up & (cb == m)) | (~up & mid & (ca == m)))
        return new_lo, new_w, exact

    lo, _, exact = lax.while_loop(
        lambda st: (st[1] > u32(stop_width)) & jnp.logical_not(st[2]), body,
        (jnp.asarray(lo, u32), jnp.asarray(w, u32), jnp.bool_(False)))
    return lo, exact


def check_search(search: str, size: int, who: str) -> str:
    """search, checked for ``top_key`` / ``thirds_search`` over ``size`` keys: "bits", or
    "thirds" when size < 2^16 (``count_pair``'s 16-bit fields)."""
    if search not in ("bits", "thirds") or (search == "thirds" and size >= 1 << 16):
        raise ValueError(f"{who}: search={search!r} must be 'bits', or 'thirds' for rows of "
                         f"fewer than 65536 keys (here {size})")
    return search


def count_pair(key, a, b):
    """(#key >= a, #key >= b) for uint32 thresholds in unsigned key order (u = key ^ INT32_MIN)
    by one reduction of two 16-bit fields (key [size], size < 2^16)."""
    ka = lax.bitcast_convert_type(a, jnp.int32) ^ INT32_MIN
    kb = lax.bitcast_convert_type(b, jnp.int32) ^ INT32_MIN
    both = jnp.sum(jnp.where(key >= ka, 1, 0) + jnp.where(key >= kb, 1 << 16, 0))
    return both & 0xFFFF, lax.shift_right_logical(both, 16)


def take_top_registers(key, pos, val, r, c, first_bit, t_u, wpos_ref, wval_ref,
                       stop_early: bool = False, skip_ties: bool = False, scan_rows: int = 1,
                       search: str = "bits"):
    """Writes the r best of candidates held in registers at output slots [c, c + r), in
    candidate order (equal keys: the earlier candidates win). key [size] int32 (INT32_MIN:
    not a candidate), pos / val [size] aligned (val raw, canonicalised on the way out).
    first_bit, t_u: the search starts at bit 31 - first_bit with T_u = t_u (the bits above
    it, known from a bracket; 0 and 0 for none). stop_early: ``radix_search``'s stop_at_m
    (T may then be a prefix that no key equals; the same r winners); skip_ties, scan_rows,
    search: ``top_slots``'s.

    Notation: u(key) = key ^ INT32_MIN; bit i (31 = top) is set in T_u when #{candidates
    with u >= T_u | 2^i} >= r; T = T_u ^ INT32_MIN is the r-th largest candidate key.
    """
    kp = wpos_ref.shape[0]
    keep, slot = top_slots(key, r, c, kp, first_bit, t_u, stop_early, skip_ties, scan_rows,
                           search)
    plgpu.store(wpos_ref.at[slot], pos, mask=keep)
    plgpu.store(wval_ref.at[slot], canonical_scores(val), mask=keep)


def exclusive_count(ci, rows: int):
    """(the exclusive prefix sum of indicators ci [CH] (cumsum(ci) - ci), their sum): one scan
    of CH, or (rows > 1) through a [rows, CH / rows] view: each row's offset (a scan of the
    row totals) plus the row's own scan; the sum is then the row totals' (no second reduction
    over CH)."""
    if rows == 1:
        return jnp.cumsum(ci) - ci, jnp.sum(ci)
    c2 = ci.reshape(rows, ci.shape[0] // rows)
    tot = jnp.sum(c2, axis=1)
    before = (jnp.cumsum(tot) - tot)[:, None] + (jnp.cumsum(c2, axis=1) - c2)
    return before.reshape(-1), jnp.sum(tot)


def top_key(key, r, first_bit, t_u, stop_early: bool = False, search: str = "bits"):
    """(T, exact) of ``take_top_registers``: T the r-th largest of key [size] (or, stop_early,
    a prefix with exactly r keys >= it), by ``radix_search`` over the keys in registers
    (search "bits") or ``thirds_search`` over the same range (bits from first_bit down
    free: [t_u, t_u + 2^(32 - first_bit) - 1]); exact: whether exactly r keys are >= T
    (known when the search stopped early; else False, though it may hold)."""
    def count_at(u):
        return jnp.sum((key >= (u ^ INT32_MIN)).astype(jnp.int32))

    if search == "thirds":
        free = 32 - jnp.asarray(first_bit, jnp.int32)  # the low bits the range leaves free
        w = jnp.where(free >= 32, jnp.uint32(0xFFFFFFFF),
                      (jnp.uint32(1) << jnp.minimum(free, 31).astype(jnp.uint32)) - 1)
        # a Python t_u becomes a uint32 constant here: jax 0.11.2's Triton lowering cannot
        # bitcast a literal inside a cond (AttributeError, H100, session 49)
        lo = (jnp.uint32(t_u & 0xFFFFFFFF) if isinstance(t_u, int)
              else lax.bitcast_convert_type(jnp.asarray(t_u, jnp.int32), jnp.uint32))
        u, exact = thirds_search(functools.partial(count_pair, key), r, stop_early, lo, w)
        return lax.bitcast_convert_type(u, jnp.int32) ^ INT32_MIN, exact
    if not stop_early:
        return radix_search(count_at, r, False, first_bit, t_u) ^ INT32_MIN, jnp.bool_(False)
    u, exact = radix_search(count_at, r, True, first_bit, t_u, with_stop=True)
    return u ^ INT32_MIN, exact


def top_slots(key, r, c, kp, first_bit, t_u, stop_early: bool = False,
              skip_ties: bool = False, scan_rows: int = 1, search: str = "bits"):
    """(keep [size] bool, slot [size] int32) of ``take_top_registers``: the r winners (keys > T,
    then the first keys == T) and their output slots c, c + 1, ... in candidate order (kp +
    lane, past the output, for the others). skip_ties: when exactly r keys are >= T (the
    search stopped early), the winners are those keys, without counting and ranking ties
    (one reduction and one prefix sum fewer). scan_rows: the prefix sums' form
    (``exclusive_count``); search: ``top_key``'s."""
    t, exact = top_key(key, r, first_bit, t_u, stop_early, search)
    return winner_slots(key, t, exact, lambda: r - jnp.sum((key > t).astype(jnp.int32)), c,
                        kp, skip_ties and stop_early, scan_rows)


def winner_slots(key, t, exact, tie_budget, first_slot, kp, skip_ties: bool = False,
                 scan_rows: int = 1):
    """(keep, slot) of keys [size] (all or a part of a candidate row) given T: the keys > T and
    the first tie_budget() keys == T, at slots first_slot, first_slot + 1, ... in key order
    (kp + lane for the others). tie_budget: a callable (evaluated only where ties are
    ranked) -> how many of these keys == T win. skip_ties: where exact (exactly the winners
    are >= T), keep the keys >= T without the tie count and ranks (a cond: the rank path's
    reduction and prefix sum are skipped)."""
    def by_ties():
        tie = (key == t).astype(jnp.int32)
        return (key > t) | ((tie != 0) & (exclusive_count(tie, scan_rows)[0] < tie_budget()))

    keep = lax.cond(exact, lambda: key >= t, by_ties) if skip_ties else by_ties()
    lane = lax.broadcasted_iota(jnp.int32, key.shape, 0)
    before = exclusive_count(keep.astype(jnp.int32), scan_rows)[0]
    return keep, jnp.where(keep, first_slot + before, kp + lane)


def _finish_row(row_ref, cpos_ref, cval_ref, wpos_ref, wval_ref, *, digit_bits, chunk, by_pos):
    """The body of ``_finish_kernel`` (same refs, less the aliased inputs)."""
    n, r, c, m = row_ref[0], row_ref[1], row_ref[2], row_ref[3]
    kp = wpos_ref.shape[0]
    steps = (n + chunk - 1) // chunk  # only the chunks that hold candidates
    nt = 1 << digit_bits

    slots = lax.broadcasted_iota(jnp.int32, (kp,), 0)
    pad = slots >= m
    plgpu.store(wpos_ref, jnp.full((kp,), -1, jnp.int32), mask=pad)
    plgpu.store(wval_ref, jnp.full((kp,), -jnp.inf, jnp.float32), mask=pad)

    def keys_at(i):
        start = pl.multiple_of(i * chunk, chunk)
        _, key = eligible_keys(cval_ref[pl.ds(start, chunk)], start, n)
        if by_pos:  # unused slots between segments hold position -1
            key = jnp.where(cpos_ref[pl.ds(start, chunk)] >= 0, key, INT32_MIN)
        return start, key

    digits = lax.broadcasted_iota(jnp.int32, (nt,), 0)

    def radix_step(p, t_u):
        shift = 32 - digit_bits * (p + 1)
        thr = (t_u | (digits << shift)) ^ INT32_MIN

        def count(i, acc):
            _, key = keys_at(i)
            return acc + count_at_least(key, thr)

        acc = lax.fori_loop(0, steps, count, jnp.zeros((chunk, nt), jnp.int32))
        digit = jnp.sum((jnp.sum(acc, axis=0) >= r).astype(jnp.int32)) - 1
        return t_u | (digit << shift)

    t = lax.fori_loop(row_ref[4], 32 // digit_bits, radix_step, row_ref[5]) ^ INT32_MIN

    def count_above(i, acc):
        _, key = keys_at(i)
        return acc + (key > t).astype(jnp.int32)

    above = jnp.sum(lax.fori_loop(0, steps, count_above, jnp.zeros((chunk,), jnp.int32)))
    ties = r - above  # how many candidates == T are taken (the first ones)

    def take(i, carry):
        seen_ties, taken = carry
        start, key = keys_at(i)
        is_tie = key == t
        tie_i = is_tie.astype(jnp.int32)
        tie_rank = seen_ties + jnp.cumsum(tie_i) - tie_i
        keep = (key > t) | (is_tie & (tie_rank < ties))
        keep_i = keep.astype(jnp.int32)
        lane = lax.broadcasted_iota(jnp.int32, (chunk,), 0)
        slot = jnp.where(keep, c + taken + jnp.cumsum(keep_i) - keep_i, kp + lane)
        plgpu.store(wpos_ref.at[slot], cpos_ref[pl.ds(start, chunk)], mask=keep)
        plgpu.store(wval_ref.at[slot], canonical_scores(cval_ref[pl.ds(start, chunk)]),
                    mask=keep)
        return seen_ties + jnp.sum(tie_i), taken + jnp.sum(keep_i)

    lax.fori_loop(0, steps, take, (jnp.int32(0), jnp.int32(0)))


# ----------------------------------------------------------------------------- XLA glue


@dataclasses.dataclass(frozen=True)
class Config:
    """Static sizes and tunables of one call, fitted to rows of N positions by ``config``
    (hashable: a jit static argument). Notation as in the module docstring."""

    k: int
    n: int
    digit_bits: int
    block: int
    cap: int
    chunk: int
    sample: int
    num_warps: int
    select_warps: int
    interpret: bool
    one_read: bool = False
    finish_in_registers: bool = False  # stage 2 on keys held in registers (opt-in until timed)

    @property
    def nt(self) -> int:
        return 1 << self.digit_bits

    @property
    def kn(self) -> int:
        return min(self.k, self.n)

    @property
    def kp(self) -> int:
        return _next_pow2(self.kn)

    @property
    def nblk(self) -> int:
        return -(-self.n // self.block)

    @property
    def chunk2(self) -> int:  # stage-2 chunk
        return min(self.chunk, self.cap)

    @property
    def max_passes(self) -> int:  # refine passes: 32 / digit_bits narrow any bracket to a key
        return 32 // self.digit_bits + 1

    @property
    def floor_ranks(self) -> int:
        """One read: sample keys kept (``lax.top_k``) to pick the floor rank from: the rank
        q + Z sqrt(q + 1) + 1 at q = k / st (a full row), plus slack, at most the sample."""
        q = self.k / max(1, self.n // self.sample)
        return int(min(-(-self.n // max(1, self.n // self.sample)),
                       math.ceil(q + ONE_READ_Z * math.sqrt(q + 1) + 3)))

    @property
    def seg(self) -> int:
        """One read: slots per block segment, twice the expected candidates of a block of a
        full row (floor_ranks * st positions over nblk blocks), a power of two in [32, BLOCK]."""
        per_block = self.floor_ranks * max(1, self.n // self.sample) / self.nblk
        return int(min(self.block, max(32, _next_pow2(math.ceil(2 * per_block)))))


def config(n: int, k: int, *, block: int = DEFAULT_BLOCK, digit_bits: int = DEFAULT_DIGIT_BITS,
           cap: int = DEFAULT_CAP, sample: int = DEFAULT_SAMPLE, chunk: int = DEFAULT_CHUNK,
           num_warps: int = DEFAULT_NUM_WARPS, select_warps: int = DEFAULT_SELECT_WARPS,
           interpret: bool | None = None, one_read: bool = False,
           finish_in_registers: bool = False) -> Config:
    """Validated tunables (see ``topk_triton``) fitted to N: BLOCK <= min(2^ceil(log2 N),
    32768), the [chunk, NT] counters at most 4096 entries, CAP in [KP, 2^ceil(log2 N)] (at
    least KP). interpret=None asks ``common.interpret()`` (call this outside jit)."""
    for name, v in (("block", block), ("cap", cap), ("chunk", chunk)):
        if v < 1 or v & (v - 1):
            raise ValueError(f"topk_triton: {name}={v} must be a power of two")
    if digit_bits not in (1, 2, 4, 8):
        raise ValueError(f"topk_triton: digit_bits={digit_bits} must be 1, 2, 4 or 8")
    if interpret is None:
        interpret = common.interpret()
    n, k = int(n), int(k)
    block = min(block, _next_pow2(n), 32768)
    chunk = min(chunk, block, max(1, 4096 // (1 << digit_bits)))
    cap = max(_next_pow2(min(k, n)), min(cap, _next_pow2(n)))
    return Config(k=k, n=n, digit_bits=digit_bits, block=block, cap=cap, chunk=chunk,
                  sample=sample, num_warps=num_warps, select_warps=select_warps,
                  interpret=bool(interpret), one_read=bool(one_read),
                  finish_in_registers=bool(finish_in_registers))


def row_lengths(lengths, cfg: Config):
    """(L [B] eligible positions per row, m [B] = min(k, L) winners) from raw lengths."""
    length = jnp.clip(lengths.astype(jnp.int32), 0, cfg.n)
    return length, jnp.minimum(length, cfg.k)


def sample_stride(cfg: Config) -> int:
    """Stride st of the first-pass sample: positions 0, st, 2 st, ... < N."""
    return max(1, cfg.n // cfg.sample)


def sample_thresholds(xs, length, m, cfg: Config):
    """First-pass thresholds [B, NT] ascending, inside the start bracket [key(-inf),
    INT32_MAX]: sample keys around the m-th largest. xs [B, S]: scores at the sample positions
    (``sample_stride``); any scores ranking like the row's will do (a fused producer samples
    its own cheap estimate), since only the counts decide the bracket.

    Notation: st = sample stride, ns = eligible samples of the row, q = m * ns / L - 1 the
    expected 0-based descending sample rank of the m-th largest key; threshold j sits at rank
    q + (j - (NT - 1) / 2) * delta, delta = max(1, CAP // (4 st)) (about CAP / 4 positions
    between neighbouring thresholds, so that one pass nearly always suffices).
    """
    st, nt, s = sample_stride(cfg), cfg.nt, xs.shape[1]
    spos = jnp.arange(s, dtype=jnp.int32)[None, :] * st
    keys = jnp.where(spos < length[:, None], order_keys(canonical_scores(xs)), INT32_MIN)
    asc = lax.sort(keys, dimension=1)
    ns = (length + st - 1) // st
    q = m.astype(jnp.float32) * ns.astype(jnp.float32) / jnp.maximum(length, 1) - 1.0
    delta = max(1, cfg.cap // (4 * st))
    offs = (jnp.arange(nt, dtype=jnp.float32) - (nt - 1) / 2.0) * delta
    ranks = jnp.clip(jnp.round(q[:, None] + offs[None, :]).astype(jnp.int32), 0,
                     jnp.maximum(ns - 1, 0)[:, None])
    thr = jnp.take_along_axis(asc, s - 1 - ranks, axis=1)[:, ::-1]  # ascending in j
    # A repeated threshold is worth more one key higher: it then isolates a tied key.
    dup = jnp.concatenate([jnp.zeros_like(thr[:, :1]), thr[:, 1:] == thr[:, :-1]], axis=1)
    return jnp.clip(thr + dup.astype(jnp.int32), KEY_NEG_INF, INT32_MAX)


def sample_floor(xs, length, m, cfg: Config):
    """One read: a floor key t [B] per row with c(t) >= m with high probability and about
    (r + 1) st positions >= t: the sample key of descending rank r. xs [B, S]: scores at the
    sample positions (``sample_stride``). Rows with fewer than r + 1 eligible samples get
    key(-inf) (every eligible position is a candidate).

    Notation: st = sample stride, ns = eligible samples, q = m ns / L - 1 the expected
    0-based descending sample rank of the m-th largest key, r = ceil(q + Z sqrt(q + 1)) + 1
    (Z = ONE_READ_Z standard deviations of the sample count above it), at most
    cfg.floor_ranks - 1 (a higher floor only makes the fallback likelier).
    """
    st = sample_stride(cfg)
    spos = jnp.arange(xs.shape[1], dtype=jnp.int32)[None, :] * st
    keys = jnp.where(spos < length[:, None], order_keys(canonical_scores(xs)), INT32_MIN)
    top = lax.top_k(keys, cfg.floor_ranks)[0]  # [B, R] descending
    ns = (length + st - 1) // st
    q = m.astype(jnp.float32) * ns.astype(jnp.float32) / jnp.maximum(length, 1) - 1.0
    r = jnp.ceil(q + ONE_READ_Z * jnp.sqrt(jnp.maximum(q, 0.0) + 1.0)).astype(jnp.int32) + 1
    r = jnp.clip(r, 0, cfg.floor_ranks - 1)
    t = jnp.take_along_axis(top, r[:, None], axis=1)[:, 0]
    return jnp.where(r >= ns, KEY_NEG_INF, jnp.maximum(t, KEY_NEG_INF))


def _exclusive_cumsum(x):
    return jnp.cumsum(x, axis=-1) - x


def _kernel_params(cfg: Config, warps: int) -> dict:
    return dict(interpret=cfg.interpret,
                compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=1))


def _start(length, cfg: Config):
    """Bracket state (pass, lo, hi, blk_lo, blk_hi) before any pass: [key(-inf), INT32_MAX),
    per-block c(lo) = the block's eligible positions, c(hi) = 0."""
    first = jnp.arange(cfg.nblk, dtype=jnp.int32)[None, :] * cfg.block
    blk_lo = jnp.clip(length[:, None] - first, 0, cfg.block)
    lo = jnp.full(length.shape, KEY_NEG_INF, jnp.int32)
    hi = jnp.full(length.shape, INT32_MAX, jnp.int32)
    return jnp.int32(0), lo, hi, blk_lo, jnp.zeros_like(blk_lo)


def _active(state, cap):
    """[B] bool: rows whose bracket still holds more than CAP keys over more than one key."""
    _, lo, hi, blk_lo, blk_hi = state
    return (jnp.sum(blk_lo - blk_hi, axis=1) > cap) & (lo + 1 < hi)


def _narrow(state, thr, cnt, m, cap):
    """One pass: the new bracket of each active row from thresholds thr [B, NT] (ascending,
    inside [lo, hi]) and their per-block counts cnt [B, nblk, NT]: the tightest [t, t') of
    lo, thr..., hi with c(t) >= m > c(t'). Inactive rows keep theirs."""
    it, lo, hi, blk_lo, blk_hi = state
    act = _active(state, cap)
    nt = thr.shape[1]
    all_thr = jnp.concatenate([lo[:, None], thr, hi[:, None]], axis=1)             # [B, NT + 2]
    all_cnt = jnp.concatenate([blk_lo[..., None], cnt, blk_hi[..., None]], axis=2)
    tot = jnp.sum(all_cnt, axis=1)                                                 # [B, NT + 2]
    sel = jnp.clip(jnp.sum((tot >= m[:, None]).astype(jnp.int32), axis=1) - 1, 0, nt)
    new_lo = jnp.take_along_axis(all_thr, sel[:, None], axis=1)[:, 0]
    new_hi = jnp.take_along_axis(all_thr, sel[:, None] + 1, axis=1)[:, 0]
    new_blk_lo = jnp.take_along_axis(all_cnt, sel[:, None, None], axis=2)[..., 0]
    new_blk_hi = jnp.take_along_axis(all_cnt, sel[:, None, None] + 1, axis=2)[..., 0]
    return (it + 1, jnp.where(act, new_lo, lo), jnp.where(act, new_hi, hi),
            jnp.where(act[:, None], new_blk_lo, blk_lo),
            jnp.where(act[:, None], new_blk_hi, blk_hi))


def _pass0(scores, length, m, thr0, cnt0, cfg: Config, todo):
    """Bracket state after pass 0: thresholds thr0; their per-block counts cnt0 when a
    producer counted them already, else the counting kernel's (rows with L <= CAP or not in
    todo [B] bool return at once)."""
    b, nt = scores.shape[0], cfg.nt
    state = _start(length, cfg)
    if cnt0 is None:
        thr0 = jnp.clip(thr0, KEY_NEG_INF, INT32_MAX)  # inside the start bracket
        act = (_active(state, cfg.cap) & todo).astype(jnp.int32)
        cnt0 = pl.pallas_call(
            functools.partial(_count_kernel, block=cfg.block, chunk=cfg.chunk),
            grid=(b, cfg.nblk),
            in_specs=[pl.BlockSpec((None, 2), lambda i, j: (i, 0)),
                      pl.BlockSpec((None, nt), lambda i, j: (i, 0)),
                      pl.BlockSpec((None, cfg.block), lambda i, j: (i, j))],
            out_specs=pl.BlockSpec((None, None, nt), lambda i, j: (i, j, 0)),
            out_shape=jax.ShapeDtypeStruct((b, cfg.nblk, nt), jnp.int32),
            name="topk_count", **_kernel_params(cfg, cfg.num_warps),
        )(jnp.stack([length, act], axis=1), thr0, scores)
    return _narrow(state, thr0, cnt0, m, cfg.cap)


def _floor_state(length, m, t, cnt, cfg: Config):
    """Bracket state from the one-read pass, which counted c(t) per block (cnt [B, nblk], true
    counts even where a segment overflowed): [t, INT32_MAX) when c(t) >= m, else
    [key(-inf), t)."""
    it, lo, hi, blk_lo, blk_hi = _start(length, cfg)
    above = jnp.sum(cnt, axis=1) >= m
    return (it, jnp.where(above, t, lo), jnp.where(above, hi, t),
            jnp.where(above[:, None], cnt, blk_lo), jnp.where(above[:, None], blk_hi, cnt))


def _search(scores, length, m, thr0, cnt0, cfg: Config, skip=None, state=None):
    """The bracket (lo, hi, blk_lo, blk_hi) of every row, by a fixed launch sequence: pass 0
    (``_pass0``; or a given bracket ``state``), then one refine launch in which only rows
    whose bracket still holds > CAP keys over > 1 key do work. No loop or branch runs on a
    device predicate in XLA, so the host never waits inside the op. skip [B] bool (optional):
    rows another path finished; their programs return at once (their results are unset)."""
    b = scores.shape[0]
    todo = jnp.ones(length.shape, bool) if skip is None else jnp.logical_not(skip)
    if state is None:
        state = _pass0(scores, length, m, thr0, cnt0, cfg, todo)
    _, lo, hi, blk_lo, blk_hi = state
    act = _active(state, cfg.cap) & todo
    row = jnp.stack([length, m, act.astype(jnp.int32), lo, hi, jnp.sum(blk_lo, axis=1),
                     jnp.sum(blk_hi, axis=1), jnp.zeros_like(lo)], axis=1)
    np_, nbp = _next_pow2(cfg.n), _next_pow2(cfg.nblk)
    br, blk = pl.pallas_call(
        functools.partial(_refine_kernel, block=cfg.block, chunk=cfg.chunk,
                          digit_bits=cfg.digit_bits, cap=cfg.cap, max_passes=cfg.max_passes),
        grid=(b,),
        in_specs=[pl.BlockSpec((None, 8), lambda i: (i, 0)),
                  pl.BlockSpec((None, np_), lambda i: (i, 0))],
        out_specs=[pl.BlockSpec((None, 2), lambda i: (i, 0)),
                   pl.BlockSpec((None, 2, nbp), lambda i: (i, 0, 0))],
        out_shape=[jax.ShapeDtypeStruct((b, 2), jnp.int32),
                   jax.ShapeDtypeStruct((b, 2, nbp), jnp.int32)],
        name="topk_refine", **_kernel_params(cfg, cfg.num_warps))(row, scores)
    # Rows the refine kernel skipped keep their pass-0 bracket (its outputs there are unset).
    keep = jnp.logical_not(act)
    return (jnp.where(keep, lo, br[:, 0]), jnp.where(keep, hi, br[:, 1]),
            jnp.where(keep[:, None], blk_lo, blk[:, 0, :cfg.nblk]),
            jnp.where(keep[:, None], blk_hi, blk[:, 1, :cfg.nblk]))


def _select(scores, length, lo, hi, blk_lo, blk_hi, cfg: Config, skip=None):
    """Selection kernel: (winner pos / val [B, KP], candidate pos / val [B, CAP]); rows with
    skip [B] (optional) return at once."""
    b, kp, cap = scores.shape[0], cfg.kp, cfg.cap
    offsets = jnp.stack([_exclusive_cumsum(blk_hi), _exclusive_cumsum(blk_lo - blk_hi)], axis=2)
    skip = jnp.zeros_like(lo) if skip is None else skip.astype(jnp.int32)
    row = jnp.stack([length, lo, hi, skip], axis=1)
    return pl.pallas_call(
        functools.partial(_select_kernel, block=cfg.block),
        grid=(b, cfg.nblk),
        in_specs=[pl.BlockSpec((None, 4), lambda i, j: (i, 0)),
                  pl.BlockSpec((None, None, 2), lambda i, j: (i, j, 0)),
                  pl.BlockSpec((None, cfg.block), lambda i, j: (i, j))],
        out_specs=[pl.BlockSpec((None, kp), lambda i, j: (i, 0)),
                   pl.BlockSpec((None, kp), lambda i, j: (i, 0)),
                   pl.BlockSpec((None, cap), lambda i, j: (i, 0)),
                   pl.BlockSpec((None, cap), lambda i, j: (i, 0))],
        out_shape=[jax.ShapeDtypeStruct((b, kp), jnp.int32),
                   jax.ShapeDtypeStruct((b, kp), jnp.float32),
                   jax.ShapeDtypeStruct((b, cap), jnp.int32),
                   jax.ShapeDtypeStruct((b, cap), jnp.float32)],
        name="topk_select", **_kernel_params(cfg, cfg.select_warps))(row, offsets, scores)


def _shared_digits(lo, hi, digit_bits):
    """(p0, u0): keys in [lo, hi) agree on their digits above step p0 (radix steps of
    digit_bits bits from the top), and u0 holds those digits in unsigned order (see
    ``_finish_kernel``)."""
    lo_u, top_u = lo ^ INT32_MIN, (hi - 1) ^ INT32_MIN
    p0 = lax.clz(lo_u ^ top_u) // digit_bits
    low_bits = 32 - p0 * digit_bits
    low_mask = jnp.where(low_bits >= 32, -1, (jnp.int32(1) << jnp.minimum(low_bits, 31)) - 1)
    return p0, lo_u & ~low_mask


def _finish_call(row2, cpos, cval, wpos, wval, cfg: Config, by_pos=False):
    """The stage-2 pallas_call, grid (B,): row2 [B, 8] as in ``_finish_kernel``, candidates
    [B, n] (position order), winners [B, KP] aliased to the outputs."""
    b, n, kp = cpos.shape[0], cpos.shape[1], cfg.kp
    one_row = lambda i: (i, 0)  # noqa: E731
    return pl.pallas_call(
        functools.partial(_finish_kernel, digit_bits=cfg.digit_bits, by_pos=by_pos,
                          chunk=min(cfg.chunk, cfg.seg if by_pos else n),  # divides n
                          in_registers=cfg.finish_in_registers
                          and n <= REGISTER_FINISH_MAX),
        grid=(b,),
        in_specs=[pl.BlockSpec((None, 8), one_row),
                  pl.BlockSpec((None, n), one_row), pl.BlockSpec((None, n), one_row),
                  pl.BlockSpec((None, kp), one_row), pl.BlockSpec((None, kp), one_row)],
        out_specs=[pl.BlockSpec((None, kp), one_row), pl.BlockSpec((None, kp), one_row)],
        out_shape=[jax.ShapeDtypeStruct((b, kp), jnp.int32),
                   jax.ShapeDtypeStruct((b, kp), jnp.float32)],
        input_output_aliases={3: 0, 4: 1},
        name="topk_finish_seg" if by_pos else "topk_finish",
        **_kernel_params(cfg, max(cfg.num_warps, 8) if cfg.finish_in_registers
                         and n <= REGISTER_FINISH_MAX else cfg.num_warps))(
                             row2, cpos, cval, wpos, wval)


def _finish(lo, hi, wins, cands, m, selected, cfg: Config, skip=None):
    """Stage 2: (positions [B, KP], values [B, KP]) from the selection kernel's outputs; rows
    with skip [B] (optional) return at once."""
    wpos, wval, cpos, cval = selected
    # Candidates lie in [lo, hi): the digits where lo and hi - 1 agree are known already.
    p0, u0 = _shared_digits(lo, hi, cfg.digit_bits)
    zero = jnp.zeros_like(lo)
    skip = zero if skip is None else skip.astype(jnp.int32)
    row2 = jnp.stack([jnp.minimum(cands, cfg.cap), m - wins, wins, m, p0, u0, skip, zero],
                     axis=1)
    return _finish_call(row2, cpos, cval, wpos, wval, cfg)


def _pad_to_k(pos, val, cfg: Config):
    """[B, KP] -> [B, k]: the first min(k, N) slots, then -1 / -inf."""
    pos, val = pos[:, :cfg.kn], val[:, :cfg.kn]
    if cfg.kn < cfg.k:
        pos = jnp.pad(pos, ((0, 0), (0, cfg.k - cfg.kn)), constant_values=-1)
        val = jnp.pad(val, ((0, 0), (0, cfg.k - cfg.kn)), constant_values=-jnp.inf)
    return pos, val


def _two_reads(scores, length, m, thr0, cnt0, cfg: Config, skip=None, state=None):
    """Everything after the first thresholds (or from a given bracket state): refine,
    selection, stage 2 -> [B, KP]."""
    lo, hi, blk_lo, blk_hi = _search(scores, length, m, thr0, cnt0, cfg, skip, state)
    selected = _select(scores, length, lo, hi, blk_lo, blk_hi, cfg, skip)
    wins, cands = jnp.sum(blk_hi, axis=1), jnp.sum(blk_lo - blk_hi, axis=1)
    return _finish(lo, hi, wins, cands, m, selected, cfg, skip)


def _from_first_pass(scores, length, m, thr0, cnt0, cfg: Config):
    """Everything after the first thresholds, padded to k."""
    return _pad_to_k(*_two_reads(scores, length, m, thr0, cnt0, cfg), cfg)


def one_read_select(scores, length, m, cfg: Config, floor=None):
    """The one-read pass and its finish: (ok [B] bool: rows finished here, positions and
    values [B, KP], valid where ok, the bracket state the pass leaves for the other rows).
    A row is ok when its floor t (``sample_floor``) has c(t) >= m and no block holds more
    than SEG candidates; its m winners are then among the candidates, which the segments hold
    in position order (tie rule kept). floor [B] f32 (optional): use these scores as the
    floors instead of the sample's, e.g. the previous decode step's k-th score of each row
    (no sample, no XLA sort); a floor above the row's m-th score only sends it to the
    fallback."""
    b, seg, nblk = scores.shape[0], cfg.seg, cfg.nblk
    if floor is None:
        t = sample_floor(scores[:, ::sample_stride(cfg)], length, m, cfg)
    else:
        t = jnp.maximum(order_keys(canonical_scores(floor.astype(jnp.float32))), KEY_NEG_INF)
    cpos, cval, cnt = pl.pallas_call(
        functools.partial(_select_seg_kernel, block=cfg.block),
        grid=(b, nblk),
        in_specs=[pl.BlockSpec((None, 2), lambda i, j: (i, 0)),
                  pl.BlockSpec((None, cfg.block), lambda i, j: (i, j))],
        out_specs=[pl.BlockSpec((None, seg), lambda i, j: (i, j)),
                   pl.BlockSpec((None, seg), lambda i, j: (i, j)),
                   pl.BlockSpec((None, None, 2), lambda i, j: (i, j, 0))],
        out_shape=[jax.ShapeDtypeStruct((b, nblk * seg), jnp.int32),
                   jax.ShapeDtypeStruct((b, nblk * seg), jnp.float32),
                   jax.ShapeDtypeStruct((b, nblk, 2), jnp.int32)],
        name="topk_select_seg", **_kernel_params(cfg, cfg.select_warps),
    )(jnp.stack([length, t], axis=1), scores)
    cnt = cnt[..., 0]
    ok = (jnp.sum(cnt, axis=1) >= m) & jnp.all(cnt <= seg, axis=1)
    size = _next_pow2(nblk * seg)
    if cfg.finish_in_registers and nblk * seg < size <= REGISTER_FINISH_MAX:
        # the register finish loads the whole candidate row: Triton needs a power of two,
        # so the row gets empty segments (-1 positions are never candidates, by_pos)
        pad = ((0, 0), (0, size - nblk * seg))
        cpos = jnp.pad(cpos, pad, constant_values=-1)
        cval = jnp.pad(cval, pad, constant_values=-jnp.inf)
    p0, u0 = _shared_digits(t, jnp.full_like(t, INT32_MAX), cfg.digit_bits)
    zero = jnp.zeros_like(t)
    row2 = jnp.stack([jnp.full_like(t, cpos.shape[1]), m, zero, m, p0, u0,
                      jnp.logical_not(ok).astype(jnp.int32), zero], axis=1)
    wpos = jnp.full((b, cfg.kp), -1, jnp.int32)
    wval = jnp.full((b, cfg.kp), -jnp.inf, jnp.float32)
    pos, val = _finish_call(row2, cpos, cval, wpos, wval, cfg, by_pos=True)
    return ok, pos, val, _floor_state(length, m, t, cnt, cfg)


def topk_after_first_pass(scores, lengths, thr, counts, cfg: Config):
    """Top-k when a producer of the score rows already ran the first counting pass (the fused
    ``pq_topc``); call inside jit. scores [B, N] f32 (N = cfg.n), lengths [B] int, thr [B, NT]
    int32 keys ascending inside [KEY_NEG_INF, INT32_MAX] (e.g. ``sample_thresholds``), counts
    [B, nblk, NT] int32: per block of cfg.block positions, #{eligible n : key(scores[n]) >=
    thr} (``count_at_least`` over ``eligible_keys``). Returns as ``topk_triton``."""
    length, m = row_lengths(lengths, cfg)
    return _from_first_pass(scores.astype(jnp.float32), length, m, thr, counts, cfg)


def topk_triton(scores: jnp.ndarray, lengths: jnp.ndarray, k: int, *,
                block: int = DEFAULT_BLOCK, digit_bits: int = DEFAULT_DIGIT_BITS,
                cap: int = DEFAULT_CAP, sample: int = DEFAULT_SAMPLE,
                chunk: int = DEFAULT_CHUNK, num_warps: int = DEFAULT_NUM_WARPS,
                select_warps: int = DEFAULT_SELECT_WARPS, interpret: bool | None = None,
                one_read: bool = False, finish_in_registers: bool = False, floor=None):
    """Exact top-k: scores [B, N] f32, lengths [B] int, k >= 1 -> (positions [B, k] int32,
    values [B, k] f32): the set of the m = min(k, length) best eligible positions (ties to the
    lower position), in no particular order, then -1 / -inf. Inputs are assumed validated
    (see api.topk). Tunables: block, chunk, cap (powers of two), digit_bits in (1, 2, 4, 8),
    sample (first-pass sample size per row), num_warps / select_warps (Triton warps of the
    counting and stage-2 kernels / of the selection kernel). interpret=None asks
    ``common.interpret()`` here, outside the jitted body. one_read=True: the one-read path
    (module docstring; a larger sample, e.g. 4096, makes its floor tighter).
    finish_in_registers=True: stage 2 loads its candidates once and searches T bit by bit in
    registers (``_finish_row_registers``) instead of re-reading them in chunks per radix step
    (H200: the one-read finish 26.7 -> 2.2 us); candidate rows longer than
    REGISTER_FINISH_MAX keep the chunked finish (registers would not hold them).
    floor [B] f32 (one_read only): per-row threshold hints replacing the sampled floor, e.g.
    the previous step's k-th score (results stay exact: a bad hint falls back)."""
    cfg = config(scores.shape[1], k, block=block, digit_bits=digit_bits, cap=cap,
                 sample=sample, chunk=chunk, num_warps=num_warps, select_warps=select_warps,
                 interpret=interpret, one_read=one_read,
                 finish_in_registers=finish_in_registers)
    if floor is not None and not one_read:
        raise ValueError("topk_triton: floor (a per-row threshold hint) needs one_read=True")
    return _topk_triton(scores, lengths, floor, cfg=cfg)


@functools.partial(jax.jit, static_argnames=("cfg",))
def _topk_triton(scores, lengths, floor=None, *, cfg: Config):
    scores = scores.astype(jnp.float32)
    length, m = row_lengths(lengths, cfg)
    if not cfg.one_read:
        thr0 = sample_thresholds(scores[:, ::sample_stride(cfg)], length, m, cfg)
        return _from_first_pass(scores, length, m, thr0, None, cfg)
    ok, pos1, val1, state = one_read_select(scores, length, m, cfg, floor)
    # The fallback: refine from the floor's bracket (the one-read pass counted c(t)), select,
    # finish; every program of an ok row returns at once.
    pos2, val2 = _two_reads(scores, length, m, None, None, cfg, skip=ok, state=state)
    return _pad_to_k(jnp.where(ok[:, None], pos1, pos2), jnp.where(ok[:, None], val1, val2),
                     cfg)

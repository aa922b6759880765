# Frozen copy of pallas_kernels/topk/triton.py at commit 78be51b (before issue 16: the counting
# passes in an XLA while loop on a device predicate). Loaded only by benchmarks/topk_nosync_gpu.py
# as the old-style baseline; not part of the package.
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

Stage 1 (the long rows, HBM-bound):
  1. Thresholds of the first pass come from a strided sample of each row (sorted in XLA): NT
     keys around the sample rank of the m-th largest, spaced so that one bracket holds about
     CAP / 4 positions. Later passes try lo + 1 (a heavily tied lo ends at once) and split
     [lo, hi) evenly in key space (NT parts, i.e. digit_bits bits per pass).
  2. Counting kernel, grid (B, N / BLOCK): per block and threshold the count of eligible keys
     >= t. XLA sums the blocks, picks the new bracket, keeps its per-block counts. A row stops
     when c(lo) - c(hi) <= CAP or hi == lo + 1 (a single key, possibly tied many times). Rows
     with L <= CAP need no pass at all.
  3. Selection kernel, same grid: keys >= hi are winners, written at [0, c(hi)) of the output
     row; keys in [lo, hi) are candidates, the first CAP of them in position order written to a
     candidate row. Offsets: exclusive prefix over blocks (XLA) + in-block prefix sum.
Stage 2 (rows of CAP candidates, one program per row): radix search of the r-th largest
  candidate key T (r = m - c(hi)), digit_bits bits per step from the first digit that the
  bracket's keys do not all share; then the candidates > T and the first (in position order)
  candidates == T until r are taken, written after the stage-1 winners; slots >= m get -1 /
  -inf.

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

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import common
from pallas_kernels.topk.reference import canonical_scores

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
_MAX_PASSES = 64            # a safety stop: 1 + 32 / digit_bits passes always suffice


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def order_keys(x: jnp.ndarray) -> jnp.ndarray:
    """Order-preserving int32 keys of canonical f32 scores (signed comparison of keys = float
    comparison): negative floats get their 31 magnitude bits flipped."""
    bits = lax.bitcast_convert_type(x, jnp.int32)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


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


def _select_kernel(row_ref, off_ref, x_ref, wpos_ref, wval_ref, cpos_ref, cval_ref, *, block):
    """Compaction of one block: winners (key >= hi) and candidates (lo <= key < hi).

    Refs: inputs  row_ref [4] int32 (length, lo, hi, unused),
                  off_ref [2] int32 (winners, candidates) of the row before this block,
                  x_ref [BLOCK] f32
          outputs wpos_ref / wval_ref [KP] (whole row; this block writes its winners),
                  cpos_ref / cval_ref [CAP] (whole row; candidates past CAP are dropped)
    Stores are scatters at computed slots; lanes that store nothing point past the row (masked
    on the GPU, dropped in interpret mode) so that no two lanes share a slot.
    """
    j = pl.program_id(1)
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


def _finish_kernel(row_ref, cpos_ref, cval_ref, wpos_in_ref, wval_in_ref, wpos_ref, wval_ref, *,
                   digit_bits, chunk):
    """Stage 2 of one row: the r best candidates appended after the stage-1 winners.

    Refs: inputs  row_ref [8] int32 (n candidates, r wanted, c = stage-1 winners, m, p0,
                  u0 = the digits above step p0 shared by the whole stage-1 bracket, 0, 0),
                  cpos_ref / cval_ref [CAP] candidates in position order (first n valid),
                  wpos_in_ref / wval_in_ref [KP] aliased to the outputs (not read)
          outputs wpos_ref / wval_ref [KP]: slots [0, c) hold the stage-1 winners already;
                  this writes [c, m) and fills [m, KP) with -1 / -inf.

    Notation: u(key) = key ^ INT32_MIN orders keys as unsigned; T = the r-th largest candidate
    key, built from the top digit down starting at step p0 with T_u = u0: at step p (shift
    s = 32 - digit_bits (p + 1)), T_u | (d << s) for the largest digit d with
    #{candidates, u >= T_u | (d << s)} >= r.
    """
    del wpos_in_ref, wval_in_ref
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


def config(n: int, k: int, *, block: int = DEFAULT_BLOCK, digit_bits: int = DEFAULT_DIGIT_BITS,
           cap: int = DEFAULT_CAP, sample: int = DEFAULT_SAMPLE, chunk: int = DEFAULT_CHUNK,
           num_warps: int = DEFAULT_NUM_WARPS, select_warps: int = DEFAULT_SELECT_WARPS,
           interpret: bool | None = None) -> Config:
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
                  interpret=bool(interpret))


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


def _even_thresholds(lo, hi, nt):
    """NT thresholds inside (lo, hi), ascending: lo + 1 (a bracket often starts at a heavily
    tied key), then lo + j * ceil((hi - lo) / NT) for j = 1 .. NT - 1 (clipped below hi), so
    the next bracket is at most ceil((hi - lo) / NT) keys wide: 32 / digit_bits passes narrow
    any bracket to one key. Unsigned offsets since hi - lo may exceed INT32_MAX."""
    d = lax.bitcast_convert_type(hi - lo, jnp.uint32)[:, None]
    step = (d + jnp.uint32(nt - 1)) // jnp.uint32(nt)  # d <= 0xFF800000: no overflow
    j = jnp.arange(nt, dtype=jnp.uint32)[None, :]
    off = jnp.minimum(jnp.maximum(j * step, 1), d - 1)
    return lo[:, None] + lax.bitcast_convert_type(off, jnp.int32)


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


def _search(scores, length, m, thr0, cnt0, cfg: Config):
    """Counting passes until every row's bracket holds <= CAP keys (or one key); returns
    (lo, hi, blk_lo, blk_hi). Pass 0 uses thr0; its counts are cnt0 when a producer counted
    them already (then the loop starts at pass 1), else the counting kernel's."""
    b, nt = scores.shape[0], cfg.nt
    count_call = pl.pallas_call(
        functools.partial(_count_kernel, block=cfg.block, chunk=cfg.chunk),
        grid=(b, cfg.nblk),
        in_specs=[pl.BlockSpec((None, 2), lambda i, j: (i, 0)),
                  pl.BlockSpec((None, nt), lambda i, j: (i, 0)),
                  pl.BlockSpec((None, cfg.block), lambda i, j: (i, j))],
        out_specs=pl.BlockSpec((None, None, nt), lambda i, j: (i, j, 0)),
        out_shape=jax.ShapeDtypeStruct((b, cfg.nblk, nt), jnp.int32),
        name="topk_count", **_kernel_params(cfg, cfg.num_warps))

    state = _start(length, cfg)
    if cnt0 is not None:
        state = _narrow(state, thr0, cnt0, m, cfg.cap)

    def cond(state):
        return jnp.any(_active(state, cfg.cap)) & (state[0] < _MAX_PASSES)

    def body(state):
        it, lo, hi = state[:3]
        thr = jnp.where(it == 0, thr0, _even_thresholds(lo, hi, nt))
        thr = jnp.clip(thr, lo[:, None], hi[:, None])
        act = _active(state, cfg.cap).astype(jnp.int32)
        cnt = count_call(jnp.stack([length, act], axis=1), thr, scores)
        return _narrow(state, thr, cnt, m, cfg.cap)

    return lax.while_loop(cond, body, state)[1:]


def _select(scores, length, lo, hi, blk_lo, blk_hi, cfg: Config):
    """Selection kernel: (winner pos / val [B, KP], candidate pos / val [B, CAP])."""
    b, kp, cap = scores.shape[0], cfg.kp, cfg.cap
    offsets = jnp.stack([_exclusive_cumsum(blk_hi), _exclusive_cumsum(blk_lo - blk_hi)], axis=2)
    row = jnp.stack([length, lo, hi, jnp.zeros_like(lo)], axis=1)
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


def _finish(lo, hi, wins, cands, m, selected, cfg: Config):
    """Stage 2: (positions [B, KP], values [B, KP]) from the selection kernel's outputs."""
    wpos, wval, cpos, cval = selected
    b, kp, cap, digit_bits = lo.shape[0], cfg.kp, cfg.cap, cfg.digit_bits
    # Candidates lie in [lo, hi): the digits where lo and hi - 1 agree are known already.
    lo_u, top_u = lo ^ INT32_MIN, (hi - 1) ^ INT32_MIN
    p0 = lax.clz(lo_u ^ top_u) // digit_bits
    low_bits = 32 - p0 * digit_bits
    low_mask = jnp.where(low_bits >= 32, -1, (jnp.int32(1) << jnp.minimum(low_bits, 31)) - 1)
    u0 = lo_u & ~low_mask
    zero = jnp.zeros_like(lo)
    row2 = jnp.stack([jnp.minimum(cands, cap), m - wins, wins, m, p0, u0, zero, zero], axis=1)
    one_row = lambda i: (i, 0)  # noqa: E731
    return pl.pallas_call(
        functools.partial(_finish_kernel, digit_bits=digit_bits, chunk=cfg.chunk2),
        grid=(b,),
        in_specs=[pl.BlockSpec((None, 8), one_row),
                  pl.BlockSpec((None, cap), one_row), pl.BlockSpec((None, cap), one_row),
                  pl.BlockSpec((None, kp), one_row), pl.BlockSpec((None, kp), one_row)],
        out_specs=[pl.BlockSpec((None, kp), one_row), pl.BlockSpec((None, kp), one_row)],
        out_shape=[jax.ShapeDtypeStruct((b, kp), jnp.int32),
                   jax.ShapeDtypeStruct((b, kp), jnp.float32)],
        input_output_aliases={3: 0, 4: 1},
        name="topk_finish", **_kernel_params(cfg, cfg.num_warps))(row2, cpos, cval, wpos, wval)


def _from_first_pass(scores, length, m, thr0, cnt0, cfg: Config):
    """Everything after the first thresholds: counting passes, selection, stage 2, padding."""
    lo, hi, blk_lo, blk_hi = _search(scores, length, m, thr0, cnt0, cfg)
    selected = _select(scores, length, lo, hi, blk_lo, blk_hi, cfg)
    wins, cands = jnp.sum(blk_hi, axis=1), jnp.sum(blk_lo - blk_hi, axis=1)
    pos, val = _finish(lo, hi, wins, cands, m, selected, cfg)
    pos, val = pos[:, :cfg.kn], val[:, :cfg.kn]
    if cfg.kn < cfg.k:
        pos = jnp.pad(pos, ((0, 0), (0, cfg.k - cfg.kn)), constant_values=-1)
        val = jnp.pad(val, ((0, 0), (0, cfg.k - cfg.kn)), constant_values=-jnp.inf)
    return pos, val


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
                select_warps: int = DEFAULT_SELECT_WARPS, interpret: bool | None = None):
    """Exact top-k: scores [B, N] f32, lengths [B] int, k >= 1 -> (positions [B, k] int32,
    values [B, k] f32): the set of the m = min(k, length) best eligible positions (ties to the
    lower position), in no particular order, then -1 / -inf. Inputs are assumed validated
    (see api.topk). Tunables: block, chunk, cap (powers of two), digit_bits in (1, 2, 4, 8),
    sample (first-pass sample size per row), num_warps / select_warps (Triton warps of the
    counting and stage-2 kernels / of the selection kernel). interpret=None asks
    ``common.interpret()`` here, outside the jitted body."""
    cfg = config(scores.shape[1], k, block=block, digit_bits=digit_bits, cap=cap,
                 sample=sample, chunk=chunk, num_warps=num_warps, select_warps=select_warps,
                 interpret=interpret)
    return _topk_triton(scores, lengths, cfg=cfg)


@functools.partial(jax.jit, static_argnames=("cfg",))
def _topk_triton(scores, lengths, *, cfg: Config):
    scores = scores.astype(jnp.float32)
    length, m = row_lengths(lengths, cfg)
    thr0 = sample_thresholds(scores[:, ::sample_stride(cfg)], length, m, cfg)
    return _from_first_pass(scores, length, m, thr0, None, cfg)

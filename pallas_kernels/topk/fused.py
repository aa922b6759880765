"""Exact top-k in 2-3 Pallas-Triton launches (``topk(..., implementation="triton_fused")``).

The one-read path of ``triton.py`` with its XLA glue moved into the kernels, so that one call
is a fixed sequence of two (or three) launches (no XLA sort, fusion, loop or cond between
them; the host never waits on a device value):

  1. select, grid (B, nblk), >= 2 programs per row when N > BLOCK: each program computes its
     row's floor t from a sample of the row (every program of the row the same t, redundantly:
     S scores, a few KB from L2) or takes the row's floor hint, then writes its block's
     eligible scores with key >= t (as (position, score bits) pairs), in position order, into
     its own segment of the row's candidate buffer, and its count c_j.
  2. finish, grid (B, P) (P = finish_programs, 2 by default): a row is ok when c(t) =
     sum_j c_j >= m and no block overflowed its segment; its m winners are then the m best
     candidates, found on keys held in registers (``triton.take_top_registers``; with P > 1
     each program writes the winners among its CR / P candidates, ``_take_part``).
     Otherwise (a floor above the m-th key, or a crowded block) the row's first program
     scans the whole row: a radix search of the m-th key over it, then one take pass in
     position order. Exact either way; the fallback only costs time.

``threshold_kernel=True`` computes t in its own grid (B,) launch before step 1 instead (three
launches, no redundant sample work); the default past two select programs a row
(``fused_config``).

Notation:
  B rows, N positions, L = clip(lengths[b], 0, N) eligible positions (n < L), m = min(k, L),
  key(x) the order-preserving int32 key of a canonical score (``reference.order_keys``),
  c(t) = #{n < L : key_n >= t}, KP = next power of two >= min(k, N) (output row),
  BLOCK positions per select program, nblk = ceil(N / BLOCK), NBP = next power of two >= nblk,
  NP = next power of two >= N (the finish program's view of a row; loads past N are masked),
  CR = candidate slots per row (a power of two), nlive = max(1, ceil(L / BLOCK)) blocks that
  hold eligible positions, seg = min(CR // nlive, BLOCK): block j < nlive owns slots
  [j seg, (j + 1) seg), the last live block up to CR (unused slots: position -1),
  S sample scores in S / W windows of W consecutive positions (W = 8: 32 bytes, at most two
  sectors, where single scores would cost one sector each), window stride
  ws = max(W, L // (S / W)); ns = #{sample positions < L};
  q = m ns / L - 1 the expected 0-based descending sample rank of the m-th key,
  r = floor(q + Z sqrt(q + 1)) + 2 the sample rank of the floor (Z = triton.ONE_READ_Z),
  t = the sample's r-th largest key with its low 32 - floor_bits bits cleared, at least
  key(-inf) (so t <= that key: c(t) >= m unless the sample misleads); with a floor hint,
  t = key(canonical hint), at least key(-inf).
Tie rule: equal scores go to the lower position (segments and the fallback keep position
order). Positions past a row's length never influence anything; NaN inside a length counts as
-inf and -0.0 as +0.0 (as reference.canonical_scores).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import common
from pallas_kernels.topk import triton as tk
from pallas_kernels.topk.reference import canonical_scores, from_order_keys

INT32_MIN, INT32_MAX, KEY_NEG_INF = tk.INT32_MIN, tk.INT32_MAX, tk.KEY_NEG_INF


@dataclasses.dataclass(frozen=True)
class FusedConfig:
    """Static sizes of one call (hashable: a jit static argument); see ``fused_config``."""

    k: int
    n: int
    block: int          # positions per select program (power of two)
    chunk: int          # positions per step of the select program's loop (divides block)
    sample: int         # S (power of two)
    window: int         # W (power of two, divides S)
    floor_bits: int     # bits of t searched (1..32)
    cr: int             # candidate slots per row
    digit_bits: int     # fallback radix digit
    fallback_chunk: int  # positions per step of the fallback scan
    select_warps: int
    finish_warps: int
    scan_rows: int      # the select chunk's prefix count: one scan (1) or rows x (CH / rows)
    threshold_kernel: bool
    interpret: bool
    compare: str = "float"  # select's test: "float" x >= f32(t) where exact, else "keys"
    stop_early: bool = True  # the finish's radix search stops at a prefix of exactly m keys
    skip_ties: bool = True  # after an early stop the finish keeps keys >= T (no tie ranks)
    finish_scan_rows: int = 64  # the finish's prefix sums: one scan (1) or rows x (CR / rows)
    finish_programs: int = 2  # finish programs a row (each writes the winners of CR / P slots)
    search: str = "bits"  # the floor's and the finish's searches: "bits" or "thirds"
    threshold_warps: int = 16  # the threshold launch's warps (finish_warps until session 50)

    @property
    def kn(self) -> int:
        return min(self.k, self.n)

    @property
    def kp(self) -> int:
        return tk._next_pow2(self.kn)

    @property
    def nblk(self) -> int:
        return -(-self.n // self.block)

    @property
    def np_(self) -> int:
        return tk._next_pow2(self.n)


def fits(n: int, k: int) -> bool:
    """Whether "triton_fused" takes (N, k): KP <= REGISTER_FINISH_MAX / 2, so that a candidate
    row with room for about twice the expected candidates (>= 2 k) fits the register finish."""
    return 2 * tk._next_pow2(min(int(k), int(n))) <= tk.REGISTER_FINISH_MAX


def fused_config(n: int, k: int, *, block: int = 16384, chunk: int = 2048, sample: int = 4096,
                 window: int = 8, floor_bits: int = 20, digit_bits: int = 4,
                 fallback_chunk: int = 1024, select_warps: int = 8, finish_warps: int = 16,
                 threshold_kernel: bool | None = None, scan_rows: int = 32,
                 compare: str = "float", stop_early: bool = True, skip_ties: bool = True,
                 finish_scan_rows: int = 64, finish_programs: int = 2, search: str = "bits",
                 threshold_warps: int = 16, interpret: bool | None = None) -> FusedConfig:
    """Tunables fitted to rows of N (call outside jit when interpret is None). threshold_kernel
    None: the separate threshold launch when a row has more than two select programs (H200,
    B 64, session 12, ms per call in a batch of 8: 262144 / k 2048 0.139 with it vs 0.197
    without, the 16 programs each redoing the sample search; 32768 / k 512 0.071 vs 0.063;
    ``benchmarks/topk_launch_gpu.py``). block 16384; floor_bits = 20 leaves t
    within 2^-11 of the sample key (a few more candidates, 12 fewer steps). CR is twice a
    full row's expected candidates (r + 1) * N / S, a power of two in [KP, 16384], at most NP.
    scan_rows: the select chunk's slots from one prefix scan of CH indicators (1) or from a
    [scan_rows, CH / scan_rows] view: row totals, a scan of them, per-row scans (shorter
    scans; the same slots, a power of two; clipped to CH). Default 32: H200, B 64, 262144 / k
    2048, session 18, busy 86.8 us a call vs 91.4 us with one scan (8: 120.7, 128: 87.8;
    ``topk_launch_gpu.py --sweep``).
    finish_warps (the threshold and finish kernels' warps) 16: at 64 x 262144, k 2048 (H100,
    session 39, ``benchmarks/launch_variants_gpu.py``, interleaved rounds against 8 warps,
    the same index sets and values) 0.962x / 0.973x / 0.967x in three runs, faster in 14 of
    15, 15 of 25 and 25 of 35 rounds (``results/launch_variants_s39/``). threshold_warps:
    the threshold launch's own, 16 (as it was with finish_warps): its bit search is faster with
    more warps (H100, 64 x 262144, k 2048, session 50, ``launch_variants_gpu.py --set s50``,
    ``results/launch_variants_s50/``: 4 warps 11.2 us, 8 warps 8.4, 16 warps 6.8; session 52,
    ``results/launch_variants_s52_call1/``: 16 warps 6.9, 32 warps 6.7, the top-k 60.2 vs 59.9).
    The select loop has no prefetch of the next chunk (removed in session 47: H100, session
    40, 35 rounds, 1.000x at chunk 2048 and slower otherwise; Triton 3.6 does not pipeline
    the loop's loads itself, session 38). Chunks wholly below the row's length skip the
    position test (ptxas sm_90a, chunk 4096: the float loop's trip 619 -> 534 SASS
    instructions).
    A candidate is stored as one 8-byte (position, score bits) pair (session 47). What the
    select kernel's time is (H100, 64 x 262144, k 2048, ``benchmarks/select_probe_gpu.py``,
    device time): its loads alone 24.6 us (2.7 TB/s), with the compare and count 24.3, with
    the prefix sums 26.6; with two 4-byte scatters (position, score) 58.8, the same at 0 and
    at 7500 candidates a row (58.2-59.2): the store instructions, issued for every lane of a
    chunk under their masks, cost it, not the candidates (without the score's scatter 41.5,
    without both 29.6). One 8-byte scatter of pairs: select 44.3 / 44.6 us in two runs (the
    finish, reading the pairs, 15.1 -> 18.0 us), the whole top-k 80.2 -> 69.6-69.9 us busy.
    chunk 2048 (default since session 47): select 40.9 / 40.8 us, top-k 66.5 / 65.8 us busy
    (ptxas sm_90a: 63 registers against 118 at 4096, four programs a SM instead of two;
    ``launch_variants_gpu.py --set s47``, ``results/launch_variants_s47/``; chunk 2048 with 4
    warps 68.6 / 68.4, block 32768 67.7 / 67.9). Not faster: the chunk as [CH / 16, 4, 4],
    16 consecutive scores a thread for both the loads and the scatter (25% fewer SASS
    instructions, no shared-memory relayout: 61.2 us); each thread's first 4 candidates found
    from its bits and stored as 4 [CH / 16] stores (49.8 us, against 41.7 for the flat
    positions-only scatter); the positions alone with the finish gathering the scores (select
    39.0, the finish 15.1 -> 25.9 us: ptxas issues its 16 gathers a thread one after another).
    compare: how select tests a score against t: "float" (default) x >= f32(t), one
    compare, wherever that picks the same set (``_float_exact``; else the key path), "keys"
    the canonical score's order key against t (session 44's form). stop_early (default on):
    the finish's radix search stops at a prefix holding exactly m candidates
    (``triton.radix_search``), instead of its 32 steps. Both exact: the same candidate rows
    and winners. Defaults since session 46 (H100, 64 x 262144, k 2048,
    ``launch_variants_gpu.py --set s45``, 5 interleaved rounds against the key path with 32
    steps, ``results/launch_variants_s46/``): both 0.975x a call (0.955-0.984, faster in 5 of
    5; busy 77.8 vs 80.3 us), "float" alone 0.981x, the early stop alone 0.989x; select's chunk
    2048 with both gains nothing (1.000x). ptxas sm_90a: select 125 registers with "float",
    127 with "keys"; its chunk loop 619 SASS instructions a trip with "float", 714 with
    "keys" (``results/pallas_ptx_topk/``).
    The finish's forms (session 48; all exact, the same winners in the same slots):
    skip_ties: after an early stop (exactly m keys >= T) the winners are the keys >= T, with
    no tie count and tie ranks; finish_scan_rows: its prefix sums through a [rows, CR / rows]
    view (Triton scans a 1-D [8192] over 16 warps by reading every warp's partial for each of
    a thread's strided elements: ptxas sm_90a, the finish after its search 2680 SASS
    instructions, 1842 at 64 rows); finish_programs P: P programs a row (grid (B, P)), each
    searching T over all CR keys and writing the winners of its CR / P slots (P = 2: 128
    programs on 132 SMs, 1069 instructions after the search with 64 rows). search: the
    floor's and the finish's searches, "bits" (one count a step) or "thirds"
    (``triton.thirds_search``: two counts in one reduction, a third of the range a step).
    Defaults since session 49 (H100, 64 x 262144, k 2048, ``launch_variants_gpu.py --set
    s48``, 3 interleaved rounds, device time from 2 profiles each,
    ``results/launch_variants_s49/``): the finish 18.9 -> 14.5 us busy with two programs a
    row and 64-row prefix sums (the top-k 64.7 -> 60.7 us); skip_ties on top of them changes
    nothing measurable (14.62 vs 14.54 us) and is kept as the shorter path; each alone
    17.6-17.8 us; "thirds" slower (the finish 19.1 us, the threshold 6.8 -> 7.9-8.1: its steps
    cost more than the steps it saves). The calls' wall times in the same rounds are noisy
    (0.87-1.18x). ``finish_probe_gpu.py`` (session 49, the session-47 finish, cumulative
    stages): the candidate row's load 2.1 us, the keys 2.2, the search 8.7, the slots 16.3,
    the whole finish 17.9.
    Raises ValueError when KP > 8192 (the finish keeps CR >= 2 KP keys in registers)."""
    for name, v in (("block", block), ("chunk", chunk), ("sample", sample), ("window", window),
                    ("fallback_chunk", fallback_chunk), ("scan_rows", scan_rows),
                    ("threshold_warps", threshold_warps),
                    ("finish_scan_rows", finish_scan_rows),
                    ("finish_programs", finish_programs)):
        if v < 1 or v & (v - 1):
            raise ValueError(f"topk_fused: {name}={v} must be a power of two")
    if compare not in ("float", "keys"):
        raise ValueError(f"topk_fused: compare={compare!r} must be 'float' or 'keys'")
    if digit_bits not in (1, 2, 4, 8) or not 1 <= floor_bits <= 32:
        raise ValueError(f"topk_fused: digit_bits={digit_bits} (1, 2, 4, 8) or floor_bits="
                         f"{floor_bits} (1..32) out of range")
    n, k = int(n), int(k)
    np_ = tk._next_pow2(n)
    block = min(block, np_)
    chunk = min(chunk, block)
    sample = min(sample, np_)
    window = min(window, sample)
    kp = tk._next_pow2(min(k, n))
    if not fits(n, k):
        raise ValueError(f"topk_fused: k={k} too large for the register finish (KP={kp} > "
                         f"{tk.REGISTER_FINISH_MAX // 2}); use implementation='triton'")
    st = max(1, n // sample)
    q = min(k, n) / st - 1.0
    expected = (q + tk.ONE_READ_Z * math.sqrt(max(q, 0.0) + 1.0) + 3.0) * st
    cr = min(tk._next_pow2(math.ceil(2 * expected)), tk.REGISTER_FINISH_MAX, np_)
    if interpret is None:
        interpret = common.interpret()
    if threshold_kernel is None:
        threshold_kernel = np_ > 2 * block
    tk.check_search(search, max(sample, cr, kp), "topk_fused")  # the floor's, the finish's
    return FusedConfig(k=k, n=n, block=block, chunk=chunk, sample=sample, window=window,
                       floor_bits=int(floor_bits), cr=max(cr, kp), digit_bits=digit_bits,
                       fallback_chunk=min(fallback_chunk, np_), select_warps=select_warps,
                       finish_warps=finish_warps, threshold_kernel=bool(threshold_kernel),
                       scan_rows=min(scan_rows, chunk), interpret=bool(interpret),
                       compare=compare, stop_early=bool(stop_early),
                       skip_ties=bool(skip_ties),
                       finish_scan_rows=min(finish_scan_rows, max(cr, kp) // finish_programs),
                       finish_programs=min(finish_programs, max(cr, kp)), search=search,
                       threshold_warps=threshold_warps)


# ----------------------------------------------------------------------------- in-kernel pieces


def _row_sizes(len_ref, cfg: FusedConfig):
    """(L, m) of this program's row from its raw length."""
    length = jnp.clip(len_ref[0], 0, cfg.n)
    return length, jnp.minimum(length, cfg.k)


def sample_scores(row_ref, length, cfg: FusedConfig):
    """(x [S] the row's windowed sample, inside [S]: its positions < L; x is 0 elsewhere).
    row_ref [NP]: the row (only sample positions < L are loaded)."""
    s, w = cfg.sample, cfg.window
    ws = jnp.maximum(w, length // (s // w))
    i = lax.broadcasted_iota(jnp.int32, (s,), 0)
    p = (i // w) * ws + (i % w)
    inside = p < length
    return plgpu.load(row_ref.at[jnp.where(inside, p, 0)], mask=inside, other=0.0), inside


def _sample_floor(row_ref, length, m, cfg: FusedConfig):
    """The row's floor key t from its windowed sample (module docstring)."""
    x, inside = sample_scores(row_ref, length, cfg)
    key = jnp.where(inside, tk.order_keys(canonical_scores(x)), INT32_MIN)
    ns = jnp.sum(inside.astype(jnp.int32)).astype(jnp.float32)
    q = m.astype(jnp.float32) * ns / jnp.maximum(length, 1).astype(jnp.float32) - 1.0
    r = (q + tk.ONE_READ_Z * jnp.sqrt(jnp.maximum(q, 0.0) + 1.0)).astype(jnp.int32) + 2

    if cfg.search == "thirds":  # to within 2^(32 - floor_bits), then those bits cleared
        low = (1 << (32 - cfg.floor_bits)) - 1
        u, _ = tk.thirds_search(functools.partial(tk.count_pair, key), r + 1,
                                stop_width=low)
        t = lax.bitcast_convert_type(u & jnp.uint32(0xFFFFFFFF ^ low), jnp.int32) ^ INT32_MIN
        return jnp.maximum(t, KEY_NEG_INF)

    def bit_step(b, t_u):  # T_u: the largest with #{u >= T_u} >= r + 1, bit by bit
        cand = t_u | lax.shift_left(jnp.int32(1), 31 - b)
        count = jnp.sum((key >= (cand ^ INT32_MIN)).astype(jnp.int32))
        return jnp.where(count > r, cand, t_u)

    t = lax.fori_loop(0, cfg.floor_bits, bit_step, jnp.int32(0)) ^ INT32_MIN
    return jnp.maximum(t, KEY_NEG_INF)


def _float_exact(tf):
    """Whether ``x >= tf`` picks exactly the canonical scores with key >= key(tf), denormal
    flushing or not: tf normal (|tf| >= 2^-126) or +inf. A flushed denormal x compares as
    +-0, on the same side of a normal tf as x itself; NaN compares false, as its canonical
    -inf would below tf > -inf; -0.0 == +0.0. Not at tf = +-0 or denormal (a flushed
    denormal would tie with it) nor at -inf (NaN would count)."""
    return (jnp.abs(tf) >= jnp.float32(np.finfo(np.float32).tiny)) & (tf > -jnp.inf)


def _segment(j, length, cfg: FusedConfig):
    """(first slot, end slot) of block j's segment of the candidate row (empty past nlive)."""
    nlive = jnp.maximum(1, (length + cfg.block - 1) // cfg.block)
    seg = jnp.minimum(cfg.cr // nlive, cfg.block)
    start = j * seg
    end = jnp.where(j == nlive - 1, cfg.cr, jnp.where(j < nlive, start + seg, start))
    return start, end


# ----------------------------------------------------------------------------- kernels


def _threshold_kernel(len_ref, row_ref, t_ref, *, cfg: FusedConfig):
    """threshold_kernel=True: t of one row. Refs: len_ref [1], row_ref [NP] -> t_ref [1]."""
    length, m = _row_sizes(len_ref, cfg)
    t_ref[...] = jnp.full((1,), _sample_floor(row_ref, length, m, cfg), jnp.int32)


def _select_kernel(len_ref, t_src_ref, x_ref, pair_ref, cnt_ref, *, cfg: FusedConfig,
                   t_from):
    """Step 1 for block j of a row: candidates key >= t into the block's segment.

    Refs: inputs  len_ref [1] int32 (raw length), t_src_ref: the row [NP] f32 (t_from =
                  "sample"), its floor hint [1] f32 ("floor") or its key t [1] int32 ("key"),
                  x_ref [BLOCK] f32 (the block; the last may run past N)
          outputs pair_ref [CR, 2] int32 (the whole candidate row: (position, the score's
                  bits) a candidate, stored as one 8-byte store; this block writes its
                  segment: candidates in position order, then position -1; candidates past
                  the segment are dropped), cnt_ref [2] int32 (c_j, t)
    """
    j = pl.program_id(1)
    ch = cfg.chunk
    lane = lax.broadcasted_iota(jnp.int32, (ch,), 0)
    two = lax.broadcasted_iota(jnp.int32, (ch, 2), 1)
    # with a sample floor, chunk 0 is loaded first: its latency overlaps the floor search
    x0 = x_ref[pl.ds(0, ch)] if t_from == "sample" else None
    length, m = _row_sizes(len_ref, cfg)
    if t_from == "sample":
        t = _sample_floor(t_src_ref, length, m, cfg)
    elif t_from == "floor":
        hint = canonical_scores(t_src_ref[...])
        t = jnp.maximum(jnp.max(tk.order_keys(hint)), KEY_NEG_INF)
    else:
        t = t_src_ref[0]
    start, end = _segment(j, length, cfg)
    live = jnp.clip(length - j * cfg.block, 0, cfg.block)
    tf = from_order_keys(t)

    def by_key(x, pos, masked):  # the rule itself: eligible, key >= t (t >= key(-inf))
        key = tk.order_keys(canonical_scores(x))
        return ((key >= t) & (pos < length)) if masked else key >= t

    def by_float(x, pos, masked):  # the same set while tf is normal or +inf (``_float_exact``)
        return ((x >= tf) & (pos < length)) if masked else x >= tf

    def scan_block(is_cand):  # the block's candidates into its segment -> their count
        def take(s, x, count, masked):  # chunk at offset s (x its scores) -> count after it
            pos = j * cfg.block + s + lane
            is_c = is_cand(x, pos, masked)
            before, n = tk.exclusive_count(is_c.astype(jnp.int32), cfg.scan_rows)
            slot = start + count + before
            ok = is_c & (slot < end)
            if cfg.interpret:  # the interpreter scatters every lane: dropped lanes past CR
                slot = jnp.where(ok, slot, cfg.cr + lane)
            pair = jnp.where(two == 0, pos[:, None],
                             lax.bitcast_convert_type(x, jnp.int32)[:, None])
            plgpu.store(pair_ref.at[slot[:, None], two], pair, mask=ok[:, None])
            return count + n

        def step(masked):
            def body(i, count):
                s = pl.multiple_of(i * ch, ch)
                return take(s, x_ref[pl.ds(s, ch)], count, masked)
            return body

        # chunks wholly below L skip the position test; then the partial chunk, if any (a
        # block past L scans none)
        full, chunks = live // ch, (live + ch - 1) // ch
        if x0 is None:
            count = lax.fori_loop(0, full, step(False), jnp.int32(0))
        else:  # chunk 0, loaded early, with the position test (past L it holds no candidate)
            count = lax.fori_loop(1, full, step(False), take(0, x0, jnp.int32(0), True))
            full, chunks = jnp.maximum(full, 1), jnp.maximum(chunks, 1)
        return lax.fori_loop(full, chunks, step(True), count)

    if cfg.compare == "keys":
        count = scan_block(by_key)
    else:
        count = lax.cond(_float_exact(tf), lambda: scan_block(by_float),
                         lambda: scan_block(by_key))
    # the segment's unused slots [start + c_j, end) get position -1, in pieces of a full
    # row's segment (a store of all CR slots under a mask costs every thread CR / threads
    # store instructions, a third of the kernel's at 64 x 262144)
    w = min(cfg.cr, tk._next_pow2(max(cfg.cr // cfg.nblk, 16)))
    piece = lax.broadcasted_iota(jnp.int32, (w,), 0)

    def fill(i, carry):
        at = start + count + i * w + piece
        ok = at < end
        if cfg.interpret:
            at = jnp.where(ok, at, cfg.cr + piece)
        plgpu.store(pair_ref.at[at, piece * 0], jnp.full((w,), -1, jnp.int32), mask=ok)
        return carry

    lax.fori_loop(0, (jnp.maximum(end - start - count, 0) + w - 1) // w, fill, 0)
    two = lax.broadcasted_iota(jnp.int32, (2,), 0)
    cnt_ref[...] = jnp.where(two == 0, count, t)


def _finish_kernel(len_ref, cnt_ref, pair_ref, row_ref, pos_ref, val_ref, *,
                   cfg: FusedConfig):
    """Step 2 of one row: its m winners at output slots [0, m), then -1 / -inf.

    Refs: inputs  len_ref [1] int32, cnt_ref [NBP, 2] (c_j, t per block; rows >= nblk
                  unset), pair_ref [CR, 2] (step 1's candidate row), row_ref [NP] (the
                  row, read only by the fallback)
          outputs pos_ref [KP] int32, val_ref [KP] f32
    """
    length, m = _row_sizes(len_ref, cfg)
    kp = pos_ref.shape[0]
    h = pl.program_id(1)  # the program's part of the row (finish_programs)
    slots = lax.broadcasted_iota(jnp.int32, (kp,), 0)
    pad = (slots >= m) & (h == 0)
    plgpu.store(pos_ref, jnp.full((kp,), -1, jnp.int32), mask=pad)
    plgpu.store(val_ref, jnp.full((kp,), -jnp.inf, jnp.float32), mask=pad)

    nbp = cnt_ref.shape[0]
    blocks = lax.broadcasted_iota(jnp.int32, (nbp,), 0)
    counts = jnp.where(blocks < cfg.nblk, cnt_ref[:, 0], 0)  # [NBP]
    t = cnt_ref[0, 1]
    start, end = _segment(blocks, length, cfg)
    over = jnp.sum((counts > end - start).astype(jnp.int32))
    total = jnp.sum(counts)
    ok = (total >= m) & (over == 0)

    @pl.when(ok)
    def _():
        key, cpos, cval, p0, u0 = candidate_keys(pair_ref[...], t)
        if cfg.finish_programs == 1:
            tk.take_top_registers(key, cpos, cval, m, 0, p0, u0, pos_ref, val_ref,
                                  stop_early=cfg.stop_early, skip_ties=cfg.skip_ties,
                                  scan_rows=cfg.finish_scan_rows, search=cfg.search)
        else:
            _take_part(pair_ref, h, key, m, p0, u0, pos_ref, val_ref, cfg)

    @pl.when(jnp.logical_not(ok) & (h == 0))
    def _():
        _fallback_row(row_ref, length, m, t, total, pos_ref, val_ref, cfg)


def _take_part(pair_ref, h, key, m, p0, u0, pos_ref, val_ref, cfg: FusedConfig):
    """finish_programs P > 1: program h writes the winners among candidate slots [h S,
    (h + 1) S) (S = CR / P) at their output slots: T from all keys (every program of the row
    the same search), the winners before the part counted, the part's own reloaded (an L2
    read) and ranked. The same winners in the same slots as ``triton.take_top_registers``.

    Notation: key [CR] the row's candidate keys, T the search's result, ties = m - #{key > T}
    (how many keys == T win: the first ones), earlier = slots < h S.
    """
    part = cfg.cr // cfg.finish_programs
    t, exact = tk.top_key(key, m, p0, u0, cfg.stop_early, cfg.search)
    earlier = lax.broadcasted_iota(jnp.int32, key.shape, 0) < h * part
    above, tie = key > t, key == t
    # #{earlier keys > T} and #{earlier keys == T} in one count (each < 2^16)
    both = jnp.sum(jnp.where(earlier, above.astype(jnp.int32) + (tie.astype(jnp.int32) << 16),
                             0))
    ties, ties_before = m - jnp.sum(above.astype(jnp.int32)), both >> 16
    kept_before = (both & 0xFFFF) + jnp.minimum(ties_before, ties)  # the earlier winners
    pkey, ppos, pval, _, _ = candidate_keys(pair_ref[pl.ds(h * part, part), :], t)
    keep, slot = tk.winner_slots(pkey, t, exact, lambda: ties - ties_before, kept_before,
                                 pos_ref.shape[0], cfg.skip_ties and cfg.stop_early,
                                 cfg.finish_scan_rows)
    plgpu.store(pos_ref.at[slot], ppos, mask=keep)
    plgpu.store(val_ref.at[slot], canonical_scores(pval), mask=keep)


def candidate_keys(pairs, t):
    """(key, cpos, cval [CR], p0, u0) of a candidate row pairs [CR, 2] (select's, loaded whole:
    one contiguous load; its columns split by in-thread sums) with floor t: keys INT32_MIN at
    unused slots, and the search's start (the bits that keys in [t, max] share)."""
    two = lax.broadcasted_iota(jnp.int32, pairs.shape, 1)
    cpos = jnp.sum(jnp.where(two == 0, pairs, 0), axis=1)
    cval = lax.bitcast_convert_type(jnp.sum(jnp.where(two == 1, pairs, 0), axis=1),
                                    jnp.float32)
    key = jnp.where(cpos >= 0, tk.order_keys(canonical_scores(cval)), INT32_MIN)
    p0, u0 = tk._shared_digits(t, jnp.maximum(jnp.max(key), t) + 1, 1)
    return key, cpos, cval, p0, u0


def _fallback_row(row_ref, length, m, t, total, pos_ref, val_ref, cfg: FusedConfig):
    """The whole row scanned by one program: T = the m-th largest key by radix steps of
    digit_bits over the row (started from the bracket t gives: [t, INT32_MAX) when c(t) >= m,
    else [key(-inf), t); none when m = L: T = key(-inf)), then the keys > T and the first
    (by position) keys == T written at slots [0, m).

    Notation: u(key) = key ^ INT32_MIN; at radix step p (shift s = 32 - digit_bits (p + 1))
    T_u | (d << s) for the largest digit d with #{n < L : u_n >= T_u | (d << s)} >= m.
    """
    db, ch = cfg.digit_bits, cfg.fallback_chunk
    steps = (length + ch - 1) // ch
    lo = jnp.where(total >= m, t, KEY_NEG_INF)
    hi = jnp.where(total >= m, INT32_MAX, t)
    p0, u0 = tk._shared_digits(lo, hi, db)
    every = m == length  # every eligible position wins
    p0 = jnp.where(every, 32 // db, p0)
    u0 = jnp.where(every, KEY_NEG_INF ^ INT32_MIN, u0)
    digits = lax.broadcasted_iota(jnp.int32, (1 << db,), 0)

    def keys_at(i):  # (positions, keys, raw scores) of chunk i
        s = pl.multiple_of(i * ch, ch)
        x = row_ref[pl.ds(s, ch)]
        return (*tk.eligible_keys(x, s, length), x)

    def radix_step(p, t_u):
        shift = 32 - db * (p + 1)
        thr = (t_u | (digits << shift)) ^ INT32_MIN

        def count(i, acc):
            return acc + jnp.sum(tk.count_at_least(keys_at(i)[1], thr), axis=0)

        c = lax.fori_loop(0, steps, count, jnp.zeros((1 << db,), jnp.int32))
        return t_u | ((jnp.sum((c >= m).astype(jnp.int32)) - 1) << shift)

    big = lax.fori_loop(p0, 32 // db, radix_step, u0) ^ INT32_MIN

    def count_above(i, acc):
        return acc + jnp.sum((keys_at(i)[1] > big).astype(jnp.int32))

    ties = m - lax.fori_loop(0, steps, count_above, jnp.int32(0))
    kp = pos_ref.shape[0]
    lane = lax.broadcasted_iota(jnp.int32, (ch,), 0)

    def take(i, carry):
        seen, taken = carry
        pos, key, x = keys_at(i)
        tie = (key == big).astype(jnp.int32)
        keep = (key > big) | ((tie != 0) & (seen + jnp.cumsum(tie) - tie < ties))
        keep_i = keep.astype(jnp.int32)
        slot = jnp.where(keep, taken + jnp.cumsum(keep_i) - keep_i, kp + lane)
        plgpu.store(pos_ref.at[slot], pos, mask=keep)
        plgpu.store(val_ref.at[slot], canonical_scores(x), mask=keep)
        return seen + jnp.sum(tie), taken + jnp.sum(keep_i)

    lax.fori_loop(0, steps, take, (jnp.int32(0), jnp.int32(0)))


# ----------------------------------------------------------------------------- entry


def _params(cfg: FusedConfig, warps: int) -> dict:
    return dict(interpret=cfg.interpret,
                compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=1))


def topk_fused(scores, lengths, k: int, *, floor=None, interpret: bool | None = None,
               **tunables):
    """Exact top-k in two or three launches: scores [B, N] f32, lengths [B] int, k >= 1 ->
    (positions [B, k] int32, values [B, k] f32) as ``topk_triton`` (the set of the min(k, L)
    best eligible positions, ties to the lower position, in no particular order, then -1 /
    -inf). floor [B] f32 (optional): per-row floor hints replacing the sample (e.g. the
    previous decode step's k-th score; a hint above a row's m-th score only costs that row the
    fallback). tunables: ``fused_config``'s. Inputs are assumed validated (api.topk)."""
    cfg = fused_config(scores.shape[1], k, interpret=interpret, **tunables)
    return _topk_fused(scores, lengths, floor, cfg=cfg)


@functools.partial(jax.jit, static_argnames=("cfg",))
def _topk_fused(scores, lengths, floor=None, *, cfg: FusedConfig):
    lens = lengths.astype(jnp.int32).reshape(-1, 1)
    scores = scores.astype(jnp.float32)
    pairs, cnt = select_call(scores, lens, floor, cfg)
    pos, val = finish_call(lens, cnt, pairs, scores, cfg)
    if cfg.kp != cfg.k:  # [B, KP] -> [B, k]: the first min(k, N) slots, then -1 / -inf
        pad = ((0, 0), (0, cfg.k - cfg.kn))
        pos = jnp.pad(pos[:, :cfg.kn], pad, constant_values=-1)
        val = jnp.pad(val[:, :cfg.kn], pad, constant_values=-jnp.inf)
    return pos, val


_ONE = pl.BlockSpec((None, 1), lambda i, *_: (i, 0))


def select_call(scores, lens, floor, cfg: FusedConfig):
    """Step 1 (and the threshold launch when cfg.threshold_kernel): scores [B, N] f32, lens
    [B, 1] int32, floor [B] f32 or None -> (pairs [B, CR, 2] int32: the candidates'
    positions and their scores' bits, cnt [B, NBP, 2] int32: c_j and t per block, rows >=
    nblk unset)."""
    b = scores.shape[0]
    whole_row = pl.BlockSpec((None, cfg.np_), lambda i, *_: (i, 0))
    if floor is not None:
        t_from, t_src, t_spec = "floor", floor.astype(jnp.float32).reshape(b, 1), _ONE
    elif cfg.threshold_kernel:
        t_from, t_spec = "key", _ONE
        t_src = pl.pallas_call(
            functools.partial(_threshold_kernel, cfg=cfg), grid=(b,),
            in_specs=[_ONE, whole_row], out_specs=_ONE,
            out_shape=jax.ShapeDtypeStruct((b, 1), jnp.int32),
            name="topk_fused_threshold", **_params(cfg, cfg.threshold_warps))(lens, scores)
    else:
        t_from, t_src, t_spec = "sample", scores, whole_row
    row = pl.BlockSpec((None, cfg.cr, 2), lambda i, j: (i, 0, 0))
    return pl.pallas_call(
        functools.partial(_select_kernel, cfg=cfg, t_from=t_from),
        grid=(b, cfg.nblk),
        in_specs=[_ONE, t_spec, pl.BlockSpec((None, cfg.block), lambda i, j: (i, j))],
        out_specs=[row, pl.BlockSpec((None, None, 2), lambda i, j: (i, j, 0))],
        out_shape=[jax.ShapeDtypeStruct((b, cfg.cr, 2), jnp.int32),
                   jax.ShapeDtypeStruct((b, tk._next_pow2(cfg.nblk), 2), jnp.int32)],
        name="topk_fused_select", **_params(cfg, cfg.select_warps))(lens, t_src, scores)


def finish_call(lens, cnt, pairs, scores, cfg: FusedConfig):
    """Step 2: (positions [B, KP] int32, values [B, KP] f32) from step 1's outputs."""
    b, nbp = scores.shape[0], cnt.shape[1]
    one_row = lambda i, *_: (i, 0)  # noqa: E731
    return pl.pallas_call(
        functools.partial(_finish_kernel, cfg=cfg), grid=(b, cfg.finish_programs),
        in_specs=[_ONE, pl.BlockSpec((None, nbp, 2), lambda i, *_: (i, 0, 0)),
                  pl.BlockSpec((None, cfg.cr, 2), lambda i, *_: (i, 0, 0)),
                  pl.BlockSpec((None, cfg.np_), one_row)],
        out_specs=[pl.BlockSpec((None, cfg.kp), one_row)] * 2,
        out_shape=[jax.ShapeDtypeStruct((b, cfg.kp), jnp.int32),
                   jax.ShapeDtypeStruct((b, cfg.kp), jnp.float32)],
        name="topk_fused_finish", **_params(cfg, cfg.finish_warps))(lens, cnt, pairs, scores)


def fast_rows(scores, lengths, k: int, *, floor=None, interpret: bool | None = None,
              **tunables):
    """[B] bool: the rows step 2 finishes from the candidates (the rest take the fallback
    scan); the finish kernel's test, in XLA, for tests and benchmarks."""
    cfg = fused_config(scores.shape[1], k, interpret=interpret, **tunables)
    return _fast_rows(scores, lengths, floor, cfg=cfg)


@functools.partial(jax.jit, static_argnames=("cfg",))
def _fast_rows(scores, lengths, floor=None, *, cfg: FusedConfig):
    lens = lengths.astype(jnp.int32).reshape(-1, 1)
    cnt = select_call(scores.astype(jnp.float32), lens, floor, cfg)[1][:, :cfg.nblk, 0]
    length = jnp.clip(lens, 0, cfg.n)
    start, end = _segment(jnp.arange(cfg.nblk, dtype=jnp.int32)[None], length, cfg)
    return (jnp.sum(cnt, 1) >= jnp.minimum(length[:, 0], cfg.k)) & jnp.all(cnt <= end - start, 1)

"""Pallas-Triton ``hot_resolve`` with the LRU control in-kernel ("triton_fused").

The "triton" implementation computes the control in XLA (a [k, B] compare, an argsort of the B
stamps, scatters) and then copies rows with one program per selection slot; at batch 64 that
control is a fixed ~0.2-0.4 ms. Here the whole op is three small kernels over all S requests
(vmap folds the request axis into S), no XLA ops between them and no host round trip:

Notation: S requests, k selected positions (KP = next pow2), B hot rows (BP = next pow2),
  D_l values per row of leaf l, P rows per host page, MP logical pages, NPOS = MP * P positions
  per request, key_i = LRU key of hot row i (its stamp; INT32_MAX when hit this step),
  M = misses of a request, (key, i) the LRU order (stable: ties by row index).
  1. map, grid (S,): pos_map[s, hot_positions[i]] = i and sel_map[s, selected[j]] = j, two
     [S, NPOS] int32 scratch outputs that are never initialised: every lookup is verified
     (hot_positions[pos_map[p]] == p), so stale entries cannot fake a hit. O(k + B) instead of
     the [k, B] scan.
  2. control, grid (S,): hit_j via pos_map, row_hit_i via sel_map, key_i; M and each miss's
     rank m (prefix sum); when M > 0 the M-th smallest (key, i) by a 2-bit radix select over
     the bits of the keys' spread (``_mth_smallest``: a counting step of 4 thresholds over the
     B keys per 2 bits; 16 steps for all 32 bits before session 29), then the M victim rows
     (key < T, and the first rows with key == T) compacted in row order into vict (the m-th
     miss takes vict[m]: the contract's row-order rule, ``reference.resolve_control``; until
     session 29 a third kernel ranked the victims in LRU order by an M x M count, whose cost
     grew as M^2: M ~ 2000 for LeanSparse's key cache). Writes code_j (hit row, -2 - m for
     the m-th miss, -1 for nothing) and counts.
  3. apply, grid (S, k / KB): per block of KB selection slots: slot = hit row or vict[m];
     stamps[slot] = clock * k + j, positions[victim] = p, and every leaf's missed rows gathered
     from the pool (pinned_host read in place over PCIe, or device) as a [KB, D_l] tile and
     written into the victim rows; hot rows, positions and stamps aliased to the outputs.
Kernel boundaries order the scratch writes and reads; launches=2 ("triton_fused2") instead runs
steps 1-2 of a request in one program, ordered by a block barrier (``plgpu.debug_barrier``,
``__syncthreads``: the steps of one request never read another request's scratch), then 3.
Results equal ``reference.hot_resolve_xla`` bit for bit (same LRU rule, rows copied as bytes).
A ``packed.PackedPool`` (the leaves of a row side by side in one row of words) is one pool
array: every hot-row leaf crosses the kernels as its words, leaf l loads words [o_l, o_l + w_l)
of the missed row, and all leaves' loads of a block are issued before its stores.
e8m0 leaves (the power-of-two scales of ``kv_dtype="fp8_v4"`` rows) cross the kernels as their
bytes: Triton 3.6 rejects f8E8M0FNU tensors (``tt.load`` verifies element types), so such a leaf
and its pool are bitcast to uint8 before the launches and the hot rows back after. Every 1-byte
leaf (e4m3 values, those bytes) then crosses as uint32 words where its D allows
(``common.as_words``): Pallas-Triton indexes arrays under 4 GiB with int32 element offsets, which
wrap for a 1-byte host pool of 2-4 GiB (an illegal address on the H200 at 200K tokens x 164
requests); words keep them < 2^31. One rule, ``_kernel_view``; bitcasts move no values.
Scratch: 2 * S * NPOS int32 (64 MB at S = 64, 128K positions), never read in full.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.custom_batching import custom_vmap
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import common
from pallas_kernels.hot_resolve.packed import PackedPool, as_words, from_words

INT32_MIN = -(2**31)
INT32_MAX = 2**31 - 1
RADIX_BITS = 2  # thresholds per counting step = 4: a [BP, 4] compare stays in registers
KERNEL_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float8_e4m3fn, jnp.uint8)
BYTE_DTYPES = (jnp.float8_e8m0fnu,)  # leaves that cross the kernels as uint8 (see above)


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _iota(n):
    return lax.broadcasted_iota(jnp.int32, (n,), 0)


def _slot(ok, idx, limit):
    """Scatter index: idx where ok, else a distinct index past the array (limit + lane):
    masked off on the GPU, dropped in interpret mode, and no two lanes share a slot (interpret
    mode's masked scatter would let a masked lane overwrite a real store)."""
    return jnp.where(ok, idx, limit + _iota(idx.shape[0]))


# ----------------------------------------------------------------------------- kernels


def _map(s, sel_ref, hp_ref, pos_map_ref, sel_map_ref, *, k, b, npos):
    # inputs  sel_ref [S, k], hp_ref [S, B] int32 (ANY)
    # outputs pos_map_ref, sel_map_ref [S, NPOS] int32 scratch (ANY; only scattered entries)
    i = _iota(_pow2(b))
    hp = plgpu.load(hp_ref.at[s, jnp.minimum(i, b - 1)], mask=i < b, other=-1)
    ok = (i < b) & (hp >= 0) & (hp < npos)
    plgpu.store(pos_map_ref.at[s, _slot(ok, hp, npos)], i, mask=ok)
    j = _iota(_pow2(k))
    sel = plgpu.load(sel_ref.at[s, jnp.minimum(j, k - 1)], mask=j < k, other=-1)
    ok = (j < k) & (sel >= 0) & (sel < npos)
    plgpu.store(sel_map_ref.at[s, _slot(ok, sel, npos)], j, mask=ok)


def _mth_smallest(key, m):
    """T = the m-th smallest of ``key`` [BP] int32 (1 <= m <= #{key < INT32_MAX}).

    Keys as offsets u = key - lo (lo = min key; unsigned, wrapping: exact for every key >= lo)
    and T's offset built RADIX_BITS bits at a time from the top, keeping #{u < t_u} < m; only
    the bits of the spread hi - lo of the keys below INT32_MAX take steps (LRU stamps of recent
    steps: ~16-20 bits, not 32). Keys of INT32_MAX (hit rows, padding) may fall inside the
    range only above T's offset, where a threshold's count is >= m either way.
    Unsigned compares: u < v <=> (u ^ MIN) < (v ^ MIN) signed.
    """
    lo = jnp.min(key)
    hi = jnp.max(jnp.where(key == INT32_MAX, lo, key))
    u = (key - lo) ^ INT32_MIN
    pw = _iota(32 // RADIX_BITS) * RADIX_BITS
    steps = jnp.sum((((hi - lo) ^ INT32_MIN) >= ((1 << pw) ^ INT32_MIN)).astype(jnp.int32))
    digits = _iota(1 << RADIX_BITS)

    def step(p, t_u):
        shift = RADIX_BITS * (steps - 1 - p)
        thr = (t_u | (digits << shift)) ^ INT32_MIN
        below = jnp.sum((u[:, None] < thr[None, :]).astype(jnp.int32), axis=0)
        digit = jnp.sum((below < m).astype(jnp.int32)) - 1
        return t_u | (digit << shift)

    return lax.fori_loop(0, steps, step, jnp.int32(0)) + lo


def _control(s, sel_ref, hp_ref, st_ref, pos_map_ref, sel_map_ref,
             code_ref, vict_ref, cnt_ref, *, k, b, npos):
    # inputs  sel_ref [S, k], hp_ref / st_ref [S, B], pos_map_ref / sel_map_ref [S, NPOS]
    # outputs code_ref [S, k] (hit row | -2 - miss rank | -1), vict_ref [S, KP] (victim
    #         rows in row order, first M valid), cnt_ref [S, 2] (hits, M)
    j = _iota(_pow2(k))
    sel = plgpu.load(sel_ref.at[s, jnp.minimum(j, k - 1)], mask=j < k, other=-1)
    want = (j < k) & (sel >= 0)
    cand = plgpu.load(pos_map_ref.at[s, jnp.clip(sel, 0, npos - 1)], mask=want, other=-1)
    cand_ok = want & (cand >= 0) & (cand < b)
    candc = jnp.clip(cand, 0, b - 1)
    held = plgpu.load(hp_ref.at[s, candc], mask=cand_ok, other=-1)
    hit = cand_ok & (held == sel)
    miss = want & jnp.logical_not(hit)
    miss_i = miss.astype(jnp.int32)
    m_total = jnp.sum(miss_i)
    rank = jnp.cumsum(miss_i) - miss_i
    code = jnp.where(hit, candc, jnp.where(miss, -2 - rank, -1))
    plgpu.store(code_ref.at[s, j], code, mask=j < k)
    two = _iota(2)
    cnt_ref[s, :] = jnp.where(two == 0, jnp.sum(hit.astype(jnp.int32)), m_total)

    @pl.when(m_total > 0)
    def _victims():
        i = _iota(_pow2(b))
        hp = plgpu.load(hp_ref.at[s, jnp.minimum(i, b - 1)], mask=i < b, other=-1)
        st = plgpu.load(st_ref.at[s, jnp.minimum(i, b - 1)], mask=i < b, other=0)
        has = (i < b) & (hp >= 0)
        c = plgpu.load(sel_map_ref.at[s, jnp.clip(hp, 0, npos - 1)], mask=has, other=-1)
        c_ok = has & (c >= 0) & (c < k)
        back = plgpu.load(sel_ref.at[s, jnp.clip(c, 0, k - 1)], mask=c_ok, other=-1)
        row_hit = c_ok & (back == hp)
        key = jnp.where(row_hit | (i >= b), INT32_MAX, st)
        t = _mth_smallest(key, m_total)
        need = m_total - jnp.sum((key < t).astype(jnp.int32))
        tie = (key == t).astype(jnp.int32)
        tie_rank = jnp.cumsum(tie) - tie
        victim = (key < t) | ((tie != 0) & (tie_rank < need))
        v_i = victim.astype(jnp.int32)
        at = _slot(victim, jnp.cumsum(v_i) - v_i, vict_ref.shape[1])
        plgpu.store(vict_ref.at[s, at], i, mask=victim)


def _map_kernel(*refs, **kw):
    _map(pl.program_id(0), *refs, **kw)


def _control_kernel(*refs, **kw):
    _control(pl.program_id(0), *refs, **kw)


def _barrier(interpret: bool):
    """A block barrier (``__syncthreads``: this program's global writes before it are seen by
    its reads after it). Interpret mode runs a program's statements in order: nothing to do."""
    if not interpret:
        plgpu.debug_barrier()


def _front_kernel(sel_ref, hp_ref, st_ref, code_ref, vict_ref, cnt_ref, pos_map_ref,
                  sel_map_ref, *, k, b, npos, interpret):
    """map and control of one request in one program (launches=2): the map's scratch writes
    are ordered before the control's reads by a block barrier instead of a kernel
    boundary."""
    s = pl.program_id(0)
    _map(s, sel_ref, hp_ref, pos_map_ref, sel_map_ref, k=k, b=b, npos=npos)
    _barrier(interpret)
    _control(s, sel_ref, hp_ref, st_ref, pos_map_ref, sel_map_ref, code_ref, vict_ref,
             cnt_ref, k=k, b=b, npos=npos)


def _apply_kernel(*refs, k, kb, page, pools, dims, sources):
    # inputs  sel_ref / code_ref [S, k], vict_ref [S, KP], clock_ref [S], table_ref [S, MP],
    #         hp_in / st_in [S, B] and rows_in (L leaves [S, B, D_l]) aliased (not read),
    #         pools (Q arrays [N_q, W_q], device or pinned_host: one a leaf, or Q = 1 packed
    #         pool whose words [o_l, o_l + D_l) are leaf l's)
    # outputs slots_ref [S, k], hp_ref / st_ref [S, B], rows (L leaves [S, B, D_l])
    # sources: (q, o_l) of every leaf
    n_leaves, n_pools = len(dims), len(pools)
    sel_ref, code_ref, vict_ref, clock_ref, table_ref = refs[:5]
    pool_refs = refs[7 + n_leaves:7 + n_leaves + n_pools]
    slots_ref, hp_ref, st_ref = refs[7 + n_leaves + n_pools:10 + n_leaves + n_pools]
    row_refs = refs[10 + n_leaves + n_pools:]
    s, blk = pl.program_id(0), pl.program_id(1)
    j = blk * kb + _iota(kb)
    ok = j < k
    jc = jnp.minimum(j, k - 1)
    sel = plgpu.load(sel_ref.at[s, jc], mask=ok, other=-1)
    code = plgpu.load(code_ref.at[s, jc], mask=ok, other=-1)
    hit, miss = code >= 0, code <= -2
    victim = plgpu.load(vict_ref.at[s, jnp.where(miss, -2 - code, 0)], mask=miss, other=0)
    slot = jnp.where(hit, code, jnp.where(miss, victim, -1))
    plgpu.store(slots_ref.at[s, j], slot, mask=ok)
    used = slot >= 0
    b = st_ref.shape[1]
    plgpu.store(st_ref.at[s, _slot(used, slot, b)], clock_ref[s] * k + j, mask=used)
    vic = _slot(miss, victim, b)
    plgpu.store(hp_ref.at[s, vic], sel, mask=miss)
    psel = jnp.where(miss, sel, 0)
    page_of = jnp.minimum(psel // page, table_ref.shape[1] - 1)
    src = plgpu.load(table_ref.at[s, page_of], mask=miss, other=0) * page + psel % page

    def tile(d):  # a leaf's pow2 columns and the [KB, D] mask of missed rows
        col = _iota(_pow2(d))
        return col, miss[:, None] & (col[None, :] < d)

    def load(q, off, d):
        col, m2 = tile(d)
        src2 = jnp.clip(src, 0, pools[q] - 1)[:, None]
        return plgpu.load(pool_refs[q].at[src2, off + jnp.minimum(col, d - 1)[None, :]],
                          mask=m2)

    def store(row_ref, d, vals):
        col, m2 = tile(d)
        plgpu.store(row_ref.at[s, vic[:, None], col[None, :]], vals, mask=m2)

    if n_pools == 1 < n_leaves:  # one packed row: every leaf's load in flight before a store
        vals = [load(q, off, d) for (q, off), d in zip(sources, dims)]
        for row_ref, d, v in zip(row_refs, dims, vals):
            store(row_ref, d, v)
    else:
        for (q, off), row_ref, d in zip(sources, row_refs, dims):
            store(row_ref, d, load(q, off, d))


# ----------------------------------------------------------------------------- XLA glue


def _call(sel, rows, hp, st, clock, table, pools, *, page, interpret, num_warps, launches,
          sources=None):
    """The launches on S requests (3: map, control, apply; 2: front, apply).
    sel [S, k]; rows, pools: tuples of leaves."""
    s_n, k = sel.shape
    b = hp.shape[1]
    npos = table.shape[1] * page
    kp = _pow2(k)
    any_ = pl.BlockSpec(memory_space=pl.ANY)
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
    params = lambda w: plgpu.CompilerParams(num_warps=w)  # noqa: E731
    control_warps = max(num_warps, 8 if b >= 2048 else 4)
    if launches == 2:
        code, vict, counts, _, _ = pl.pallas_call(
            functools.partial(_front_kernel, k=k, b=b, npos=npos, interpret=interpret),
            grid=(s_n,), in_specs=[any_] * 3, out_specs=[any_] * 5,
            out_shape=[i32(s_n, k), i32(s_n, kp), i32(s_n, 2), i32(s_n, npos), i32(s_n, npos)],
            compiler_params=params(control_warps), interpret=interpret,
            name="hot_resolve_front")(sel, hp, st)
    else:
        pos_map, sel_map = pl.pallas_call(
            functools.partial(_map_kernel, k=k, b=b, npos=npos), grid=(s_n,),
            in_specs=[any_] * 2, out_specs=[any_] * 2, out_shape=[i32(s_n, npos)] * 2,
            compiler_params=params(num_warps), interpret=interpret,
            name="hot_resolve_map")(sel, hp)
        code, vict, counts = pl.pallas_call(
            functools.partial(_control_kernel, k=k, b=b, npos=npos), grid=(s_n,),
            in_specs=[any_] * 5, out_specs=[any_] * 3,
            out_shape=[i32(s_n, k), i32(s_n, kp), i32(s_n, 2)],
            compiler_params=params(control_warps), interpret=interpret,
            name="hot_resolve_control")(sel, hp, st, pos_map, sel_map)
    dims = tuple(r.shape[2] for r in rows)
    widest = max(_pow2(d) * jnp.dtype(r.dtype).itemsize for d, r in zip(dims, rows))
    kb = max(1, min(_pow2(k), 32768 // widest, 64))  # a [KB, D] tile of <= 32 KB per leaf
    n, q = len(rows), len(pools)
    if sources is None:  # one pool a leaf
        sources = tuple((i, 0) for i in range(n))
    outs = pl.pallas_call(
        functools.partial(_apply_kernel, k=k, kb=kb, page=page,
                          pools=tuple(p.shape[0] for p in pools), dims=dims, sources=sources),
        grid=(s_n, -(-k // kb)), in_specs=[any_] * (7 + n + q), out_specs=[any_] * (3 + n),
        out_shape=[i32(s_n, k), i32(s_n, b), i32(s_n, b)]
        + [jax.ShapeDtypeStruct(r.shape, r.dtype) for r in rows],
        input_output_aliases={5: 1, 6: 2, **{7 + i: 3 + i for i in range(n)}},
        compiler_params=params(num_warps), interpret=interpret,
        name="hot_resolve_apply")(sel, code, vict, clock, table, hp, st, *rows, *pools)
    slots, hp, st = outs[:3]
    return slots, tuple(outs[3:]), hp, st, clock + 1, counts


def _flat(x, lead):
    return x.reshape((-1,) + x.shape[lead:])


@functools.lru_cache(maxsize=None)
def _batched_op(treedef, page, interpret, num_warps, launches, sources=None):
    """custom_vmap'd op on S requests (leading axis); a vmap over it folds into S."""

    @custom_vmap
    def op(sel, rows, hp, st, clock, table, pools):
        out = _call(sel, tuple(rows), hp, st, clock, table, tuple(pools), page=page,
                    interpret=interpret, num_warps=num_warps, launches=launches,
                    sources=sources)
        return out

    @op.def_vmap
    def _rule(axis_size, in_batched, sel, rows, hp, st, clock, table, pools):
        if any(jax.tree.leaves(in_batched[6])):
            raise ValueError("hot_resolve: pool is shared by every request; do not vmap it "
                             "(in_axes=None)")
        front = lambda x, bt: x if bt else jnp.broadcast_to(x, (axis_size,) + x.shape)  # noqa: E731
        sel, hp, st, clock, table = (front(x, bt) for x, bt in zip(
            (sel, hp, st, clock, table), (in_batched[0],) + tuple(in_batched[2:6])))
        rows = tuple(front(r, bt) for r, bt in zip(rows, in_batched[1]))
        s_in = sel.shape[1]
        out = op(_flat(sel, 2), tuple(_flat(r, 2) for r in rows), _flat(hp, 2), _flat(st, 2),
                 clock.reshape(-1), _flat(table, 2), pools)
        unflat = lambda x: x.reshape((axis_size, s_in) + x.shape[1:])  # noqa: E731
        out = jax.tree.map(unflat, out)
        return out, jax.tree.map(lambda _: True, out)

    return op


def _kernel_view(x):
    """A leaf as the kernels see it: an e8m0 leaf as its uint8 bytes, then any 1-byte leaf as
    words (``common.as_words``: offsets of a 2-4 GiB host pool stay in int32); others as is."""
    if x.dtype in BYTE_DTYPES:
        x = lax.bitcast_convert_type(x, jnp.uint8)
    return common.as_words(x)


def _from_kernel_view(x, like):
    """Inverse of ``_kernel_view`` for a leaf shaped and typed as ``like``."""
    x = common.from_words(x, jax.ShapeDtypeStruct(like.shape, jnp.uint8)
                          if like.dtype in BYTE_DTYPES else like)
    return x if x.dtype == like.dtype else lax.bitcast_convert_type(x, like.dtype)


def hot_resolve_fused(selected, hot_rows, hot_positions, hot_stamps, clock, page_table, pool, *,
                      page_size: int, interpret: bool, num_warps: int = 4,
                      launches: int = 3):
    """``hot_resolve`` of one request by the three kernels above (arguments checked by
    ``api.hot_resolve``); under ``jax.vmap`` over requests (pool shared) one launch sequence
    serves all of them. launches=2 runs map and control as one program a request
    (``_front_kernel``), then apply. Leaves: f32, bf16, float8_e4m3fn, or float8_e8m0fnu
    (moved as uint8 bytes), any D >= 1.

    Returns (slots [k], hot_rows, hot_positions, hot_stamps, clock + 1, counts [2]).
    """
    rows, treedef = jax.tree.flatten(hot_rows)
    like = [jax.ShapeDtypeStruct(r.shape, r.dtype) for r in rows]
    for r in rows:
        if r.dtype not in KERNEL_DTYPES + BYTE_DTYPES:
            raise ValueError(f"hot_resolve: implementation='triton_fused' moves float32, "
                             f"bfloat16, float8_e4m3fn and float8_e8m0fnu rows, got {r.dtype} "
                             "(use 'xla')")
    if launches not in (2, 3):
        raise ValueError(f"hot_resolve: launches={launches} must be 3 (map, control, apply) "
                         "or 2 (front, apply)")
    if isinstance(pool, PackedPool):  # every leaf as its words, read from one packed row
        rows, pools, sources = [as_words(r) for r in rows], [pool.words], tuple(
            (0, off) for off, _ in pool.offsets)
        back = lambda r, lk: from_words(r, lk.dtype, lk.shape[-1])  # noqa: E731
    else:
        rows, sources = [_kernel_view(r) for r in rows], None
        pools = [_kernel_view(p) for p in jax.tree.leaves(pool)]
        back = _from_kernel_view
    op = _batched_op(treedef, page_size, interpret, num_warps, launches, sources)
    one = lambda x: x[None]  # noqa: E731
    slots, rows, hp, st, clk, counts = op(
        one(selected), tuple(one(r) for r in rows), one(hot_positions), one(hot_stamps),
        one(clock), one(page_table), tuple(pools))
    rows = [back(r[0], lk) for r, lk in zip(rows, like)]
    return (slots[0], jax.tree.unflatten(treedef, rows), hp[0], st[0], clk[0], counts[0])

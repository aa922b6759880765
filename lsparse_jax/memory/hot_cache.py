"""The per-request, per-layer GPU hot cache (HiSparse) and its resolver.

The resolver finds each selected compressed row, in order: (1) the tail of rows not yet paged
and, for the adaptive method, the ready map of optional (lent) device pages, (2) the hot cache,
by a scan bounded by its B rows, (3) a copy from the host pool into the least-recently-used
rows not hit this step. Steps (2) and (3) are the ``hot_resolve`` op
(``pallas_kernels.hot_resolve``: XLA reference, or a Pallas-Triton kernel that reads the
pinned_host pool in place and writes each missed row straight into its victim row).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from lsparse_jax.kernels import for_op
from lsparse_jax.memory.host_pool import read_host_rows
from lsparse_jax.model.store import NUM_SOURCES  # noqa: F401  (0 tail/lent map, 1 hit, 2 host)
from pallas_kernels.hot_resolve import hot_resolve


@struct.dataclass
class HotCache:
    rows: Any  # [B, ...] array (or pytree of them) of cached rows; NaN where empty
    positions: jnp.ndarray  # [B] int32 compressed position held by each row, -1 = empty
    stamps: jnp.ndarray  # [B] int32 last use: clock * k + rank in that step's selection
    #   (k = min(selection length, B), see ``resolve``), -1 empty
    clock: jnp.ndarray  # [] int32 decode steps this cache has served

    @classmethod
    def empty(cls, rows: int, dim: int, dtype=jnp.float32) -> HotCache:
        return cls.empty_like(jnp.zeros((dim,), dtype), rows)

    @classmethod
    def empty_like(cls, row, rows: int) -> HotCache:
        """B NaN rows shaped like ``row`` (an array or pytree of per-row arrays)."""
        return cls(rows=jax.tree.map(lambda r: jnp.full((rows,) + r.shape, jnp.nan, r.dtype), row),
                   positions=jnp.full((rows,), -1, jnp.int32),
                   stamps=jnp.full((rows,), -1, jnp.int32), clock=jnp.zeros((), jnp.int32))


@struct.dataclass
class Plan:
    """How ``resolve`` made one selection readable: its location vector (where each selected
    row sits) and the host rows it copied. A layer that shares the selection but keeps its
    own rows of the same positions in the same layout (a DSA share group's member: same
    tail, same lent pages, a hot cache of the same B rows that saw the same selections) reads
    its rows with ``follow`` instead of resolving again.

    Notation: k selected positions, B hot rows, P rows per page.
    """

    selected: jnp.ndarray  # [k] int32 the positions (-1 none)
    paged_rows: jnp.ndarray  # [] int32 rows already in host pages (the tail holds them ..)
    in_tail: jnp.ndarray  # [k] bool read from the tail
    opt: jnp.ndarray  # [k] int32 lent optional page holding the row (adaptive), -1 none
    row_of: jnp.ndarray  # [k] int32 hot row holding the row otherwise, -1 none
    fetch: jnp.ndarray  # [B] int32 host-pool row copied into each hot row this step, -1 none


def _pick(plan: Plan, tail, rows, optional=None):
    """The selected rows [k, ...] in order, read where ``plan`` says (NaN where selected < 0);
    tail, hot rows and optional pages may be pytrees (every leaf alike)."""
    page = jax.tree.leaves(tail)[0].shape[0]
    b = jax.tree.leaves(rows)[0].shape[0]
    sel, valid, in_opt = plan.selected, plan.selected >= 0, plan.opt >= 0

    def pick(t, r, o=None):
        mask = lambda m: m.reshape(m.shape + (1,) * (t.ndim - 1))  # noqa: E731
        got = jnp.where(mask(plan.in_tail), t[jnp.clip(sel - plan.paged_rows, 0, page - 1)],
                        r[jnp.clip(plan.row_of, 0, b - 1)])
        if o is not None:
            at = jnp.clip(plan.opt * page + sel % page, 0, o.shape[0] - 1)
            got = jnp.where(mask(in_opt), o[at], got)
        return jnp.where(mask(valid), got, jnp.nan)

    return (jax.tree.map(pick, tail, rows) if optional is None
            else jax.tree.map(pick, tail, rows, optional))


def resolve(hot: HotCache, selected, tail, paged, page_table, pool,
            implementation: str | None = "xla", optional=None, ready=None):
    """``resolve_plan`` without the plan: (rows, new hot cache, counts)."""
    return resolve_plan(hot, selected, tail, paged, page_table, pool, implementation,
                        optional, ready)[:3]


def resolve_in_place(hot: HotCache, selected, tail, paged, page_table, pool,
                     implementation: str | None = "xla"):
    """``resolve_plan``'s cache update without the gathered rows, for a consumer that reads
    them in place: (new hot cache, counts, row_of [k] int32 the hot row of each selected
    position, -1 where it is -1 or in the tail, whose row is tail[selected - paged])."""
    hot, counts, plan = _update(hot, selected, tail, paged, page_table, pool, implementation)
    return hot, counts, plan.row_of


def resolve_plan(hot: HotCache, selected, tail, paged, page_table, pool,
                 implementation: str | None = "xla", optional=None, ready=None):
    """Makes every selected row readable on the device and returns the rows in order.

    Notation: k selected positions (best first, -1 padded); B hot rows; P rows per page.
      selected [k] int32; tail [P, D] rows of positions paged .. paged+P-1 (not yet on host);
      page_table [max_pages] int32 physical host page of each logical page; pool [NP * P, D]
      (row r of physical page p at p * P + r); implementation: the engine's
      (``lsparse_jax.kernels``: what the ``hot_resolve`` op runs). Rows may be pytrees (e.g.
      FP8 keys and their scales): tail, pool and hot.rows alike. Adaptive only: optional
      [NO * P, D] device pages lent to imported history, ready [max_pages] int32 the optional
      page holding each logical page (-1 = not resident).
    Steps:
      1. tail hits: selected >= paged; optional hits: ready[selected // P] >= 0 (read in
         place, the hot cache is not touched).
      2. the other positions go through ``pallas_kernels.hot_resolve``: hot hits by a [k, B]
         compare with hot.positions; misses take the LRU rows among those not hit this step
         (empty rows first), the m-th miss the m-th victim in row order, and their rows are
         copied from the host pool; every touched row gets stamp clock * k + rank, so the LRU
         order is the order of use.
      3. when k > B (leansparse: C candidates plus the P tail rows), the non-tail positions
         are first compacted, in order, into B entries (callers keep at most B of them); the
         stamps are then clock * B + rank among them, which keeps the same LRU order.
    Returns (rows [k, D] with NaN where selected is -1, new hot cache, counts [3] int32 of
    rows resolved from tail, hot cache and host, the ``Plan``).
    """
    hot, counts, plan = _update(hot, selected, tail, paged, page_table, pool, implementation,
                                ready)
    return _pick(plan, tail, hot.rows, optional), hot, counts, plan


def _update(hot: HotCache, selected, tail, paged, page_table, pool, implementation,
            ready=None):
    """Steps 1-3 of ``resolve_plan``: (new hot cache, counts, ``Plan``), no rows gathered."""
    k, b = selected.shape[0], hot.positions.shape[0]
    page = jax.tree.leaves(tail)[0].shape[0]
    valid = selected >= 0
    in_tail = valid & (selected >= paged)
    opt = jnp.full((k,), -1, jnp.int32)
    if ready is not None:
        lp = jnp.clip(selected // page, 0, ready.shape[0] - 1)
        opt = jnp.where(valid & ~in_tail, ready[lp], -1)
    in_opt = opt >= 0
    want = valid & ~in_tail & ~in_opt
    request = jnp.where(want, selected, -1)
    if k <= b:
        order = None
    else:  # keep the first B non-tail positions, in selection order
        order = jnp.argsort(~want, stable=True)[:b]
        request = request[order]
    row_of, rows, positions, stamps, clock, hot_counts = hot_resolve(
        request, hot.rows, hot.positions, hot.stamps, hot.clock, page_table, pool,
        page_size=page, implementation=for_op("hot_resolve", implementation))
    if order is not None:
        row_of = jnp.full((k,), -1, jnp.int32).at[order].set(row_of)
    # a victim row took a position the cache did not hold: its row came from the host
    refilled = (positions >= 0) & (positions != hot.positions)
    held = jnp.maximum(positions, 0)
    fetch = jnp.where(refilled, page_table[jnp.clip(held // page, 0, page_table.shape[0] - 1)]
                      * page + held % page, -1)
    plan = Plan(selected, jnp.asarray(paged, jnp.int32), in_tail, opt, row_of,
                fetch.astype(jnp.int32))
    hot = HotCache(rows=rows, positions=positions, stamps=stamps, clock=clock)
    first = jnp.sum(in_tail | in_opt, keepdims=True).astype(jnp.int32)
    return hot, jnp.concatenate([first, hot_counts]), plan


def follow(plan: Plan, rows, tail, pool, implementation: str | None = "xla", optional=None):
    """Another layer's rows at the positions ``plan`` resolved: its hot rows ``rows`` [B, ...]
    get the plan's host rows from its own ``pool`` (each fetched once: ``plan.fetch``), then
    its rows are read where the plan says (its tail, its lent pages, its hot rows).

    Exact for a layer whose hot cache saw the same selections as the plan's (same positions
    in the same rows): its own ``resolve_plan`` would find the same hits and victims.
    Returns (selected rows [k, ...], new hot rows, counts [3] int32 as ``resolve_plan``'s).
    """
    fetched = jax.tree.map(
        lambda p: read_host_rows(p, plan.fetch, for_op("gather_rows", implementation)), pool)
    put = plan.fetch >= 0
    rows = jax.tree.map(lambda r, f: jnp.where(put.reshape((-1,) + (1,) * (r.ndim - 1)), f, r),
                        rows, fetched)
    valid = plan.selected >= 0
    first = jnp.sum(plan.in_tail | (plan.opt >= 0))
    host = jnp.sum(put)
    counts = jnp.stack([first, jnp.sum(valid) - first - host, host]).astype(jnp.int32)
    return _pick(plan, tail, rows, optional), rows, counts

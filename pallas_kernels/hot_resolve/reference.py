"""XLA reference of ``hot_resolve``: plain-jnp control, then one host-row copy per miss.

Notation: k selected positions (best first, -1 = nothing), B hot rows, D values per row,
P rows per host page, N = NP * P rows of the flat host pool, S requests under ``jax.vmap``.

The control (hits, victims, stamps) is small int arrays and is shared by every implementation
(``resolve_control``). The data movement here is the XLA path: a ``fori_loop`` over the misses
that slices one pool row (``dynamic_slice`` of the host array), ``device_put``s it to device
memory and writes it into its victim row (``dynamic_update_slice``) -- XLA rejects a gather from
a pinned_host array inside jit, so rows move one at a time (~7 us a row on an H200).

Batching: ``vmappable`` wraps a per-leaf mover in ``custom_vmap`` so that under ``jax.vmap``
over requests the S hot-row buffers are flattened into one [S * B, D] buffer and every
request's misses go through a single mover call (one loop / one kernel launch); the host pool is
shared by all requests and must not be batched.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.custom_batching import custom_vmap

from pallas_kernels.common import as_bytes, from_bytes

DEVICE = jax.memory.Space.Device
INT32_MAX = jnp.iinfo(jnp.int32).max


class Control(NamedTuple):
    slots: jnp.ndarray  # [k] int32 hot row of each selected position, -1 where selected < 0
    src: jnp.ndarray  # [k] int32 pool row to copy for each miss, -1 elsewhere
    dst: jnp.ndarray  # [k] int32 victim hot row of each miss, -1 elsewhere
    positions: jnp.ndarray  # [B] int32 new hot_positions
    stamps: jnp.ndarray  # [B] int32 new hot_stamps
    counts: jnp.ndarray  # [2] int32 (hits, misses)


def resolve_control(selected, hot_positions, hot_stamps, clock, page_table, *,
                    page_size: int) -> Control:
    """Hits, LRU victims and the new LRU state of one request (plain jnp; vmappable).

    Notation: k = len(selected) <= B = len(hot_positions); P = page_size; j a rank in the
      selection, i a hot row.
    Steps:
      1. hits by a bounded [k, B] scan: match[j, i] = selected[j] >= 0 and
         hot_positions[i] == selected[j]; hit[j] = any_i match[j, i].
      2. misses: selected[j] >= 0 and not hit[j].
      3. victims: the M least recently used rows among those not hit this step (M misses;
         LRU order by key (stamp, i) ascending, so empty rows (stamp -1) come first and ties
         go to the lowest row); the m-th miss (in selection order) takes the m-th victim in
         row order. k <= B guarantees enough victims. Which victim gets which miss does not
         change what the cache holds or its future LRU choices (every touched row's stamp is
         clock * k + j, whichever row it is), only where the rows sit; row order needs no
         ordering of the victims among themselves (``fused.py``: no M x M rank count).
      4. a miss at position p copies pool row page_table[p // P] * P + p % P.
      5. every touched row (hit or victim) gets stamp clock * k + j; victims get position p.
    Positions in ``selected`` must be distinct (two copies of one position would both miss and
    take two victims).
    """
    k, b = selected.shape[0], hot_positions.shape[0]
    want = selected >= 0
    match = (hot_positions[None, :] == selected[:, None]) & want[:, None]  # [k, B]
    hit = jnp.any(match, axis=1)
    hit_row = jnp.argmax(match, axis=1).astype(jnp.int32)
    miss = want & ~hit
    lru_key = jnp.where(jnp.any(match, axis=0), INT32_MAX, hot_stamps)
    lru = jnp.argsort(lru_key, stable=True)
    rows = jnp.arange(b, dtype=jnp.int32)
    is_victim = jnp.zeros((b,), jnp.int32).at[lru].set(rows) < jnp.sum(miss)  # LRU rank < M
    at = jnp.where(is_victim, jnp.cumsum(is_victim) - 1, b)
    victims = jnp.zeros((b,), jnp.int32).at[at].set(rows, mode="drop")  # row order, first M
    victim = victims[jnp.clip(jnp.cumsum(miss) - 1, 0, b - 1)]
    slots = jnp.where(hit, hit_row, jnp.where(miss, victim, -1))
    page = jnp.where(miss, selected // page_size, 0)
    src = jnp.where(miss, page_table[page] * page_size + selected % page_size, -1)
    dst = jnp.where(miss, victim, -1)
    positions = hot_positions.at[jnp.where(miss, victim, b)].set(selected, mode="drop")
    rank = clock * k + jnp.arange(k, dtype=jnp.int32)
    stamps = hot_stamps.at[jnp.where(slots >= 0, slots, b)].set(rank, mode="drop")
    counts = jnp.stack([jnp.sum(hit), jnp.sum(miss)]).astype(jnp.int32)
    return Control(slots, src.astype(jnp.int32), dst, positions, stamps, counts)


def move_rows_xla(hot_rows, pool, src, dst):
    """hot_rows[dst[j]] = pool[src[j]] for every src[j] >= 0 (one row transfer each).

    hot_rows [B, D] device; pool [N, D] device or pinned_host; src, dst [n] int32.
    """
    d = hot_rows.shape[1]
    valid = src >= 0
    order = jnp.argsort(~valid, stable=True)  # copies first

    def body(i, rows):
        j = order[i]
        row = jax.lax.dynamic_slice(pool, (src[j], 0), (1, d))  # [1, D] where the pool lives
        row = as_bytes(jax.device_put(row, DEVICE))  # FP8 on CPU: moved as bytes
        return jax.lax.dynamic_update_slice(rows, row, (dst[j], 0))

    moved = jax.lax.fori_loop(0, jnp.sum(valid), body, as_bytes(hot_rows))
    return from_bytes(moved, hot_rows.dtype)


def vmappable(move):
    """``move(hot_rows [B, D], pool [N, D], src [n], dst [n]) -> hot_rows`` under custom_vmap:
    a vmap over requests becomes one call on [S * B, D] rows with dst offset by s * B."""

    @custom_vmap
    def moved(hot_rows, pool, src, dst):
        return move(hot_rows, pool, src, dst)

    @moved.def_vmap
    def _batched(axis_size, in_batched, hot_rows, pool, src, dst):
        rows_b, pool_b, src_b, dst_b = in_batched
        if pool_b:
            raise ValueError("hot_resolve: pool is shared by every request; do not vmap it "
                             "(in_axes=None)")
        front = lambda x, b: x if b else jnp.broadcast_to(x, (axis_size,) + x.shape)  # noqa: E731
        hot_rows, src, dst = front(hot_rows, rows_b), front(src, src_b), front(dst, dst_b)
        b = hot_rows.shape[1]
        offset = (jnp.arange(axis_size, dtype=jnp.int32) * b)[:, None]
        dst = jnp.where(dst >= 0, dst + offset, -1)
        flat = moved(hot_rows.reshape((-1,) + hot_rows.shape[2:]), pool, src.reshape(-1),
                     dst.reshape(-1))
        return flat.reshape(hot_rows.shape), True

    return moved


_MOVE_XLA = vmappable(move_rows_xla)


def apply_control(control: Control, clock, hot_rows, pool, movers):
    """The op's outputs given the control and one mover per leaf (``movers(leaf_dim)``)."""
    rows = jax.tree.map(lambda r, p: movers(r.shape[1])(r, p, control.src, control.dst),
                        hot_rows, pool)
    return control.slots, rows, control.positions, control.stamps, clock + 1, control.counts


@functools.partial(jax.jit, static_argnames=("page_size",))
def hot_resolve_xla(selected, hot_rows, hot_positions, hot_stamps, clock, page_table, pool, *,
                    page_size: int):
    """XLA ``hot_resolve`` of one request (arguments checked by ``api.hot_resolve``).

    Returns (slots [k], hot_rows, hot_positions, hot_stamps, clock + 1, counts [2]).
    """
    control = resolve_control(selected, hot_positions, hot_stamps, clock, page_table,
                              page_size=page_size)
    return apply_control(control, clock, hot_rows, pool, lambda d: _MOVE_XLA)

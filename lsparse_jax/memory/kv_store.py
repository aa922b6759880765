"""Where a CSA layer's compressed KV lives: fully on the device, or paged to the host behind a
hot cache. The model writes and reads rows through these two functions, whatever the store."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from lsparse_jax.memory.hot_cache import NUM_SOURCES, HotCache, resolve


@struct.dataclass
class ResidentKV:
    entries: jnp.ndarray  # [N, D] f32 every compressed row of the slot; NaN past its length


@struct.dataclass
class PagedKV:
    tail: jnp.ndarray  # [P, D] f32 rows of the page being filled (not yet on the host)
    hot: HotCache  # B rows copied from the host pool


@struct.dataclass
class HostView:
    """What one slot's layer sees of the host tier (the pool is shared by all slots)."""

    pool: jax.Array  # [NP * P, D] pinned_host pages of this layer (page p: rows p*P ..)
    page_table: jnp.ndarray  # [max_pages] int32 physical page of each logical page, -1 none
    key_pool: tuple[jax.Array, jax.Array] | None = None  # ([NP*P, D_I] e4m3, [NP*P, nb] f32)
    codebooks: jnp.ndarray | None = None  # [M, K, D_I / M] PQ codebooks (leansparse)
    optional: jax.Array | None = None  # [NO * P, D] device pages lent to imported history
    ready: jnp.ndarray | None = None  # [max_pages] int32 optional page of each logical page


def paged_rows(kv, completed) -> jnp.ndarray:
    """Rows already written back to the host, given ``completed`` rows before this chunk.

    Every completed page is written back at the end of the step that completes it, so the
    tail holds rows paged .. completed-1 (and the rows this chunk adds).
    """
    if isinstance(kv, ResidentKV):
        return jnp.zeros((), jnp.int32)
    page = kv.tail.shape[0]
    return (completed // page) * page


def write(kv, ids, rows, ok, paged):
    """Stores new rows ids[j] (where ok[j])."""
    if isinstance(kv, ResidentKV):
        return kv.replace(entries=write_rows(kv.entries, ids, rows, ok))
    return kv.replace(tail=write_rows(kv.tail, ids - paged, rows, ok))


def gather(kv, selected, paged, host: HostView | None, implementation: str | None = "xla"):
    """Rows of the selected positions [T, k] -> (rows [T, k, D], counts [T, 3], new kv).

    Counts are the rows resolved from (tail or resident map, hot cache, host copy).
    """
    if isinstance(kv, ResidentKV):
        return kv.entries[jnp.maximum(selected, 0)], resident_counts(selected), kv
    if selected.shape[0] != 1:
        raise ValueError("PagedKV serves decode (one query per slot); prefill runs resident")
    rows, hot, counts = resolve(kv.hot, selected[0], kv.tail, paged, host.page_table, host.pool,
                                implementation, host.optional, host.ready)
    return rows[None], counts[None], kv.replace(hot=hot)


def resident_counts(selected) -> jnp.ndarray:
    """Counts [T, 3] of selected rows [T, k] that a resident store holds: all valid ones."""
    counts = jnp.zeros(selected.shape[:1] + (NUM_SOURCES,), jnp.int32)
    return counts.at[:, 0].set(jnp.sum(selected >= 0, axis=-1))


def write_rows(table: jnp.ndarray, ids: jnp.ndarray, rows: jnp.ndarray, ok: jnp.ndarray):
    """table[ids[j]] = rows[j] where ok[j]; other rows are dropped (never written)."""
    ids = jnp.where(ok, ids, table.shape[0])  # out of bounds -> dropped
    return table.at[ids].set(rows.astype(table.dtype), mode="drop")

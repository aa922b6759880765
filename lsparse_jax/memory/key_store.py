"""Where a CSA layer's FP8 indexer keys live: on the device (resident, hisparse), or on the
host behind a GPU key cache with PQ codes on the device (leansparse)."""

from __future__ import annotations

import jax.numpy as jnp
from flax import struct

from lsparse_jax.memory.hot_cache import HotCache
from lsparse_jax.memory.kv_store import write_rows


@struct.dataclass
class ResidentKeys:
    values: jnp.ndarray  # [N, D_I] float8_e4m3fn every key of the slot; NaN past its length
    scales: jnp.ndarray  # [N, D_I / fp8_block] f32


@struct.dataclass
class PagedKeys:
    tail: tuple[jnp.ndarray, jnp.ndarray]  # ([P, D_I] e4m3, [P, nb] f32) keys not yet paged
    cache: HotCache  # key cache: rows = ([Bk, D_I] e4m3, [Bk, nb] f32), LRU like the hot cache
    codes: jnp.ndarray  # [N, M] uint8 PQ codes of paged keys (junk past the paged rows)


def write(keys, ids, values, scales, ok, paged):
    """Stores new keys ids[j] (where ok[j]); paged = rows already on the host."""
    if isinstance(keys, ResidentKeys):
        return keys.replace(values=write_rows(keys.values, ids, values, ok),
                            scales=write_rows(keys.scales, ids, scales, ok))
    tv, ts = keys.tail
    return keys.replace(tail=(write_rows(tv, ids - paged, values, ok),
                              write_rows(ts, ids - paged, scales, ok)))

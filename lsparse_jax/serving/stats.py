"""Selection statistics of decode steps, accumulated on the device and read when asked.

Every decode step adds its counts inside one jitted update (no host round trip); a read
(``as_dict``) is the only transfer. Sums are exact to 2^64: each is two uint32 words with carry
(JAX keeps 64-bit integers off by default, and an int32 sum of eligible positions overflows
within minutes at V4 shapes).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

FIELDS = ("steps", "eligible", "selected", "reused", "reuse_base",
          "rows_tail", "rows_hot", "rows_host", "keys_tail", "keys_cache", "keys_host",
          "rows_prefetched")


@struct.dataclass
class SelectionStats:
    """Running sums per sparse layer and active slot over decode steps (Notation: S slots, L
    sparse layers, k top-k; F = len(FIELDS))."""

    sums: jnp.ndarray  # [F, 2] uint32 (low, high) word of each field's sum
    prev: jnp.ndarray  # [S, L, k] int32 each slot's selection at its last decode step
    has_prev: jnp.ndarray  # [S] bool the slot has a previous step since its admission

    @classmethod
    def empty(cls, slots: int, layers: int, top_k: int) -> SelectionStats:
        stats = cls(jnp.zeros((len(FIELDS), 2), jnp.uint32),
                    jnp.full((slots, layers, top_k), -1, jnp.int32), jnp.zeros((slots,), bool))
        # committed, as ``record``'s outputs are: the first update then compiles once, not twice
        return jax.tree.map(lambda a: jax.device_put(a, a.sharding), stats)

    def totals(self) -> dict[str, int]:
        """The exact sums (one device-to-host transfer)."""
        words = np.asarray(self.sums).astype(np.uint64)
        return {f: int(lo) + (int(hi) << 32) for f, (lo, hi) in zip(FIELDS, words)}


def _add64(sums, values):
    """(low, high) words += values [F] uint32, with carry."""
    low = sums[:, 0] + values
    high = sums[:, 1] + (low < sums[:, 0]).astype(jnp.uint32)
    return jnp.stack([low, high], axis=1)


@functools.partial(jax.jit, donate_argnames=("stats",))
def record(stats: SelectionStats, selected, eligible, sources, key_sources, active,
           prefetched=None):
    """Adds one decode step.

    selected [S, L, k] int32 (-1 padded), eligible [S, L] int32, sources and key_sources
    [S, L, 3] int32, active [S] bool, prefetched [S, L] int32 or None (none). Reuse:
    selected positions that the same slot also selected at its previous step (positions
    within a row are distinct, so matches count the intersection).
    """
    act = active[:, None]
    valid = selected >= 0
    both = (active & stats.has_prev)[:, None, None]
    match = jnp.any((selected[..., :, None] == stats.prev[..., None, :]) & valid[..., None],
                    axis=-1)
    counts = [jnp.sum(active) * selected.shape[1], jnp.sum(jnp.where(act, eligible, 0)),
              jnp.sum(valid & act[..., None]), jnp.sum(match & both), jnp.sum(valid & both)]
    counts += [jnp.sum(jnp.where(act, sources[..., j], 0)) for j in range(3)]
    counts += [jnp.sum(jnp.where(act, key_sources[..., j], 0)) for j in range(3)]
    counts.append(jnp.zeros((), jnp.int32) if prefetched is None
                  else jnp.sum(jnp.where(act, prefetched, 0)))
    values = jnp.stack([c.astype(jnp.uint32) for c in counts])
    return SelectionStats(_add64(stats.sums, values), selected, stats.has_prev | active)


@functools.partial(jax.jit, donate_argnames=("stats",))
def admitted(stats: SelectionStats, slot) -> SelectionStats:
    """A new request in ``slot`` has no previous step."""
    return stats.replace(has_prev=stats.has_prev.at[slot].set(False))


def as_dict(totals: dict[str, int], row_bytes: int, key_bytes: int) -> dict:
    """The engine's ``selection`` metrics from ``SelectionStats.totals()``."""
    n = max(totals["steps"], 1)
    rows = np.array([totals["rows_tail"], totals["rows_hot"], totals["rows_host"]], float)
    keys = np.array([totals["keys_tail"], totals["keys_cache"], totals["keys_host"]], float)
    return {"eligible": totals["eligible"] / n, "selected": totals["selected"] / n,
            "reuse_fraction": totals["reused"] / max(totals["reuse_base"], 1),
            "resolved_fraction": dict(zip(("tail_or_resident", "hot_cache", "host_copy"),
                                          (rows / max(rows.sum(), 1.0)).tolist())),
            "key_resolved_fraction": dict(zip(("tail_or_resident", "key_cache", "host_copy"),
                                              (keys / max(keys.sum(), 1.0)).tolist())),
            "host_rows": float(rows[2]), "host_key_rows": float(keys[2]),
            "prefetched_rows": float(totals["rows_prefetched"]),  # echo's prefetch copies
            "host_bytes": (float(rows[2]) + totals["rows_prefetched"]) * row_bytes
            + float(keys[2]) * key_bytes}


__all__ = ["FIELDS", "SelectionStats", "admitted", "as_dict", "record"]

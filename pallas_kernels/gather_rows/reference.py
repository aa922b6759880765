"""XLA reference of ``gather_rows``: one ``dynamic_slice`` + ``device_put`` per row.

Notation: N table rows, D values per row, n ids (-1 = skip).

XLA rejects a gather from a pinned_host array inside jit, so (as ``host_pool._read_rows``) the
valid ids are moved first by a stable argsort and a ``fori_loop`` over them slices one row of
the table and transfers it to device memory; skipped rows keep their NaN fill. This works for
device and pinned_host tables alike (for a device table the ``device_put`` is a no-op). Each
row is one transfer (~7 us on an H200 for a host table). Ids >= N are clamped by
``dynamic_slice`` (undefined: callers must not pass them).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.common import as_bytes, from_bytes

DEVICE = jax.memory.Space.Device


@jax.jit
def gather_rows_xla(table: jnp.ndarray, ids: jnp.ndarray) -> jnp.ndarray:
    """table [N, D] (device or pinned_host), ids [n] int32 -> rows [n, D] on the device."""
    n, d = ids.shape[0], table.shape[1]
    valid = ids >= 0
    order = jnp.argsort(~valid, stable=True)  # valid ids first
    out = as_bytes(jnp.full((n, d), jnp.nan, table.dtype))  # FP8 on CPU: moved as bytes

    def body(j, out):
        slot = order[j]
        row = jax.lax.dynamic_slice(table, (ids[slot], 0), (1, d))  # [1, D] in table's space
        row = as_bytes(jax.device_put(row, DEVICE))
        return jax.lax.dynamic_update_slice(out, row, (slot, 0))

    return from_bytes(jax.lax.fori_loop(0, jnp.sum(valid), body, out), table.dtype)

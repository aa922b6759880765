"""Public entry point of ``gather_rows``: selected rows of a device or pinned_host table.

Notation: N table rows, D values per row, n ids (-1 = skip).

Math: rows[j] = table[ids[j]] for ids[j] >= 0, a NaN row for ids[j] < 0. The result is on the
device with the table's dtype. Ids >= N cannot raise inside jit: they are clamped and the row
they give is undefined (callers must not pass them).

Implementations: "xla" (``reference.py``, one ``dynamic_slice`` + ``device_put`` per row:
works everywhere, ~7 us a row from a host table on an H200), "triton" (``triton.py``, a
Pallas-Triton kernel that reads a pinned_host table in place over PCIe; interpret mode
without a GPU; needs D a power of two). None picks "triton" on a GPU and "xla" elsewhere.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import common

OP = "gather_rows"
AVAILABLE = ("xla", "triton")
FASTEST_ON_GPU = "triton"
DTYPES = (jnp.float32, jnp.bfloat16, jnp.float8_e4m3fn, jnp.float8_e8m0fnu)


def _check(table, ids, ids_dtype) -> None:
    """Raises ValueError naming the first argument with a bad shape or dtype (``ids_dtype``:
    the dtype the caller passed, before jnp.asarray narrows an int64 array to int32)."""
    def fail(arg, what):
        raise ValueError(f"{OP}: {arg} {what}")

    if table.ndim != 2:
        fail("table", f"must be [N, D], got shape {table.shape}")
    if table.dtype not in DTYPES:
        fail("table", f"must be float32, bfloat16, float8_e4m3fn or float8_e8m0fnu, got "
             f"{table.dtype}")
    if table.shape[0] < 1 or table.shape[1] < 1:
        fail("table", f"must have at least one row and one column, got shape {table.shape}")
    if ids.ndim != 1:
        fail("ids", f"must be [n], got shape {ids.shape}")
    if ids_dtype != jnp.int32:
        fail("ids", f"must be int32, got {ids_dtype}")


def gather_rows(table, ids, *,
                implementation: common.Implementation | None = None) -> jnp.ndarray:
    """Rows of ``table`` selected by ``ids``, on the device.

    Inputs:
      table [N, D]  f32, bf16, float8_e4m3fn or float8_e8m0fnu (rows are copied, never
                    converted), in device or pinned_host memory (left where it is)
      ids   [n]     int32 row ids; -1 (any negative id) = skip
    Outputs:
      rows  [n, D]  table's dtype, device memory; NaN rows where ids < 0
    Raises ValueError for bad shapes/dtypes (naming the argument), implementations, or (for
    "triton") a D that is not a power of two.
    """
    impl = common.choose(OP, implementation, AVAILABLE, FASTEST_ON_GPU)
    ids_dtype = jnp.dtype(ids.dtype if hasattr(ids, "dtype") else jnp.asarray(ids).dtype)
    table = table if isinstance(table, jax.Array) else jnp.asarray(table)
    ids = ids if isinstance(ids, jax.Array) else jnp.asarray(ids)
    _check(table, ids, ids_dtype)
    if impl == "triton":
        from pallas_kernels.gather_rows.triton import check_triton_shapes, gather_rows_triton

        check_triton_shapes(OP, table.shape[1])
        if ids.shape[0] == 0:
            return jnp.zeros((0, table.shape[1]), table.dtype)
        return gather_rows_triton(table, ids)
    if ids.shape[0] == 0:
        return jnp.zeros((0, table.shape[1]), table.dtype)
    from pallas_kernels.gather_rows.reference import gather_rows_xla

    return gather_rows_xla(table, ids)

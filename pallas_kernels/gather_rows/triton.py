"""Pallas (Triton lowering) kernel of ``gather_rows``: a zero-copy read of selected rows.

Notation: N table rows, D values per row (a power of two), n ids (-1 = skip).

Design: grid (n,); program j loads ids[j] and copies row table[ids[j]] [1, D] to rows[j], or
stores a NaN row when ids[j] < 0 (``pl.when`` branches: padding reads nothing from the table,
and valid rows are copied without arithmetic, so FP8 bytes come back unchanged). The ids,
the table and the output are passed with ``memory_space=pl.ANY``, so XLA hands the kernel the
table where it lives: a pinned_host table is read in place over PCIe (../shared/gpu_facts
measured 512 random 512-byte rows in ~0.05-0.1 ms from 0.5-8 GiB host arrays; a staged copy
of the whole array would take ~85 ms at 4 GiB). Ids are clamped to [0, N - 1] before the read
so an id >= N (undefined) cannot read outside the table. Triton blocks must have power-of-two
sizes, hence the limit on D (n is free: the program id picks the row).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from pallas_kernels import common


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def check_triton_shapes(op: str, d: int) -> None:
    """The Triton kernel loads [1, D] blocks, which must have a power-of-two size."""
    if not _pow2(d):
        raise ValueError(f"{op}: table row size D={d} must be a power of two for the Triton "
                         "kernel; use implementation='xla'")


def _kernel(ids_ref, table_ref, out_ref, *, num_rows: int, fill):
    # inputs
    #   ids_ref    [n]     int32 (whole array, memory_space=ANY)
    #   table_ref  [N, D]  f32 / bf16 / words of 1-byte rows (whole array, device or pinned_host)
    # outputs
    #   out_ref    [n, D]  same dtype (whole array, device)
    # scratch: none
    j = pl.program_id(0)
    rid = ids_ref[j]
    d = out_ref.shape[1]

    @pl.when(rid >= 0)
    def _copy():
        row = jnp.minimum(rid, num_rows - 1)
        out_ref[pl.ds(j, 1), :] = table_ref[pl.ds(row, 1), :]

    @pl.when(rid < 0)
    def _skip():
        out_ref[pl.ds(j, 1), :] = jnp.full((1, d), fill, out_ref.dtype)


@functools.partial(jax.jit, static_argnames=("num_warps",))
def gather_rows_triton(table: jnp.ndarray, ids: jnp.ndarray, *,
                       num_warps: int = 1) -> jnp.ndarray:
    """Pallas-Triton ``gather_rows`` (interpret mode without a GPU).

    Inputs: table [N, D] f32 / float8_e4m3fn (device or pinned_host), ids [n] int32
    (checked by ``api.gather_rows``). Output: rows [n, D] on the device, NaN where ids < 0.
    """
    from jax.experimental.pallas import triton as plt

    (n,), (num_rows, d) = ids.shape, table.shape
    check_triton_shapes("gather_rows", d)
    like = jax.ShapeDtypeStruct((n, d), table.dtype)
    table = common.as_words(table)  # a 2-4 GiB 1-byte table's offsets stay in int32
    # the NaN poison of skipped rows, as one element of the kernel's view of the table
    nan = np.full(table.dtype.itemsize // like.dtype.itemsize, np.nan, np.float32)
    fill = nan.astype(like.dtype).view(table.dtype)[0].item()
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    return common.from_words(pl.pallas_call(
        functools.partial(_kernel, num_rows=num_rows, fill=fill),
        out_shape=jax.ShapeDtypeStruct((n, table.shape[1]), table.dtype),
        grid=(n,),
        in_specs=[any_spec, any_spec],
        out_specs=any_spec,
        compiler_params=plt.CompilerParams(num_warps=num_warps),
        interpret=common.interpret(),
        name="gather_rows",
    )(ids, table), like)

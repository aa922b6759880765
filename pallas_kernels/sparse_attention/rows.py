"""Row formats ``sparse_attention`` reads: dense f32/bf16 tables and DeepSeek-V4's FP8 rows.

Notation: S requests, R rows, D = n + r head dim, r RoPE dims (the trailing ones), n non-RoPE
dims, b = 64 values per scale block, nb = ceil(n / b) scale blocks.

A table is either one array [S, R, D] (f32 or bf16) or the three leaves of the FP8 format
(``lsparse_jax.quant.kv_rows.FP8Rows``; the kernel layer takes them as a plain tuple):
  nope   [S, R, n]  float8_e4m3fn non-RoPE values divided by their block's scale
  scales [S, R, nb] float8_e8m0fnu power-of-two scale of each block of b values
  rope   [S, R, r]  bfloat16 RoPE part
Dequantized row = concat(nope * repeat(scales, b)[:n], rope) (exact in f32).
A leading 1 in place of S is one table shared by all S requests (e.g. a device page pool that
every request's slots index), read in place, never copied per request.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

FP8_BLOCK = 64  # non-RoPE values per scale (DeepSeek-V4)
DENSE_DTYPES = (jnp.float32, jnp.bfloat16)
FP8_DTYPES = (jnp.float8_e4m3fn, jnp.float8_e8m0fnu, jnp.bfloat16)  # nope, scales, rope


def is_fp8(table) -> bool:
    """True for the FP8 format (a tuple of leaves), False for one dense array."""
    return isinstance(table, (tuple, list))


def head_dim(table) -> int:
    """D of a table in either format."""
    if is_fp8(table):
        return table[0].shape[-1] + table[2].shape[-1]
    return table.shape[-1]


def leading(table) -> tuple[int, ...]:
    """[S, R] of a table in either format."""
    return tuple((table[0] if is_fp8(table) else table).shape[:-1])


def shared(table, s: int) -> bool:
    """Whether ``table`` is one table for all ``s`` requests (leading dim 1 < s)."""
    return leading(table)[0] == 1 < s


def broadcast(table, s: int):
    """``table`` with its leading dim S (a shared [1, R, ...] table repeated: a copy)."""
    return jax.tree.map(lambda t: jnp.broadcast_to(t, (s,) + t.shape[1:]), table)


def dequantize(table) -> jnp.ndarray:
    """Rows [..., D] f32 of a table in either format (NaN poison stays NaN)."""
    if not is_fp8(table):
        return table.astype(jnp.float32)
    nope, scales, rope = table
    n = nope.shape[-1]
    scale = jnp.repeat(scales.astype(jnp.float32), FP8_BLOCK, axis=-1)[..., :n]
    return jnp.concatenate([nope.astype(jnp.float32) * scale, rope.astype(jnp.float32)], -1)


def check_table(op: str, table, s: int, d: int) -> None:
    """Raises ValueError naming ``table`` when it is neither a dense [S, R, D] f32/bf16 array
    nor a (nope, scales, rope) FP8 tuple of matching shapes and dtypes; a leading 1 in
    place of S is one table shared by every request (``shared``)."""
    def fail(what):
        raise ValueError(f"{op}: table {what}")

    if not is_fp8(table):
        if table.ndim != 3 or table.shape[0] not in (s, 1) or table.shape[2] != d:
            fail(f"must be [S, R, D] (or [1, R, D]: shared) with S={s}, D={d}, got shape "
                 f"{table.shape}")
        if table.dtype not in DENSE_DTYPES:
            fail(f"must be float32 or bfloat16 (or an FP8 (nope, scales, rope) tuple), got "
                 f"{table.dtype}")
        if table.shape[1] < 1:
            fail(f"must have at least one row, got shape {table.shape}")
        return
    if len(table) != 3:
        fail(f"as a tuple must be the FP8 leaves (nope, scales, rope), got {len(table)} leaves")
    nope, scales, rope = table
    for name, leaf, dt in zip(("nope", "scales", "rope"), table, FP8_DTYPES):
        if leaf.ndim != 3:
            fail(f"{name} must be [S, R, *], got shape {leaf.shape}")
        if leaf.dtype != dt:
            fail(f"{name} must be {jnp.dtype(dt).name}, got {leaf.dtype}")
        if leaf.shape[:2] != nope.shape[:2]:
            fail(f"{name} must share nope's [S, R] = {nope.shape[:2]}, got {leaf.shape}")
    n, r = nope.shape[2], rope.shape[2]
    if nope.shape[0] not in (s, 1) or n + r != d or n < 1 or r < 1:
        fail(f"FP8 leaves must be nope [S={s} or 1, R, n], rope [S, R, r] with n, r >= 1 and "
             f"n + r = D = {d}, got {nope.shape} and {rope.shape}")
    if scales.shape[2] != -(-n // FP8_BLOCK):
        fail(f"scales must hold ceil(n / {FP8_BLOCK}) = {-(-n // FP8_BLOCK)} per row, got "
             f"{scales.shape}")
    if nope.shape[1] < 1:
        fail(f"must have at least one row, got nope shape {nope.shape}")

"""Compressed KV rows as a CSA layer stores them: f32, bf16, or DeepSeek-V4's FP8 layout.

Notation: D head dim, r = rope_dim (the trailing RoPE dims of a row), n = D - r non-RoPE dims,
  b = 64 values per scale block, nb = ceil(n / b) blocks (the last may be shorter);
  rows [..., D] f32 (what the compressor outputs and the attention reads).

Formats (``ModelConfig.kv_dtype``), each a pytree of arrays with the row axes in front, so the
row machinery (write_rows, host pages, hot cache, lent pages) moves every leaf alike:
  "f32"     one array [..., D] f32: 4D bytes a row (the default; today's layout)
  "bf16"    one array [..., D] bf16: 2D bytes
  "fp8_v4"  ``FP8Rows``(nope [..., n] float8_e4m3fn, scales [..., nb] float8_e8m0fnu,
            rope [..., r] bf16): n + nb + 2r bytes. V4-Flash (D 512, r 64): 448 + 7 + 128 =
            583 B, DeepSeek-V4's 584 B less its one alignment pad byte (each field is its own
            array here, so there is nothing to align); the tiny preset (D 64, r 16):
            48 + 1 + 32 = 81 B; the test model (D 32, r 16): 16 + 1 + 32 = 49 B.
Math (fp8_v4), per block x of non-RoPE values:
  s = 2^ceil(log2(max|x| / 448)) (ue8m0: a power of two, 2^-126 .. 2^127; 1 where x == 0),
  nope = e4m3(x / s) (|x / s| <= 448, the largest e4m3 value), rope = bf16(RoPE part).
  Dequantized x' = nope * s with |x - x'| <= 2^-4 |x| + 2^-10 s and s < 2 max|x| / 448
  (e4m3 keeps 3 mantissa bits; its subnormal spacing is 2^-9); |y - y'| <= 2^-8 |y| for the
  RoPE part (bf16 keeps 8 significant bits).
A NaN row (never written) stays NaN in every format (e4m3, e8m0 and bf16 NaN).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from lsparse_jax.config import KV_DTYPES, ModelConfig

FP8_BLOCK = 64  # non-RoPE values per scale (DeepSeek-V4: 448 = 7 x 64)
E4M3_MAX = 448.0


class FP8Rows(NamedTuple):
    nope: jnp.ndarray  # [..., n] float8_e4m3fn non-RoPE values / their block's scale
    scales: jnp.ndarray  # [..., nb] float8_e8m0fnu power-of-two scale of each block
    rope: jnp.ndarray  # [..., r] bf16 RoPE part


@dataclasses.dataclass(frozen=True)
class KVRowFormat:
    """How rows of ``dim`` values (the last ``rope_dim`` RoPE'd) are stored (``kind``)."""

    kind: str = "f32"
    dim: int = 64
    rope_dim: int = 16

    def __post_init__(self):
        if self.kind not in KV_DTYPES:
            raise ValueError(f"KVRowFormat.kind={self.kind!r} is invalid: allowed {KV_DTYPES}")
        if self.kind == "fp8_v4" and not 0 < self.rope_dim < self.dim:
            raise ValueError(f"KVRowFormat: fp8_v4 needs 0 < rope_dim < dim, got "
                             f"rope_dim={self.rope_dim}, dim={self.dim}")

    @classmethod
    def of(cls, cfg: ModelConfig) -> KVRowFormat:
        """The format of ``cfg``'s compressed CSA rows."""
        return cls(cfg.kv_dtype, cfg.head_dim, cfg.rope_dim)

    @property
    def num_scales(self) -> int:
        return -(-(self.dim - self.rope_dim) // FP8_BLOCK)

    def template(self):
        """One row of zeros in the stored format (a pytree of [...]-shaped arrays)."""
        if self.kind == "f32":
            return jnp.zeros((self.dim,), jnp.float32)
        if self.kind == "bf16":
            return jnp.zeros((self.dim,), jnp.bfloat16)
        n = self.dim - self.rope_dim
        return FP8Rows(jnp.zeros((n,), jnp.float8_e4m3fn),
                       jnp.zeros((self.num_scales,), jnp.float8_e8m0fnu),
                       jnp.zeros((self.rope_dim,), jnp.bfloat16))

    @property
    def row_bytes(self) -> int:
        """Bytes of one stored row."""
        return sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(self.template()))

    def empty(self, num_rows: int):
        """``num_rows`` NaN rows in the stored format."""
        return jax.tree.map(lambda r: jnp.full((num_rows,) + r.shape, jnp.nan, r.dtype),
                            self.template())

    def encode(self, rows: jnp.ndarray):
        """rows [..., D] -> the stored format (module docstring)."""
        if self.kind == "f32":
            return rows.astype(jnp.float32)
        if self.kind == "bf16":
            return rows.astype(jnp.bfloat16)
        return quantize_fp8_rows(rows, self.rope_dim)

    def decode(self, stored) -> jnp.ndarray:
        """The stored format -> rows [..., D] f32."""
        if self.kind in ("f32", "bf16"):
            return stored.astype(jnp.float32)
        return dequantize_fp8_rows(stored)


def _blocks(x: jnp.ndarray, num_blocks: int) -> jnp.ndarray:
    """x [..., n] zero-padded to [..., nb, b]."""
    pad = num_blocks * FP8_BLOCK - x.shape[-1]
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)])
    return x.reshape(x.shape[:-1] + (num_blocks, FP8_BLOCK))


def quantize_fp8_rows(rows: jnp.ndarray, rope_dim: int) -> FP8Rows:
    """rows [..., D] -> FP8Rows (non-RoPE rows[..., :D-r] in FP8 blocks, RoPE part bf16)."""
    rows = rows.astype(jnp.float32)
    n = rows.shape[-1] - rope_dim
    blocks = _blocks(rows[..., :n], -(-n // FP8_BLOCK))  # [..., nb, b]
    amax = jnp.max(jnp.abs(blocks), axis=-1)
    mant, expo = jnp.frexp(amax / E4M3_MAX)  # amax / 448 = mant * 2^expo, mant in [0.5, 1)
    expo = jnp.where(mant == 0.5, expo - 1, expo)  # an exact power of two keeps its exponent
    expo = jnp.clip(jnp.where(amax > 0, expo, 0), -126, 127)
    scale = jnp.ldexp(jnp.ones_like(amax), expo)  # 2^ceil(log2(amax / 448))
    # NaN blocks (never-written rows) get a NaN scale; reduce_max need not propagate NaN
    scale = jnp.where(jnp.any(jnp.isnan(blocks), axis=-1), jnp.nan, scale)
    nope = (blocks / scale[..., None]).astype(jnp.float8_e4m3fn)
    nope = nope.reshape(nope.shape[:-2] + (-1,))[..., :n]
    return FP8Rows(nope, scale.astype(jnp.float8_e8m0fnu),
                   rows[..., n:].astype(jnp.bfloat16))


def dequantize_fp8_rows(stored: FP8Rows) -> jnp.ndarray:
    """FP8Rows -> rows [..., D] f32: nope * its block's scale, then the RoPE part."""
    n = stored.nope.shape[-1]
    scale = jnp.repeat(stored.scales.astype(jnp.float32), FP8_BLOCK, axis=-1)[..., :n]
    nope = stored.nope.astype(jnp.float32) * scale
    return jnp.concatenate([nope, stored.rope.astype(jnp.float32)], axis=-1)


__all__ = ["FP8Rows", "FP8_BLOCK", "KVRowFormat", "dequantize_fp8_rows", "quantize_fp8_rows"]

"""Small shared building blocks: matmul precision, RMSNorm, RoPE, gated MLP, ring windows."""

import contextlib
import contextvars

import flax.linen as nn
import jax
import jax.numpy as jnp

HIGHEST = jax.lax.Precision.HIGHEST
PRECISIONS = {"highest": HIGHEST, "tf32": jax.lax.Precision.DEFAULT,
              "bf16": jax.lax.DotAlgorithmPreset.BF16_BF16_F32}  # ModelConfig.matmul_precision
_PRECISION = contextvars.ContextVar("matmul_precision", default=HIGHEST)


def precision():
    """The precision of the model's matmuls where they are traced: HIGHEST unless a
    ``matmul_precision`` scope (entered by ``Transformer`` and ``Block`` from their config)
    says otherwise."""
    return _PRECISION.get()


@contextlib.contextmanager
def matmul_precision(name: str):
    """Trace-time scope: matmuls built inside use ``ModelConfig.matmul_precision`` ``name``."""
    token = _PRECISION.set(PRECISIONS[name])
    try:
        yield
    finally:
        _PRECISION.reset(token)


class RMSNorm(nn.Module):
    eps: float = 1e-6

    @nn.compact
    def __call__(self, x):
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],))
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return y * scale


def dense(features: int, name: str, std: float | None = None) -> nn.Dense:
    init = nn.initializers.normal(std) if std else nn.initializers.lecun_normal()
    return nn.Dense(features, use_bias=False, name=name, kernel_init=init,
                    precision=precision())


def rope(x: jnp.ndarray, positions: jnp.ndarray, rope_dim: int, theta: float) -> jnp.ndarray:
    """Rotary embedding on the trailing ``rope_dim`` dims of x [..., T, (heads,) D].

    positions [..., T] int. x may carry a heads axis after T; it is broadcast.
    """
    if rope_dim == 0:
        return x
    half = rope_dim // 2
    freqs = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    ang = positions.astype(jnp.float32)[..., None] * freqs  # [..., T, half]
    while ang.ndim < x.ndim:
        ang = ang[..., None, :]
    cos, sin = jnp.cos(ang), jnp.sin(ang)
    keep, rot = x[..., :-rope_dim], x[..., -rope_dim:]
    x1, x2 = rot[..., :half], rot[..., half:]
    rot = jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)
    return jnp.concatenate([keep, rot], axis=-1)


class MLP(nn.Module):
    hidden: int

    @nn.compact
    def __call__(self, x):
        gate = dense(self.hidden, "gate")(x)
        up = dense(self.hidden, "up")(x)
        return dense(x.shape[-1], "down")(jax.nn.silu(gate) * up)


def extend_window(ring: jnp.ndarray, rows: jnp.ndarray, start, num_valid):
    """Prepends the ring's rows to a chunk's rows and returns the ring after the chunk.

    Notation: R ring rows; the row of position q sits at q % R. T chunk rows at positions
      start .. start+T-1, of which the first ``num_valid`` are real.
    Returns (ext [R+T, F], ext_pos [R+T], new_ring [R, F]) where ext holds positions
      start-R .. start+T-1 (entries at negative positions are whatever the ring held: callers
      mask by position) and new_ring holds, per slot, the newest valid position with that
      residue, so a later chunk sees positions start+num_valid-R .. start+num_valid-1.
    """
    r = ring.shape[0]
    prior = (start - r + jnp.arange(r)) % r
    ext = jnp.concatenate([ring[prior], rows.astype(ring.dtype)], axis=0)
    ext_pos = start - r + jnp.arange(r + rows.shape[0])
    end = start + num_valid  # first position not written
    newest = end - 1 - ((end - 1 - jnp.arange(r)) % r)  # newest position < end with q % r == slot
    new_ring = ext[newest - (start - r)]
    return ext, ext_pos, new_ring

"""Gated-pooling KV compressors (DeepSeek-V4 CSA and HCA)."""

import flax.linen as nn
import jax
import jax.numpy as jnp

from lsparse_jax.model.layers import RMSNorm, dense, extend_window, rope


class Compressor(nn.Module):
    """Pools each window of ``ratio`` tokens into one compressed entry.

    With ``overlap`` (CSA) entry i pools 2m tokens (i-1)m .. im+m-1: every token is projected to
    2 x dim values and gate logits; tokens of window i-1 use the first half, tokens of window i
    the second half (the first half "shifted forward by one window"). Without overlap (HCA)
    entry i pools tokens im .. im+m-1. Per channel, a softmax over the pooled positions of
    (gate logit + learned positional bias) weights the values; then RMSNorm and RoPE at im.

    Notation: m = ratio, P = 2 if overlap else 1, D = dim, T chunk tokens from position p.
    State: a ring of the last P*m tokens' projections [P*m, 2*P*D] (values, gate logits).
    Entry i is complete once token im+m-1 is seen; query t may read entries i < (t+1)//m.
    """

    dim: int
    ratio: int
    overlap: bool
    rope_dim: int
    rope_theta: float

    @property
    def parts(self) -> int:
        return 2 if self.overlap else 1

    @nn.compact
    def __call__(self, x, ring, start, num_valid):
        """x [T, hidden], ring [P*m, 2*P*D] -> (entry ids [J], entries [J, D], ok [J], ring).

        J = T // m + 1 candidate entries p//m .. p//m+J-1; ok marks those completed by the
        chunk's valid tokens.
        """
        m, parts, d = self.ratio, self.parts, self.dim
        proj = dense(2 * parts * d, "proj")(x)  # values and gate logits of every part
        # At decode with one request XLA rewrites this matrix-vector product as a reduce and
        # fuses it into extend_window's concatenate, where each output element reduces the
        # hidden axis alone: 2.4 + 1.2 ms of a 6.9 ms step (H200, 128K, batch 1, session 28).
        # The barrier keeps the product its own kernel; values are unchanged.
        proj = jax.lax.optimization_barrier(proj)
        bias = self.param("pos_bias", nn.initializers.zeros, (parts * m, d))
        ext, ext_pos, ring = extend_window(ring, proj, start, num_valid)

        num = x.shape[0] // m + 1
        ids = start // m + jnp.arange(num)
        first = (ids - (parts - 1)) * m  # first pooled position of each entry
        pos = first[:, None] + jnp.arange(parts * m)  # [J, P*m]
        rows = ext[jnp.clip(pos - ext_pos[0], 0, ext.shape[0] - 1)]  # [J, P*m, 2*P*D]
        part = jnp.arange(parts * m) // m  # which half each pooled position uses
        vals = rows[..., : parts * d].reshape(num, parts * m, parts, d)
        gates = rows[..., parts * d:].reshape(num, parts * m, parts, d)
        vals = jnp.take_along_axis(vals, part[None, :, None, None], axis=2)[:, :, 0]
        gates = jnp.take_along_axis(gates, part[None, :, None, None], axis=2)[:, :, 0] + bias
        live = (pos >= 0)[..., None]
        gates = jnp.where(live, gates, -jnp.inf)
        weights = jax.nn.softmax(gates, axis=1)
        # positions before 0 hold NaN poison: zero them before the product, so that neither
        # the forward nor the backward pass multiplies by NaN
        pooled = jnp.sum(weights * jnp.where(live, vals, 0.0), axis=1)  # [J, D]
        entries = rope(RMSNorm(name="norm")(pooled), ids * m, self.rope_dim, self.rope_theta)
        ok = ids * m + m - 1 < start + num_valid
        return ids, entries, ok, ring

    def ring_shape(self) -> tuple[int, int]:
        return (self.parts * self.ratio, 2 * self.parts * self.dim)

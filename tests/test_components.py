"""Model components against direct numpy transcriptions of their formulas."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lsparse_jax.model.attention import sink_attention
from lsparse_jax.model.compressor import Compressor


def np_rope(x, pos, rope_dim, theta):
    half = rope_dim // 2
    freqs = theta ** (-np.arange(half) / half)
    ang = pos[:, None] * freqs
    keep, a, b = x[:, :-rope_dim], x[:, -rope_dim:-half], x[:, -half:]
    return np.concatenate([keep, a * np.cos(ang) - b * np.sin(ang),
                           a * np.sin(ang) + b * np.cos(ang)], axis=1)


def np_compress(x, params, dim, m, overlap, rope_dim, theta):
    """Entry i = RMSNorm(sum_r softmax_r(gate_r + bias_r) * value_r) then RoPE at i*m."""
    proj = x @ np.asarray(params["proj"]["kernel"])
    bias, scale = np.asarray(params["pos_bias"]), np.asarray(params["norm"]["scale"])
    parts = 2 if overlap else 1
    entries = []
    for i in range(x.shape[0] // m):
        vals, gates = [], []
        for r in range(parts * m):
            t = (i - parts + 1) * m + r
            if t < 0:
                continue
            half = r // m if overlap else 0
            vals.append(proj[t, half * dim:(half + 1) * dim])
            gate_at = parts * dim + half * dim
            gates.append(proj[t, gate_at:gate_at + dim] + bias[r])
        gates = np.stack(gates)
        w = np.exp(gates - gates.max(0)) / np.exp(gates - gates.max(0)).sum(0)
        pooled = (w * np.stack(vals)).sum(0)
        entries.append(pooled / np.sqrt(np.mean(pooled**2) + 1e-6) * scale)
    entries = np.stack(entries)
    return np_rope(entries, np.arange(len(entries)) * m, rope_dim, theta)


@pytest.mark.parametrize("overlap,m,chunk", [(True, 4, 7), (True, 4, 1), (False, 8, 5)])
def test_compressor_matches_formula_in_any_chunking(overlap, m, chunk):
    comp = Compressor(dim=8, ratio=m, overlap=overlap, rope_dim=4, rope_theta=100.0)
    x = jax.random.normal(jax.random.key(0), (40, 16))
    ring = jnp.full(comp.ring_shape(), jnp.nan)
    params = comp.init(jax.random.key(1), x[:chunk], ring, 0, chunk)["params"]
    params = jax.tree.map(lambda p: p + 0.3 * jax.random.normal(jax.random.key(2), p.shape),
                          params)
    ref = np_compress(np.asarray(x, np.float64), params, 8, m, overlap, 4, 100.0)
    got = np.full((40 // m, 8), np.nan)
    for start in range(0, 40, chunk):
        piece = x[start:start + chunk]
        valid = piece.shape[0]
        piece = jnp.pad(piece, ((0, chunk - valid), (0, 0)))
        ids, rows, ok, ring = comp.apply({"params": params}, piece, ring, start, valid)
        for i, row, good in zip(np.asarray(ids), np.asarray(rows), np.asarray(ok)):
            if good:
                assert np.isnan(got[i]).all(), f"entry {i} completed twice"
                got[i] = row
    np.testing.assert_allclose(got, ref, atol=1e-4, rtol=1e-4)


def test_sink_attention_matches_softmax_with_sink():
    rng = np.random.default_rng(0)
    t, h, d, s1, s2 = 3, 2, 8, 5, 4
    q = rng.normal(size=(t, h, d))
    rows1, rows2 = rng.normal(size=(t, s1, d)), rng.normal(size=(1, s2, d))
    mask1, mask2 = rng.random((t, s1)) < 0.6, rng.random((t, s2)) < 0.6
    mask2[:, 0] = False  # a shared row no query reads
    sink = rng.normal(size=h)
    poisoned1 = np.where(mask1[..., None], rows1, np.nan)  # masked rows hold NaN poison
    poisoned2 = rows2.copy()
    poisoned2[0, 0] = np.nan
    got = sink_attention(jnp.asarray(q), [(jnp.asarray(poisoned1), jnp.asarray(mask1)),
                                          (jnp.asarray(poisoned2), jnp.asarray(mask2))],
                         jnp.asarray(sink))
    want = np.zeros((t, h, d))
    for i in range(t):
        rows = np.concatenate([rows1[i][mask1[i]], rows2[0][mask2[i]]])
        for j in range(h):
            logits = rows @ q[i, j] / np.sqrt(d)
            e = np.exp(np.concatenate([logits, [sink[j]]]))
            want[i, j] = (e[:-1] / e.sum()) @ rows
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5)

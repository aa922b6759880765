"""Shared test utilities for pallas_kernels ops: tolerances keyed by dtype, poison, sets."""

import numpy as np

# Relative tolerance of a kernel against its XLA reference, keyed by the dtype the kernel
# computes in (the reference runs in f32 at HIGHEST precision).
TOLERANCE = {"float32": 1e-5, "tf32": 5e-3, "bfloat16": 2e-2, "float8_e4m3fn": 2e-2}


def assert_close(got, want, dtype: str, mask=None):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if mask is not None:
        got, want = got[mask], want[mask]
    assert np.isfinite(got).all(), "kernel produced NaN/inf where the reference has values"
    scale = max(np.abs(want).max(initial=0.0), 1e-6)
    err = np.abs(got - want).max(initial=0.0) / scale
    assert err <= TOLERANCE[dtype], f"max error {err:.3g} (relative to max |ref|) > {dtype} tol"


def assert_same_sets(got, want):
    """Rows of index sets (-1 = padding) equal as sets, with equal padding counts."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape
    for r, (a, b) in enumerate(zip(got.reshape(-1, got.shape[-1]),
                                   want.reshape(-1, want.shape[-1]))):
        assert sorted(a[a >= 0].tolist()) == sorted(b[b >= 0].tolist()), f"row {r} differs"
        assert (a < 0).sum() == (b < 0).sum(), f"row {r}: padding differs"


def assert_swaps_at_boundary(got, want, scores, c: int, tol: float):
    """Rows of index sets (-1 = padding) that may differ only by positions whose reference
    score lies within tol (absolute) of the row's c-th largest reference score: what two
    computations each within tol / 2 of the reference can swap at the top-c boundary."""
    got, want, scores = np.asarray(got), np.asarray(want), np.asarray(scores, np.float64)
    for r in range(got.shape[0]):
        live = np.sort(scores[r][np.isfinite(scores[r])])
        kth = live[-c] if live.size >= c else -np.inf
        a, b = set(got[r][got[r] >= 0].tolist()), set(want[r][want[r] >= 0].tolist())
        assert len(a) == len(b), f"row {r}: {len(a)} vs {len(b)} positions"
        far = [p for p in a ^ b if not abs(scores[r, p] - kth) <= tol]
        assert not far, f"row {r}: {len(far)} swaps away from the boundary, e.g. {far[:4]}"


def gpu_topk_rows(rng, b: int, n: int, k: int, kind: str):
    """Score rows [b, n] f32 of ``kind`` ("ties": small integers, "relu": sparse nonnegative,
    else normal) and lengths [b] int32 with the edge cases 0, 1, k - 1, k, k + 1, 5000, n / 2,
    n - 1 first; unpoisoned (callers poison past each length their own way)."""
    lengths = np.full((b,), n, np.int32)
    lengths[:8] = [0, 1, k - 1, k, k + 1, 5000, n // 2, n - 1]
    if kind == "ties":
        scores = rng.integers(0, 50, size=(b, n)).astype(np.float32)
    elif kind == "relu":
        scores = np.maximum(rng.normal(size=(b, n)) - 1.5, 0).astype(np.float32)
    else:
        scores = rng.normal(size=(b, n)).astype(np.float32)
    return scores, lengths


def pq_problem(seed: int, b: int, h: int, d: int, m: int, k: int, n: int):
    """A random coarse-pass problem: q [B, H, D], weights [B, H] (f32), codes [B, N, M]
    (uint8 < K) and codebooks [M, K, D / M] (f32), as jax arrays."""
    import jax.numpy as jnp

    rng = np.random.default_rng(seed)
    return (jnp.asarray(rng.standard_normal((b, h, d)), jnp.float32),
            jnp.asarray(rng.standard_normal((b, h)), jnp.float32),
            jnp.asarray(rng.integers(0, k, (b, n, m)), jnp.uint8),
            jnp.asarray(rng.standard_normal((m, k, d // m)), jnp.float32))


def index_scores_oracle(q, weights, values, scales, valid):
    """float64 numpy scores: dequantize, dot, ReLU, weighted head sum; -inf where invalid."""
    d, nb = values.shape[-1], scales.shape[-1]
    keys = values.astype(np.float64) * np.repeat(scales.astype(np.float64), d // nb, axis=-1)
    keys = np.where(valid[..., None], keys, 0.0)
    dots = q.astype(np.float64) @ keys.transpose(0, 2, 1)                  # [B, H, C]
    scores = (weights.astype(np.float64)[:, None, :] @ np.maximum(dots, 0.0))[:, 0]
    return np.where(valid, scores, -np.inf)

"""Exact indexer scores and the top-k tie/padding rule against numpy references."""

import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from lsparse_jax.indexing import index_scores, topk_positions


def test_index_scores_formula():
    rng = np.random.default_rng(0)
    q, w, k = rng.normal(size=(3, 4, 8)), rng.normal(size=(3, 4)), rng.normal(size=(3, 10, 8))
    ref = np.einsum("bh,bhn->bn", w, np.maximum(np.einsum("bhd,bnd->bhn", q, k), 0))
    got = index_scores(jnp.asarray(q, jnp.float32), jnp.asarray(w, jnp.float32),
                       jnp.asarray(k, jnp.float32))
    np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-5, atol=1e-5)


def reference_topk(scores, eligible, k):
    """Stable sort by descending score: ties keep the lower position; pad with -1."""
    out = np.full((scores.shape[0], k), -1, np.int32)
    for r in range(scores.shape[0]):
        pos = np.flatnonzero(eligible[r])
        order = pos[np.argsort(-scores[r, pos], kind="stable")][:k]
        out[r, :order.size] = order
    return out


@settings(deadline=None, max_examples=40)
@given(seed=st.integers(0, 2**16), n=st.integers(1, 40), k=st.integers(1, 50),
       levels=st.integers(1, 4), density=st.floats(0.0, 1.0))
def test_topk_ties_and_padding(seed, n, k, levels, density):
    rng = np.random.default_rng(seed)
    scores = rng.integers(0, levels, size=(3, n)).astype(np.float32)  # many exact ties
    eligible = rng.random((3, n)) < density
    pos, vals = topk_positions(jnp.asarray(scores), jnp.asarray(eligible), k)
    ref = reference_topk(scores, eligible, k)
    np.testing.assert_array_equal(np.asarray(pos), ref)
    ref_vals = np.where(ref >= 0, np.take_along_axis(scores, np.maximum(ref, 0), 1), -np.inf)
    np.testing.assert_array_equal(np.asarray(vals), ref_vals)

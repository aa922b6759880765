"""``candidate_topk``: the XLA twin against a numpy rule, the Pallas kernel (interpret mode)
against the twin as sets with values aligned, NaN / -1 poison, ties by id, CUDA lowering."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import common
from pallas_kernels.topk import candidate_topk


def numpy_rule(scores, ids, k):
    """Winners of one row by the documented rule: canonical score descending (NaN -> -inf,
    -0.0 -> +0.0), id ascending; -1 / -inf padded to k."""
    s = np.where(np.isnan(scores), -np.inf, scores) + 0.0  # -0.0 + 0.0 == +0.0
    ok = np.flatnonzero(ids >= 0)
    order = ok[np.lexsort((ids[ok], -s[ok]))][:k]
    pad = k - order.size
    return (np.concatenate([ids[order], np.full(pad, -1)]).astype(np.int32),
            np.concatenate([s[order], np.full(pad, -np.inf)]).astype(np.float32))


def make_rows(rng, b, r, kind):
    """Rows of scores and distinct ids (-1 for ~20%, their scores NaN poison); row b - 1
    has no eligible entry."""
    if kind == "ties":
        scores = rng.integers(-2, 3, (b, r)).astype(np.float32)
    elif kind == "special":
        pool = np.array([1.5, 0.0, -0.0, -2.0, -np.inf, np.nan, 1e-41], np.float32)
        scores = np.where(rng.random((b, r)) < 0.5, rng.normal(size=(b, r)),
                          rng.choice(pool, (b, r))).astype(np.float32)
    else:
        scores = rng.normal(size=(b, r)).astype(np.float32)
    ids = np.stack([rng.choice(2**31 - 1, r, replace=False) if i % 2 else
                    rng.permutation(r) for i in range(b)]).astype(np.int32)
    ids[rng.random((b, r)) < 0.2] = -1
    ids[b - 1] = -1
    scores[ids < 0] = np.nan
    return scores, ids


def assert_same_winners(got, want):
    """Same winner set per row, values aligned with their ids, -1 / -inf padding."""
    for gi, gv, wi, wv in zip(*map(np.asarray, (*got, *want))):
        g, w = np.argsort(gi, kind="stable"), np.argsort(wi, kind="stable")
        np.testing.assert_array_equal(gi[g], wi[w])
        np.testing.assert_array_equal(gv[g], wv[w])


@pytest.mark.parametrize("kind", ["normal", "ties", "special"])
@pytest.mark.parametrize("r,k", [(300, 40), (64, 64), (5, 8), (130, 16)])
def test_xla_twin_follows_the_rule_best_first(kind, r, k):
    rng = np.random.default_rng(r + k)
    scores, ids = make_rows(rng, 3, r, kind)
    got_ids, got_val = map(np.asarray, candidate_topk(scores, ids, k, implementation="xla"))
    for row in range(3):
        want_ids, want_val = numpy_rule(scores[row], ids[row], k)
        np.testing.assert_array_equal(got_ids[row], want_ids)
        np.testing.assert_array_equal(got_val[row], want_val)


@pytest.mark.parametrize("kind", ["normal", "ties", "special"])
@pytest.mark.parametrize("r,k", [(300, 40), (2112, 512), (64, 64), (5, 8), (1000, 1000)])
def test_kernel_matches_twin_as_sets(kind, r, k):
    rng = np.random.default_rng(7 * r + k)
    scores, ids = make_rows(rng, 3, r, kind)
    assert_same_winners(candidate_topk(scores, ids, k, implementation="triton"),
                        candidate_topk(scores, ids, k, implementation="xla"))


@pytest.mark.parametrize("k", [3, 4, 5])
def test_search_stops_on_a_prefix_that_is_a_key(k):
    """The key search stops once a prefix has exactly m keys at or above it; with powers of two
    (keys with trailing zero bits) that prefix is the m-th key itself, some winners equal it,
    and k = 4 cuts through a tie (4.0 twice at ranks 3-4 of 5 keys >= 4)."""
    row = np.array([1.0, 16.0, 0.5, 4.0, 8.0, 4.0, 2.0, 4.0, 0.25, 1.0, 64.0], np.float32)
    scores = np.stack([row, row[::-1]])
    ids = np.stack([np.arange(row.size), np.arange(row.size)[::-1] + 100]).astype(np.int32)
    assert_same_winners(candidate_topk(scores, ids, k, implementation="triton"),
                        candidate_topk(scores, ids, k, implementation="xla"))


@pytest.mark.parametrize("kind", ["normal", "ties", "special"])
@pytest.mark.parametrize("r,k", [(300, 40), (2112, 512), (11, 4), (1000, 1000)])
def test_search_by_thirds_writes_the_bits_outputs(kind, r, k):
    """T searched by thirds (``search="thirds"``: two thresholds a count) gives bit for bit
    the outputs of the search by bits (the same winners in the same slots), ties by id
    and the early stop on a prefix that is a key included, with ids given and as
    ``short_rows_topk``'s bool rows; rows of 2^16 entries refused."""
    from pallas_kernels.topk.candidates import candidate_topk_triton

    rng = np.random.default_rng(5 * r + k)
    scores, ids = make_rows(rng, 3, r, kind)
    if r == 11:
        scores[0] = [1.0, 16.0, 0.5, 4.0, 8.0, 4.0, 2.0, 4.0, 0.25, 1.0, 64.0]
    for i in (ids, ids >= 0):
        got = candidate_topk_triton(scores, i, k=k, search="thirds")
        want = candidate_topk_triton(scores, i, k=k)
        for a, b in zip(got, want):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(ValueError, match="thirds"):
        candidate_topk_triton(np.zeros((1, 1 << 16), np.float32),
                              np.zeros((1, 1 << 16), np.int32), k=2, search="thirds")


def test_ties_go_to_the_lower_id_not_the_earlier_entry():
    """All scores equal, ids falling along the row: the k smallest ids (the last entries)
    win, in the kernel as in the twin."""
    ids = np.arange(500, 0, -1, dtype=np.int32)[None]
    scores = np.zeros((1, 500), np.float32)
    for impl in ("xla", "triton"):
        got, _ = candidate_topk(scores, ids, 24, implementation=impl)
        assert sorted(np.asarray(got)[0].tolist()) == list(range(1, 25))


def test_kernel_under_vmap_equals_batched_call():
    """coarse_to_fine calls the op on [1, R] inside the decode step's vmap over slots."""
    rng = np.random.default_rng(1)
    scores, ids = make_rows(rng, 4, 200, "ties")
    fn = functools.partial(candidate_topk, k=32, implementation="triton")
    got = jax.vmap(lambda s, i: tuple(x[0] for x in fn(s[None], i[None])))(
        jnp.asarray(scores), jnp.asarray(ids))
    assert_same_winners(got, fn(scores, ids))


def test_bad_inputs_raise():
    s, i = np.zeros((2, 8), np.float32), np.zeros((2, 8), np.int32)
    with pytest.raises(ValueError, match="k must be"):
        candidate_topk(s, i, 0)
    with pytest.raises(ValueError, match="shapes"):
        candidate_topk(s, i[:, :4], 2)
    with pytest.raises(ValueError, match="float32"):
        candidate_topk(s.astype(np.float16), i, 2)
    with pytest.raises(ValueError, match="int32"):
        candidate_topk(s, i.astype(np.int16), 2)
    with pytest.raises(ValueError, match="not available"):
        candidate_topk(s, i, 2, implementation="triton_fused")


def test_lowers_for_cuda_at_leansparse_shape():
    """One Triton call for B 64 rows of C + P = 2048 + 64 entries, k 512, under vmap as the
    decode step runs it."""
    fn = functools.partial(candidate_topk, k=512, implementation="triton")
    batched = jax.vmap(lambda s, i: fn(s[None], i[None]))
    text = common.lower_for_cuda(batched, jax.ShapeDtypeStruct((64, 2112), jnp.float32),
                                 jax.ShapeDtypeStruct((64, 2112), jnp.int32))
    assert text.count(common.TRITON_CALL_TARGET) == 1


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["normal", "ties"])
def test_gpu_kernel_matches_twin(kind):
    """At LeanSparse's shape, the search by bits (the default) and by thirds."""
    from pallas_kernels.topk.candidates import candidate_topk_triton

    rng = np.random.default_rng(11)
    scores, ids = make_rows(rng, 64, 2112, kind)
    want = candidate_topk(scores, ids, 512, implementation="xla")
    assert_same_winners(candidate_topk(scores, ids, 512, implementation="triton"), want)
    assert_same_winners(candidate_topk_triton(jnp.asarray(scores), jnp.asarray(ids), k=512,
                                              search="thirds"), want)

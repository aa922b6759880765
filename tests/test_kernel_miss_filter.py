"""``miss_filter``: the XLA twin against a numpy statement of the rule, the Pallas kernel
(interpret mode) against the twin, NaN poison where not valid, CUDA lowering."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import common
from pallas_kernels.miss_filter import miss_filter


def numpy_rule(scores, valid, cached, k, offset):
    """keep and the threshold of one row, in float64 from the canonical f32 scores."""
    s = np.where(np.isnan(scores), -np.inf, scores).astype(np.float64) + 0.0
    v = s[valid]
    if v.size == 0:
        return np.zeros_like(valid), np.inf
    kth = np.sort(v)[::-1][min(k, v.size) - 1]
    sigma = np.sqrt(((v - v.mean()) ** 2).sum() / max(v.size - 1, 1))
    threshold = kth - offset * sigma
    return valid & (cached | (s >= threshold)), threshold


def make_rows(rng, b, c, kind):
    if kind == "ties":
        scores = rng.integers(-3, 4, (b, c)).astype(np.float32)
    elif kind == "special":
        pool = np.array([1.5, 0.0, -0.0, -2.0, 1e-41, 7.0], np.float32)
        scores = np.where(rng.random((b, c)) < 0.5, rng.normal(size=(b, c)),
                          rng.choice(pool, (b, c))).astype(np.float32)
    else:
        scores = rng.normal(size=(b, c)).astype(np.float32)
    valid = rng.random((b, c)) < 0.9
    valid[b - 1] = False  # a request without candidates
    valid[b - 2] = rng.random(c) < 4 / c  # fewer valid candidates than k
    cached = rng.random((b, c)) < 0.3
    scores[~valid] = np.nan
    return scores, valid, cached


def assert_rule(keep, scores, valid, cached, k, offset, slack=0.0):
    """keep equals the numpy rule, except candidates within ``slack`` (relative) of the
    threshold (the kernel sums in its own order)."""
    for r in range(scores.shape[0]):
        want, threshold = numpy_rule(scores[r], valid[r], cached[r], k, offset)
        near = np.abs(scores[r] - threshold) <= slack * max(1.0, abs(threshold))
        np.testing.assert_array_equal(np.asarray(keep)[r][~near], want[~near])


@pytest.mark.parametrize("kind", ["normal", "ties", "special"])
@pytest.mark.parametrize("c,k,offset", [(2048, 512, 1.0), (300, 40, 0.5), (64, 64, 0.0)])
def test_twin_follows_the_rule(kind, c, k, offset):
    rng = np.random.default_rng(c + k)
    scores, valid, cached = make_rows(rng, 4, c, kind)
    keep = miss_filter(scores, valid, cached, k=k, offset=offset, implementation="xla")
    assert_rule(keep, scores, valid, cached, k, offset, slack=1e-6)


@pytest.mark.parametrize("kind", ["normal", "ties", "special"])
@pytest.mark.parametrize("c,k,offset", [(2048, 512, 1.0), (300, 40, 0.5), (64, 64, 0.0)])
def test_kernel_matches_twin(kind, c, k, offset):
    rng = np.random.default_rng(3 * c + k)
    scores, valid, cached = make_rows(rng, 4, c, kind)
    got = miss_filter(scores, valid, cached, k=k, offset=offset, implementation="triton")
    want = miss_filter(scores, valid, cached, k=k, offset=offset, implementation="xla")
    assert_rule(got, scores, valid, cached, k, offset, slack=1e-5)
    assert np.mean(np.asarray(got) == np.asarray(want)) > 0.999


def test_bad_inputs_raise():
    s, v = np.zeros((2, 8), np.float32), np.ones((2, 8), bool)
    with pytest.raises(ValueError, match="k must be"):
        miss_filter(s, v, v, k=0, offset=1.0)
    with pytest.raises(ValueError, match="offset"):
        miss_filter(s, v, v, k=2, offset=float("nan"))
    with pytest.raises(ValueError, match="shapes"):
        miss_filter(s, v[:, :4], v, k=2, offset=1.0)
    with pytest.raises(ValueError, match="bool"):
        miss_filter(s, v.astype(np.int32), v, k=2, offset=1.0)


def test_lowers_for_cuda_at_leansparse_shape():
    """One Triton call for B 64 requests of C 2048 under vmap, as the decode step runs it."""
    fn = functools.partial(miss_filter, k=512, offset=1.0, implementation="triton")
    batched = jax.vmap(lambda s, v, c: fn(s[None], v[None], c[None])[0])
    text = common.lower_for_cuda(batched, jax.ShapeDtypeStruct((64, 2048), jnp.float32),
                                 jax.ShapeDtypeStruct((64, 2048), jnp.bool_),
                                 jax.ShapeDtypeStruct((64, 2048), jnp.bool_))
    assert text.count(common.TRITON_CALL_TARGET) == 1


@pytest.mark.gpu
def test_gpu_kernel_matches_twin():
    rng = np.random.default_rng(12)
    scores, valid, cached = make_rows(rng, 64, 2048, "normal")
    got = miss_filter(scores, valid, cached, k=512, offset=1.0, implementation="triton")
    assert_rule(got, scores, valid, cached, 512, 1.0, slack=1e-5)

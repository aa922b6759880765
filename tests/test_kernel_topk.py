"""pallas_kernels.topk: exact top-k under per-row lengths, XLA and Pallas-Triton implementations.

Triton runs in Pallas interpret mode on CPU (small shapes, small tunables so that the counting
passes, several blocks and a partial last block are all exercised); the CUDA lowering is
checked on CPU at the benchmark shape; GPU tests compare the real kernels with XLA.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_helpers import assert_same_sets, gpu_topk_rows

from pallas_kernels import common
from pallas_kernels.topk import topk
from pallas_kernels.topk import triton as topk_impl
from pallas_kernels.topk.triton import topk_triton

IMPLEMENTATIONS = ("xla", "triton")


def numpy_topk(scores, lengths, k):
    """Stable-sort reference: higher score first, ties to the lower position, -1 / -inf pad.
    NaN inside the length counts as -inf and -0.0 as +0.0, as documented for topk."""
    b, n = scores.shape
    pos = np.full((b, k), -1, np.int32)
    val = np.full((b, k), -np.inf, np.float32)
    for r in range(b):
        length = min(max(int(lengths[r]), 0), n)
        s = scores[r, :length].astype(np.float32).copy()
        s[np.isnan(s)] = -np.inf
        s[s == 0] = 0.0
        order = np.lexsort((np.arange(length), -s.astype(np.float64)))[:k]
        pos[r, :order.size] = order
        val[r, :order.size] = s[order]
    return pos, val


def assert_topk_equal(got, want):
    """Positions equal as sets (with equal -1 padding); values aligned to them, exactly."""
    (gp, gv), (wp, wv) = [(np.asarray(p), np.asarray(v)) for p, v in (got, want)]
    assert gp.dtype == np.int32 and gv.dtype == np.float32
    assert gp.shape == wp.shape and gv.shape == wv.shape
    assert_same_sets(gp, wp)
    for r in range(gp.shape[0]):
        go, wo = np.argsort(gp[r], kind="stable"), np.argsort(wp[r], kind="stable")
        np.testing.assert_array_equal(gv[r][go], wv[r][wo], err_msg=f"row {r} values")
        assert np.all(gv[r][gp[r] < 0] == -np.inf), f"row {r}: padding value is not -inf"


def _poison(scores, lengths):
    scores = scores.copy()
    for r, length in enumerate(lengths):
        scores[r, max(int(length), 0):] = np.nan
    return scores


def _ties(rng):
    """Integer scores from a small range (many exact ties), lengths 0 / < k / == k / == N."""
    n, k = 300, 16
    lengths = np.array([0, 5, n, k, k + 1, 157], np.int32)
    scores = rng.integers(-3, 4, size=(lengths.size, n)).astype(np.float32)
    return _poison(scores, lengths), lengths, k


def _k_over_n(rng):
    """k > N; lengths past N count as N, negative lengths as 0."""
    n, k = 20, 40
    lengths = np.array([n, 0, 7, n + 5, -1], np.int32)
    scores = rng.integers(-2, 3, size=(lengths.size, n)).astype(np.float32)
    return _poison(scores, lengths), lengths, k


def _wide(rng):
    """Normal scores plus some ties; a 4-bit radix needs several counting passes here."""
    n, k = 1000, 8
    lengths = np.array([n, n - 1, 3, 640], np.int32)
    scores = rng.normal(size=(lengths.size, n)).astype(np.float32)
    scores[:, ::7] = np.round(scores[:, ::7])
    return _poison(scores, lengths), lengths, k


def _special(rng):
    """Signed zeros, infinities, denormals; one NaN inside a length (treated as -inf)."""
    n, k = 64, 10
    lengths = np.array([n, 40], np.int32)
    pool = np.array([0.0, -0.0, np.inf, -np.inf, 1e-40, -1e-40, 2.5, -2.5], np.float32)
    scores = rng.choice(pool, size=(lengths.size, n))
    scores[1, 3] = np.nan
    return _poison(scores, lengths), lengths, k


def _long(rng):
    """Rows longer than the default candidate buffer: the sampled first pass runs (defaults)."""
    n, k = 50000, 300
    lengths = np.array([n, n - 1, 9000], np.int32)
    scores = np.round(rng.normal(size=(lengths.size, n)), 2).astype(np.float32)
    return _poison(scores, lengths), lengths, k


# case -> (builder, Triton tunables: small ones force counting passes and several blocks)
CASES = {
    "ties": (_ties, dict(block=64, cap=32, chunk=32, sample=32)),
    "k_over_n": (_k_over_n, None),
    "wide": (_wide, dict(block=128, cap=16, chunk=32, sample=64, digit_bits=2)),
    "special": (_special, None),
    "long": (_long, None),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_topk_matches_numpy(implementation, case):
    build, tunables = CASES[case]
    scores, lengths, k = build(np.random.default_rng(sorted(CASES).index(case)))
    want = numpy_topk(scores, lengths, k)
    if implementation == "triton" and tunables is not None:
        got = topk_triton(jnp.asarray(scores), jnp.asarray(lengths), k, **tunables)
    else:
        got = topk(jnp.asarray(scores), jnp.asarray(lengths), k, implementation=implementation)
    assert_topk_equal(got, want)


@pytest.mark.parametrize("case", ["ties", "wide"])
def test_topk_after_first_pass_matches_numpy(case):
    """Entering after a first counting pass done elsewhere (as the fused pq_topc does): sample
    thresholds and per-block counts computed in numpy from the row; later passes, selection
    and stage 2 run as usual."""
    build, tunables = CASES[case]
    scores, lengths, k = build(np.random.default_rng(sorted(CASES).index(case)))
    cfg = topk_impl.config(scores.shape[1], k, interpret=True, **tunables)
    length, m = topk_impl.row_lengths(jnp.asarray(lengths), cfg)
    xs = jnp.asarray(scores)[:, ::topk_impl.sample_stride(cfg)]
    thr = np.asarray(topk_impl.sample_thresholds(xs, length, m, cfg))
    x = np.where(np.isnan(scores), -np.inf, scores).astype(np.float32)
    x[x == 0] = 0.0
    bits = x.view(np.int32)
    keys = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    keys[np.arange(x.shape[1])[None, :] >= np.asarray(length)[:, None]] = np.iinfo(np.int32).min
    keys = np.pad(keys, ((0, 0), (0, cfg.nblk * cfg.block - x.shape[1])),
                  constant_values=np.iinfo(np.int32).min)
    ge = keys[:, :, None] >= thr[:, None, :]
    counts = ge.reshape(x.shape[0], cfg.nblk, cfg.block, cfg.nt).sum(2).astype(np.int32)
    fn = jax.jit(topk_impl.topk_after_first_pass, static_argnames="cfg")
    got = fn(jnp.asarray(scores), jnp.asarray(lengths), thr, counts, cfg=cfg)
    assert_topk_equal(got, numpy_topk(scores, lengths, k))


def test_xla_is_best_first_and_jittable():
    scores, lengths, k = _ties(np.random.default_rng(0))
    fn = jax.jit(lambda s, n: topk(s, n, k, implementation="xla"))
    pos, val = map(np.asarray, fn(jnp.asarray(scores), jnp.asarray(lengths)))
    assert np.all(val[:, 1:] <= val[:, :-1])
    assert_topk_equal((pos, val), numpy_topk(scores, lengths, k))


# 36864: 9 blocks, so the one-read candidate row (9 segments) is padded to a power of two for
# the register finish (Triton's lowering needs one)
@pytest.mark.parametrize("b,n,k", [(64, 262144, 2048), (3, 100, 5), (8, 36864, 512)])
def test_triton_lowers_for_cuda(b, n, k):
    fn = functools.partial(topk, k=k, implementation="triton")
    specs = (jax.ShapeDtypeStruct((b, n), jnp.float32), jax.ShapeDtypeStruct((b,), jnp.int32))
    text = common.lower_for_cuda(fn, *specs)
    # the default (api.TRITON_OPTIONS): one-read select_seg + finish_seg, fallback refine,
    # select, finish (early exits)
    assert text.count(common.TRITON_CALL_TARGET) == 5
    assert "topk_select_seg" in text and "topk_finish_seg" in text
    two_reads = functools.partial(topk_triton, k=k)
    text = common.lower_for_cuda(two_reads, *specs)
    assert text.count(common.TRITON_CALL_TARGET) == 4  # count, refine, select, finish


@pytest.mark.parametrize("bad,match", [
    (dict(scores=np.zeros((4,), np.float32)), "scores"),
    (dict(scores=np.zeros((2, 3, 4), np.float32)), "scores"),
    (dict(scores=np.zeros((2, 8), np.float16)), "scores"),
    (dict(scores=np.zeros((2, 8), np.int32)), "scores"),
    (dict(lengths=np.zeros((3,), np.int32)), "lengths"),
    (dict(lengths=np.zeros((2, 1), np.int32)), "lengths"),
    (dict(lengths=np.zeros((2,), np.float32)), "lengths"),
    (dict(k=0), "k"),
    (dict(k=-3), "k"),
    (dict(k=2.0), "k"),
])
def test_bad_inputs_raise(bad, match):
    args = dict(scores=np.zeros((2, 8), np.float32), lengths=np.full((2,), 8, np.int32), k=3)
    args.update(bad)
    with pytest.raises(ValueError, match=match):
        topk(args["scores"], args["lengths"], args["k"], implementation="xla")


def test_unknown_implementation_raises():
    with pytest.raises(ValueError, match="implementation"):
        topk(np.zeros((1, 4), np.float32), np.ones((1,), np.int32), 2, implementation="cuda")


def _gpu_case(seed, b, n, k, kind):
    scores, lengths = gpu_topk_rows(np.random.default_rng(seed), b, n, k, kind)
    return _poison(scores, lengths), lengths


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["normal", "ties", "relu"])
@pytest.mark.parametrize("b,n,k", [(64, 262144, 2048), (16, 100000, 512), (8, 36864, 512)])
def test_triton_matches_xla_on_gpu(b, n, k, kind):
    scores, lengths = _gpu_case(b + k, b, n, k, kind)
    args = (jnp.asarray(scores), jnp.asarray(lengths), k)
    want = topk(*args, implementation="xla")
    assert_topk_equal(topk(*args, implementation="triton"), want)
    assert_topk_equal(topk(*args), want)  # None picks triton on a GPU

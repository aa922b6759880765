"""pallas_kernels.topk: exact top-k under per-row lengths, XLA and Pallas-Triton implementations.

Triton runs in Pallas interpret mode on CPU (small shapes, small tunables so that the counting
passes, several blocks and a partial last block are all exercised); the CUDA lowering is
checked on CPU at the benchmark shape; GPU tests compare the real kernels with XLA.
"triton_fused" (fused.py, two launches) is tested the same way, on both of its paths: rows
its finish kernel takes from the candidates and rows it scans whole (a sample or floor hint
above the m-th score, too low a floor, crowded blocks).
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_helpers import assert_same_sets, gpu_topk_rows

from pallas_kernels import common
from pallas_kernels.topk import fused, topk
from pallas_kernels.topk import triton as topk_impl
from pallas_kernels.topk.reference import topk_xla
from pallas_kernels.topk.triton import topk_triton

IMPLEMENTATIONS = ("xla", "triton", "triton_fused")


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
# the same for "triton_fused": several select programs per row, a partial last block
FUSED_TUNABLES = {"ties": dict(block=64, chunk=32, sample=32, window=4),
                  "wide": dict(block=128, chunk=64, sample=64, digit_bits=2),
                  "special": dict(block=16, sample=16, window=1)}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_topk_matches_numpy(implementation, case):
    build, tunables = CASES[case]
    scores, lengths, k = build(np.random.default_rng(sorted(CASES).index(case)))
    want = numpy_topk(scores, lengths, k)
    if implementation == "triton" and tunables is not None:
        got = topk_triton(jnp.asarray(scores), jnp.asarray(lengths), k, **tunables)
    elif implementation == "triton_fused" and case in FUSED_TUNABLES:
        got = fused.topk_fused(jnp.asarray(scores), jnp.asarray(lengths), k,
                               **FUSED_TUNABLES[case])
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


# ------------------------------------------------------------ triton_fused (fused.py)

FUSED_POISON = np.array([np.nan, np.inf, 3e38, -1.0], np.float32)
FUSED_TUN = dict(block=128, chunk=64, sample=256)  # 16 select programs a row, a partial last


def _fused_rows(seed, kind, n=2000, k=24):
    """Rows: lengths 0, < k, == k, a partial last block, N - 1, N; scores by kind; NaN /
    +inf / huge / -1 poison past each length."""
    rng = np.random.default_rng(seed)
    lengths = np.array([0, k // 3, k, 333, n - 1, n], np.int32)
    shape = (lengths.size, n)
    if kind == "normal":
        scores = rng.normal(size=shape)
    elif kind == "ties":  # few distinct values: the k-th place is tied many times
        scores = rng.integers(-2, 3, size=shape)
    elif kind == "extreme":  # keys spanning the whole int32 range
        pool = np.array([np.inf, -np.inf, 3.4e38, -3.4e38, 1e-45, -1e-45, 0.0, -0.0, 1.0])
        scores = rng.choice(pool, size=shape)
        scores[:, ::5] = rng.normal(size=scores[:, ::5].shape) * 1e30
    else:  # "relu": most scores exactly 0
        scores = np.maximum(rng.normal(size=shape) - 1.0, 0.0)
    scores = scores.astype(np.float32)
    for r, length in enumerate(lengths):
        scores[r, length:] = rng.choice(FUSED_POISON, size=n - length)
    return scores, lengths, k


def _check_fused(scores, lengths, k, floor=None, **tun):
    """topk_fused against topk_xla and numpy; returns fused.fast_rows (the rows finished from
    the candidates rather than by the fallback scan)."""
    args = (jnp.asarray(scores), jnp.asarray(lengths), k)
    floor = None if floor is None else jnp.asarray(floor, jnp.float32)
    got = fused.topk_fused(*args, floor=floor, **tun)
    assert_topk_equal(got, topk_xla(*args))
    assert_topk_equal(got, numpy_topk(scores, lengths, k))
    return np.asarray(fused.fast_rows(*args, floor=floor, **tun))


@pytest.mark.parametrize("kind", ["normal", "ties", "extreme", "relu"])
def test_fused_matches_xla(kind):
    """Both paths of the finish kernel: the sampled floor's candidates (most rows) and the
    whole-row scan for crowded blocks (an ascending row; a row whose winners sit in one
    block)."""
    scores, lengths, k = _fused_rows(11 + len(kind), kind)
    lengths[1] = 2000  # the row shorter than k becomes two adversarial full rows
    scores[1] = np.sort(scores[1])
    scores[2] = -1.0
    scores[2, 640:640 + k] = 5.0
    lengths[2] = 2000
    fast = _check_fused(scores, lengths, k, **FUSED_TUN)
    if kind == "normal":
        assert fast[[0, 3, 4, 5]].all() and not fast[1], fast


@pytest.mark.parametrize("kind", ["normal", "ties"])
@pytest.mark.parametrize("scan_rows", [4, 32])
def test_fused_scan_rows_gives_the_same_sets(kind, scan_rows):
    """``scan_rows`` (the select chunk's prefix count through a [rows, CH / rows] view; 32 is
    the default): the same sets as the reference, the crowded-block fallback and ties
    included, and the same candidate rows as one scan (position order kept in every
    segment)."""
    scores, lengths, k = _fused_rows(21 + scan_rows, kind)
    scores[1] = np.sort(scores[1])
    lengths[1] = 2000
    fast = _check_fused(scores, lengths, k, scan_rows=scan_rows, **FUSED_TUN)
    assert fast.tolist() == _check_fused(scores, lengths, k, scan_rows=1,
                                         **FUSED_TUN).tolist()
    args = (jnp.asarray(scores), jnp.asarray(lengths).reshape(-1, 1))
    one = fused.select_call(*args, None, fused.fused_config(2000, k, scan_rows=1,
                                                            **FUSED_TUN))
    rows = fused.select_call(*args, None, fused.fused_config(2000, k, scan_rows=scan_rows,
                                                             **FUSED_TUN))
    for a, b in zip(one, rows):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("kind", ["normal", "ties", "relu"])
def test_fused_each_floor_source_matches_xla(kind):
    """The select kernel's three floors (its own sample search, which loads chunk 0 early
    and tests its positions; the threshold launch's key; a floor hint), over rows of one
    chunk, several, a partial last chunk and blocks past the length (chunks wholly below
    the length skip the position test), against XLA and numpy, with identical candidate
    rows for the sample and the threshold launch."""
    scores, lengths, k = _fused_rows(61, kind)
    lengths[1], lengths[2] = 2000, 700
    for tun in (dict(threshold_kernel=False), dict(threshold_kernel=True)):
        _check_fused(scores, lengths, k, **(FUSED_TUN | tun))
    hint = np.sort(np.where(np.isnan(scores), -np.inf, scores), axis=1)[:, -k]
    _check_fused(scores, lengths, k, floor=hint, **FUSED_TUN)
    args = (jnp.asarray(scores), jnp.asarray(lengths).reshape(-1, 1))
    outs = [fused.select_call(*args, None, fused.fused_config(2000, k, threshold_kernel=how,
                                                              **FUSED_TUN))
            for how in (False, True)]
    for a, b in zip(*outs):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("kind", ["normal", "ties", "extreme", "relu"])
def test_fused_float_compare_gives_the_key_paths_candidate_rows(kind):
    """select's f32 compare (``compare="float"``, the default) against the order-key path:
    the reference's sets (with the finish's early stop, ``stop_early``, ties cut at the m-th
    key included), and bit for bit the same candidate rows, counts and floors, where the floor
    is a normal float (normal, ties), and where it is +-0, denormal or -inf (relu, extreme:
    the kernel's key branch)."""
    scores, lengths, k = _fused_rows(51, kind)
    lengths[1], lengths[2] = 2000, 700
    _check_fused(scores, lengths, k, compare="float", stop_early=True, **FUSED_TUN)
    args = (jnp.asarray(scores), jnp.asarray(lengths).reshape(-1, 1))
    outs = [fused.select_call(*args, None, fused.fused_config(2000, k, compare=how,
                                                              **FUSED_TUN))
            for how in ("float", "keys")]
    for a, b in zip(*outs):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# session 47's finish (one program a row, one scan of CR, tie ranks after an early stop)
PLAIN_FINISH = dict(skip_ties=False, finish_scan_rows=1, finish_programs=1)
FINISH_FORMS = {"default": None, "skip_ties": dict(skip_ties=True),
                "scan_rows": dict(finish_scan_rows=8),
                "programs2": dict(finish_programs=2),
                "thirds": dict(search="thirds"),
                "thirds_bits_run": dict(search="thirds", stop_early=False),
                "programs4_all": dict(finish_programs=4, finish_scan_rows=4, skip_ties=True,
                                      search="thirds")}


@pytest.mark.parametrize("kind", ["normal", "ties", "extreme"])
@pytest.mark.parametrize("form", list(FINISH_FORMS))
def test_fused_finish_forms_write_the_same_winners(kind, form):
    """The finish's forms: ``skip_ties`` (after an early stop, the keys >= T without tie
    ranks), ``finish_scan_rows`` (its prefix sums through a [rows, CR / rows] view),
    ``finish_programs`` (P programs a row, each writing its part's winners), ``search``
    "thirds" (the floor's and the finish's searches by thirds; with and without the early
    stop), all of them, and the defaults (two programs, 64 rows, skip_ties): the reference's
    sets, and bit for bit session 47's finish's outputs (``PLAIN_FINISH``: the same winners in
    the same slots), ties at the m-th key and the whole-row fallback included."""
    scores, lengths, k = _fused_rows(71, kind)
    lengths[1], lengths[2] = 2000, 700
    scores[1] = np.sort(scores[1])  # crowded last blocks: the fallback
    args = (jnp.asarray(scores), jnp.asarray(lengths), k)
    tun = {} if FINISH_FORMS[form] is None else {**PLAIN_FINISH, **FINISH_FORMS[form]}
    _check_fused(scores, lengths, k, **tun, **FUSED_TUN)
    got = fused.topk_fused(*args, **tun, **FUSED_TUN)
    want = fused.topk_fused(*args, **PLAIN_FINISH, **FUSED_TUN)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("kind", ["normal", "ties", "extreme", "relu"])
def test_thirds_floor_is_the_bits_floor_or_one_bucket_below(kind):
    """The sample floor by thirds (``search="thirds"``: the range cut to a third a step
    until it is narrower than 2^(32 - floor_bits), then those low bits cleared) against the
    bit-by-bit floor: equal, or one bucket of 2^(32 - floor_bits) keys below it (never
    above: both are at most the sample's (r + 1)-th key); both floors' rows finish from
    their candidates alike."""
    scores, lengths, k = _fused_rows(81, kind)
    args = (jnp.asarray(scores), jnp.asarray(lengths).reshape(-1, 1))
    floors = {}
    for search in ("bits", "thirds"):
        cfg = fused.fused_config(2000, k, search=search, floor_bits=12, **FUSED_TUN)
        floors[search] = np.asarray(fused.select_call(*args, None, cfg)[1][:, 0, 1],
                                    np.int64)
    step = 1 << (32 - 12)
    diff = floors["bits"] - floors["thirds"]
    assert np.all((diff == 0) | (diff == step)), (floors, diff)
    assert (diff == 0).any()
    fast = [fused.fast_rows(jnp.asarray(scores), jnp.asarray(lengths), k, search=search,
                            floor_bits=12, **FUSED_TUN) for search in ("bits", "thirds")]
    assert np.asarray(fast[0]).tolist() == np.asarray(fast[1]).tolist()


def test_float_compare_is_exact_where_it_is_used():
    """``fused._float_exact(tf)`` => (x >= tf) == (key(canonical(x)) >= key(tf)) for every x,
    denormals, +-0, +-inf and NaN included, under this backend's compare (XLA:CPU flushes
    denormals); it refuses exactly the floors that are +-0, denormal or -inf;
    ``from_order_keys`` inverts ``order_keys``."""
    from pallas_kernels.topk.reference import canonical_scores, from_order_keys, order_keys

    tiny = np.finfo(np.float32).tiny
    special = [0.0, -0.0, 1e-45, -1e-45, tiny / 2, -tiny / 2, tiny, -tiny, 1.0, -1.0, 3e38,
               -3e38, np.inf, -np.inf, np.nan, 2.5, -2.5, 1.5 * tiny, -1.5 * tiny]
    x = jnp.asarray(np.array(special, np.float32))
    floors = np.array([t for t in special if not np.isnan(t)], np.float32)

    @jax.jit
    def table(tf):
        exact = fused._float_exact(tf)
        by_float = x[:, None] >= tf[None, :]
        by_key = order_keys(canonical_scores(x))[:, None] >= order_keys(tf)[None, :]
        return exact, by_float, by_key

    exact, by_float, by_key = map(np.asarray, table(jnp.asarray(floors)))
    np.testing.assert_array_equal(by_float[:, exact], by_key[:, exact])
    assert exact.tolist() == [abs(t) >= tiny and t > -np.inf for t in floors.tolist()]
    for t in (1.0, -2.5, -1e-45, 0.0, np.inf, -np.inf, 3e38):  # the inverse of order_keys
        key = order_keys(jnp.float32(t))
        assert np.asarray(from_order_keys(key)).tobytes() == np.float32(t).tobytes()


def test_fused_scan_rows_lowers_for_cuda():
    specs = (jax.ShapeDtypeStruct((64, 262144), jnp.float32),
             jax.ShapeDtypeStruct((64,), jnp.int32))
    text = common.lower_for_cuda(functools.partial(fused.topk_fused, k=2048, scan_rows=32),
                                 *specs)
    assert text.count(common.TRITON_CALL_TARGET) == 3 and _xla_ops(text) == []
    with pytest.raises(ValueError, match="scan_rows=3 must be a power of two"):
        fused.fused_config(2000, 64, scan_rows=3)
    assert fused.fused_config(262144, 2048, scan_rows=8192).scan_rows == 2048  # <= CH
    assert fused.fused_config(16, 4).scan_rows == 16  # the default 32, clipped to CH


def _sample_positions(length, sample, window):
    """fused._sample_floor's sample positions of a row of the given length."""
    ws = max(window, length // (sample // window))
    i = np.arange(sample)
    p = (i // window) * ws + i % window
    return p[p < length]


def test_fused_sample_too_high_or_too_low():
    """A sample that sits above the m-th score (every sample position holds the row's top
    score: c(t) < m) or far below it (every sample position holds its lowest: every block
    overflows) sends the row to the fallback scan, from the bracket below / above t."""
    rng = np.random.default_rng(3)
    n, k, tun = 2000, 100, dict(block=128, chunk=64, sample=64, window=8)
    lengths = np.array([n, n, n, n - 5], np.int32)
    scores = rng.normal(size=(4, n)).astype(np.float32)
    for r, value in ((0, 10.0), (1, -10.0), (3, 10.0)):
        scores[r, _sample_positions(lengths[r], tun["sample"], tun["window"])] = value
    scores[3, n - 5:] = np.nan
    fast = _check_fused(scores, lengths, k, **tun)
    assert fast.tolist() == [False, False, True, False]


def test_fused_floor_hint():
    """floor = a per-row score hint (the previous step's k-th score): a hint at or below the
    m-th score finishes from the candidates; above every score, NaN or -inf (every position a
    candidate: crowded blocks) the row is scanned; all rows exact."""
    scores, lengths, k = _fused_rows(5, "normal")
    srt = -np.sort(-np.where(np.arange(2000)[None] < lengths[:, None], scores, -np.inf), 1)
    floor = srt[:, k + 5].copy()
    floor[3] = srt[3, 0] + 1.0  # above every score
    floor[4], floor[5] = np.nan, -np.inf
    fast = _check_fused(scores, lengths, k, floor=floor, **FUSED_TUN)
    assert fast.tolist() == [True, True, True, False, False, False]


@pytest.mark.parametrize("kind", ["normal", "ties", "extreme", "relu"])
@pytest.mark.parametrize("hint,digit_bits", [("above", 4), ("above", 1), ("below", 8)])
def test_fused_fallback_matches_xla(kind, hint, digit_bits):
    """Every long row scanned whole (floor hints above every score: c(t) < m; or -inf: every
    position a candidate, crowded blocks): the radix search over the row and the take pass
    in position order give the reference's sets, ties and the full key range included."""
    scores, lengths, k = _fused_rows(7 + len(kind), kind)
    floor = np.full(lengths.shape, np.inf if hint == "above" else -np.inf, np.float32)
    fast = _check_fused(scores, lengths, k, floor=floor, digit_bits=digit_bits,
                        fallback_chunk=256, **FUSED_TUN)
    if kind != "extreme":  # (there, +inf scores can fill a row's top k: c(+inf) >= m)
        assert not fast[3:].any(), fast


@pytest.mark.parametrize("n,k", [(300, 300), (1000, 999), (20, 40)])
def test_fused_k_at_least_length(n, k):
    """k >= N (or N - 1) and rows shorter than k: every eligible position wins."""
    rng = np.random.default_rng(n)
    lengths = np.array([n, 0, n - 7, 1], np.int32)
    scores = rng.integers(-3, 4, size=(4, n)).astype(np.float32)
    for r, length in enumerate(lengths):
        scores[r, length:] = np.nan
    _check_fused(scores, lengths, k, block=64, chunk=32, sample=128)


def test_fused_n_not_a_power_of_two():
    """N = 36864: 9 select programs a row (NBP = 16 count rows, 7 unset), a 65536-wide row
    view in the finish; full, partial and short rows."""
    rng = np.random.default_rng(36864)
    n, k = 36864, 512
    lengths = np.array([n, 20000, 511], np.int32)
    scores = np.round(rng.normal(size=(3, n)), 3).astype(np.float32)
    for r, length in enumerate(lengths):
        scores[r, length:] = np.nan
    assert _check_fused(scores, lengths, k, block=4096).all()


def _xla_ops(text):
    """StableHLO ops of a lowered module other than the Triton calls, reshapes and metadata
    (sharding annotations, functions, constants): what XLA would run between the kernels."""
    ops = re.findall(r"^\s*(?:%[^=]*= )?\"?(stablehlo\.[a-z_]+|chlo\.[a-z_]+)", text, re.M)
    return sorted(op for op in ops if op not in (
        "stablehlo.custom_call", "stablehlo.reshape", "stablehlo.constant", "stablehlo.return"))


@pytest.mark.parametrize("b,n,k,tun,calls", [
    (64, 262144, 2048, {}, 3), (64, 262144, 2048, dict(threshold_kernel=False), 2),
    (64, 131072, 2048, {}, 3), (64, 32768, 512, {}, 2), (8, 36864, 512, {}, 3)])
def test_fused_lowers_to_few_launches(b, n, k, tun, calls):
    """Lowered for CUDA: the Triton calls and nothing else for XLA to run (no sort, fusion,
    loop, conditional or host transfer; a reshape of the lengths is a bitcast), while the
    "triton" path has 5 Triton calls and XLA work between them. By default a row of more than
    two select programs (N > 32768) gets the separate threshold launch (three calls)."""
    specs = (jax.ShapeDtypeStruct((b, n), jnp.float32), jax.ShapeDtypeStruct((b,), jnp.int32))
    text = common.lower_for_cuda(functools.partial(fused.topk_fused, k=k, **tun), *specs)
    assert text.count(common.TRITON_CALL_TARGET) == calls
    assert "topk_fused_select" in text and "topk_fused_finish" in text
    assert _xla_ops(text) == []
    if not tun and n == 262144:
        old = common.lower_for_cuda(functools.partial(topk, k=k, implementation="triton"),
                                    *specs)
        assert old.count(common.TRITON_CALL_TARGET) == 5 and "chlo.top_k" in _xla_ops(old)


def test_fused_api_has_no_device_predicate_control_flow():
    """Through api.topk: no while / cond in the jaxpr outside the kernels, three Triton calls
    at N = 262144 (threshold, select, finish), no host callback; a k too large for the
    register finish runs "triton" instead."""
    from test_kernel_topk_nosync import _control_flow_prims

    fn = functools.partial(topk, k=2048, implementation="triton_fused")
    specs = (jax.ShapeDtypeStruct((64, 262144), jnp.float32),
             jax.ShapeDtypeStruct((64,), jnp.int32))
    with common.abstract_gpu():
        jaxpr = jax.make_jaxpr(fn)(*specs)
    assert _control_flow_prims(jaxpr.jaxpr, []) == []
    text = common.lower_for_cuda(fn, *specs)
    assert text.count(common.TRITON_CALL_TARGET) == 3 and "callback" not in text
    big = functools.partial(topk, k=9000, implementation="triton_fused")
    specs = (jax.ShapeDtypeStruct((2, 65536), jnp.float32), jax.ShapeDtypeStruct((2,), jnp.int32))
    assert not fused.fits(65536, 9000)
    assert "topk_select_seg" in common.lower_for_cuda(big, *specs)


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
    assert_topk_equal(topk(*args, implementation="triton_fused"), want)
    assert_topk_equal(topk(*args), want)  # None picks triton on a GPU


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["normal", "ties", "relu"])
@pytest.mark.parametrize("variant", ["default", "thr_kernel", "b8192", "hint_above", "hint_ok",
                                     "r1", "keys", "keys_stop", "finish_plain",
                                     "skip_ties_only", "thirds", "thr_warps4"])
def test_fused_on_gpu(variant, kind):
    """fused.py's compiled kernels at the target shape against XLA: the defaults, the separate
    threshold launch, 32 programs a row, floor hints that send every row to the whole-row
    scan or finish it from the candidates, the prefix count in one scan (the default: 32
    row scans), select's f32 compare with the finish's early stop and the early stop alone,
    the threshold launch at 4 warps; one ascending row (crowded last blocks) in each."""
    b, n, k = 64, 262144, 2048
    scores, lengths = _gpu_case(3 * b + k, b, n, k, kind)
    scores[9] = np.sort(scores[9])
    args = (jnp.asarray(scores), jnp.asarray(lengths), k)
    want = topk_xla(*args)
    floor = None
    if variant.startswith("hint"):
        vals = np.asarray(want[1])
        floor = np.full((b,), np.inf, np.float32) if variant == "hint_above" else vals[:, -1]
        floor = jnp.asarray(np.where(np.isfinite(floor) | (variant == "hint_above"), floor,
                                     -np.inf).astype(np.float32))
    tun = {"thr_kernel": dict(threshold_kernel=True), "b8192": dict(block=8192),
           "r1": dict(scan_rows=1),
           "keys": dict(compare="keys", stop_early=False),
           "keys_stop": dict(compare="keys"),
           "finish_plain": PLAIN_FINISH,
           "skip_ties_only": dict(PLAIN_FINISH, skip_ties=True),
           "thirds": dict(search="thirds"),
           "thr_warps4": dict(threshold_kernel=True, threshold_warps=4),
           }.get(variant, {})
    assert_topk_equal(fused.topk_fused(*args, floor=floor, **tun), want)

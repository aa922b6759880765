"""pallas_kernels.topk's fixed launch sequence (issue 16, deliver 1): no XLA loop or branch on a
device value; the refine launch (later counting passes inside one kernel, an early exit for
rows that are done) against the XLA reference, in Pallas interpret mode on CPU.

Sets are compared as sets; values aligned to them exactly; padding -1 / -inf. Inputs: random
scores, NaN / +inf / huge / -1 poison past each length, heavy ties, rows with fewer than k
eligible positions, k == N, brackets of the full key range (extreme keys).
"""

import functools

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_helpers import gpu_topk_rows
from test_kernel_topk import assert_topk_equal, numpy_topk

from pallas_kernels import common
from pallas_kernels.pq_topc import triton as pq_triton
from pallas_kernels.topk import topk
from pallas_kernels.topk import triton as topk_impl
from pallas_kernels.topk.reference import topk_xla

POISON = np.array([np.nan, np.inf, 3e38, -1.0], np.float32)


def _poison(rng, scores, lengths):
    scores = scores.copy()
    for r, length in enumerate(lengths):
        tail = scores[r, max(int(length), 0):]
        tail[...] = rng.choice(POISON, size=tail.shape)
    return scores


def _case(seed, kind, b=6, n=700, k=24):
    """Rows: lengths 0, < k, == k, a partial last block, N - 1, N; scores by kind."""
    rng = np.random.default_rng(seed)
    lengths = np.array([0, k // 3, k, 333, n - 1, n], np.int32)[:b]
    if kind == "normal":
        scores = rng.normal(size=(b, n))
    elif kind == "ties":  # few distinct values: the k-th place is tied many times
        scores = rng.integers(-2, 3, size=(b, n))
    elif kind == "extreme":  # keys spanning the whole int32 range: the widest brackets
        pool = np.array([np.inf, -np.inf, 3.4e38, -3.4e38, 1e-45, -1e-45, 0.0, -0.0, 1.0],
                        np.float64)
        scores = rng.choice(pool, size=(b, n))
        scores[:, ::5] = rng.normal(size=scores[:, ::5].shape) * 1e30
    else:  # "relu": most scores exactly 0, a tail of positive ones
        scores = np.maximum(rng.normal(size=(b, n)) - 1.0, 0.0)
    return _poison(rng, scores.astype(np.float32), lengths), lengths, k


def _check_against_xla(scores, lengths, k, got):
    want = topk_xla(jnp.asarray(scores), jnp.asarray(lengths), k)
    assert_topk_equal(got, want)
    assert_topk_equal(got, numpy_topk(scores, lengths, k))


@pytest.mark.parametrize("digit_bits", [1, 2, 4, 8])
@pytest.mark.parametrize("kind", ["normal", "ties", "extreme", "relu"])
def test_refine_runs_and_matches_xla(kind, digit_bits):
    """Tiny CAP and sample: the sampled first pass leaves wide brackets, so the refine kernel
    narrows them (asserted), with 1 to 8 bits per in-kernel pass."""
    scores, lengths, k = _case(digit_bits * 7 + len(kind), kind)
    tun = dict(block=128, cap=32, chunk=32, sample=16, digit_bits=digit_bits)
    got = topk_impl.topk_triton(jnp.asarray(scores), jnp.asarray(lengths), k, **tun)
    _check_against_xla(scores, lengths, k, got)
    # The refine launch had work: some row's bracket after pass 0 still held > CAP keys.
    cfg = topk_impl.config(scores.shape[1], k, interpret=True, **tun)
    length, m = topk_impl.row_lengths(jnp.asarray(lengths), cfg)
    thr = topk_impl.sample_thresholds(jnp.asarray(scores)[:, ::topk_impl.sample_stride(cfg)],
                                      length, m, cfg)
    keys = np.asarray(topk_impl.order_keys(jnp.asarray(np.where(np.isnan(scores), -np.inf,
                                                                 scores))))
    eligible = np.arange(scores.shape[1])[None, :] < np.asarray(length)[:, None]
    c = ((keys[:, :, None] >= np.asarray(thr)[:, None, :]) & eligible[..., None]).sum(1)
    c_all = np.concatenate([np.asarray(length)[:, None], c, np.zeros_like(c[:, :1])], 1)
    m = np.asarray(m)
    sel = [(c_all[r] >= m[r]).sum() for r in range(len(m)) if m[r] > 0]  # c(hi) < m <= c(lo)
    left = [c_all[r, s - 1] - c_all[r, s] for r, s in zip(np.flatnonzero(m > 0), sel)]
    assert max(left) > tun["cap"], f"no row left for the refine kernel: {left}"


@pytest.mark.parametrize("digit_bits", [2, 4])
@pytest.mark.parametrize("kind", ["normal", "ties", "extreme"])
def test_refine_from_the_start_bracket(kind, digit_bits):
    """A producer's first pass that narrowed nothing (every threshold = key(-inf)): every row
    longer than CAP enters the refine kernel at [key(-inf), INT32_MAX) and is narrowed there
    alone; per-block counts come from the refine kernel."""
    scores, lengths, k = _case(3 + digit_bits, kind)
    cfg = topk_impl.config(scores.shape[1], k, interpret=True, block=64, cap=32, chunk=32,
                           digit_bits=digit_bits)
    thr = np.full((scores.shape[0], cfg.nt), topk_impl.KEY_NEG_INF, np.int32)
    first = np.arange(cfg.nblk)[None, :] * cfg.block
    per_block = np.clip(np.clip(lengths, 0, None)[:, None] - first, 0, cfg.block)
    counts = np.repeat(per_block[:, :, None], cfg.nt, axis=2).astype(np.int32)
    fn = jax.jit(topk_impl.topk_after_first_pass, static_argnames="cfg")
    got = fn(jnp.asarray(scores), jnp.asarray(lengths), thr, counts, cfg=cfg)
    _check_against_xla(scores, lengths, k, got)


@pytest.mark.parametrize("n,k", [(200, 200), (300, 300), (64, 64)])
def test_k_equal_to_n(n, k):
    """k == N: every eligible position wins (rows shorter than N pad with -1)."""
    rng = np.random.default_rng(n)
    lengths = np.array([n, 0, n - 7, 1], np.int32)
    scores = _poison(rng, rng.integers(-3, 4, size=(4, n)).astype(np.float32), lengths)
    for tun in (dict(), dict(block=32, cap=16, chunk=16, sample=8, digit_bits=2)):
        got = topk_impl.topk_triton(jnp.asarray(scores), jnp.asarray(lengths), k, **tun)
        _check_against_xla(scores, lengths, k, got)


def _one_read_ok(scores, lengths, k, tun):
    cfg = topk_impl.config(scores.shape[1], k, interpret=True, one_read=True, **tun)
    length, m = topk_impl.row_lengths(jnp.asarray(lengths), cfg)
    fn = jax.jit(topk_impl.one_read_select, static_argnames="cfg")
    return np.asarray(fn(jnp.asarray(scores), length, m, cfg=cfg)[0])


@pytest.mark.parametrize("kind", ["normal", "ties", "extreme", "relu"])
def test_one_read_matches_xla(kind):
    """one_read=True: rows finished from the one selection pass (sampled floor, per-block
    segments) and rows that fall back to the two-read sequence (a floor above the m-th key,
    or a block with more than SEG candidates: here an ascending row and a row whose
    candidates all sit in one block) both give the reference's sets."""
    scores, lengths, k = _case(11 + len(kind), kind, b=6, n=2000, k=24)
    lengths[1] = 2000  # replace the row shorter than k by two long adversarial ones
    scores[1] = np.sort(scores[1])  # ascending: every winner in the last blocks
    scores[2, :lengths[2]] = -1.0
    scores[2, 640:640 + k] = 5.0  # fewer than k candidates anywhere but one block
    lengths[2] = 2000
    tun = dict(block=128, sample=512, chunk=64)
    got = topk_impl.topk_triton(jnp.asarray(scores), jnp.asarray(lengths), k, one_read=True,
                                **tun)
    _check_against_xla(scores, lengths, k, got)
    ok = _one_read_ok(scores, lengths, k, tun)
    if kind == "normal":  # both paths ran
        assert ok[[0, 4, 5]].all() and not ok[1], ok


@pytest.mark.parametrize("kind,one_read", [("normal", True)] + [
    pytest.param(kind, one_read, marks=pytest.mark.slow) for kind, one_read in (
        ("ties", False), ("normal", False), ("ties", True), ("extreme", False), ("extreme", True),
        ("relu", False), ("relu", True))])
def test_finish_in_registers_matches_xla(kind, one_read):
    """Stage 2 on keys held in registers (bit-by-bit search of T, one prefix-sum take) gives
    the reference's sets on both paths, ties and the full key range included; adversarial
    rows make the one-read path fall back too."""
    scores, lengths, k = _case(31 + len(kind), kind, b=6, n=2000, k=24)
    lengths[1] = 2000
    scores[1] = np.sort(scores[1])
    got = topk_impl.topk_triton(jnp.asarray(scores), jnp.asarray(lengths), k,
                                one_read=one_read, finish_in_registers=True, block=128,
                                sample=512, chunk=64, cap=64)
    _check_against_xla(scores, lengths, k, got)


def test_one_read_with_a_floor_hint():
    """floor = a per-row score hint (the previous step's k-th score): rows whose hint is at or
    below their m-th score finish in the one-read pass, rows whose hint is too high (or NaN /
    -inf) fall back; every row gives the reference's set."""
    scores, lengths, k = _case(5, "normal", b=6, n=2000, k=24)
    srt = -np.sort(-np.where(np.arange(2000)[None] < lengths[:, None], scores, -np.inf), 1)
    floor = srt[:, k + 5].copy()  # a little below the k-th: ok
    floor[1] = srt[1, 0] + 1.0  # above every score: fallback
    floor[2], floor[3] = np.nan, -np.inf  # no hint: every eligible position a candidate
    tun = dict(block=128, chunk=64, finish_in_registers=True)
    got = topk_impl.topk_triton(jnp.asarray(scores), jnp.asarray(lengths), k, one_read=True,
                                floor=jnp.asarray(floor), **tun)
    _check_against_xla(scores, lengths, k, got)
    with pytest.raises(ValueError, match="needs one_read=True"):
        topk_impl.topk_triton(jnp.asarray(scores), jnp.asarray(lengths), k,
                              floor=jnp.asarray(floor))


@pytest.mark.parametrize("cap", [64, 4096])
def test_one_read_floor_above_the_kth(cap):
    """Every sample position holds the row's top score, so the floor t lands on it and c(t)
    (the sampled positions only) < m: the row falls back from the bracket [key(-inf), t)
    (refined in-kernel when it holds > CAP keys, cap=64)."""
    rng = np.random.default_rng(cap)
    n, k, sample = 2000, 100, 64
    scores = rng.normal(size=(3, n)).astype(np.float32)
    stride = n // sample
    scores[:2, ::stride] = 10.0
    lengths = np.array([n, n - 5, n], np.int32)
    scores = _poison(rng, scores, lengths)
    tun = dict(block=128, sample=sample, chunk=64, cap=cap)
    got = topk_impl.topk_triton(jnp.asarray(scores), jnp.asarray(lengths), k, one_read=True,
                                **tun)
    _check_against_xla(scores, lengths, k, got)
    assert not _one_read_ok(scores, lengths, k, tun)[:2].any()


@pytest.mark.parametrize("n,k", [(300, 300), (1000, 999)])
def test_one_read_k_near_n(n, k):
    """k == N (or N - 1): the floor is key(-inf), every eligible position a candidate."""
    rng = np.random.default_rng(n)
    lengths = np.array([n, 0, n - 7, 1], np.int32)
    scores = _poison(rng, rng.integers(-3, 4, size=(4, n)).astype(np.float32), lengths)
    got = topk_impl.topk_triton(jnp.asarray(scores), jnp.asarray(lengths), k, one_read=True,
                                block=64, sample=128)
    _check_against_xla(scores, lengths, k, got)


def test_even_thresholds_against_big_ints():
    """Inside (lo, hi), ascending, first lo + 1, gaps <= ceil((hi - lo) / NT), for brackets up
    to the whole int32 range (hi - lo overflows int32)."""
    rng = np.random.default_rng(5)
    i32 = np.iinfo(np.int32)
    lo = rng.integers(i32.min, i32.max - 2, size=400, dtype=np.int64)
    hi = lo + 2 + (rng.integers(0, i32.max, size=400, dtype=np.int64) % (i32.max - lo - 1))
    lo[:4], hi[:4] = [i32.min, i32.min, -5, topk_impl.KEY_NEG_INF], [i32.max, i32.min + 2, 5,
                                                                      i32.max]
    for bits in (1, 2, 4, 8):
        thr = np.asarray(topk_impl.even_thresholds(jnp.asarray(lo, jnp.int32),
                                                   jnp.asarray(hi, jnp.int32), bits), np.int64)
        nt = 1 << bits
        assert np.all(thr[:, 0] == lo + 1)
        assert np.all(thr > lo[:, None]) and np.all(thr < hi[:, None])
        assert np.all(np.diff(thr, axis=1) >= 0)
        edges = np.concatenate([lo[:, None], thr, hi[:, None]], 1)
        assert np.all(np.diff(edges, axis=1) <= -(-(hi - lo) // nt)[:, None])


# -------------------------------------------------------- no loop / branch on device values


def _control_flow_prims(jaxpr, found):
    """Names of while / cond primitives in a closed jaxpr and its sub-jaxprs, not looking
    inside Pallas kernels (their loops run on the device, without the host)."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            continue
        if eqn.primitive.name in ("while", "cond"):
            found.append(eqn.primitive.name)
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(sub, jax.extend.core.ClosedJaxpr):
                    sub = sub.jaxpr
                if isinstance(sub, jax.extend.core.Jaxpr):
                    _control_flow_prims(sub, found)
    return found


def _ops():
    """(name, fn, input specs) of every call path through topk's Triton stages."""
    topk_specs = (jax.ShapeDtypeStruct((64, 262144), jnp.float32),
                  jax.ShapeDtypeStruct((64,), jnp.int32))
    b, h, d, m, k, n = 64, 64, 128, 32, 256, 131072
    pq_specs = (jax.ShapeDtypeStruct((b, h, d), jnp.bfloat16),
                jax.ShapeDtypeStruct((b, h), jnp.float32),
                jax.ShapeDtypeStruct((b, n, m), jnp.uint8),
                jax.ShapeDtypeStruct((m, k, d // m), jnp.float32),
                jax.ShapeDtypeStruct((b,), jnp.int32))
    return [
        ("topk", functools.partial(topk, k=2048, implementation="triton"), topk_specs),
        ("topk_one_read", functools.partial(topk_impl.topk_triton, k=2048, one_read=True,
                                            sample=4096), topk_specs),
        ("topk_one_read_regs", functools.partial(topk_impl.topk_triton, k=2048, one_read=True,
                                                 sample=4096, finish_in_registers=True),
         topk_specs),
        ("pq_topc_fused", functools.partial(pq_triton.pq_topc_triton, num_candidates=2048),
         pq_specs),
        ("pq_topc_unfused", functools.partial(pq_triton.pq_topc_triton, num_candidates=2048,
                                              fused=False), pq_specs),
    ]


@pytest.mark.parametrize("name,fn,specs", _ops(), ids=[o[0] for o in _ops()])
def test_no_device_predicate_control_flow(name, fn, specs):
    """The CPU-side proof of deliver 1: as lowered for CUDA, neither the jaxpr (outside the
    Pallas kernels) nor the StableHLO holds a while loop or a conditional, so XLA's GPU runtime
    never copies a predicate to the host; the kernels are all there."""
    with common.abstract_gpu():
        jaxpr = jax.make_jaxpr(fn)(*specs)
    assert _control_flow_prims(jaxpr.jaxpr, []) == []
    text = common.lower_for_cuda(fn, *specs)
    body = "\n".join(line for line in text.splitlines() if common.TRITON_CALL_TARGET not in line)
    assert not [op for op in ("stablehlo.while", "stablehlo.case", "stablehlo.if")
                if op in body], f"{name}: control flow on device values"
    assert text.count(common.TRITON_CALL_TARGET) >= 4  # ... refine, select, finish
    assert "topk_refine" in text
    if name.startswith("topk_one_read"):
        assert "topk_select_seg" in text and "topk_finish_seg" in text


def _other_ops():
    """(name, fn, specs, expected): the Triton paths of the other ops at their V4 shapes."""
    from pallas_kernels.gather_rows import gather_rows
    from pallas_kernels.hot_resolve import hot_resolve
    from pallas_kernels.hot_resolve import triton as hot_triton
    from pallas_kernels.index_scores import index_scores
    from pallas_kernels.miss_filter import miss_filter
    from pallas_kernels.sparse_attention import sparse_attention
    from pallas_kernels.topk import candidate_topk

    s = jax.ShapeDtypeStruct
    hot = functools.partial(hot_resolve, page_size=64, implementation="triton_copy")
    hot_common = (s((128,), jnp.int32), s((256,), jnp.int32), s((256,), jnp.int32),
                  s((), jnp.int32), s((64,), jnp.int32))
    from pallas_kernels.index_scores import index_topk

    fused = functools.partial(hot_resolve, page_size=64, implementation="triton_fused")
    index_specs = (s((64, 64, 128), jnp.float32), s((64, 64), jnp.float32),
                   s((64, 2048, 128), jnp.float8_e4m3fn), s((64, 2048, 1), jnp.float32),
                   s((64, 2048), jnp.bool_))
    return [
        ("hot_resolve_fused", fused,  # FP8 keys, D=1 scales and a D=24 leaf: all in-kernel
         (hot_common[0], (s((256, 128), jnp.float8_e4m3fn), s((256, 1), jnp.float32),
                          s((256, 24), jnp.bfloat16)), *hot_common[1:],
          (s((4096, 128), jnp.float8_e4m3fn), s((4096, 1), jnp.float32),
           s((4096, 24), jnp.bfloat16)))),
        ("hot_resolve_fused_e8m0", fused,  # fp8_v4 rows: e4m3 values and e8m0 scales
         (hot_common[0], (s((256, 448), jnp.float8_e4m3fn), s((256, 7), jnp.float8_e8m0fnu)),
          *hot_common[1:],
          (s((4096, 448), jnp.float8_e4m3fn), s((4096, 7), jnp.float8_e8m0fnu)))),
        ("index_scores_fp8", functools.partial(index_scores, implementation="triton_fp8"),
         index_specs),
        ("index_topk_fp8", functools.partial(index_topk, k=512, implementation="triton_fp8"),
         index_specs),
        ("candidate_topk", functools.partial(candidate_topk, k=512, implementation="triton"),
         (s((64, 2112), jnp.float32), s((64, 2112), jnp.int32))),
        ("miss_filter", functools.partial(miss_filter, k=512, offset=1.0,
                                          implementation="triton"),
         (s((64, 2048), jnp.float32), s((64, 2048), jnp.bool_), s((64, 2048), jnp.bool_))),
        ("topk_fused_top_c", functools.partial(topk, k=2048, implementation="triton_fused"),
         (s((64, 32768), jnp.float32), s((64,), jnp.int32))),  # the jax-triton pq's top-C
        ("gather_rows", functools.partial(gather_rows, implementation="triton"),
         (s((1 << 20, 128), jnp.float32), s((512,), jnp.int32))),
        ("index_scores", functools.partial(index_scores, implementation="triton"),
         (s((64, 64, 128), jnp.float32), s((64, 64), jnp.float32),
          s((64, 2048, 128), jnp.float8_e4m3fn), s((64, 2048, 1), jnp.float32),
          s((64, 2048), jnp.bool_))),
        ("sparse_attention", functools.partial(sparse_attention, implementation="triton"),
         (s((2, 64, 512), jnp.bfloat16), s((2, 2048, 512), jnp.bfloat16),
          s((2, 512), jnp.int32), s((2, 128, 512), jnp.bfloat16), s((2, 128), jnp.bool_),
          s((64,), jnp.float32))),
        ("hot_resolve_f32", hot,
         (hot_common[0], s((256, 128), jnp.float32), *hot_common[1:],
          s((4096, 128), jnp.float32))),
        pytest.param(
            "hot_resolve_fp8_scales", hot,
            (hot_common[0], (s((256, 128), jnp.float8_e4m3fn), s((256, 1), jnp.float32)),
             *hot_common[1:], (s((4096, 128), jnp.float8_e4m3fn), s((4096, 1), jnp.float32))),
            marks=pytest.mark.xfail(not hot_triton.kernel_row(1), strict=True, reason=(
                "hot_resolve/triton.py moves leaves narrower than 16 values (the FP8 scale "
                "leaf, D=1) with reference.move_rows_xla: a fori_loop over a device count of "
                "misses, i.e. an XLA while loop on a device predicate (issue 16, deliver 1); "
                "main's ba4aef9 sends D=1 through the kernel, and then this must pass"))),
    ]


@pytest.mark.parametrize("name,fn,specs", _other_ops(),
                         ids=["hot_resolve_fused", "hot_resolve_fused_e8m0", "index_scores_fp8",
                              "index_topk_fp8", "candidate_topk", "miss_filter",
                              "topk_fused_top_c",
                              "gather_rows", "index_scores", "sparse_attention",
                              "hot_resolve_f32", "hot_resolve_fp8_scales"])
def test_other_ops_have_no_device_predicate_control_flow(name, fn, specs):
    """The same check over the other ops' Triton paths (the known exception is xfail)."""
    with common.abstract_gpu():
        jaxpr = jax.make_jaxpr(fn)(*specs)
    assert _control_flow_prims(jaxpr.jaxpr, []) == [], name


def test_old_while_loop_would_be_caught():
    """The checks above do see an XLA while loop on a device value (guards the test)."""
    def looping(x):
        return jax.lax.while_loop(lambda s: jnp.sum(s) < 100.0, lambda s: s * 2.0 + 1.0, x)

    spec = jax.ShapeDtypeStruct((4,), jnp.float32)
    assert _control_flow_prims(jax.make_jaxpr(looping)(spec).jaxpr, []) == ["while"]
    assert "stablehlo.while" in common.lower_for_cuda(looping, spec)


# ------------------------------------------------------------------------------------- GPU


def _gpu_rows(seed, b, n, k, kind):
    rng = np.random.default_rng(seed)
    scores, lengths = gpu_topk_rows(rng, b, n, k, kind)
    scores[9] = np.sort(scores[9])  # ascending: the one-read path falls back
    return _poison(rng, scores, lengths), lengths


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["normal", "ties", "relu"])
@pytest.mark.parametrize("variant", ["refine", "one_read", "one_read_s4096", "regs",
                                     "one_read_regs"])
def test_fixed_sequence_on_gpu(variant, kind):
    """The compiled kernels at the benchmark shape: refine forced by a small CAP and sample,
    and the one-read path (with its fallback rows), against XLA."""
    b, n, k = 64, 262144, 2048
    scores, lengths = _gpu_rows(7, b, n, k, kind)
    tun = {"refine": dict(cap=2048, sample=64, digit_bits=4),
           "one_read": dict(one_read=True),
           "one_read_s4096": dict(one_read=True, sample=4096),
           "regs": dict(finish_in_registers=True),
           "one_read_regs": dict(one_read=True, sample=4096, finish_in_registers=True)}[variant]
    got = topk_impl.topk_triton(jnp.asarray(scores), jnp.asarray(lengths), k, **tun)
    assert_topk_equal(got, topk_xla(jnp.asarray(scores), jnp.asarray(lengths), k))


"""pq_topc (PQ coarse scores + top-C): xla, triton (fused: the score kernel runs topk's first
counting pass) and triton_unfused (score kernel, then topk) implementations, CUDA lowering,
errors; jax_triton (plain Triton, GPU only): its packing/decode emulated in jnp on CPU, the
kernel itself under the gpu marker.

Exact-value tests use small-integer queries and codebooks with dyadic head weights, so bf16 and
f32 agree bit for bit and the many ties must be broken exactly by the rule (higher score first,
then the lower position). Random-value tests compare scores within the bf16 tolerance and
compare positions with the top-C of the kernel's own scores.
"""


import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import common
from pallas_kernels.pq_topc import jax_triton as pq_jt
from pallas_kernels.pq_topc import pq_topc, reference
from pallas_kernels.pq_topc import triton as pq_triton
from tests.kernel_helpers import (
    TOLERANCE,
    assert_close,
    assert_same_sets,
    assert_swaps_at_boundary,
    pq_problem,
)

IMPLEMENTATIONS = ("xla", "triton", "triton_unfused")
V4_FLASH = dict(b=64, h=64, d=128, m=32, k=256, n=131072, c=2048)


# ----------------------------------------------------------------------------------- helpers


def make_inputs(rng, b, h, d, m, k, n, lengths, *, exact, q_dtype=np.float32, garbage="mix"):
    """(q, weights, codes, codebooks, lengths) as numpy. Codes past each length are garbage:
    255 (>= K when K < 256) in even rows, random bytes in odd rows (or all of one kind)."""
    if exact:  # small integers and dyadic weights: exact in bf16, exact sums in f32
        q = rng.integers(-1, 2, (b, h, d)).astype(np.float32)
        books = rng.integers(-1, 2, (m, k, d // m)).astype(np.float32)
        weights = (rng.integers(-2, 5, (b, h)) / 4).astype(np.float32)
    else:
        q = rng.normal(size=(b, h, d)).astype(np.float32)
        books = rng.normal(size=(m, k, d // m)).astype(np.float32)
        weights = rng.uniform(-0.5, 1.0, (b, h)).astype(np.float32)
    codes = rng.integers(0, k, (b, n, m)).astype(np.uint8)
    lengths = np.asarray(lengths, np.int32)
    for row, length in enumerate(lengths):
        tail = codes[row, max(int(length), 0):]
        use_255 = garbage == "255" or (garbage == "mix" and row % 2 == 0)
        tail[...] = 255 if use_255 else rng.integers(0, 256, tail.shape)
    return jnp.asarray(q).astype(q_dtype), weights, codes, books, lengths


def numpy_scores(q, weights, codes, books, lengths):
    """Masked Eq. 6 scores [B, N] in float64 (-inf past each length; garbage codes clamped)."""
    m, k, ds = books.shape
    idx = np.minimum(codes.astype(np.int64), k - 1)
    keys = books.astype(np.float64)[np.arange(m), idx].reshape(*codes.shape[:2], m * ds)
    dots = np.einsum("bhd,bnd->bhn", np.asarray(q, np.float64), keys)
    s = np.einsum("bh,bhn->bn", weights.astype(np.float64), np.maximum(dots, 0.0))
    eligible = np.arange(codes.shape[1])[None, :] < lengths[:, None]
    return np.where(eligible, s, -np.inf)


def numpy_top_c(scores, c):
    """Best-first top-C per row by the rule: higher score, then lower position; -1 padding."""
    b, n = scores.shape
    pos = np.full((b, c), -1, np.int64)
    vals = np.full((b, c), -np.inf)
    for r in range(b):
        order = np.lexsort((np.arange(n), -scores[r]))  # primary: -score, secondary: position
        order = order[np.isfinite(scores[r][order])][:c]
        pos[r, :len(order)], vals[r, :len(order)] = order, scores[r][order]
    return pos, vals


def values_at(pos, vals, scores):
    """Checks vals are aligned with pos: equal to ``scores`` there, -inf at padding."""
    pos, vals = np.asarray(pos), np.asarray(vals)
    pad = pos < 0
    assert np.all(np.isneginf(vals[pad])), "padding positions must have score -inf"
    want = np.take_along_axis(np.asarray(scores), np.maximum(pos, 0), axis=1)
    return vals[~pad], want[~pad]


def check_exact(got_pos, got_vals, want_pos, want_vals):
    """Same sets, and every returned score equals the wanted score of that position."""
    assert_same_sets(got_pos, want_pos)
    got_pos, got_vals = np.asarray(got_pos), np.asarray(got_vals, np.float64)
    for r in range(got_pos.shape[0]):
        want = dict(zip(np.asarray(want_pos[r]).tolist(), np.asarray(want_vals[r]).tolist()))
        for p, v in zip(got_pos[r].tolist(), got_vals[r].tolist()):
            assert v == want[p] or (p < 0 and v == -np.inf), f"row {r} position {p}: {v}"


def run(implementation, *args, c, **kwargs):
    """pq_topc by ``implementation``; "triton_unfused" is pq_topc_triton(fused=False)."""
    precision = kwargs.pop("precision", "bf16")
    if implementation == "triton_unfused":
        args = [jnp.asarray(a) for a in args]
        return pq_triton.pq_topc_triton(*args, num_candidates=c, fused=False,
                                        precision=precision, **kwargs)
    if kwargs:
        args = [jnp.asarray(a) for a in args]
        return pq_triton.pq_topc_triton(*args, num_candidates=c, precision=precision, **kwargs)
    return pq_topc(*args, num_candidates=c, implementation=implementation, precision=precision)


# ------------------------------------------------------------------------ all implementations


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_exact_scores_with_ties(implementation):
    """Integer-valued inputs: exact scores, many ties, lengths 0, < C, == N, > N; garbage codes
    (255 >= K and random bytes) past each length; N not a multiple of the kernel block; H, D/M
    not powers of two (the triton wrapper pads them)."""
    rng = np.random.default_rng(0)
    b, h, d, m, k, n, c = 6, 6, 12, 4, 10, 200, 24
    lengths = [0, 7, n, 150, 1, n + 5]
    q, w, codes, books, lengths = make_inputs(rng, b, h, d, m, k, n, lengths, exact=True)
    pos, vals = run(implementation, q, w, codes, books, lengths, c=c)
    assert pos.shape == (b, c) and pos.dtype == jnp.int32
    assert vals.shape == (b, c) and vals.dtype == jnp.float32
    exact = numpy_scores(q, w, codes, books, lengths)
    straddle = [np.sort(row[np.isfinite(row)])[::-1][c - 1:c + 1] for row in exact]
    assert any(len(t) == 2 and t[0] == t[1] for t in straddle), "want a tie at the C-th place"
    want_pos, want_vals = numpy_top_c(exact, c)
    check_exact(pos, vals, want_pos, want_vals)
    assert (np.asarray(pos) < 0).sum(1).tolist() == [c, c - 7, 0, 0, c - 1, 0]


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_random_scores_bf16_query(implementation):
    """Gaussian inputs with a bf16 query, under jax.jit: scores within the bf16 tolerance of the
    f32 reference; positions are the top-C of the implementation's own score buffer and are
    near-optimal under the reference scores."""
    rng = np.random.default_rng(1)
    b, h, d, m, k, n, c = 4, 16, 32, 8, 16, 256, 40
    lengths = [n, 0, 33, 200]
    q, w, codes, books, lengths = make_inputs(rng, b, h, d, m, k, n, lengths, exact=False,
                                              q_dtype=jnp.bfloat16)
    fn = jax.jit(lambda *a: run(implementation, *a, c=c))
    pos, vals = fn(q, w, codes, books, lengths)
    ref = np.asarray(reference.masked_coarse_scores(q, w, codes, books, lengths))
    if implementation != "xla":
        own = np.asarray(pq_triton.coarse_scores_triton(q, w, codes, books, lengths))
        assert np.array_equal(np.isneginf(own), np.isneginf(ref)), "mask differs"
        assert_close(own, ref, "bfloat16", mask=np.isfinite(ref))
    else:
        own = ref
    want_pos, want_vals = numpy_top_c(own.astype(np.float64), c)
    check_exact(pos, np.asarray(vals).astype(np.float32), want_pos, want_vals.astype(np.float32))
    got, want = values_at(pos, vals, ref)
    assert_close(got, want, "bfloat16")
    # near-optimal: every chosen position's reference score >= the C-th best reference score
    # minus the tolerance (both relative to the row's largest |score|)
    ref_pos, ref_vals = numpy_top_c(ref.astype(np.float64), c)
    for r in range(b):
        chosen = np.asarray(pos[r])
        chosen = chosen[chosen >= 0]
        if chosen.size:
            floor = ref_vals[r][ref_pos[r] >= 0].min()
            scale = np.abs(ref[r][np.isfinite(ref[r])]).max()
            assert ref[r, chosen].min() >= floor - 2 * TOLERANCE["bfloat16"] * scale


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_more_candidates_than_positions(implementation):
    rng = np.random.default_rng(2)
    b, h, d, m, k, n, c = 2, 16, 16, 4, 256, 20, 32
    q, w, codes, books, lengths = make_inputs(rng, b, h, d, m, k, n, [n, 5], exact=True)
    pos, vals = run(implementation, q, w, codes, books, lengths, c=c)
    want_pos, want_vals = numpy_top_c(numpy_scores(q, w, codes, books, lengths), c)
    check_exact(pos, vals, want_pos, want_vals)
    assert (np.asarray(pos) < 0).sum(1).tolist() == [c - n, c - 5]


def test_default_implementation_on_cpu_is_xla():
    rng = np.random.default_rng(3)
    args = make_inputs(rng, 2, 4, 8, 2, 4, 16, [16, 3], exact=True)
    got = pq_topc(*args, num_candidates=4)
    want = pq_topc(*args, num_candidates=4, implementation="xla")
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])


# ------------------------------------------------------------------------ triton kernel only


@pytest.mark.parametrize("shape", [(3, 3, 9, 3, 5), (2, 32, 64, 16, 256)])
def test_triton_scores_loop_and_padding(shape):
    """The score buffer of the kernel equals the exact scores bit for bit, with a multi-block
    loop per program (blocks_per_program=4), N padded to the span, and padded H / M / D/M."""
    rng = np.random.default_rng(4)
    b, h, d, m, k = shape
    n = 100
    q, w, codes, books, lengths = make_inputs(rng, b, h, d, m, k, n, [n, 37, 0][:b],
                                              exact=True)
    params = pq_triton.Params(block_n=16, blocks_per_program=4)
    got = pq_triton.coarse_scores_triton(q, w, jnp.asarray(codes), jnp.asarray(books),
                                         jnp.asarray(lengths), params=params)
    assert got.shape == (b, n) and got.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(got), numpy_scores(q, w, codes, books, lengths))


def test_triton_with_xla_top_c_stage():
    """The score kernel followed by the XLA top-C stage (``topk_implementation="xla"``)."""
    rng = np.random.default_rng(10)
    b, h, d, m, k, n, c = 3, 16, 16, 4, 8, 90, 12
    q, w, codes, books, lengths = make_inputs(rng, b, h, d, m, k, n, [n, 4, 60], exact=True)
    pos, vals = pq_triton.pq_topc_triton(
        jnp.asarray(q), jnp.asarray(w), jnp.asarray(codes), jnp.asarray(books),
        jnp.asarray(lengths), num_candidates=c, fused=False, topk_implementation="xla")
    want_pos, want_vals = numpy_top_c(numpy_scores(q, w, codes, books, lengths), c)
    check_exact(pos, vals, want_pos, want_vals)


def numpy_span_counts(scores, thr, lengths, span):
    """[B, N_pad / SPAN, NT] counts of eligible order-preserving keys >= each threshold, from a
    score row (topk's keys: -0.0 as +0.0, negative floats with their magnitude bits flipped)."""
    x = np.array(scores, np.float32)
    x[x == 0] = 0.0
    bits = x.view(np.int32)
    keys = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    eligible = np.arange(x.shape[1])[None, :] < np.minimum(lengths, x.shape[1])[:, None]
    keys = np.where(eligible, keys, np.iinfo(np.int32).min)
    ge = keys[:, :, None] >= np.asarray(thr)[:, None, :]  # [B, N_pad, NT]
    return ge.reshape(x.shape[0], -1, span, ge.shape[2]).sum(axis=2)


def bracket_after_first_pass(thr, counts, lengths, n, c):
    """[B] positions left in topk's bracket after the fused first pass (the tightest [t, t')
    of key(-inf), thresholds, INT32_MAX with c(t) >= m > c(t'))."""
    length = np.clip(lengths, 0, n)
    m = np.minimum(length, c)
    tot = np.concatenate([length[:, None], np.asarray(counts).sum(1),
                          np.zeros_like(length)[:, None]], axis=1)
    sel = np.clip((tot >= m[:, None]).sum(1) - 1, 0, tot.shape[1] - 2)
    rows = np.arange(len(length))
    return tot[rows, sel] - tot[rows, sel + 1]


@pytest.mark.parametrize("exact", [False, True])
def test_fused_counts_equal_counts_of_own_scores(exact):
    """The fused kernel's per-span counts equal exactly the counts recomputed from its own
    score output, over several spans, a partial last span, garbage codes and lengths N / 0 /
    inside a span; its scores equal the unfused kernel's bit for bit (-inf past lengths)."""
    rng = np.random.default_rng(11)
    b, h, d, m, k, n, c = 4, 16, 32, 8, 16, 200, 20
    q, w, codes, books, lengths = make_inputs(rng, b, h, d, m, k, n, [n, 0, 77, 130],
                                              exact=exact)
    args = [jnp.asarray(a) for a in (q, w, codes, books, lengths)]
    params = pq_triton.Params(block_n=16, blocks_per_program=2)  # SPAN 32, N_pad 224
    thr, scores, counts, span = pq_triton.fused_first_pass(*args, num_candidates=c,
                                                           params=params)
    thr, scores, counts = np.asarray(thr), np.asarray(scores), np.asarray(counts)
    assert span == 32 and counts.shape == (b, 7, 16)
    assert np.all(thr[:, 1:] >= thr[:, :-1]), "thresholds must ascend"
    np.testing.assert_array_equal(counts, numpy_span_counts(scores, thr, lengths, span))
    unfused = pq_triton.coarse_scores_triton(*args, params=params)
    np.testing.assert_array_equal(scores[:, :n], np.asarray(unfused))
    assert np.all(np.isneginf(scores[:, n:]))
    total = counts.sum(1)
    assert np.any((total > 0) & (total < lengths[:, None])), "thresholds split no row"


def test_fused_rows_needing_more_passes():
    """Small topk tunables (CAP 16, 4 thresholds a pass, an 8-position sample, topk block = 2
    spans) so that the fused first pass leaves brackets of > CAP positions and later counting
    passes run; integer-valued scores (heavy ties, a tie at the C-th place); lengths 0, < C,
    not a multiple of the block, N."""
    rng = np.random.default_rng(12)
    b, h, d, m, k, n, c = 5, 6, 12, 4, 10, 300, 24
    q, w, codes, books, lengths = make_inputs(rng, b, h, d, m, k, n, [n, 0, 13, 250, 299],
                                              exact=True)
    tunables = dict(cap=16, digit_bits=2, sample=8, block=64, chunk=32)
    params = pq_triton.Params(block_n=16, blocks_per_program=2)
    pos, vals = run("triton", q, w, codes, books, lengths, c=c, params=params,
                    topk_tunables=tunables)
    exact = numpy_scores(q, w, codes, books, lengths)
    straddle = [np.sort(row[np.isfinite(row)])[::-1][c - 1:c + 1] for row in exact]
    assert any(len(t) == 2 and t[0] == t[1] for t in straddle), "want a tie at the C-th place"
    check_exact(pos, vals, *numpy_top_c(exact, c))
    thr, _, counts, _ = pq_triton.fused_first_pass(
        *[jnp.asarray(a) for a in (q, w, codes, books, lengths)], num_candidates=c,
        params=params, topk_tunables=tunables)
    left = bracket_after_first_pass(thr, counts, lengths, n, c)
    assert np.any(left > tunables["cap"]), f"no row needs a second pass: {left}"


def test_fused_needs_triton_top_c():
    args = [jnp.asarray(a) for a in make_inputs(np.random.default_rng(13), 1, 4, 8, 2, 4, 16,
                                                [16], exact=True)]
    with pytest.raises(ValueError, match="fused=True"):
        pq_triton.pq_topc_triton(*args, num_candidates=4, topk_implementation="xla")


def _specs(b, h, d, m, k, n, q_dtype=jnp.bfloat16):
    return (jax.ShapeDtypeStruct((b, h, d), q_dtype), jax.ShapeDtypeStruct((b, h), jnp.float32),
            jax.ShapeDtypeStruct((b, n, m), jnp.uint8),
            jax.ShapeDtypeStruct((m, k, d // m), jnp.float32),
            jax.ShapeDtypeStruct((b,), jnp.int32))


@pytest.mark.parametrize("shape", [V4_FLASH, dict(b=3, h=6, d=12, m=4, k=10, n=200, c=24)],
                         ids=["v4_flash", "small"])
def test_triton_lowers_for_cuda(shape):
    """Default (fused): the score + first-pass count kernel, then topk's refine (later passes),
    selection and stage-2 kernels; unfused: the plain score kernel, then topk's (api default:
    one-read select_seg, finish_seg, and the fallback's refine, select, finish)."""
    s = dict(shape)
    c = s.pop("c")
    for q_dtype in (jnp.bfloat16, jnp.float32):
        text = common.lower_for_cuda(
            lambda *a: pq_topc(*a, num_candidates=c, implementation="triton"),
            *_specs(**s, q_dtype=q_dtype))
        assert "pq_coarse_scores_count" in text, "the fused kernel did not lower to Triton"
        assert text.count(common.TRITON_CALL_TARGET) == 4
    text = common.lower_for_cuda(
        lambda *a: pq_triton.pq_topc_triton(*a, num_candidates=c, fused=False), *_specs(**s))
    assert "pq_coarse_scores" in text and "pq_coarse_scores_count" not in text
    assert text.count(common.TRITON_CALL_TARGET) == 6  # + topk's default one-read five


# ------------------------------------------------------------------------------- bad inputs


def _good():
    rng = np.random.default_rng(5)
    q, w, codes, books, lengths = make_inputs(rng, 2, 4, 8, 2, 4, 16, [16, 3], exact=True)
    return dict(q=q, weights=w, codes=codes, codebooks=books, lengths=lengths)


@pytest.mark.parametrize("change, match", [
    (dict(q=np.zeros((2, 4), np.float32)), "q must be 3-D"),
    (dict(q=np.zeros((2, 4, 8), np.float16)), "q must be float32 or bfloat16"),
    (dict(weights=np.zeros((2, 5), np.float32)), "weights must be"),
    (dict(weights=np.zeros((2, 4), np.int32)), "weights must be floating"),
    (dict(codes=np.zeros((2, 16, 3), np.uint8)), "codes must be"),
    (dict(codes=np.zeros((3, 16, 2), np.uint8)), "codes must be"),
    (dict(codes=np.zeros((2, 16, 2), np.int32)), "codes must be uint8"),
    (dict(codes=np.zeros((2, 0, 2), np.uint8)), "N=0"),
    (dict(codebooks=np.zeros((2, 4, 3), np.float32)), "codebooks"),
    (dict(codebooks=np.zeros((2, 257, 4), np.float32)), "K=257"),
    (dict(codebooks=np.zeros((8, 4), np.float32)), "codebooks must be 3-D"),
    (dict(codebooks=np.zeros((2, 4, 4), np.int32)), "codebooks must be floating"),
    (dict(lengths=np.zeros((3,), np.int32)), "lengths must be"),
    (dict(lengths=np.zeros((2,), np.float32)), "lengths must be integers"),
    (dict(num_candidates=0), "num_candidates"),
    (dict(num_candidates=2.5), "num_candidates"),
    (dict(num_candidates=True), "num_candidates"),
    (dict(implementation="cuda"), "unknown"),
    (dict(implementation="mosaic"), "not available"),
])
def test_bad_inputs(change, match):
    kwargs = dict(_good(), num_candidates=4, implementation="xla") | change
    with pytest.raises(ValueError, match=match):
        pq_topc(**kwargs)


# ------------------------------------------------------------- jax_triton (plain Triton, GPU)


@pytest.mark.parametrize("decode", pq_jt.DECODES)
@pytest.mark.parametrize("shape", [(3, 6, 12, 4, 10), (2, 20, 10, 5, 7), (2, 4, 128, 32, 256)],
                         ids=["d3", "d2_m5", "v4_dims"])
def test_jax_triton_packed_decode_is_the_reference_decode(shape, decode):
    """The kernel's packed codebook (four bf16 fields per 64-bit word) and its unpacking, in jnp:
    the decoded keys equal ``reference.decode_codes`` bit for bit (bf16-exact codebooks) at the
    real columns and are zero at the padded ones (d padded to >= 4, M to a power of two), and the
    emulated kernel math equals the exact scores, garbage codes past each length masked."""
    rng = np.random.default_rng(21)
    b, h, d, m, k = shape
    n = 50
    q, w, codes, books, lengths = make_inputs(rng, b, h, d, m, k, n, [n, 13, 0][:b],
                                              exact=True)
    lay = pq_jt.layout(h, m, k, d // m)
    assert lay.dsp % pq_jt.WORD_VALUES == 0 and lay.dp >= pq_jt.MIN_DOT_DIM
    live = np.minimum(codes, k - 1)  # the kernel clamps garbage codes; they are masked later
    swz = pq_jt.swizzle_mask(lay, decode)
    keys = jax.jit(lambda bk, cd: pq_jt.decode_packed(pq_jt.packed_codebook(bk, lay, swz), cd,
                                                       lay, swz))(books, live)
    keys = np.asarray(keys, np.float32).reshape(b, n, lay.mp, lay.dsp)
    want = np.asarray(reference.decode_codes(live, books)).reshape(b, n, m, d // m)
    np.testing.assert_array_equal(keys[:, :, :m, :d // m], want)
    assert not keys[:, :, m:].any() and not keys[:, :, :, d // m:].any()
    got = pq_jt.emulated_scores(*(jnp.asarray(a) for a in (q, w, codes, books, lengths)))
    np.testing.assert_array_equal(np.asarray(got), numpy_scores(q, w, codes, books, lengths))


def test_jax_triton_emulated_random_within_bf16():
    rng = np.random.default_rng(22)
    b, h, d, m, k, n = 2, 16, 32, 8, 16, 64
    args = make_inputs(rng, b, h, d, m, k, n, [n, 40], exact=False, q_dtype=jnp.bfloat16)
    got = np.asarray(pq_jt.emulated_scores(*(jnp.asarray(a) for a in args)))
    ref = np.asarray(reference.masked_coarse_scores(*args))
    assert np.array_equal(np.isneginf(got), np.isneginf(ref))
    assert_close(got, ref, "bfloat16", mask=np.isfinite(ref))


def test_boundary_swap_check():
    """``assert_swaps_at_boundary`` (the fp8 GPU tests' comparison with the XLA twin): equal
    sets pass; a swap of the C-th and (C+1)-th positions passes when their reference scores are
    within tol of the C-th and fails when the swapped-in one is far below; padding counts
    must agree."""
    scores = np.array([[9.0, 8.0, 5.0, 4.99, 1.0, -np.inf]])
    c = 3  # top-3 = {0, 1, 2}; the 3rd score is 5.0
    assert_swaps_at_boundary([[0, 1, 2]], [[2, 0, 1]], scores, c, 0.0)
    assert_swaps_at_boundary([[0, 1, 3]], [[0, 1, 2]], scores, c, 0.02)
    with pytest.raises(AssertionError, match="away from the boundary"):
        assert_swaps_at_boundary([[0, 1, 3]], [[0, 1, 2]], scores, c, 0.001)
    with pytest.raises(AssertionError, match="away from the boundary"):
        assert_swaps_at_boundary([[0, 1, 4]], [[0, 1, 2]], scores, c, 0.02)
    with pytest.raises(AssertionError, match="positions"):
        assert_swaps_at_boundary([[0, 1, -1]], [[0, 1, 2]], scores, c, 10.0)


def test_jax_triton_refused_without_gpu():
    """The module imports without triton / jax-triton (lazy imports); the api refuses the
    implementation on a machine without a GPU, naming what to use instead."""
    assert callable(pq_jt.pq_topc_jax_triton)
    with pytest.raises(ValueError, match="needs a CUDA GPU"):
        pq_topc(**_good(), num_candidates=4, implementation="jax_triton")
    with pytest.raises(ValueError, match="decode"):
        pq_jt.coarse_scores_jax_triton(*(jnp.asarray(a) for a in _good().values()),
                                       params=pq_jt.Params(decode="gather"))


# ------------------------------------------------------------------------ precision="fp8"


def test_fp8_quantization_rule():
    """``quantize_fp8``: every codebook subspace and every (request, head) query row reaches
    +-448 exactly at its largest magnitude and nothing exceeds it (no NaN), all-zero blocks get
    scale 1, and dequantizing (books8 * sc, q8 * sq / sc) is within the e4m3 bound of the
    inputs; the fp8 reference equals the exact scores of the dequantized values."""
    rng = np.random.default_rng(30)
    b, h, d, m, k = 2, 4, 16, 4, 8
    q = rng.normal(size=(b, h, d)).astype(np.float32) * np.float32(1e3)
    q[1, 2] = 0.0  # an all-zero head
    books = rng.standard_t(3, size=(m, k, d // m)).astype(np.float32)
    books[3] = 0.0  # an all-zero subspace
    w = rng.uniform(-0.5, 1.0, (b, h)).astype(np.float32)
    q8, w8, books8 = (np.asarray(x, np.float32) for x in reference.quantize_fp8(
        jnp.asarray(q), jnp.asarray(w), jnp.asarray(books)))
    amax = np.abs(books).max(axis=(1, 2))
    sc = np.where(amax > 0, amax / 448.0, 1.0).astype(np.float32)
    np.testing.assert_array_equal(np.abs(books8).max(axis=(1, 2)), [448.0] * 3 + [0.0])
    back = books8 * sc[:, None, None]
    assert np.all(np.abs(back - books) <= 2.0**-4 * np.abs(books) + 2.0**-9 * sc[:, None, None]
                  * (1 + 1e-6))
    qmax = np.abs(q8).max(axis=2)
    assert qmax[1, 2] == 0.0 and np.all(np.delete(qmax.ravel(), 1 * h + 2) == 448.0)
    sq = w8 / w  # [B, H]: the folded query scales
    assert sq[1, 2] == 1.0
    qs = (q.reshape(b, h, m, -1) * sc[:, None]).reshape(b, h, d)
    np.testing.assert_allclose(q8 * sq[:, :, None], qs, rtol=2.0**-4 + 1e-6,
                               atol=float(2.0**-9 * sq.max()))
    codes = rng.integers(0, k, (b, 10, m)).astype(np.uint8)
    got = np.asarray(reference.coarse_scores_fp8(q, w, codes, books))
    deq_q = (q8 * sq[:, :, None]).reshape(b, h, m, -1) / sc[:, None]
    want = numpy_scores(deq_q.reshape(b, h, d), w, codes, back, np.full((b,), 10))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_fp8_matches_its_reference(implementation):
    """precision="fp8": scores equal the fp8 reference (same quantization, f32 accumulation;
    interpret mode accumulates exactly as XLA) to f32 rounding, -inf past each length (garbage
    codes there), positions the top-C of the implementation's own scores; the fp8 selection
    stays close to the unquantized one (scores within 2^-4 of the largest |score|; e4m3 keeps
    3 mantissa bits)."""
    rng = np.random.default_rng(31)
    b, h, d, m, k, n, c = 3, 16, 32, 8, 16, 160, 24
    lengths = [n, 0, 70]
    args = [jnp.asarray(a) for a in make_inputs(rng, b, h, d, m, k, n, lengths, exact=False,
                                                q_dtype=jnp.bfloat16)]
    ref8 = np.asarray(reference.masked_coarse_scores_fp8(*args))
    if implementation == "xla":  # the twin's scores as its jitted op computes them (XLA may
        # round a fused program's sums differently from the op-by-op reference: jax 0.12.1)
        own = np.asarray(jax.jit(reference.masked_coarse_scores_fp8)(*args))
        pos, vals = pq_topc(*args, num_candidates=c, implementation="xla", precision="fp8")
    else:
        own = np.asarray(pq_triton.coarse_scores_triton(*args, precision="fp8"))
        assert np.array_equal(np.isneginf(own), np.isneginf(ref8)), "mask differs"
        assert_close(own, ref8, "float32", mask=np.isfinite(ref8))
        pos, vals = run(implementation, *args, c=c, precision="fp8")
    want_pos, _ = numpy_top_c(own.astype(np.float64), c)
    assert_same_sets(pos, want_pos)
    got, want = values_at(pos, vals, own)
    np.testing.assert_array_equal(got, want)
    exact = np.asarray(reference.masked_coarse_scores(*args))
    live = np.isfinite(exact)
    err = np.abs(own[live] - exact[live]).max() / np.abs(exact[live]).max()
    assert err <= 2.0**-4, f"fp8 scores off the unquantized ones by {err:.3g} of max |score|"


def test_fp8_exact_inputs_are_exact():
    """Small-integer q and codebooks with max |value| 1 quantize exactly (every scale is the
    same 1/448 factor, up to its f32 rounding), so the fp8 top-C (xla, fused Pallas) equals the
    exact one, ties included, and its scores agree to f32 rounding."""
    rng = np.random.default_rng(32)
    b, h, d, m, k, n, c = 3, 16, 32, 8, 10, 120, 16
    q, w, codes, books, lengths = make_inputs(rng, b, h, d, m, k, n, [n, 5, 77], exact=True)
    want_pos, want_vals = numpy_top_c(numpy_scores(q, w, codes, books, lengths), c)
    for implementation in ("xla", "triton"):
        pos, vals = run(implementation, q, w, codes, books, lengths, c=c, precision="fp8")
        assert_same_sets(pos, want_pos)
        got, want = values_at(pos, vals, numpy_scores(q, w, codes, books, lengths))
        np.testing.assert_allclose(got, want, rtol=1e-6)


@pytest.mark.parametrize("decode", pq_jt.DECODES)
@pytest.mark.parametrize("shape", [(3, 6, 12, 4, 10), (2, 4, 128, 32, 256)],
                         ids=["d3", "v4_dims"])
def test_jax_triton_fp8_packed_decode(shape, decode):
    """The fp8 book (four e4m3 bytes per 32-bit word) decodes to the quantized codebook rows
    bit for bit, zero at padded columns (DP >= 32), and the emulated fp8 kernel math equals the
    fp8 reference to f32 rounding."""
    rng = np.random.default_rng(33)
    b, h, d, m, k = shape
    n = 40
    q, w, codes, books, lengths = (jnp.asarray(a) for a in make_inputs(
        rng, b, h, d, m, k, n, [n, 11, 0][:b], exact=False))
    _, _, books8 = reference.quantize_fp8(q, w, books)
    lay = pq_jt.layout(h, m, k, d // m, fp8=True)
    assert lay.dp >= pq_jt.MIN_DOT_K_FP8
    live = jnp.minimum(codes, k - 1)
    swz = pq_jt.swizzle_mask(lay, decode)
    keys = np.asarray(pq_jt.decode_packed(pq_jt.packed_codebook(books8, lay, swz), live, lay,
                                          swz), np.float32).reshape(b, n, lay.mp, lay.dsp)
    want = np.asarray(reference.decode_codes(live, books8.astype(jnp.float32)))
    np.testing.assert_array_equal(keys[:, :, :m, :d // m], want.reshape(b, n, m, d // m))
    assert not keys[:, :, m:].any() and not keys[:, :, :, d // m:].any()
    got = np.asarray(pq_jt.emulated_scores(q, w, codes, books, lengths, precision="fp8"))
    ref8 = np.asarray(reference.masked_coarse_scores_fp8(q, w, codes, books, lengths))
    assert np.array_equal(np.isneginf(got), np.isneginf(ref8))
    assert_close(got, ref8, "float32", mask=np.isfinite(ref8))


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_jax_triton_swizzle_spreads_one_word_over_all_banks(fp8):
    """At the V4 shape the "smem" book puts word w of rows c = 0 .. S - 1 (S words of one
    128-byte bank row) in S distinct bank slots, for every w; the row-major book ("smem_linear")
    puts them all in one slot (the conflict of a gather whose lanes share w, which is how
    Triton lays the gather out under jax-triton's 16-byte alignment: the module docstring)."""
    lay = pq_jt.layout(64, 32, 256, 4, fp8=fp8)
    slots = pq_jt.BANK_BYTES // (4 if fp8 else 8)
    rows = np.arange(slots)[:, None]
    for decode, distinct in (("smem", slots), ("smem_linear", 1)):
        swz = pq_jt.swizzle_mask(lay, decode)
        address = rows * lay.words + (np.arange(lay.words)[None, :] ^ (rows & swz))
        per_word = [len(set(a)) for a in (address % slots).T]
        assert per_word == [distinct] * lay.words, decode
    assert pq_jt.swizzle_mask(lay, "shuffle") == 0


@pytest.mark.parametrize("decode", pq_jt.DECODES)
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_jax_triton_compiles_for_sm90(fp8, decode):
    """With the triton package (no GPU needed; skipped without it): the score kernel at the
    V4 shape compiles to PTX whose tile dot is a Hopper wgmma of e4m3 (fp8) or bf16 operands."""
    pytest.importorskip("triton")
    lay = pq_jt.layout(64, 32, 256, 4, fp8=fp8)
    ptx = pq_jt.compile_ptx(lay, V4_FLASH["n"], pq_jt.Params(decode=decode))
    kind = "e4m3.e4m3" if fp8 else "bf16.bf16"
    assert f".f32.{kind}" in ptx and "wgmma.mma_async" in ptx


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_jax_triton_default_launches_compile_for_sm90(precision):
    """With the triton package: each precision's default launch (``default_params``: BF16_PARAMS'
    512-key tiles with 16 warps, FP8_PARAMS' 128-key tiles with 4) compiles for sm_90 to a
    wgmma of its operands, contiguous and paged codes."""
    pytest.importorskip("triton")
    lay = pq_jt.layout(64, 32, 256, 4, fp8=precision == "fp8")
    kind = "e4m3.e4m3" if precision == "fp8" else "bf16.bf16"
    for page in (0, 64):
        ptx = pq_jt.compile_ptx(lay, V4_FLASH["n"], pq_jt.default_params(precision), page=page,
                                max_pages=V4_FLASH["n"] // 64 if page else 1)
        assert f".f32.{kind}" in ptx and "wgmma.mma_async" in ptx


@pytest.mark.parametrize("params", [dict(prefetch=True), dict(book_per_tile=True),
                                    dict(block_n=128, steps=16, prefetch=True,
                                         book_per_tile=True),
                                    dict(block_n=128, steps=16, book_per_tile=True,
                                         keys_as_b=True)], ids=str)
def test_jax_triton_launch_variants_compile_for_sm90(params):
    """With the triton package: the code-prefetch, book-per-tile and keys-as-B variants (fp8,
    contiguous and paged codes) compile for sm_90 to e4m3 wgmma; what each costs is the GPU's
    to say (``benchmarks/pq_variants_gpu.py``)."""
    pytest.importorskip("triton")
    lay = pq_jt.layout(64, 32, 256, 4, fp8=True)
    for page in (0, 64):
        ptx = pq_jt.compile_ptx(lay, V4_FLASH["n"], pq_jt.Params(**params), page=page,
                                max_pages=V4_FLASH["n"] // 64 if page else 1)
        assert ".f32.e4m3.e4m3" in ptx and "wgmma.mma_async" in ptx


def test_fp8_lowers_for_cuda():
    """The fused Pallas kernel lowers for CUDA with e4m3 operands at the V4-Flash shape."""
    s = dict(V4_FLASH)
    c = s.pop("c")
    text = common.lower_for_cuda(
        lambda *a: pq_topc(*a, num_candidates=c, implementation="triton", precision="fp8"),
        *_specs(**s))
    assert "pq_coarse_scores_count" in text and "f8E4M3FN" in text
    assert text.count(common.TRITON_CALL_TARGET) == 4


@pytest.mark.parametrize("implementation", ["xla", "triton", "jax_triton"])
def test_bad_precision(implementation):
    with pytest.raises(ValueError, match="precision='fp16' is unknown"):
        pq_topc(**_good(), num_candidates=4, implementation=implementation, precision="fp16")
    if implementation == "triton":
        args = [jnp.asarray(a) for a in _good().values()]
        with pytest.raises(ValueError, match="precision"):
            pq_triton.pq_topc_triton(*args, num_candidates=4, precision="int8")
    if implementation == "jax_triton":
        args = [jnp.asarray(a) for a in _good().values()]
        with pytest.raises(ValueError, match="precision"):
            pq_jt.coarse_scores_jax_triton(*args, precision="int8")


# ---------------------------------------------------------------------------------- GPU only


@pytest.mark.gpu
@pytest.mark.parametrize("implementation", ["triton", "triton_unfused", "jax_triton"])
def test_gpu_exact_ties_large(implementation):
    """Integer-valued inputs at a moderately large shape: the real kernels must return exactly
    the xla sets and scores, ties included."""
    rng = np.random.default_rng(6)
    b, h, d, m, k, n, c = 8, 64, 128, 32, 256, 40000, 2048
    lengths = [n, 0, 1000, 2047, 2048, 39999, 12345, n]
    q, w, codes, books, lengths = make_inputs(rng, b, h, d, m, k, n, lengths, exact=True,
                                              garbage="random")
    args = (q, w, codes, books, lengths)
    want = pq_topc(*args, num_candidates=c, implementation="xla")
    got = run(implementation, *args, c=c)
    check_exact(got[0], got[1], np.asarray(want[0]), np.asarray(want[1]))


@pytest.mark.gpu
@pytest.mark.parametrize("exact", [False, True])
def test_gpu_fused_counts_and_passes(exact):
    """The compiled fused kernel: per-span counts equal those of its own scores exactly, and a
    small CAP (later counting passes needed) still gives the exact top-C of those scores."""
    rng = np.random.default_rng(9)
    b, h, d, m, k, n, c = 8, 64, 128, 32, 256, 20000 + 77, 512
    lengths = [n, 0, 100, 511, 512, 9000, n - 1, 4097]
    q, w, codes, books, lengths = make_inputs(rng, b, h, d, m, k, n, lengths, exact=exact)
    args = [jnp.asarray(a) for a in (q, w, codes, books, lengths)]
    tunables = dict(cap=512, sample=16)  # sample stride ~1250 > CAP: a first bracket > CAP
    thr, scores, counts, span = pq_triton.fused_first_pass(*args, num_candidates=c,
                                                           topk_tunables=tunables)
    scores = np.asarray(scores)
    np.testing.assert_array_equal(np.asarray(counts),
                                  numpy_span_counts(scores, np.asarray(thr), lengths, span))
    pos, vals = run("triton", *args, c=c, topk_tunables=tunables)
    want_pos, _ = numpy_top_c(scores[:, :n].astype(np.float64), c)
    assert_same_sets(pos, want_pos)
    got, want = values_at(pos, vals, scores[:, :n])
    np.testing.assert_array_equal(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("q_dtype", [jnp.bfloat16, jnp.float32])
def test_gpu_random_against_xla(q_dtype):
    rng = np.random.default_rng(7)
    b, h, d, m, k, n, c = 8, 64, 128, 32, 256, 32768 + 77, 2048
    lengths = [n, 0, 100, 2048, 30000, n - 1, 5000, 17]
    q, w, codes, books, lengths = make_inputs(rng, b, h, d, m, k, n, lengths, exact=False,
                                              q_dtype=q_dtype)
    ref = np.asarray(reference.masked_coarse_scores(q, w, codes, books, lengths))
    own = np.asarray(pq_triton.coarse_scores_triton(q, w, codes, books, lengths))
    assert np.array_equal(np.isneginf(own), np.isneginf(ref)), "mask differs"
    assert_close(own, ref, "bfloat16", mask=np.isfinite(ref))
    pos, vals = pq_topc(q, w, codes, books, lengths, num_candidates=c, implementation="triton")
    want_pos, _ = numpy_top_c(own.astype(np.float64), c)
    assert_same_sets(pos, want_pos)
    got, want = values_at(pos, vals, own)
    np.testing.assert_array_equal(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("params", [dict(prefetch=True), dict(book_per_tile=True),
                                    dict(block_n=128, steps=16, prefetch=True,
                                         book_per_tile=True),
                                    dataclasses.asdict(pq_jt.FP8_PARAMS),
                                    dataclasses.asdict(pq_jt.BF16_PARAMS),
                                    dict(block_n=128, steps=16, book_per_tile=True),
                                    dict(keys_as_b=True)], ids=str)
@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_gpu_jax_triton_launch_variants_equal_the_default(params, precision):
    """The code-prefetch and book-per-tile launches (and the default launches, FP8_PARAMS and
    BF16_PARAMS, and keys as the dot's B operand) compute what the BN-256 launch
    (DEFAULT_PARAMS) does: at its tile and operand order the same scores bit for bit (each
    key's decode and dot are the same instructions; only when its codes arrive changes), at
    another tile or with keys as B within f32 rounding (the sum over heads may run in another
    order); -inf past each length exactly."""
    rng = np.random.default_rng(29)
    b, h, d, m, k, n = 8, 64, 128, 32, 256, 32768 + 77
    lengths = [n, 0, 100, 2048, 30000, n - 1, 5000, 17]
    args = [jnp.asarray(a) for a in make_inputs(rng, b, h, d, m, k, n, lengths, exact=False,
                                                q_dtype=jnp.bfloat16)]
    want = np.asarray(pq_jt.coarse_scores_jax_triton(*args, params=pq_jt.DEFAULT_PARAMS,
                                                     precision=precision))
    launch = pq_jt.Params(**params)
    got = np.asarray(pq_jt.coarse_scores_jax_triton(*args, params=launch, precision=precision))
    if launch.block_n == pq_jt.DEFAULT_PARAMS.block_n and not launch.keys_as_b:
        np.testing.assert_array_equal(got, want)
    assert np.array_equal(np.isneginf(got), np.isneginf(want))
    assert_close(got, want, "float32", mask=np.isfinite(want))


@pytest.mark.gpu
@pytest.mark.parametrize("decode", pq_jt.DECODES)
def test_gpu_jax_triton_random_against_xla(decode):
    """The plain Triton kernel with either gather lowering: scores within the bf16 tolerance of
    the f32 reference and within f32 rounding of its jnp emulation, -inf exactly past each
    length (garbage codes there), and the top-C sets those of its own scores."""
    rng = np.random.default_rng(23)
    b, h, d, m, k, n, c = 8, 64, 128, 32, 256, 32768 + 77, 2048
    lengths = [n, 0, 100, 2048, 30000, n - 1, 5000, 17]
    args = [jnp.asarray(a) for a in make_inputs(rng, b, h, d, m, k, n, lengths, exact=False,
                                                q_dtype=jnp.bfloat16)]
    params = pq_jt.Params(decode=decode)
    own = np.asarray(pq_jt.coarse_scores_jax_triton(*args, params=params))
    ref = np.asarray(reference.masked_coarse_scores(*args))
    assert np.array_equal(np.isneginf(own), np.isneginf(ref)), "mask differs"
    assert_close(own, ref, "bfloat16", mask=np.isfinite(ref))
    assert_close(own, np.asarray(pq_jt.emulated_scores(*args)), "float32",
                 mask=np.isfinite(ref))
    pos, vals = pq_jt.pq_topc_jax_triton(*args, num_candidates=c, params=params)
    want_pos, _ = numpy_top_c(own.astype(np.float64), c)
    assert_same_sets(pos, want_pos)
    got, want = values_at(pos, vals, own)
    np.testing.assert_array_equal(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("implementation", ["triton", "jax_triton"])
def test_gpu_v4_flash_shape_matches_xla(implementation):
    """V4-Flash shape: scores within tolerance of xla and top-C sets nearly equal (speed is
    measured by experiments/kernel_compare.py and benchmarks/pq_topc_sweep.py)."""
    s = dict(V4_FLASH)
    c = s.pop("c")
    b, n = s["b"], s["n"]
    keys = jax.random.split(jax.random.key(8), 4)
    q = jax.random.normal(keys[0], (b, s["h"], s["d"]), jnp.bfloat16)
    w = jax.random.uniform(keys[1], (b, s["h"]), jnp.float32, -0.5, 1.0)
    codes = jax.random.randint(keys[2], (b, n, s["m"]), 0, 256, jnp.int32).astype(jnp.uint8)
    books = jax.random.normal(keys[3], (s["m"], s["k"], s["d"] // s["m"]), jnp.float32)
    lengths = jnp.full((b,), n, jnp.int32).at[0].set(n // 3)
    args = (q, w, codes, books, lengths)
    xla = jax.jit(lambda *a: pq_topc(*a, num_candidates=c, implementation="xla"))
    tri = jax.jit(lambda *a: pq_topc(*a, num_candidates=c, implementation=implementation))
    got, want = tri(*args), xla(*args)
    ref = reference.masked_coarse_scores(*args)
    g, r = values_at(got[0], got[1], ref)
    assert_close(g, r, "bfloat16")
    overlap = np.mean([len(set(np.asarray(got[0][i]).tolist())
                           & set(np.asarray(want[0][i]).tolist())) / c for i in range(b)])
    assert overlap > 0.98, f"top-C overlap with xla only {overlap:.3f}"


@pytest.mark.gpu
@pytest.mark.parametrize("implementation", ["triton", "jax_triton", "jax_triton_smem"])
def test_gpu_fp8_against_its_reference(implementation):
    """precision="fp8" compiled (jax_triton: its default decode, "smem_lanes"; jax_triton_smem:
    the swizzled book): scores within accumulation error of the fp8 reference
    (same e4m3 values; Hopper fp8 MMAs accumulate with reduced precision, hence tf32's
    tolerance), -inf exactly past each length, top-C sets those of the kernel's own scores,
    and the top-C set of the xla fp8 twin up to swaps at the boundary (positions whose fp8
    reference score is within twice the tolerance of the C-th)."""
    rng = np.random.default_rng(24)
    b, h, d, m, k, n, c = 8, 64, 128, 32, 256, 32768 + 77, 2048
    lengths = [n, 0, 100, 2048, 30000, n - 1, 5000, 17]
    args = [jnp.asarray(a) for a in make_inputs(rng, b, h, d, m, k, n, lengths, exact=False,
                                                q_dtype=jnp.bfloat16)]
    if implementation.startswith("jax_triton"):
        params = pq_jt.Params(decode="smem") if implementation == "jax_triton_smem" else None
        own = pq_jt.coarse_scores_jax_triton(*args, params=params, precision="fp8")
    else:
        own = pq_triton.coarse_scores_triton(*args, precision="fp8")
    own = np.asarray(own)
    ref8 = np.asarray(reference.masked_coarse_scores_fp8(*args))
    assert np.array_equal(np.isneginf(own), np.isneginf(ref8)), "mask differs"
    assert_close(own, ref8, "tf32", mask=np.isfinite(ref8))
    # jax_triton_smem: the op's top-C (default decode) against the swizzled book's scores, so
    # the two lowerings must also score bit for bit alike
    pos, vals = pq_topc(*args, num_candidates=c, implementation=implementation.removesuffix(
        "_smem"), precision="fp8")
    want_pos, _ = numpy_top_c(own.astype(np.float64), c)
    assert_same_sets(pos, want_pos)
    got, want = values_at(pos, vals, own)
    np.testing.assert_array_equal(got, want)
    xla_pos = pq_topc(*args, num_candidates=c, implementation="xla", precision="fp8")[0]
    tol = TOLERANCE["tf32"] * np.abs(ref8[np.isfinite(ref8)]).max()
    assert_swaps_at_boundary(pos, xla_pos, ref8, c, 2 * tol)


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_gpu_jax_triton_swizzle_moves_words_not_values(precision):
    """The bank swizzle changes where the book's words sit in shared memory, not the decoded
    keys: scores with the swizzled book ("smem") equal the row-major book's bit for bit."""
    rng = np.random.default_rng(25)
    b, h, d, m, k, n = 4, 64, 128, 32, 256, 32768 + 77
    args = [jnp.asarray(a) for a in make_inputs(rng, b, h, d, m, k, n, [n, 0, 100, 30000],
                                                exact=False, q_dtype=jnp.bfloat16)]
    got = [np.asarray(pq_jt.coarse_scores_jax_triton(*args, params=pq_jt.Params(decode=dec),
                                                     precision=precision))
           for dec in ("smem", "smem_linear")]
    np.testing.assert_array_equal(got[0], got[1])


def test_batch_folding_makes_a_batch_op_vmappable():
    """common.batch_folding (how the jax-triton pq_topc runs under the decode step's vmap over
    slots): a vmap, nested vmaps and an unmapped batched argument give the direct call's
    result; a vmapped shared argument is refused."""
    b, n, c = 6, 64, 8
    q, w, codes, books = pq_problem(4, b, 4, 32, 8, 16, n)
    lengths = jnp.asarray(np.random.default_rng(4).integers(1, n + 1, b), jnp.int32)
    op = functools.partial(pq_topc, num_candidates=c, implementation="xla")
    folded = common.batch_folding(op, (True, True, True, False, True))
    want = op(q, w, codes, books, lengths)
    one = lambda *a: jax.tree.map(lambda x: x[0], folded(*(x[None] for x in a[:3]),  # noqa: E731
                                                         books, a[3][None]))
    got = jax.jit(jax.vmap(one))(q, w, codes, lengths)
    nested = jax.vmap(jax.vmap(one))(*(x.reshape(2, 3, *x.shape[1:])
                                       for x in (q, w, codes, lengths)))
    for g in (got, jax.tree.map(lambda x: x.reshape(b, *x.shape[2:]), nested)):
        np.testing.assert_array_equal(np.asarray(g[0]), np.asarray(want[0]))
        np.testing.assert_array_equal(np.asarray(g[1]), np.asarray(want[1]))
    # an unmapped batched argument (every slot the same lengths) is broadcast
    shared_len = jax.vmap(lambda q1: folded(q1[None], w[:1], codes[:1], books, lengths[:1]))(q)
    direct = op(q, jnp.repeat(w[:1], b, 0), jnp.repeat(codes[:1], b, 0), books,
                jnp.repeat(lengths[:1], b))
    np.testing.assert_array_equal(np.asarray(shared_len[0][:, 0]), np.asarray(direct[0]))
    with pytest.raises(ValueError, match="argument 3 is shared"):
        jax.vmap(lambda bk: folded(q, w, codes, bk, lengths))(jnp.stack([books, books]))


def test_triton_refuses_codes_whose_offsets_would_wrap():
    """PQ codes of 2-4 GiB (3 x 2^25 positions x 32 subspaces) would be indexed with wrapping
    int32 offsets by the Pallas kernel: a clear error at trace time; the XLA twin takes them."""
    sd = jax.ShapeDtypeStruct
    b, h, n, m, k, ds = 3, 16, 1 << 25, 32, 256, 4
    args = (sd((b, h, m * ds), jnp.float32), sd((b, h), jnp.float32), sd((b, n, m), jnp.uint8),
            sd((m, k, ds), jnp.float32), sd((b,), jnp.int32))
    with pytest.raises(ValueError, match="codes is a uint8 array.*offsets that wrap"):
        jax.eval_shape(functools.partial(pq_topc, num_candidates=64, implementation="triton"),
                       *args)
    jax.eval_shape(functools.partial(pq_topc, num_candidates=64, implementation="xla"), *args)

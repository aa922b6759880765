"""index_scores kernels (pallas_kernels/index_scores) against a float64 numpy oracle.

Notation: B requests, H heads, D head dim, C candidates, NB scale blocks per key.
Invalid candidate rows hold NaN poison in their FP8 values and their scales; they must come back
as exactly -inf and never leak into valid rows. "triton" runs in Pallas interpret mode on CPU;
"jax_triton" and the V4-shape comparisons need a GPU (``gpu`` marker).
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_helpers import assert_close, assert_same_sets, index_scores_oracle

from lsparse_jax.quant import quantize_index_keys
from pallas_kernels import common
from pallas_kernels.index_scores import index_scores

IMPLS = ["xla", "triton", pytest.param("jax_triton", marks=pytest.mark.gpu)]
V4 = dict(b=64, h=64, d=128, c=2048)  # V4-Flash indexer: 64 heads x 128, 2048 candidates


def _valid(rng, b, c, pattern):
    if pattern == "all_valid":
        return np.ones((b, c), bool)
    if pattern == "none":
        return np.zeros((b, c), bool)
    if pattern == "prefix":  # ragged candidate lists, row 0 empty
        lengths = np.linspace(0, c, b).astype(int)
        return np.arange(c)[None, :] < lengths[:, None]
    valid = rng.random((b, c)) < 0.7  # "random"; "invalid_row" also empties row 0
    if pattern == "invalid_row":
        valid[0] = False
    return valid


def _inputs(b, h, d, c, nb, pattern="random", q_dtype="float32", seed=0):
    """(q, weights, key_values, key_scales, valid) with NaN poison in invalid rows."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, h, d), np.float32).astype(jnp.dtype(q_dtype))
    weights = rng.standard_normal((b, h), np.float32)
    keys = rng.standard_normal((b, c, d), np.float32) * rng.uniform(0.1, 10, (b, c, 1))
    values, scales = (np.asarray(x) for x in quantize_index_keys(jnp.asarray(keys), d // nb))
    valid = _valid(rng, b, c, pattern)
    values = np.where(valid[..., None], values, np.float32(np.nan).astype(values.dtype))
    scales = np.where(valid[..., None], scales, np.nan).astype(np.float32)
    return q, weights, values, scales, valid


def _check(got, args, dtype):
    valid = args[-1]
    got = np.asarray(got)
    assert got.shape == valid.shape and got.dtype == np.float32
    assert np.all(got[~valid] == -np.inf), "invalid rows must be exactly -inf"
    assert_close(got, index_scores_oracle(*args), dtype, mask=valid)


# (B, H, D, C, NB, valid pattern, q dtype): C not a multiple of the block, H padded to 16,
# ragged / empty / all-invalid rows, one and two scale blocks.
CASES = [
    (2, 4, 64, 100, 1, "random", "float32"),
    (2, 64, 128, 256, 2, "prefix", "float32"),
    (3, 4, 128, 64, 2, "invalid_row", "bfloat16"),
    (2, 64, 64, 128, 1, "all_valid", "bfloat16"),
    (2, 4, 128, 32, 1, "none", "float32"),
    (1, 6, 64, 300, 2, "random", "float32"),
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_index_scores(impl, case):
    b, h, d, c, nb, pattern, q_dtype = case
    args = _inputs(b, h, d, c, nb, pattern, q_dtype)
    got = index_scores(*args, implementation=impl)
    # "triton" splits an f32 q into bf16 hi + lo (f32-level error), "jax_triton" rounds it to
    # bf16; with a bf16 q every kernel is exact up to f32 sums
    exact = impl in ("xla", "triton") or q_dtype == "bfloat16"
    _check(got, args, "float32" if exact else "bfloat16")


@pytest.mark.parametrize("steps", [1, 2, 4, 8])
def test_block_and_loop_tiling_in_interpret_mode(steps):
    """Blocks of 16 candidates, STEPS per program, a partial last program (8: only the
    partial one): same scores."""
    from pallas_kernels.index_scores.triton import index_scores_triton

    args = _inputs(2, 4, 64, 72, 2, "random", "bfloat16", seed=1)
    got = index_scores_triton(*map(jnp.asarray, args), block_c=16, steps=steps)
    _check(got, args, "float32")


def test_long_row_launch_rule_scores_exactly():
    """A decode step's long row (C >= LONG_ROW: one request's whole history, BC 64 and
    STEPS > 1 by ``default_config``) with a partial last program: the oracle's scores, under the
    vmap over requests the engine uses."""
    from pallas_kernels.index_scores import triton as tri

    c = tri.LONG_ROW + 40
    assert tri.default_config(1, 4, c)[:2] == (64, 2)
    args = _inputs(2, 4, 64, c, 1, "random", "bfloat16", seed=3)
    one = jax.vmap(lambda *a: index_scores(*(x[None] for x in a), implementation="triton")[0])
    _check(one(*map(jnp.asarray, args)), args, "float32")


def test_rescoring_launch_rule():
    """Rescoring (C < LONG_ROW) at H 64: BC 128; 4 warps and one block a program while fewer
    than 2 x MIN_PROGRAMS blocks (one LeanSparse request's C + tail), and where blocks would
    merge in pairs (B 64, C 2048: 1024 blocks) 8 warps with 4 blocks a program instead
    (session 39's measured launch); 8 warps at HP 128 keep the merge rule alone."""
    from pallas_kernels.index_scores import triton as tri

    assert tri.default_config(1, 64, 2048 + 64) == (128, 1, 4)
    assert tri.default_config(64, 64, 2048) == (128, 4, 8)
    assert tri.default_config(256, 64, 2048) == (128, 4, 4)  # 4096 blocks: STEPS 4 already
    assert tri.default_config(64, 128, 2048) == (128, 2, 8)


def test_partial_last_program_pads_only_its_rows():
    """C not a multiple of a program's rows: the whole programs read the keys in place and
    only the last C mod rows keys are copied (padded to one program), never all C (a decode
    step scores every stored key of a slot)."""
    import re

    fn = functools.partial(index_scores, implementation="triton")
    text = common.lower_for_cuda(fn, *_specs(8, 64, 128, 131104, 1))
    assert text.count(common.TRITON_CALL_TARGET) == 2
    padded = re.findall(r"stablehlo\.pad[^\n]*-> tensor<([0-9x]+)xf8E4M3FN>", text)
    assert padded and all(int(shape.split("x")[1]) < 1024 for shape in padded), padded


def test_empty_candidate_list():
    args = _inputs(2, 4, 64, 0, 1)
    assert index_scores(*args, implementation="triton").shape == (2, 0)


def _specs(b, h, d, c, nb, q_dtype=jnp.float32):
    s = jax.ShapeDtypeStruct
    return (s((b, h, d), q_dtype), s((b, h), jnp.float32), s((b, c, d), jnp.float8_e4m3fn),
            s((b, c, nb), jnp.float32), s((b, c), jnp.bool_))


@pytest.mark.parametrize("nb,q_dtype", [(1, jnp.float32), (2, jnp.bfloat16)])
def test_triton_lowers_for_cuda_at_v4_shape(nb, q_dtype):
    fn = functools.partial(index_scores, implementation="triton")
    text = common.lower_for_cuda(fn, *_specs(**V4, nb=nb, q_dtype=q_dtype))
    assert text.count(common.TRITON_CALL_TARGET) == 1


@pytest.mark.parametrize("steps", [1, 4])
def test_triton_tilings_lower_for_cuda(steps):
    from pallas_kernels.index_scores.triton import index_scores_triton

    fn = functools.partial(index_scores_triton, block_c=64, steps=steps, num_warps=4)
    text = common.lower_for_cuda(fn, *_specs(**V4, nb=1))
    assert text.count(common.TRITON_CALL_TARGET) == 1


def _bad(name):
    """Valid small inputs with one argument replaced by a bad shape or dtype."""
    q, w, kv, ks, valid = _inputs(2, 4, 64, 16, 1)
    bad = {
        "q_rank": ("q", q[0]),
        "q_dtype": ("q", q.astype(np.int32)),
        "weights_shape": ("weights", w[:, :3]),
        "key_values_dtype": ("key_values", kv.astype(np.float32)),
        "key_values_dim": ("key_values", kv[..., :32]),
        "key_scales_blocks": ("key_scales", np.ones((2, 16, 3), np.float32)),
        "key_scales_dtype": ("key_scales", ks.astype(jnp.bfloat16)),
        "valid_dtype": ("valid", valid.astype(np.int32)),
        "valid_shape": ("valid", valid[:, :8]),
    }[name]
    args = dict(q=q, weights=w, key_values=kv, key_scales=ks, valid=valid)
    args[bad[0]] = bad[1]
    return bad[0], args


@pytest.mark.parametrize("case", ["q_rank", "q_dtype", "weights_shape", "key_values_dtype",
                                  "key_values_dim", "key_scales_blocks", "key_scales_dtype",
                                  "valid_dtype", "valid_shape"])
def test_bad_inputs_name_the_argument(case):
    arg, args = _bad(case)
    with pytest.raises(ValueError, match=rf"index_scores: {arg}\b"):
        index_scores(**args, implementation="xla")


def test_triton_shape_limits_and_implementations():
    q, w, kv, ks, valid = _inputs(1, 4, 48, 8, 1)  # D = 48 is not a power of two
    index_scores(q, w, kv, ks, valid, implementation="xla")
    with pytest.raises(ValueError, match="key_values key dim D=48"):
        index_scores(q, w, kv, ks, valid, implementation="triton")
    q, w, kv, ks, valid = _inputs(1, 4, 64, 8, 8)  # scale blocks of 8 values: too small
    with pytest.raises(ValueError, match="key_scales has 8 scale blocks"):
        index_scores(q, w, kv, ks, valid, implementation="triton")
    with pytest.raises(ValueError, match="implementation='mosaic' is not available"):
        index_scores(q, w, kv, ks, valid, implementation="mosaic")
    if not common.on_gpu():
        with pytest.raises(ValueError, match="needs a CUDA GPU"):
            index_scores(q, w, kv, ks, valid, implementation="jax_triton")


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["triton", "jax_triton", None])
@pytest.mark.parametrize("nb", [1, 2])
def test_gpu_v4_shape_matches_xla(impl, nb):
    args = _inputs(**V4, nb=nb, pattern="prefix", seed=3)
    want = index_scores(*args, implementation="xla")
    got = index_scores(*args, implementation=impl)
    valid = args[-1]
    assert np.all(np.asarray(got)[~valid] == -np.inf)
    assert_close(got, want, "bfloat16", mask=valid)
    _check(got, args, "bfloat16")


@pytest.mark.parametrize("precision", [jax.lax.Precision.DEFAULT,
                                       jax.lax.DotAlgorithmPreset.BF16_BF16_F32])
def test_reduced_precision_head_sum_equals_the_einsum_form(precision):
    """Below HIGHEST, exact_index_scores sums the heads as a multiply-reduce (no batched
    GEMV): the same sum of w_h ReLU(q_h . k_n) as the f32 einsum up to the dot's rounding."""
    from pallas_kernels.index_scores.reference import exact_index_scores

    rng = np.random.default_rng(5)
    q = jnp.asarray(rng.normal(size=(6, 4, 32)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(6, 4)), jnp.float32)
    keys = jnp.asarray(rng.normal(size=(50, 32)), jnp.float32)
    dots = np.einsum("thd,nd->thn", np.asarray(q, np.float64), np.asarray(keys, np.float64))
    want = np.einsum("th,thn->tn", np.asarray(w, np.float64), np.maximum(dots, 0))
    got = np.asarray(exact_index_scores(q, w, keys, precision))
    tol = 1e-5 if precision is jax.lax.Precision.DEFAULT else 3e-2
    assert np.max(np.abs(got - want)) <= tol * np.max(np.abs(want))
    exact = np.asarray(exact_index_scores(q, w, keys))  # HIGHEST: the einsum form
    assert np.max(np.abs(exact - want)) <= 1e-5 * np.max(np.abs(want))
# ---------------------------------------------------------------- fp8 x fp8 and fused top-k


def _twin_scores(args):
    from pallas_kernels.index_scores.reference import index_scores_fp8_xla

    return np.asarray(index_scores_fp8_xla(*map(jnp.asarray, args)))


@pytest.mark.parametrize("case", [CASES[0]] + [pytest.param(c, marks=pytest.mark.slow)
                                  for c in (CASES[1], CASES[4])], ids=["c100", "nb2", "none"])
def test_fp8_kernel_matches_its_twin_and_the_exact_scores(case):
    """triton_fp8 equals its XLA twin (same FP8 q, f32 sums) and stays within FP8 rounding of
    q (<= 2^-4 a value) of the exact scores; invalid rows exactly -inf."""
    args = _inputs(*case)
    got = np.asarray(index_scores(*args, implementation="triton_fp8"))
    valid = args[-1]
    assert np.all(got[~valid] == -np.inf)
    twin = _twin_scores(args)
    assert np.all(twin[~valid] == -np.inf)
    assert_close(got, twin, "float32", mask=valid)
    exact = index_scores_oracle(*args)[valid]  # e4m3 rounds each q value by <= 2^-4 relative
    assert np.abs(twin[valid] - exact).max(initial=0) <= 0.0625 * max(np.abs(exact).max(
        initial=0), 1e-6)


def test_fp8_query_quantized_in_kernel_equals_quantized_before(monkeypatch):
    """The fp8 kernel quantizes q in-kernel (few programs a request) or once before it (long
    rows): the same exact ops (power-of-two scales), so the same scores bit for bit."""
    from pallas_kernels.index_scores import triton as tri

    args = _inputs(*CASES[0])
    got = {}
    for programs in (0, 1 << 20):  # 0: every row is "long"
        monkeypatch.setattr(tri, "IN_KERNEL_QUANT_PROGRAMS", programs)
        jax.clear_caches()
        got[programs] = np.asarray(index_scores(*args, implementation="triton_fp8"))
    np.testing.assert_array_equal(got[0], got[1 << 20])


def _assert_topk(pos, val, scores, valid, k):
    """pos/val: the top-k of ``scores`` over ``valid`` as a set (ties within 1e-5 relative of
    the k-th score may swap), -1 / -inf after the min(k, #valid) winners."""
    pos, val = np.asarray(pos), np.asarray(val)
    for r in range(pos.shape[0]):
        m = min(k, int(valid[r].sum()))
        got = pos[r][pos[r] >= 0]
        assert got.size == m and np.all(pos[r][m:] == -1) and np.all(val[r][m:] == -np.inf)
        assert np.all(np.sort(pos[r][:m]) == np.sort(got)), "winners first"
        assert len(set(got.tolist())) == m and valid[r][got].all()
        if m:
            np.testing.assert_array_equal(val[r][:m], scores[r][pos[r][:m]])
            kth = np.sort(scores[r][valid[r]])[::-1][m - 1]
            tol = 1e-5 * max(np.abs(scores[r][valid[r]]).max(), 1e-6)
            assert scores[r][got].min() >= kth - tol
            assert np.sort(scores[r][valid[r]])[::-1][:m].sum() <= scores[r][got].sum() + m * tol


@pytest.mark.parametrize("case,k", [(CASES[0], 16), ((2, 4, 64, 40, 1, "random", "float32"), 64)]
                         + [pytest.param(CASES[1], 64, marks=pytest.mark.slow),
                            pytest.param(CASES[4], 8, marks=pytest.mark.slow)],
                         ids=["c100-k16", "k>C", "nb2-k64", "none"])
def test_index_topk_fused_is_the_top_k_of_its_scores(case, k):
    """The fused kernel's scores equal the twin's; its winners are the top-k of them as a set
    (ties to the lower index) and the same set as ``index_topk_xla(fp8=True)``."""
    from pallas_kernels.index_scores import index_topk
    from pallas_kernels.index_scores.reference import index_topk_xla

    args = _inputs(*case)
    valid = args[-1]
    pos, val, scores = index_topk(*args, k=k, implementation="triton_fp8")
    scores = np.asarray(scores)
    assert np.all(scores[~valid] == -np.inf)
    assert_close(scores, _twin_scores(args), "float32", mask=valid)
    _assert_topk(pos, val, scores, valid, k)
    want, _ = index_topk_xla(*map(jnp.asarray, args), k=k)
    assert_same_sets(pos, want)
    xp, xv, xs = index_topk(*args, k=k, implementation="xla")
    _assert_topk(xp, xv, np.asarray(xs), valid, k)


def test_split_form_and_short_rows_topk():
    """index_topk_split (fp8 score kernel, then the one-kernel top-k of short rows) gives the
    fused kernel's outputs, as does the fused kernel searching T by thirds (bit for bit);
    short_rows_topk alone on tied, poisoned rows with C not a power of two gives
    topk_positions' sets (ties to the lower index), -1 / -inf padding."""
    from pallas_kernels.index_scores.topk_fused import (
        index_topk_split,
        index_topk_triton,
        short_rows_topk,
    )
    from pallas_kernels.topk.reference import topk_positions

    args = [jnp.asarray(a) for a in _inputs(*CASES[0])]
    got, want = index_topk_split(*args, k=16), index_topk_triton(*args, k=16)
    assert_same_sets(got[0], want[0])
    for a, b in zip(index_topk_triton(*args, k=16, search="thirds"), want):  # bit for bit
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert_close(got[2], want[2], "float32", mask=np.asarray(args[4]))
    rng = np.random.default_rng(4)
    scores = rng.integers(-2, 3, (3, 300)).astype(np.float32)
    valid = rng.random((3, 300)) < 0.8
    valid[2] = False
    scores[~valid] = np.nan
    pos, val = short_rows_topk(jnp.asarray(scores), jnp.asarray(valid), k=40)
    wpos, _ = topk_positions(jnp.asarray(np.where(valid, scores, 0)), jnp.asarray(valid), 40)
    assert_same_sets(pos, wpos)
    pos, val = np.asarray(pos), np.asarray(val)
    assert np.all(pos[2] == -1) and np.all(val[2] == -np.inf)
    np.testing.assert_array_equal(val[pos >= 0], scores[np.nonzero(pos >= 0)[0], pos[pos >= 0]])


def test_index_topk_ties_go_to_the_lower_index():
    """All valid candidates score the same (identical keys): the first k valid ones win."""
    from pallas_kernels.index_scores import index_topk

    q, w, kv, ks, valid = _inputs(2, 4, 64, 64, 1, "random")
    kv[:] = kv[0, 0]
    ks[:] = 1.0
    pos, _, _ = index_topk(q, w, kv, ks, valid, k=8, implementation="triton_fp8")
    for r in range(2):
        assert sorted(np.asarray(pos)[r].tolist()) == np.flatnonzero(valid[r])[:8].tolist()


def test_fp8_variants_lower_for_cuda_at_v4_shape():
    from pallas_kernels.index_scores import index_topk

    text = common.lower_for_cuda(functools.partial(index_scores, implementation="triton_fp8"),
                                 *_specs(**V4, nb=1))
    assert text.count(common.TRITON_CALL_TARGET) == 1 and "f8E4M3FN" in text
    text = common.lower_for_cuda(
        functools.partial(index_topk, k=512, implementation="triton_fp8"), *_specs(**V4, nb=1))
    assert text.count(common.TRITON_CALL_TARGET) == 1
    from pallas_kernels.index_scores.topk_fused import index_topk_split

    text = common.lower_for_cuda(functools.partial(index_topk_split, k=512),
                                 *_specs(**V4, nb=1))
    assert text.count(common.TRITON_CALL_TARGET) == 2
    # the two kernels alone: valid goes to the top-k as is (no [B, C] ids made between them)
    assert not re.search(r"stablehlo\.(iota|select|convert|broadcast_in_dim)", text)


@pytest.mark.gpu
@pytest.mark.parametrize("nb", [1, 2])
def test_gpu_fp8_variants_at_v4_shape(nb):
    """On the GPU the fp8 x fp8 dots run on Hopper's fp8 MMA (``pallas_kernels.fp8_dot``),
    which accumulates with reduced precision: scores within tf32's tolerance of the twin (as
    the pq kernels' fp8 path), the top-k sets those of the kernel's own scores (the fused
    kernel, the split form, the fused kernel searching T by thirds)."""
    from pallas_kernels.index_scores import index_topk

    args = _inputs(**V4, nb=nb, pattern="prefix", seed=3)
    valid = args[-1]
    got = np.asarray(index_scores(*args, implementation="triton_fp8"))
    assert np.all(got[~valid] == -np.inf)
    assert_close(got, _twin_scores(args), "tf32", mask=valid)
    from pallas_kernels.index_scores.topk_fused import index_topk_split, index_topk_triton

    thirds = functools.partial(index_topk_triton, search="thirds")
    for fn in (functools.partial(index_topk, implementation="triton_fp8"), index_topk_split,
               thirds):
        pos, val, scores = fn(*args, k=512)
        assert_close(scores, _twin_scores(args), "tf32", mask=valid)
        _assert_topk(pos, val, np.asarray(scores), valid, 512)


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["triton", "triton_fp8", "jax_triton"])
@pytest.mark.parametrize("c", [2112, 80, 131104])
def test_gpu_partial_last_block_stays_in_its_request(impl, c):
    """The engine's rescoring width C + T (V4: 2048 + 64; the small model: 64 + 16) is not a
    multiple of the kernel's block: with B > 1 the last block of a request must not reach the
    next request's rows (it did before the padding: scores off by ~100% at B 4, C 2112).
    131104: a decode step's long row (512K / 4 + 32) under the long-row launch rule."""
    args = _inputs(4, 64, 128, c, 1, "random", seed=5)
    valid = args[-1]
    got = np.asarray(index_scores(*args, implementation=impl))
    assert np.all(got[~valid] == -np.inf)
    if impl == "triton_fp8":  # Hopper's fp8 MMA accumulation: tf32's tolerance
        assert_close(got, _twin_scores(args), "tf32", mask=valid)
    else:
        _check(got, args, "float32" if impl == "triton" else "bfloat16")

"""index_logits (pallas_kernels/index_logits): the Pallas-Triton kernel against its XLA twin and a
float64 numpy oracle, and its use in the prefill's exact selection.

Notation: T queries, H heads, D head dim, N keys. Keys past a history hold NaN poison (as a
slot's unwritten rows do); it must stay in its own column. "triton" runs in Pallas interpret
mode on CPU; the V4-shape comparison needs a GPU (``gpu`` marker).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_helpers import assert_close

from lsparse_jax.model.layers import matmul_precision
from lsparse_jax.model.store import (
    FUSED_MIN_QUERIES,
    IndexerQuery,
    exact_selection,
    logits_of_queries,
)
from pallas_kernels import common
from pallas_kernels.index_logits import index_logits
from pallas_kernels.index_logits.triton import index_logits_triton


def _inputs(t, h, d, n, poison=(), integers=False, seed=0):
    rng = np.random.default_rng(seed)
    if integers:  # bf16-exact values whose products and sums are exact in f32
        q = rng.integers(-3, 4, (t, h, d)).astype(np.float32)
        w = rng.integers(-2, 3, (t, h)).astype(np.float32)
        k = rng.integers(-3, 4, (n, d)).astype(np.float32)
    else:
        q = rng.standard_normal((t, h, d), np.float32)
        w = rng.standard_normal((t, h), np.float32)
        k = rng.standard_normal((n, d), np.float32)
    k[list(poison)] = np.nan
    return q, w, k


def _oracle(q, w, k):
    """float64 scores of the bf16-rounded operands."""
    def bf16(x):
        return np.asarray(jnp.asarray(x).astype(jnp.bfloat16), np.float64)
    dots = np.einsum("thd,nd->thn", bf16(q), bf16(k))
    return np.einsum("th,thn->tn", w.astype(np.float64), np.maximum(dots, 0.0))


@pytest.mark.parametrize("impl", ["xla", "triton"])
@pytest.mark.parametrize("shape", [(5, 6, 32, 200), (33, 64, 16, 70), (1, 1, 64, 1)],
                         ids=["ragged", "v4_heads", "one"])
def test_random_against_oracle_poison_stays_in_its_column(impl, shape):
    """Random inputs with NaN-poisoned keys: every unpoisoned column within f32 rounding of the
    oracle (bf16 operands, as the kernel takes them)."""
    t, h, d, n = shape
    poison = [n // 2, n - 1] if n > 2 else []
    q, w, k = _inputs(t, h, d, n, poison)
    got = np.asarray(index_logits(q, w, k, implementation=impl))
    ok = np.ones(n, bool)
    ok[poison] = False
    assert_close(got[:, ok], _oracle(q, w, np.nan_to_num(k))[:, ok], "float32")


def test_kernel_equals_twin_bit_for_bit_on_exact_values():
    """Integer inputs (exact in bf16, exact sums in f32): the kernel equals its XLA twin bit for
    bit, whatever its tiling (BT, BN, STEPS)."""
    q, w, k = _inputs(37, 12, 32, 300, integers=True, seed=1)
    want = np.asarray(index_logits(q, w, k, implementation="xla"))
    np.testing.assert_array_equal(want, _oracle(q, w, k))
    for kw in ({}, dict(block_t=4, block_n=16, steps=2), dict(block_t=1, block_n=32, steps=1)):
        np.testing.assert_array_equal(np.asarray(index_logits_triton(q, w, k, **kw)), want)


@pytest.mark.parametrize("impl", ["xla", "triton"])
def test_keys_past_num_keys_are_minus_inf(impl):
    """num_keys (traced): -inf at n >= num_keys, the others as without it, for a num_keys
    inside a program's key range, at a program boundary, 0 and N; NaN-poisoned keys past it
    never matter."""
    q, w, k = _inputs(9, 4, 32, 300, poison=[250, 299], integers=True, seed=4)
    full = np.asarray(index_logits(q, w, np.nan_to_num(k), implementation="xla"))
    fns = [jax.jit(functools.partial(index_logits, implementation=impl))]
    if impl == "triton":  # 32 keys a program: whole programs past num_keys are skipped
        fns.append(jax.jit(functools.partial(index_logits_triton, block_n=16, steps=2)))
    for fn in fns:
        for num_keys in (0, 77, 64, 200, 300):
            got = np.asarray(fn(q, w, k if num_keys <= 250 else np.nan_to_num(k),
                                jnp.int32(num_keys)))
            assert np.all(got[:, num_keys:] == -np.inf)
            np.testing.assert_array_equal(got[:, :num_keys], full[:, :num_keys])


def test_bad_inputs_raise():
    q, w, k = _inputs(4, 2, 32, 8)
    with pytest.raises(ValueError, match="index_logits: q must be"):
        index_logits(q[0], w, k, implementation="xla")
    with pytest.raises(ValueError, match="index_logits: weights must be"):
        index_logits(q, w[:, :1], k, implementation="xla")
    with pytest.raises(ValueError, match="index_logits: keys must be"):
        index_logits(q, w, k[:, :16], implementation="xla")
    with pytest.raises(ValueError, match="D a power of two"):
        index_logits(q[..., :24], w, k[:, :24], implementation="triton")
    with pytest.raises(ValueError, match="not available"):
        index_logits(q, w, k, implementation="triton_fp8")
    with pytest.raises(ValueError, match="num_keys must be an integer scalar"):
        index_logits(q, w, k, 2.5, implementation="xla")
    with pytest.raises(ValueError, match="block_n=24 must be a power of two"):
        index_logits_triton(q, w, k, block_n=24)


def test_lowers_for_cuda_at_the_v4_prefill_shape():
    """One Triton kernel for a prefill tile of 1024 queries x 64 heads x 128 against 32768 keys
    (the XLA form would write 8 GiB of products for it)."""
    specs = (jax.ShapeDtypeStruct((1024, 64, 128), jnp.float32),
             jax.ShapeDtypeStruct((1024, 64), jnp.float32),
             jax.ShapeDtypeStruct((32768, 128), jnp.float32))
    text = common.lower_for_cuda(functools.partial(index_logits, implementation="triton"), *specs)
    assert text.count(common.TRITON_CALL_TARGET) == 1


def test_exact_selection_takes_the_kernel_for_a_bf16_prefill_chunk():
    """``logits_of_queries``: the kernel for >= FUSED_MIN_QUERIES queries with kernels and bf16
    matmuls, the XLA form otherwise (a decode step, f32 / tf32 matmuls, implementation "xla");
    and the prefill's selection through it equals the XLA selection on exact values, with
    NaN-poisoned keys never selected."""
    with matmul_precision("bf16"):
        fn, per_head = logits_of_queries(FUSED_MIN_QUERIES, "triton")
        assert fn.func is index_logits and not per_head
        for num, impl in ((FUSED_MIN_QUERIES - 1, "triton"), (64, "xla")):
            fn, per_head = logits_of_queries(num, impl)
            assert not isinstance(fn, functools.partial) and per_head  # the XLA form
    for name in ("highest", "tf32"):
        with matmul_precision(name):
            assert logits_of_queries(64, "triton")[1]
    with pytest.raises(ValueError, match="implementation='cuda' is unknown"):
        logits_of_queries(64, "cuda")

    t, h, d, n, k = 40, 8, 32, 96, 8
    q, w, keys = _inputs(t, h, d, n, integers=True, seed=2)
    # stored FP8 keys holding the small integers exactly, scale 1: exact dequantized keys
    values = jnp.asarray(keys).astype(jnp.float8_e4m3fn)
    scales = jnp.ones((n, 1), jnp.float32)
    values = values.at[n - 5:].set(jnp.nan)  # unwritten rows
    scales = scales.at[n - 5:].set(jnp.nan)
    eligible = np.arange(n)[None, :] <= np.arange(t)[:, None] + 50  # causal-like, ragged
    eligible &= np.arange(n)[None, :] < n - 5
    query = IndexerQuery(jnp.asarray(q), jnp.asarray(w))
    with matmul_precision("bf16"):
        # tiles of 16 queries (3 tiles, the last padded) in the kernel's form
        got = exact_selection(query, values, scales, jnp.asarray(eligible), k,
                              tile_bytes=16 * n * 4, implementation="triton")
        want = exact_selection(query, values, scales, jnp.asarray(eligible), k,
                               implementation="xla")
    np.testing.assert_array_equal(np.asarray(got.positions), np.asarray(want.positions))
    assert np.asarray(got.positions).max() < n - 5


@pytest.mark.gpu
def test_gpu_v4_prefill_tile_matches_twin():
    """On the GPU at a V4 prefill tile (1024 queries, 64 heads x 128, 32768 keys, NaN-poisoned
    tail): within f32 rounding of the XLA twin at every unpoisoned column."""
    q, w, k = _inputs(1024, 64, 128, 32768, poison=range(30000, 32768), seed=3)
    want = np.asarray(index_logits(q, w, k, implementation="xla"))
    got = np.asarray(index_logits(q, w, k, implementation="triton"))
    assert_close(got[:, :30000], want[:, :30000], "float32")


def test_decode_selection_scores_the_fp8_keys_in_the_index_scores_kernel():
    """``decode_kernel``: a decode step's few queries (< FUSED_MIN_QUERIES) with kernels score
    the stored FP8 keys through the ``index_scores`` op (no f32 key copy, no [T, H, N] products
    in XLA): the CUDA lowering of such a selection has no XLA dot; its selection equals the XLA
    form's on exact values, query by query of a block as alone, NaN-poisoned keys never
    selected, at f32 and bf16 matmuls alike."""
    from lsparse_jax.model.store import decode_kernel

    assert decode_kernel(1, "triton") == "triton"
    assert decode_kernel(FUSED_MIN_QUERIES - 1, "mosaic") == "triton"
    assert decode_kernel(FUSED_MIN_QUERIES, "triton") is None  # a prefill chunk
    assert decode_kernel(1, "xla") is None and decode_kernel(1, None) is None  # CPU: XLA
    with pytest.raises(ValueError, match="implementation='cuda' is unknown"):
        decode_kernel(1, "cuda")

    t, h, d, n, k = 3, 8, 32, 96, 8
    q, w, keys = _inputs(t, h, d, n, integers=True, seed=4)
    values = jnp.asarray(keys).astype(jnp.float8_e4m3fn)
    scales = jnp.full((n, 1), 2.0, jnp.float32)  # a power of two: still exact
    values = values.at[n - 7:].set(jnp.nan)
    scales = scales.at[n - 7:].set(jnp.nan)
    eligible = np.arange(n)[None, :] <= np.arange(t)[:, None] + 70
    eligible &= np.arange(n)[None, :] < n - 7
    query = IndexerQuery(jnp.asarray(q), jnp.asarray(w))

    def select(q, w, values, scales, eligible, implementation):
        return exact_selection(IndexerQuery(q, w), values, scales, eligible, k,
                               implementation=implementation).positions

    specs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in
             (query.q, query.weights, values, scales, jnp.asarray(eligible))]
    text = common.lower_for_cuda(functools.partial(select, implementation="triton"), *specs)
    assert "stablehlo.dot_general" not in text and common.TRITON_CALL_TARGET in text
    kernel = jax.jit(functools.partial(select, implementation="triton"))
    got = kernel(query.q, query.weights, values, scales, jnp.asarray(eligible))
    for name in ("highest", "bf16"):  # the kernel's arithmetic is not the model's matmuls'
        with matmul_precision(name):  # (traced afresh under each: no jit cache)
            want = select(query.q, query.weights, values, scales, jnp.asarray(eligible), "xla")
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    alone = kernel(query.q[1:2], query.weights[1:2], values, scales,
                   jnp.asarray(eligible[1:2]))  # one query: no loop
    np.testing.assert_array_equal(np.asarray(got)[1:2], np.asarray(alone))
    assert np.asarray(got).max() < n - 7

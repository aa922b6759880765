"""IndexerConfig.score_precision "fp8": a decode step's exact key scores in DeepSeek-V4's
fp8 x fp8 arithmetic, for every method and implementation alike (so the hierarchy identities
hold at it), and the ``index_scores`` op's "xla_fp8" twin."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lsparse_jax.config import CacheConfig, EngineConfig, IndexerConfig, LeanSparseConfig
from lsparse_jax.methods.leansparse import calibrate_codebooks
from lsparse_jax.model.store import FUSED_MIN_QUERIES, decode_scoring, fp8_scoring
from lsparse_jax.serving.engine import Engine
from pallas_kernels.index_scores import api
from pallas_kernels.index_scores.reference import (
    index_scores_fp8_xla,
    index_scores_paged_xla,
    index_scores_xla,
)
from tests.helpers import model_and_tokens, tiny


def test_bad_score_precision_is_rejected():
    with pytest.raises(ValueError, match="score_precision='bf16' is invalid"):
        IndexerConfig(score_precision="bf16")
    assert tiny(score_precision="fp8").indexer.score_precision == "fp8"


def test_decode_scoring_picks_each_ops_fp8_form():
    # f32: decode_kernel's choice (None: XLA's forms); fp8: the op always, in its fp8 form
    assert decode_scoring(1, "xla") is None
    assert decode_scoring(1, "triton") == "triton"
    assert decode_scoring(1, "xla", "fp8") == "xla_fp8"
    assert decode_scoring(1, "triton", "fp8", "index_scores_paged") == "triton_fp8"
    assert decode_scoring(4, "triton_fp8", "fp8") == "triton_fp8"
    # a prefill chunk keeps the model's matmul precision
    assert decode_scoring(FUSED_MIN_QUERIES, "triton", "fp8") is None
    # the engine family "jax_triton" scores with the op's "triton" kernel; the op's own
    # jax-triton kernel (bf16 q) has no fp8 form
    assert decode_scoring(1, "jax_triton", "fp8") == "triton_fp8"
    with pytest.raises(ValueError, match="no fp8 form"):
        fp8_scoring("jax_triton")


def _problem(seed, b=3, c=40, h=4, d=32, nb=1, p_valid=0.8):
    k = jax.random.split(jax.random.key(seed), 5)
    q = jax.random.normal(k[0], (b, h, d))
    w = jax.random.normal(k[1], (b, h))
    values = jax.random.normal(k[2], (b, c, d)).astype(jnp.float8_e4m3fn)
    scales = jax.random.uniform(k[3], (b, c, nb), jnp.float32, 0.5, 2.0)
    valid = jax.random.bernoulli(k[4], p_valid, (b, c))
    # NaN poison where invalid: it must never reach a score
    values = jnp.where(valid[..., None], values, jnp.nan).astype(jnp.float8_e4m3fn)
    scales = jnp.where(valid[..., None], scales, jnp.nan)
    return q, w, values, scales, valid


def test_xla_fp8_is_the_fp8_twin():
    args = _problem(0)
    got = np.asarray(api.index_scores(*args, implementation="xla_fp8"))
    np.testing.assert_array_equal(got, np.asarray(index_scores_fp8_xla(*args)))
    assert np.all(got[~np.asarray(args[4])] == -np.inf)
    # q's e4m3 rounding moves the scores off the f32 ones (the choice is not a no-op)
    f32 = np.asarray(index_scores_xla(*args))
    ok = np.asarray(args[4])
    assert not np.array_equal(got[ok], f32[ok])
    np.testing.assert_allclose(got[ok], f32[ok], rtol=0.2, atol=0.2 * np.abs(f32[ok]).max())


def test_paged_xla_fp8_scores_the_pages_rows_as_the_gathered_twin():
    q, w, values, scales, _ = _problem(1, b=2, c=32, p_valid=1.0)
    page = 8
    pool_v, pool_s = values.reshape(64, -1), scales.reshape(64, -1)  # 8 pages of 8 rows
    table = jnp.array([[3, 0, 5, -1], [7, 2, 1, 6]], jnp.int32)  # request 0: page 3 unmapped
    valid = jnp.ones((2, 4 * page), bool).at[1, 5].set(False)
    got = api.index_scores_paged(q, w, pool_v, pool_s, table, valid, page=page,
                                 implementation="xla_fp8")
    tail = (jnp.zeros((2, page, pool_v.shape[1]), pool_v.dtype),
            jnp.ones((2, page, 1), jnp.float32), jnp.full((2,), -2 ** 30, jnp.int32))
    want = index_scores_paged_xla(q, w, pool_v, pool_s, table, *tail, valid, page=page,
                                  fp8=True)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    # row by row: position n of request b is pool row table[b, n // P] * P + n % P
    rows = jnp.maximum(table, 0).repeat(page, axis=1) * page + jnp.arange(4 * page) % page
    ok = valid & (table.repeat(page, axis=1) >= 0)
    direct = index_scores_fp8_xla(q, w, pool_v[rows], pool_s[rows], ok)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(direct))
    assert np.all(np.asarray(got)[0, 3 * page:] == -np.inf)  # the unmapped page


def _engine(cfg, params, method, implementation="xla", device_pages=None, books=None,
            lean=None, slots=2):
    cache = CacheConfig(num_slots=slots, prefill_chunk=32, page_size=8,
                        hot_cache_rows=None if method == "resident" else 16,
                        device_pages=device_pages)
    return Engine(EngineConfig(model=cfg, cache=cache, method=method, implementation=implementation,
                               leansparse=lean or LeanSparseConfig()), params, books)


@functools.cache
def _model(score_precision):
    cfg = tiny(max_len=512, score_precision=score_precision)
    params, _ = model_and_tokens(cfg, 1, seed=21)
    return cfg, params


def _prompts():
    rng = np.random.default_rng(21)
    return [rng.integers(0, 256, n).astype(np.int32) for n in (95, 130)]


# slow tier (session 49; 31 s): fp8 scores keep identity 6 (leansparse) and run through the
# kernels in the fast suite
@pytest.mark.slow
def test_fp8_scores_keep_hisparse_identical_to_resident_and_change_selections():
    """At "fp8" HiSparse (exact keys in device pools: the paged op) equals resident (the
    contiguous op) bit for bit; and its selections are not f32's at every step."""
    cfg, params = _model("fp8")
    engines = [_engine(cfg, params, "resident"), _engine(cfg, params, "hisparse",
                                                         device_pages=22),
               _engine(*_model("f32"), "resident")]
    for engine in engines:
        for p in _prompts():
            engine.admit(p, max_new_tokens=40)
    differ = 0
    for _ in range(12):
        fed = engines[0].next_token.copy()
        want, got, f32 = (e.step(fed) for e in engines)
        np.testing.assert_array_equal(np.asarray(got.logits), np.asarray(want.logits))
        np.testing.assert_array_equal(np.asarray(got.selected), np.asarray(want.selected))
        differ += not np.array_equal(np.asarray(f32.selected), np.asarray(want.selected))
    assert differ > 0


def test_fp8_scores_keep_leansparse_identity_six():
    """Identity 6 at "fp8": with C >= every history and no miss filter, LeanSparse's fp8
    rescoring of its candidates selects what resident's fp8 scores select, bit for bit."""
    cfg, params = _model("fp8")
    calib = np.random.default_rng(123).integers(0, 256, 600).astype(np.int32)
    books = calibrate_codebooks(params, cfg, calib, iters=2)
    lean = LeanSparseConfig(num_candidates=128, miss_filter_offset=None, key_cache_rows=128)
    resident = _engine(cfg, params, "resident")
    lean_engine = _engine(cfg, params, "leansparse", books=books, lean=lean, device_pages=21)
    for engine in (resident, lean_engine):
        for p in _prompts():
            engine.admit(p, max_new_tokens=40)
    for _ in range(20):
        fed = resident.next_token.copy()
        want, got = resident.step(), lean_engine.step(tokens=fed)
        np.testing.assert_array_equal(np.asarray(got.logits), np.asarray(want.logits))


def test_fp8_scores_through_the_kernels(monkeypatch):
    """implementation "triton" (interpret mode) at "fp8": the decode step scores with the
    ``triton_fp8`` kernel (every ``index_scores`` kernel it traces is the fp8 form) and selects
    what the XLA twin ("xla_fp8") selects on the steps without near-ties (most of them: 6 of 6
    when written). The paged kernel's fp8 form against the contiguous one:
    ``test_kernel_index_scores_paged.py``."""
    from pallas_kernels.index_scores import triton as kernel_module

    traced, kernel_fn = [], kernel_module.index_scores_triton

    def spy(*args, **kwargs):
        traced.append(kwargs.get("fp8", False))
        return kernel_fn(*args, **kwargs)

    monkeypatch.setattr(kernel_module, "index_scores_triton", spy)
    cfg, params = _model("fp8")
    engines = [_engine(cfg, params, "resident", "triton"), _engine(cfg, params, "resident")]
    for engine in engines:
        engine.admit(_prompts()[0], max_new_tokens=20)
    agree = 0
    for _ in range(6):
        fed = engines[0].next_token.copy()
        kernel, xla = (e.step(fed) for e in engines)
        a, b = np.asarray(kernel.selected)[0], np.asarray(xla.selected)[0]
        agree += all(set(x[x >= 0]) == set(y[y >= 0]) for x, y in zip(a, b))
    assert traced and all(traced)  # the decode step traced the kernel, only its fp8 form
    assert agree >= 4

"""Sampling, engine bookkeeping and state byte counts."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lsparse_jax.config import CacheConfig, EngineConfig, SamplingConfig
from lsparse_jax.model import serving_params
from lsparse_jax.model.cache import empty_cache
from lsparse_jax.serving.engine import Engine
from lsparse_jax.serving.sampling import sample
from lsparse_jax.serving.state import empty_state, slot_bytes
from lsparse_jax.serving.steps import forward_chunk
from tests.helpers import assert_same_continuation, model_and_tokens, tiny


def test_greedy_is_argmax_with_lower_id_on_ties():
    logits = jnp.asarray([[0.0, 2.0, 2.0, 1.0], [5.0, -1.0, 5.0, 5.0]])
    np.testing.assert_array_equal(np.asarray(sample(logits, jax.random.key(0), 0.0)), [1, 0])


def test_temperature_sampling_follows_softmax():
    logits = jnp.log(jnp.asarray([[0.5, 0.3, 0.2, 0.0]]))
    keys = jax.random.split(jax.random.key(3), 4000)
    draws = np.asarray(jax.vmap(lambda k: sample(logits, k, 1.0)[0])(keys))
    freq = np.bincount(draws, minlength=4) / draws.size
    np.testing.assert_allclose(freq, [0.5, 0.3, 0.2, 0.0], atol=0.03)
    # temperature 0.5 squares and renormalizes the probabilities
    draws = np.asarray(jax.vmap(lambda k: sample(logits, k, 0.5)[0])(keys))
    p = np.array([0.25, 0.09, 0.04, 0.0]) / 0.38
    np.testing.assert_allclose(np.bincount(draws, minlength=4) / draws.size, p, atol=0.03)


def expected_slot_bytes(cfg):
    """Byte count of one slot's caches written out from the config (f32 rows, e4m3 keys)."""
    d, di, w = cfg.head_dim, cfg.indexer.head_dim, cfg.swa_window
    total = 0
    for i, kind in enumerate(cfg.layer_pattern):
        n = cfg.num_compressed(kind)
        if kind in ("swa", "csa", "hca"):
            total += 4 * w * d
        if kind == "csa":
            m = cfg.csa_ratio
            total += 4 * (2 * m * 4 * d + n * d + 2 * m * 4 * di) + n * cfg.indexer.key_bytes
        if kind == "hca":
            total += 4 * (cfg.hca_ratio * 2 * d + n * d)
        if kind == "dsa":
            keys = n if cfg.dsa_leader(i) == i else 0
            total += 4 * n * d + keys * cfg.indexer.key_bytes
    return total


@pytest.mark.parametrize("pattern", [("swa", "csa", "hca"), ("dsa", "dsa", "dsa")])
def test_slot_bytes_match_config(pattern):
    cfg = tiny(max_len=256, layer_pattern=pattern, dsa_share_group=2)
    engine = EngineConfig(model=cfg, cache=CacheConfig(num_slots=3))
    assert slot_bytes(engine, empty_state(engine)) == expected_slot_bytes(cfg)


def test_engine_generates_greedy_continuation_of_forward():
    """The engine's greedy tokens are the argmax chain of teacher-forced forwards."""
    cfg = tiny(max_len=128)
    params, prompt = model_and_tokens(cfg, 29, seed=5)
    engine = Engine(EngineConfig(model=cfg, cache=CacheConfig(num_slots=2, prefill_chunk=8),
                                 sampling=SamplingConfig(0.0)), params)
    engine.warmup()
    slot = engine.admit(prompt)
    for _ in range(6):
        engine.step()
    out = engine.release(slot)
    seq = list(prompt)
    for _ in range(7):  # one compilation: every forward is padded to 40 tokens
        padded = jnp.asarray(np.pad(seq, (0, 40 - len(seq))), jnp.int32)
        logits, _, _ = forward_chunk(params, cfg, empty_cache(cfg), padded, 0, len(seq))
        seq.append(int(np.argmax(np.asarray(logits)[len(seq) - 1])))
    assert out == seq[len(prompt):]
    m = engine.metrics()
    assert m["decode_tokens"] == 6
    assert m["device_bytes_per_request"] == expected_slot_bytes(cfg)
    sel = m["selection"]
    assert sel["selected"] == pytest.approx(min(cfg.indexer.top_k, sel["eligible"]))


def test_engine_refuses_when_full():
    cfg = tiny(max_len=128)  # the model above: its prefill chunks of 8 are compiled
    params, prompt = model_and_tokens(cfg, 10)
    engine = Engine(EngineConfig(model=cfg, cache=CacheConfig(num_slots=1, prefill_chunk=8)),
                    params)
    engine.admit(prompt)
    with pytest.raises(RuntimeError, match="all 1 slots are busy"):
        engine.admit(prompt)


def test_device_statistics_equal_a_host_recount():
    """The engine's device-side selection statistics (serving/stats.py) equal the counts
    recomputed on the host from every step's outputs, reuse by per-row set intersection."""
    from lsparse_jax.serving.stats import SelectionStats, as_dict, record

    rng = np.random.default_rng(0)
    s, layers, k, steps = 3, 2, 5, 6
    stats = SelectionStats.empty(s, layers, k)
    prev, has_prev = None, np.zeros(s, bool)
    want = dict.fromkeys(("steps", "eligible", "selected", "reused", "reuse_base"), 0)
    rows = np.zeros(3)
    for _ in range(steps):
        active = rng.random(s) < 0.7
        sel = np.stack([[np.where(rng.random(k) < 0.8, rng.permutation(12)[:k], -1)
                         for _ in range(layers)] for _ in range(s)]).astype(np.int32)
        elig = rng.integers(0, 50, (s, layers)).astype(np.int32)
        src = rng.integers(0, 4, (s, layers, 3)).astype(np.int32)
        stats = record(stats, jnp.asarray(sel), jnp.asarray(elig), jnp.asarray(src),
                       jnp.asarray(src), jnp.asarray(active))
        want["steps"] += active.sum() * layers
        want["eligible"] += elig[active].sum()
        want["selected"] += (sel[active] >= 0).sum()
        rows += src[active].sum(axis=(0, 1))
        for i in np.flatnonzero(active & has_prev):
            for a, b in zip(sel[i], prev[i]):
                want["reuse_base"] += (a >= 0).sum()
                want["reused"] += len(set(a[a >= 0]) & set(b[b >= 0]))
        prev, has_prev = sel, has_prev | active
    got = stats.totals()
    assert {f: got[f] for f in want} == {f: int(v) for f, v in want.items()}
    m = as_dict(got, 4, 1)
    assert m["host_rows"] == rows[2] and m["host_bytes"] == rows[2] * 4 + rows[2]


def test_device_sums_are_exact_past_32_bits():
    from lsparse_jax.serving.stats import SelectionStats, record

    stats = SelectionStats.empty(1, 1, 1)
    big = jnp.full((1, 1), 2**31 - 1, jnp.int32)  # eligible per step near the int32 limit
    for _ in range(5):
        stats = record(stats, jnp.zeros((1, 1, 1), jnp.int32), big,
                       jnp.zeros((1, 1, 3), jnp.int32), jnp.zeros((1, 1, 3), jnp.int32),
                       jnp.ones((1,), bool))
    assert stats.totals()["eligible"] == 5 * (2**31 - 1)


def _rounded_kernels(params):
    """params whose Dense kernels hold bf16 values (stored f32)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, x: (x.astype(jnp.bfloat16).astype(jnp.float32)
                         if getattr(path[-1], "key", None) == "kernel" else x), params)


def test_serving_params_casts_only_the_matmul_weights():
    cfg = tiny(max_len=128, matmul_precision="bf16", weight_dtype="bf16")
    params, _ = model_and_tokens(cfg, 1)
    got = serving_params(params, cfg)
    flat = jax.tree_util.tree_flatten_with_path(got)[0]
    kernels = [x for path, x in flat if path[-1].key == "kernel"]
    others = [x for path, x in flat if path[-1].key != "kernel"]
    assert kernels and others and all(x.dtype == jnp.bfloat16 for x in kernels)
    want = jax.tree.leaves(_rounded_kernels(params))
    for a, b in zip(jax.tree.leaves(got), want, strict=True):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b))
    assert jax.tree.all(jax.tree.map(lambda a, b: a is b, serving_params(got, cfg), got))
    f32 = tiny(max_len=128, matmul_precision="bf16")
    assert serving_params(params, f32) is params
    with pytest.raises(ValueError, match="weight_dtype.*matmul_precision='bf16'"):
        tiny(weight_dtype="bf16")
    with pytest.raises(ValueError, match="weight_dtype"):
        tiny(matmul_precision="bf16", weight_dtype="fp8")


@pytest.mark.parametrize("method", ["resident", pytest.param("hisparse", marks=pytest.mark.slow)])
def test_bf16_stored_weights_serve_as_f32_weights_of_the_same_values(method):
    """An engine storing its matmul weights bf16 (``weight_dtype``) gives the tokens and
    logits, bit for bit, of one given f32 weights holding the same bf16 values."""
    cfg = tiny(max_len=128, matmul_precision="bf16", weight_dtype="bf16")
    params, prompt = model_and_tokens(cfg, 37, seed=3)
    hot = 32 if method == "hisparse" else None
    engines = []
    for model, weights in ((cfg, params), (tiny(max_len=128, matmul_precision="bf16"),
                                           _rounded_kernels(params))):
        engine = Engine(EngineConfig(model=model, method=method, sampling=SamplingConfig(0.0),
                                     cache=CacheConfig(2, 16, hot, 8)), weights)
        engine.admit(prompt)
        engines.append(engine)
    assert engines[0].params["lm_head"]["kernel"].dtype == jnp.bfloat16
    assert_same_continuation(engines[1], engines[0], 6)

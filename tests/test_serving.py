"""Sampling, engine bookkeeping and state byte counts."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lsparse_jax.config import CacheConfig, EngineConfig, SamplingConfig
from lsparse_jax.model.cache import empty_cache
from lsparse_jax.serving.engine import Engine
from lsparse_jax.serving.sampling import sample
from lsparse_jax.serving.state import empty_state, slot_bytes
from lsparse_jax.serving.steps import forward_chunk
from tests.helpers import model_and_tokens, tiny


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
    cfg = tiny(max_len=64)
    params, prompt = model_and_tokens(cfg, 10)
    engine = Engine(EngineConfig(model=cfg, cache=CacheConfig(num_slots=1, prefill_chunk=8)),
                    params)
    engine.admit(prompt)
    with pytest.raises(RuntimeError, match="all 1 slots are busy"):
        engine.admit(prompt)

"""``Engine.decode(n)``: n pipelined decode steps equal n calls of ``Engine.step``, bit for
bit (tokens, each request's token list, the decode state, the selection statistics)."""

import functools

import jax
import numpy as np
import pytest

from lsparse_jax.config import CacheConfig, EngineConfig, LeanSparseConfig
from lsparse_jax.serving.engine import Engine
from tests.helpers import model_and_codebooks, tiny


@functools.cache
def setup():
    cfg = tiny(max_len=256)
    return cfg, *model_and_codebooks(cfg, 5, 7, 400, iters=2)


def make(method):
    cfg, params, books = setup()
    cache = CacheConfig(num_slots=3, prefill_chunk=32, page_size=4,
                        hot_cache_rows=None if method == "resident" else 16,
                        optional_pages=6 if method == "adaptive" else None, refill_pages=2)
    # C 32 >= the tiny preset's top-k 16, and >= the <= 28 compressed rows these requests reach,
    # as the default C 2048 is: every row is a candidate either way (the default's 4K-row key
    # cache made one decode step ~140x slower on CPU)
    lean = LeanSparseConfig(num_candidates=32, key_cache_rows=64)
    engine = Engine(EngineConfig(model=cfg, cache=cache, method=method, leansparse=lean), params,
                    books if method == "leansparse" else None)
    rng = np.random.default_rng(3)
    for n in (41, 70):  # slot 2 stays idle
        engine.admit(rng.integers(0, 256, n).astype(np.int32), max_new_tokens=40)
    return engine


def assert_same(a: Engine, b: Engine):
    assert a.generated == b.generated
    np.testing.assert_array_equal(a.lengths, b.lengths)
    np.testing.assert_array_equal(a.next_token, b.next_token)
    assert a.decode_tokens == b.decode_tokens
    for x, y in zip(jax.tree.leaves((a.state, a.stats)), jax.tree.leaves((b.state, b.stats)),
                    strict=True):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert a.metrics()["selection"] == b.metrics()["selection"]
    for s in a.requests:
        assert len(a.requests[s].token_times) == len(b.requests[s].token_times)


# 20 steps complete tail pages (page 4 x ratio 4 = 16 tokens) mid-run: the writeback is
# launched inside the pipeline
# hisparse's writeback runs in adaptive's case too (adaptive is hisparse plus lent pages)
# the pipeline is the engine's, not a method's: two methods with host traffic in the fast suite
@pytest.mark.parametrize("method", [pytest.param("resident", marks=pytest.mark.slow),
                                    pytest.param("hisparse", marks=pytest.mark.slow),
                                    "leansparse", "adaptive"])
def test_decode_equals_repeated_steps(method):
    stepped, piped = make(method), make(method)
    want = np.stack([np.asarray(stepped.step().tokens) for _ in range(20)])
    got = piped.decode(20)
    active = stepped.active
    np.testing.assert_array_equal(got[:, active], want[:, active])
    assert_same(stepped, piped)


def test_forced_decode_equals_forced_steps():
    stepped, piped = make("hisparse"), make("hisparse")
    inputs = np.random.default_rng(9).integers(0, 256, (12, 3)).astype(np.int32)
    for row in inputs:
        stepped.step(row)
    piped.decode(12, inputs)
    assert_same(stepped, piped)
    # the forced inputs replace what each step sampled, as step(tokens) records them
    assert piped.generated[0][-13:-1] == inputs[:, 0].tolist()


def test_decode_refuses_what_it_cannot_run():
    engine = make("resident")
    with pytest.raises(ValueError, match="n must be >= 1"):
        engine.decode(0)
    with pytest.raises(ValueError, match=r"inputs must be \[n=2, slots=3\]"):
        engine.decode(2, np.zeros((2, 2), np.int32))
    before = [list(t) for t in engine.generated]
    with pytest.raises(RuntimeError, match="room for fewer than 41 more tokens"):
        engine.decode(41)  # max_new_tokens 40
    assert engine.generated == before  # nothing ran


def test_timed_steps_feed_repeat_inputs_alike_pipelined_or_not():
    from experiments.common import timed_steps
    from lsparse_jax.serving.workloads import RepeatInputs

    a, b = make("hisparse"), make("hisparse")
    start = a.next_token.copy()
    timed_steps(a, 2, 3, pipelined=True, input_repeat=0.5)
    timed_steps(b, 2, 3, pipelined=False, input_repeat=0.5)
    assert_same(a, b)
    source = RepeatInputs(0.5, a.config.model.vocab_size, 0)
    want = np.concatenate([source.block(2, start), source.block(3, start)])
    assert a.generated[1][-6:-1] == want[:, 1].tolist()


def test_steps_share_one_launch_program():
    """step(), the pipelined decode (its first step has none in flight, the rest feed the
    previous step's tokens on the device) and a teacher-forced decode all dispatch one
    compiled ``launch_step``: no recompilation per call or per kind of step."""
    from lsparse_jax.serving.steps import launch_step

    engine = make("hisparse")
    engine.warmup()
    before = launch_step._cache_size()
    engine.step()
    engine.decode(3)
    engine.decode(2, inputs=np.ones((2, 3), np.int32))
    assert launch_step._cache_size() == before

"""Identity 4: layer-streamed prefill equals monolithic prefill; its state lives on the host."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lsparse_jax.config import CacheConfig, EngineConfig
from lsparse_jax.quant import KVRowFormat
from lsparse_jax.serving import prefill_stream
from lsparse_jax.serving.prefill_stream import (
    layer_state_bytes,
    stream_prefix,
    stream_state_bytes,
    streamed_prefill,
)
from lsparse_jax.serving.state import empty_state, insert
from lsparse_jax.serving.steps import decode_step, prefill
from tests.helpers import PATTERNS, model_and_tokens, tiny

# (layer pattern, chunk): the v4 pattern (SWA, CSA, HCA, CSA: two CSA layers share a role) and
# DSA with index sharing (leader, follower, leader); chunk 6 is not a multiple of the stride 4;
# v4_fp8: the v4 pattern with FP8 CSA rows (kv_dtype="fp8_v4").
CASES = {"v4": (PATTERNS["v4"], 16),
         "v4_fp8": (dict(PATTERNS["v4"], kv_dtype="fp8_v4"), 16),
         "dsa_shared": (dict(layer_pattern=("dsa",) * 3, dsa_share_group=2), 6)}
LENGTHS = {"v4": (100, 64, 9), "v4_fp8": (100, 9), "dsa_shared": (45, 24)}


@functools.cache
def setup(name):
    pattern, chunk = CASES[name]
    cfg = tiny(max_len=512, **pattern)
    params, tokens = model_and_tokens(cfg, 128, seed=11)
    return cfg, params, tokens, chunk


@functools.cache
def monolithic(name, n):
    cfg, params, tokens, chunk = setup(name)
    return prefill(params, cfg, tokens[:n], chunk)


def assert_bitwise_equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
        # e4m3 has NaN but no inf: compare its bits through f32 (exact), NaN-aware
        np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))


@pytest.mark.parametrize("name", sorted(CASES))
def test_identity4_streamed_equals_monolithic_prefill(name):
    cfg, params, tokens, chunk = setup(name)
    for n in LENGTHS[name]:
        caches, last = streamed_prefill(params, cfg, tokens[:n], chunk)
        ref_caches, ref_last = monolithic(name, n)
        assert_bitwise_equal(caches, ref_caches)
        np.testing.assert_array_equal(np.asarray(last), np.asarray(ref_last))
        assert {x.sharding.memory_kind for x in jax.tree.leaves(caches)} == {"device"}
    # the caches were really written: layer 1 (CSA / DSA) holds n // 4 (n) finite rows
    csa = name != "dsa_shared"
    rows = np.asarray(KVRowFormat.of(cfg).decode(caches[1].kv.entries) if csa
                      else caches[1].kv.entries)
    written = n // 4 if csa else n
    assert np.isfinite(rows[:written]).all() and np.isnan(rows[written:]).all()


def test_no_overlap_and_prefix_extension_are_identical():
    """The blocking (no-overlap) schedule, and a prefix extended by a later call at a chunk
    boundary, give the same state as one monolithic prefill."""
    cfg, params, tokens, chunk = setup("v4")
    ref_caches, ref_last = monolithic("v4", 100)
    caches, last = streamed_prefill(params, cfg, tokens[:100], chunk, overlap=False)
    assert_bitwise_equal(caches, ref_caches)
    np.testing.assert_array_equal(np.asarray(last), np.asarray(ref_last))
    head = stream_prefix(params, cfg, tokens[:2 * chunk], chunk)
    full = stream_prefix(params, cfg, tokens[2 * chunk:100], chunk, prefix=head)
    assert full.length == 100
    assert_bitwise_equal(full.to_device(), ref_caches)
    np.testing.assert_array_equal(np.asarray(full.last_logits), np.asarray(ref_last))


def test_state_lives_on_host_and_device_holds_two_layers():
    cfg, params, tokens, chunk = setup("v4")
    n = 100
    state = layer_state_bytes(cfg)
    assert stream_state_bytes(cfg) == max(a + b for a, b in zip(state, state[1:]))
    assert stream_state_bytes(cfg) < sum(state)  # two of four layers
    streamed_prefill(params, cfg, tokens[:n], chunk)  # compile outside the measurement
    existing = jax.live_arrays()  # held, so that no new array can reuse their ids
    before = {id(a) for a in existing}
    # activations besides the layer states: x [T, hidden] f32, a Selection (positions [T, k],
    # eligible [T], sources and key_sources [T, 3]) and the prompt, plain and padded (int32)
    activations = 4 * (chunk * cfg.hidden + chunk * (cfg.indexer.top_k + 7) + 2 * n + chunk)
    events = []

    def on_layer(event):
        # what the device holds now, beyond what existed before the call (params, ...)
        new = [a for a in jax.live_arrays() if id(a) not in before and not a.is_deleted()
               and a.sharding.memory_kind == "device"]
        held_bytes = sum(a.nbytes for a in new)
        events.append((event.start, event.layer, sorted(event.held), held_bytes))

    prefix = stream_prefix(params, cfg, tokens[:n], chunk, on_layer=on_layer)
    num = cfg.num_layers
    assert [(s, layer) for s, layer, _, _ in events] == [
        (s, layer) for s in range(0, n, chunk) for layer in range(num)]
    for _, layer, held, held_bytes in events:
        assert held == list(range(layer, min(layer + 2, num)))  # this layer and the next load
        assert held_bytes <= stream_state_bytes(cfg) + activations
        assert held_bytes < sum(state)  # a monolithic prefill would hold every layer
    # every layer's state is in pinned host memory between uses, and holds the prompt
    for cache in prefix.caches:
        assert {x.sharding.memory_kind for x in jax.tree.leaves(cache)} == {"pinned_host"}
    assert_bitwise_equal(prefix.to_device(), monolithic("v4", n)[0])


def test_one_compilation_per_layer_role():
    """Compilation does not grow with L: the layers of one role share one jitted Block."""
    _, _, tokens, chunk = setup("v4")
    cfg = tiny(max_len=64, layer_pattern=("swa",) * 5)
    params, _ = model_and_tokens(cfg, 1, seed=2)
    size = prefill_stream._block._cache_size()
    caches, last = streamed_prefill(params, cfg, tokens[:40], chunk)
    assert prefill_stream._block._cache_size() == size + 1  # five SWA layers, one compilation
    ref_caches, ref_last = prefill(params, cfg, tokens[:40], chunk)
    assert_bitwise_equal(caches, ref_caches)
    np.testing.assert_array_equal(np.asarray(last), np.asarray(ref_last))


def test_progress_and_errors():
    cfg, params, tokens, chunk = setup("v4")

    class Bar:
        def __init__(self):
            self.updates = []

        def update(self, k):
            self.updates.append(k)

    bar = Bar()
    streamed_prefill(params, cfg, tokens[:37], chunk, progress=bar)
    assert bar.updates == [16, 16, 5]
    with pytest.raises(ValueError, match="prompt is empty"):
        streamed_prefill(params, cfg, tokens[:0], chunk)
    with pytest.raises(ValueError, match="exceeds ModelConfig.max_len=512"):
        streamed_prefill(params, cfg, np.zeros(513, np.int32), chunk)
    with pytest.raises(ValueError, match="chunk=0"):
        streamed_prefill(params, cfg, tokens[:8], 0)
    head = stream_prefix(params, cfg, tokens[:16], chunk)
    with pytest.raises(ValueError, match="prompt of 513 tokens"):
        stream_prefix(params, cfg, np.zeros(497, np.int32), chunk, prefix=head)


def test_decoding_after_streamed_prefill_matches_monolithic():
    """Greedy decode steps (the engine's jitted step, two slots) from either prefill emit the
    same tokens and logits."""
    cfg, params, tokens, chunk = setup("dsa_shared")
    n, steps = 45, 4
    engine = EngineConfig(model=cfg, cache=CacheConfig(num_slots=2, prefill_chunk=chunk))
    ref_caches, ref_last = monolithic("dsa_shared", n)
    caches, last = streamed_prefill(params, cfg, tokens[:n], chunk)
    state = insert(insert(empty_state(engine), 0, ref_caches, n), 1, caches, n)
    nxt = jnp.stack([jnp.argmax(ref_last), jnp.argmax(last)]).astype(jnp.int32)
    both = jnp.ones(2, bool)
    emitted = [np.asarray(nxt)]
    for _ in range(steps):
        state, out = decode_step(params, engine, state, nxt, both)
        np.testing.assert_array_equal(np.asarray(out.logits[0]), np.asarray(out.logits[1]))
        nxt = out.tokens
        emitted.append(np.asarray(nxt))
    emitted = np.stack(emitted)
    np.testing.assert_array_equal(emitted[:, 0], emitted[:, 1])
    assert len(set(emitted[:, 0].tolist())) > 1  # a real continuation, not a constant


def test_engine_with_streamed_prefill_serves_like_monolithic():
    """CacheConfig(streamed_prefill=True): a paged (leansparse-style hierarchy) engine admits
    through the stream and decodes exactly as one admitting through monolithic prefill."""
    from lsparse_jax.serving.engine import Engine

    cfg = setup("v4")[0]  # the identity tests' model: its prefill chunks of 16 are compiled
    params, prompt = model_and_tokens(cfg, 70, seed=3)
    outs = []
    for streamed in (False, True):
        cache = CacheConfig(1, 16, 16, 8, streamed_prefill=streamed)
        engine = Engine(EngineConfig(model=cfg, cache=cache, method="hisparse"), params)
        engine.admit(prompt, max_new_tokens=8)
        outs.append([np.asarray(engine.step().logits) for _ in range(4)])
    for a, b in zip(*outs):
        np.testing.assert_array_equal(a, b)

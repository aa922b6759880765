"""Model identities: sparse == dense at full top-k (1), decode == forward (2), chunking."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lsparse_jax.config import CacheConfig, EngineConfig, IndexerConfig
from lsparse_jax.model.cache import empty_cache
from lsparse_jax.serving.state import empty_state, insert
from lsparse_jax.serving.steps import decode_step, forward, forward_chunk, prefill, sparse_layers
from tests.helpers import PATTERNS, model_and_tokens, tiny


def assert_trees_close(a, b, atol):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
        np.testing.assert_array_equal(np.isnan(x), np.isnan(y))
        np.testing.assert_allclose(np.nan_to_num(x), np.nan_to_num(y), atol=atol, rtol=1e-5)


# dsa_shared: slow tier (session 49; the DSA layers keep test_dsa_paging in the fast suite)
@pytest.mark.parametrize("pattern", ["v4", pytest.param("dsa_shared", marks=pytest.mark.slow)])
def test_identity1_full_topk_equals_dense(pattern):
    """Identity 1: top-k >= eligible length selects everything, so attention is dense."""
    cfg = tiny(max_len=128, indexer=IndexerConfig(2, 16, top_k=128, fp8_block=16),
               **PATTERNS[pattern])
    params, tokens = model_and_tokens(cfg, 100, seed=1)
    sparse = forward(params, cfg, tokens)
    dense = forward(params, cfg, tokens, dense_selection=True)
    np.testing.assert_allclose(np.asarray(sparse), np.asarray(dense), atol=2e-5, rtol=1e-5)
    # ...and with a small top-k the sparse model really differs from dense.
    small = tiny(max_len=128, indexer=IndexerConfig(2, 16, top_k=4, fp8_block=16),
                 **PATTERNS[pattern])
    assert not np.allclose(np.asarray(forward(params, small, tokens)),
                           np.asarray(forward(params, small, tokens, dense_selection=True)),
                           atol=1e-3)


@pytest.mark.parametrize("pattern", ["v4", pytest.param("dsa_shared", marks=pytest.mark.slow)])
def test_identity2_decode_equals_teacher_forced_forward(pattern):
    """Identity 2 (resident): prefill + decode steps over a batch of slots give the logits and
    the indexer selections of one teacher-forced forward of each sequence."""
    cfg = tiny(max_len=256, **PATTERNS[pattern])
    engine = EngineConfig(model=cfg, cache=CacheConfig(num_slots=3))
    params, _ = model_and_tokens(cfg, 1)
    rng = np.random.default_rng(7)
    seqs = [rng.integers(0, 256, n).astype(np.int32) for n in (90, 130)]
    prompt_lens = [37, 61]
    refs = [forward_chunk(params, cfg, empty_cache(cfg), jnp.asarray(s), 0, len(s)) for s in seqs]

    state = empty_state(engine)
    for slot, (s, p) in zip((0, 2), zip(seqs, prompt_lens)):
        caches, last = prefill(params, cfg, s[:p], chunk=16)
        np.testing.assert_allclose(np.asarray(last), np.asarray(refs[slot // 2][0][p - 1]),
                                   atol=1e-4, rtol=1e-4)
        state = insert(state, slot, caches, p)
    idle_before = jax.tree.map(lambda a: np.asarray(a[1], np.float32), state.caches)

    pos = list(prompt_lens)
    for _ in range(max(len(s) for s in seqs) - min(prompt_lens) - 1):
        live = [pos[i] < len(seqs[i]) - 1 for i in range(2)]
        if not any(live):
            break
        tokens = jnp.asarray([seqs[0][min(pos[0], 89)], 0, seqs[1][min(pos[1], 129)]], jnp.int32)
        active = jnp.asarray([live[0], False, live[1]])
        state, out = decode_step(params, engine, state, tokens, active)
        for i, slot in enumerate((0, 2)):
            if not live[i]:
                continue
            ref_logits, _, ref_sels = refs[i]
            np.testing.assert_allclose(np.asarray(out.logits[slot]),
                                       np.asarray(ref_logits[pos[i]]), atol=1e-4, rtol=1e-4)
            for j, layer in enumerate(sparse_layers(cfg)):
                got = np.asarray(out.selected[slot, j])
                want = np.asarray(ref_sels[layer].positions[pos[i]])
                assert set(got[got >= 0]) == set(want[want >= 0])
            pos[i] += 1
    np.testing.assert_array_equal(np.asarray(state.lengths), [pos[0], 0, pos[1]])
    assert_trees_close(idle_before, jax.tree.map(lambda a: a[1], state.caches), atol=0)


@pytest.mark.parametrize("pattern", ["v4", pytest.param("dsa_shared", marks=pytest.mark.slow)])
def test_chunked_prefill_equals_unchunked(pattern):
    # max_len 256: the model of identity 2 and the kernel tests, whose chunks of 16 and 5
    # tokens compile the same programs (reused)
    cfg = tiny(max_len=256, **PATTERNS[pattern])
    params, tokens = model_and_tokens(cfg, 83, seed=3)
    whole, last = prefill(params, cfg, tokens, chunk=83)
    for chunk in (1, 5, 16):
        caches, last_c = prefill(params, cfg, tokens, chunk=chunk)
        assert_trees_close(caches, whole, atol=2e-5)
        np.testing.assert_allclose(np.asarray(last_c), np.asarray(last), atol=5e-5, rtol=1e-5)


def test_prefill_rejects_bad_prompts():
    cfg = tiny(max_len=64)
    params, tokens = model_and_tokens(cfg, 65)
    with pytest.raises(ValueError, match="exceeds ModelConfig.max_len=64"):
        prefill(params, cfg, tokens, chunk=16)
    with pytest.raises(ValueError, match="empty"):
        prefill(params, cfg, tokens[:0], chunk=16)


@pytest.mark.parametrize("budget", [1, 3 * 4 * 64 * 4])  # tiles of 1 query; of 2 (T = 7: padded)
def test_exact_selection_in_query_tiles_equals_untiled(budget):
    """Prefill's indexer scores [T, H, N] are computed in query tiles when they exceed the
    budget; every query's selection is the same as untiled."""
    from lsparse_jax.model.store import IndexerQuery, exact_selection
    from lsparse_jax.quant import quantize_index_keys

    rng = np.random.default_rng(0)
    t, h, d, n = 7, 4, 32, 64
    query = IndexerQuery(jnp.asarray(rng.normal(size=(t, h, d)), jnp.float32),
                         jnp.asarray(rng.normal(size=(t, h)), jnp.float32))
    values, scales = quantize_index_keys(jnp.asarray(rng.normal(size=(n, d)), jnp.float32), 32)
    eligible = jnp.arange(n)[None, :] < jnp.asarray([1, 5, 9, 20, 33, 50, 64])[:, None]
    want = exact_selection(query, values, scales, eligible, 8)
    got = exact_selection(query, values, scales, eligible, 8, tile_bytes=budget)
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_select_topk_through_the_kernel_equals_topk_positions():
    """``select_topk`` through the Pallas top-k (interpret mode) and through "xla" return
    topk_positions' positions and values entry for entry: any eligibility mask (not only
    prefixes), rows with fewer than k or no eligible entries, ties resolved to the lower
    position (-0.0 tied with +0.0), k > N."""
    from lsparse_jax.indexing.topk import select_topk, topk_positions

    rng = np.random.default_rng(1)
    t, n = 6, 96
    scores = rng.normal(size=(t, n)).astype(np.float32)
    scores[1, ::3] = 0.5  # ties across the k-th place
    eligible = rng.random((t, n)) < 0.6
    eligible[2] = np.arange(n) < 5  # fewer than k
    eligible[3] = False  # nothing eligible (a padding query)
    scores[4, ~eligible[4]] = np.nan  # poison where not eligible
    scores[5, :40] = np.where(np.arange(40) % 2, 0.0, -0.0)  # signed zeros tie
    scores[5, 40:] = -1.0
    want = np.where(scores == 0, 0.0, scores)  # -0.0 counts as +0.0
    for k in (16, 128):
        ref = topk_positions(jnp.asarray(want), jnp.asarray(eligible), k)
        for impl in ("xla", "triton"):
            got = select_topk(jnp.asarray(scores), jnp.asarray(eligible), k, impl)
            for a, b in zip(ref, got):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(ValueError, match="unknown"):
        select_topk(jnp.asarray(scores), jnp.asarray(eligible), 4, "cuda")


@pytest.mark.gpu
def test_select_topk_kernel_equals_topk_positions_on_gpu():
    """The same identity at prefill shapes on the GPU (a 256-query tile over 32768 keys, k 512,
    causal-prefix and random masks, ties)."""
    from lsparse_jax.indexing.topk import select_topk, topk_positions

    rng = np.random.default_rng(2)
    t, n = 256, 32768
    scores = np.round(rng.normal(size=(t, n)), 2).astype(np.float32)  # many ties
    prefix = np.arange(n)[None, :] < rng.integers(0, n, t)[:, None]
    for eligible in (prefix, rng.random((t, n)) < 0.3):
        want = topk_positions(jnp.asarray(scores), jnp.asarray(eligible), 512)
        got = select_topk(jnp.asarray(scores), jnp.asarray(eligible), 512, "triton")
        for a, b in zip(want, got):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("pattern", [
    "v4", pytest.param("dsa_shared", marks=pytest.mark.slow)])  # 100 DSA rows: ~30 s interpreted
def test_prefill_with_kernel_topk_equals_xla_bit_for_bit(pattern):
    """A chunk's exact selections (CSA and DSA leaders) through the top-k kernel (interpret
    mode) give the same positions in the same order, so logits, caches and selections equal
    the "xla" prefill's bit for bit (100 tokens: 25 CSA rows, 100 DSA rows > top_k 16)."""
    cfg = tiny(**PATTERNS[pattern])
    params, tokens = model_and_tokens(cfg, 100)
    want = forward_chunk(params, cfg, empty_cache(cfg), tokens, 0, 100)
    got = forward_chunk(params, cfg, empty_cache(cfg), tokens, 0, 100, implementation="triton")
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got)):  # bits (FP8 NaN included)
        a, b = np.asarray(a), np.asarray(b)
        np.testing.assert_array_equal(a.view(f"u{a.itemsize}"), b.view(f"u{b.itemsize}"))


def test_matmul_precision_reaches_every_model_matmul():
    """ModelConfig.matmul_precision="bf16" puts bf16 operands (f32 accumulation) on every dot of
    a chunk's forward (projections, attention, the indexer's exact scores, the LM head), and
    "highest" on none; bf16 logits stay close to f32 ones; an unknown name is a config error."""
    import dataclasses
    import re

    cfg = tiny(max_len=256, indexer=IndexerConfig(2, 16, top_k=8, fp8_block=16))
    params, tokens = model_and_tokens(cfg, 200, seed=3)
    low = dataclasses.replace(cfg, matmul_precision="bf16")

    def dots(c):
        hlo = forward_chunk.lower(params, c, empty_cache(c), tokens, 0, 200).as_text()
        ops = re.findall(r"stablehlo\.dot_general[^\n]*", hlo)
        return len(ops), sum("BF16" in op.upper() or "bf16" in op for op in ops)

    total, marked = dots(low)
    assert total >= 10 and marked == total  # all of them, including the indexer's scores
    assert dots(cfg)[1] == 0
    ref = np.asarray(forward(params, cfg, tokens))
    got = np.asarray(forward(params, low, tokens))
    assert np.max(np.abs(got - ref)) < 0.05 * np.max(np.abs(ref))
    with pytest.raises(ValueError, match="matmul_precision"):
        tiny(matmul_precision="fp16")


@pytest.mark.parametrize("kv_dtype,precision,atol", [
    ("f32", "f32", 1e-4), pytest.param("bf16", "bf16", 3e-2, marks=pytest.mark.slow),
    pytest.param("f32", "bf16", 3e-2, marks=pytest.mark.slow)])  # slow since session 49
def test_short_chunk_attends_through_the_kernel_like_xla(kv_dtype, precision, atol):
    """A CSA chunk of T <= blocks.KERNEL_QUERIES queries (a verification block) attends through
    the sparse_attention kernel (interpret mode), query by query with its own window rows; the
    table shared, or per query where ``selected_rows`` rounds f32 rows to bf16. Its logits
    match the XLA path's within the kernel's precision (f32: 3-pass products; bf16: q and
    probabilities rounded), and the selections are the same sets."""
    from lsparse_jax.model.blocks import KERNEL_QUERIES

    cfg = tiny(kv_dtype=kv_dtype, attention_precision=precision)
    params, tokens = model_and_tokens(cfg, 69)
    _, caches, _ = forward_chunk(params, cfg, empty_cache(cfg), tokens[:64], 0, 64)
    t = 5
    assert t <= KERNEL_QUERIES
    want = forward_chunk(params, cfg, caches, tokens[64:], 64, t)
    got = forward_chunk(params, cfg, caches, tokens[64:], 64, t, implementation="triton")
    for layer in sparse_layers(cfg):  # the same sets (the HCA layer before layer 3 attends
        #  in the kernel too at bf16: a rounding may reorder equal-set selections)
        np.testing.assert_array_equal(np.sort(want[2][layer].positions, axis=-1),
                                      np.sort(got[2][layer].positions, axis=-1))
        assert (np.asarray(got[2][layer].positions) >= 0).any()
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), atol=atol, rtol=0)
    assert not np.array_equal(np.asarray(got[0]), np.asarray(want[0]))  # the kernel ran

"""LeanSparse's cold start (issue 17): ``LeanSparseConfig.warm_steps`` changes only what the
miss filter keeps while a request's key cache is cold, i.e. which exact keys are fetched into
the cache; every exact score and selection rule is unchanged. Seeding the key cache at admission
(``methods.leansparse.seed_key_cache``) changes only which keys count as cached."""

import jax.numpy as jnp
import numpy as np
import pytest

from lsparse_jax.config import LeanSparseConfig
from lsparse_jax.methods.leansparse import seed_key_cache, seed_positions
from lsparse_jax.serving.steps import prefill
from tests.helpers import model_and_tokens
from tests.test_leansparse import make

C, ROWS = 32, 48  # candidates (> top-k 16) and key-cache rows, below the ~57-row histories


def run(lean, steps=8):
    """Two requests decoded on fixed inputs; per step: logits, selections, key sources."""
    engine = make("leansparse", lean, slots=2)
    for n, seed in ((230, 3), (190, 4)):
        engine.admit(model_and_tokens(engine.config.model, n, seed=seed)[1],
                     max_new_tokens=steps + 2)
    out = []
    for i in range(steps):
        o = engine.step(tokens=(np.asarray([7, 9], np.int32) + i) % 256)  # the same inputs
        out.append({k: np.asarray(getattr(o, k)) for k in ("logits", "selected", "key_sources")})
    return out


def same(a, b, steps) -> bool:
    return all(np.array_equal(x[k], y[k]) for x, y in zip(a[:steps], b[:steps]) for k in x)


def host_keys(out, step):
    return int(out[step]["key_sources"][..., 2].sum())  # exact keys copied from host pages


def test_warm_steps_run_the_filterless_selection_while_cold():
    """While the cache is cold the filtered engine is the filterless one, bit for bit
    (selections, logits, key traffic): warm_steps only decides which keys enter the cache."""
    off = run(LeanSparseConfig(C, None, ROWS))
    warm = run(LeanSparseConfig(C, 0.0, ROWS, warm_steps=8))
    assert same(warm, off, 8)


@pytest.mark.slow
def test_warm_steps_identities_and_effect():
    """Filter off: warm_steps is invisible. Filter on: the first warm_steps steps equal the
    filterless run and fetch every candidate; warm_steps = 0 fetches fewer at step 1; after the
    warm steps the filter acts again."""
    off = run(LeanSparseConfig(C, None, ROWS))
    assert same(run(LeanSparseConfig(C, None, ROWS, warm_steps=3)), off, 8)
    warm = run(LeanSparseConfig(C, 0.0, ROWS, warm_steps=2))
    cold = run(LeanSparseConfig(C, 0.0, ROWS, warm_steps=0))
    assert same(warm, off, 2) and not same(warm, off, 8)
    assert host_keys(cold, 0) < host_keys(warm, 0) == host_keys(off, 0)


def test_seed_positions_ranking():
    """The last query's picks first, then by how many queries picked a position, then the
    most recent; -1 padded."""
    sel = np.array([[5, 9, -1], [9, 2, 7], [9, 4, 3], [1, 3, -1]])
    np.testing.assert_array_equal(seed_positions(sel, 4), [3, 1, 9, 7])
    np.testing.assert_array_equal(seed_positions(sel, 9), [3, 1, 9, 7, 5, 4, 2, -1, -1])


@pytest.mark.slow
def test_seeding_every_key_equals_the_filterless_engine():
    """A key cache seeded with every paged key makes every candidate cached: with the miss
    filter on and no warm step, selections and logits equal the filterless engine's until a
    new page completes (the 190-token request's at its third step; its keys were never
    seeded), and the first step copies no exact key from the host (all key-cache hits)."""
    steps = 2
    off = run(LeanSparseConfig(C, None, 64), steps)
    engine = make("leansparse", LeanSparseConfig(C, 0.0, 64, warm_steps=0), slots=2)
    cfg = engine.config.model
    for n, seed in ((230, 3), (190, 4)):
        tokens = model_and_tokens(cfg, n, seed=seed)[1]
        prefilled = prefill(engine.params, cfg, tokens, engine.config.cache.prefill_chunk)
        slot = engine.admit(tokens, max_new_tokens=10, prefilled=prefilled)
        rows = n // cfg.csa_ratio
        paged = rows // engine.config.cache.page_size * engine.config.cache.page_size
        for layer in (i for i, k in enumerate(cfg.layer_pattern) if k == "csa"):
            keys = prefilled[0][layer].keys
            pos = np.full(64, -1, np.int32)
            pos[:rows] = np.arange(rows)
            engine.state = seed_key_cache(engine.state, layer, slot, jnp.asarray(pos),
                                          keys.values, keys.scales, paged)
    seeded = []
    for i in range(steps):
        o = engine.step(tokens=(np.asarray([7, 9], np.int32) + i) % 256)
        seeded.append({k: np.asarray(getattr(o, k)) for k in ("logits", "selected",
                                                             "key_sources")})
    assert host_keys(seeded, 0) == 0 < host_keys(off, 0)
    for x, y in zip(seeded, off):
        np.testing.assert_array_equal(x["selected"], y["selected"])
        np.testing.assert_array_equal(x["logits"], y["logits"])

"""LeanSparse's cold start (issue 17): ``LeanSparseConfig.warm_steps`` changes only what the
miss filter keeps while a request's key cache is cold, i.e. which exact keys are fetched into
the cache; every exact score and selection rule is unchanged."""

import numpy as np
import pytest

from lsparse_jax.config import LeanSparseConfig
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

"""Training (issue 7): the indexer's loss reaches only the indexer, batches are deterministic
and held out where they say, and an interrupted run resumes to exactly the same parameters."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lsparse_jax.model.presets import fit_max_len
from lsparse_jax.model.transformer import init_params
from lsparse_jax.tasks import tokenizer
from lsparse_jax.training import TRAIN_SEED_BASE, TrainConfig, load_params, loss_fn, train
from lsparse_jax.training.data import make_batch, training_sequence
from tests.helpers import tiny


def _is_indexer(path) -> bool:
    names = [getattr(k, "key", "") for k in path]
    return "indexer" in names or "index_comp" in names


@pytest.mark.parametrize("dense", [True, False])
def test_indexer_loss_reaches_only_the_indexer(dense):
    """Exact identity: with the LM loss alone every indexer gradient is 0; with the indexer KL
    alone every non-indexer gradient is 0 (and the indexer's is not)."""
    cfg = fit_max_len(tiny(), 64)
    params = init_params(cfg, 0)
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, 256, (2, 64)), jnp.int32)
    weights = jnp.ones((2, 64), jnp.float32)

    def grads(lm_scale, kl_weight):
        def f(p):
            _, aux = loss_fn(p, cfg, tokens, tokens, weights, dense, kl_weight)
            return lm_scale * aux["lm"] + kl_weight * aux["kl"]
        return jax.tree_util.tree_leaves_with_path(jax.grad(f)(params))

    for path, g in grads(1.0, 0.0):
        g = np.asarray(g)
        assert np.isfinite(g).all()
        if _is_indexer(path):
            assert not g.any(), f"LM loss reached {jax.tree_util.keystr(path)}"
    indexer_norm = 0.0
    for path, g in grads(0.0, 1.0):
        g = np.asarray(g)
        assert np.isfinite(g).all()
        if _is_indexer(path):
            indexer_norm += float(np.abs(g).sum())
        else:
            assert not g.any(), f"indexer KL reached {jax.tree_util.keystr(path)}"
    assert indexer_norm > 0


def test_batches_are_deterministic_and_held_out_where_they_say():
    mix = {"niah": 0.5, "mrcr": 0.5}
    a = make_batch(3, 4, 512, mix, 10.0, extra_queries=2)
    b = make_batch(3, 4, 512, mix, 10.0, extra_queries=2)
    c = make_batch(4, 4, 512, mix, 10.0, extra_queries=2)
    held = make_batch(3, 4, 512, mix, 10.0, held_out=True)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    assert not np.array_equal(a.tokens, c.tokens)
    assert not np.array_equal(a.tokens, held.tokens)
    np.testing.assert_array_equal(a.tokens[:, 1:], a.targets[:, :-1])  # targets = next tokens
    assert set(np.unique(a.weights)) <= {0.0, 1.0, 10.0}
    np.testing.assert_array_equal(a.weights == 10.0, a.answer_mask)
    # held-out batches have exactly one answer, at the end, in the plain task format
    for row, mask in zip(held.targets, held.answer_mask):
        span = np.flatnonzero(mask)
        assert span[-1] == len(row) - 1 and np.all(np.diff(span) == 1)


def test_training_sequence_answers_are_the_needle_values():
    """Every answer span of a multi-query NIAH sequence is the value its question asks for."""
    seq, answer, real = training_sequence("niah", 1025, TRAIN_SEED_BASE + 7, extra_queries=3)
    text = tokenizer.decode(seq[real])
    import re

    values = dict(re.findall(r" The magic number for (\S+) is (\d+)\. ", text))
    asked = re.findall(r"Answer: The magic number for (\S+) is ", text)
    spans = np.split(np.flatnonzero(answer), np.flatnonzero(np.diff(np.flatnonzero(answer)) > 1)
                     + 1)
    assert len(asked) == len(spans) >= 2
    for key, span in zip(asked, spans):
        assert tokenizer.decode(seq[span]) == values[key]


def test_train_resumes_to_the_same_parameters(tmp_path):
    """Two steps straight == one step, stop, resume, one more step (orbax state + data stream
    are both resumable), and the exported params load back."""
    cfg = tiny(max_len=384)
    tc = TrainConfig(seq_len=320, batch=2, dense_steps=1, sparse_steps=1, warmup=1,
                     checkpoint_every=1, mix=(("niah", 1.0),), extra_queries=1)
    straight, hist = train(cfg, tc, tmp_path / "a", progress=False, log=lambda *_: None)
    assert [h["phase"] for h in hist] == ["dense", "sparse"]
    train(cfg, tc, tmp_path / "b", progress=False, log=lambda *_: None, stop_at=1)
    resumed, _ = train(cfg, tc, tmp_path / "b", progress=False, log=lambda *_: None)
    for x, y in zip(jax.tree.leaves(straight), jax.tree.leaves(resumed)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    from lsparse_jax.training import save_params

    save_params(tmp_path / "export", straight, {"note": "test"})
    loaded = load_params(tmp_path / "export", fit_max_len(cfg, tc.seq_len))
    for x, y in zip(jax.tree.leaves(straight), jax.tree.leaves(loaded)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    with pytest.raises(ValueError, match="does not match"):
        load_params(tmp_path / "export", tiny(max_len=384, hidden=32))


def test_train_config_rejects_bad_values():
    with pytest.raises(ValueError, match="seq_len"):
        TrainConfig(seq_len=0)
    with pytest.raises(ValueError, match="not both 0"):
        TrainConfig(dense_steps=0, sparse_steps=0)

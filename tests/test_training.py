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

    # the two loss weights are arguments of one compiled gradient (not constants of two)
    @jax.jit
    @jax.grad
    def grad_fn(p, lm_scale, kl_weight):
        _, aux = loss_fn(p, cfg, tokens, tokens, weights, dense, kl_weight)
        return lm_scale * aux["lm"] + kl_weight * aux["kl"]

    def grads(lm_scale, kl_weight):
        return jax.tree_util.tree_leaves_with_path(grad_fn(params, lm_scale, kl_weight))

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
    # held-out batches have exactly one answer, at the end, in the plain task format (a
    # shorter MRCR answer is followed by padding of weight 0)
    for mask, w in zip(held.answer_mask, held.weights):
        span = np.flatnonzero(mask)
        assert np.all(np.diff(span) == 1) and not w[span[-1] + 1:].any()


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


# slow tier (session 49): 60 s; the training losses keep test_training's fast tests
@pytest.mark.slow
def test_train_resumes_to_the_same_parameters(tmp_path):
    """Two steps straight == one step, stop, resume, one more step (orbax state + data stream
    are both resumable), and the exported params load back."""
    cfg = tiny(max_len=384)
    tc = TrainConfig(seq_len=320, batch=2, dense_steps=1, sparse_steps=1, warmup=1,
                     checkpoint_every=1, mix=(("niah", 1.0),), extra_queries=1)
    # eval_batch 2: 8 held-out evaluation sequences, not the default's 204 (the evaluation
    # only writes the history; it does not touch the parameters)
    quiet = dict(progress=False, log=lambda *_: None, eval_batch=2)
    straight, hist = train(cfg, tc, tmp_path / "a", **quiet)
    assert [h["phase"] for h in hist] == ["dense", "sparse"]
    train(cfg, tc, tmp_path / "b", stop_at=1, **quiet)
    resumed, _ = train(cfg, tc, tmp_path / "b", **quiet)
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


@pytest.mark.slow
def test_curriculum_run_resumes_bit_identically(tmp_path):
    """A length curriculum (two stages, dense then sparse) started from an exported checkpoint:
    straight through == stopped by max_seconds after the first step, then resumed (the stage
    boundary, the init_from params and the optimizer state all survive the restart)."""
    from lsparse_jax.training import save_params
    from lsparse_jax.training.trainer import completed_steps

    cfg = tiny(max_len=384)
    start = init_params(fit_max_len(cfg, 320), 5)
    save_params(tmp_path / "init", start)
    tc = TrainConfig(seq_len=320, batch=1, dense_steps=1, sparse_steps=2, warmup=1,
                     checkpoint_every=10, mix=(("niah", 0.5), ("mrcr", 0.5)), extra_queries=1,
                     mrcr_extra_queries=1, curriculum=((1, 320, 2), (2, 384, 1)),
                     init_from=str(tmp_path / "init"))
    assert [tc.stage(s) for s in range(3)] == [(320, 2), (384, 1), (384, 1)]
    quiet = dict(progress=False, log=lambda *_: None, eval_batch=2)
    straight, hist = train(cfg, tc, tmp_path / "a", **quiet)
    assert [(h["step"], h["phase"], h["seq_len"]) for h in hist] == [(0, "dense", 320),
                                                                     (2, "sparse", 384)]
    _, part = train(cfg, tc, tmp_path / "b", max_seconds=1e-9, **quiet)  # stops after 1 step
    assert completed_steps(tmp_path / "b") == 1 and len(part) == 1
    resumed, _ = train(cfg, tc, tmp_path / "b", **quiet)
    assert completed_steps(tmp_path / "b") == 3
    for x, y in zip(jax.tree.leaves(straight), jax.tree.leaves(resumed)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    # init_from took effect: a run stopped before its first step returns `start` itself
    untouched, _ = train(cfg, tc, tmp_path / "c", stop_at=0, **quiet)
    for x, y in zip(jax.tree.leaves(start), jax.tree.leaves(untouched)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_curriculum_must_cover_the_schedule():
    tc = TrainConfig(dense_steps=2, sparse_steps=3, curriculum=((2, 512, 4), (3, 1024, 2)))
    assert [tc.stage(s) for s in range(5)] == [(512, 4)] * 2 + [(1024, 2)] * 3
    assert tc.max_seq_len == 1024
    with pytest.raises(ValueError, match="sum to 3"):
        TrainConfig(dense_steps=2, sparse_steps=2, curriculum=((3, 256, 2),))
    with pytest.raises(ValueError, match="positive integers"):
        TrainConfig(dense_steps=2, sparse_steps=0, curriculum=((2, 256, 0),))


def test_mrcr_training_rounds_answer_what_they_ask():
    """Every answered round of a multi-query MRCR conversation is the body of the ordinal-th
    'write' round of its kind and topic, and the first answer is the task's own."""
    import re

    for seed in range(6):
        seq, answer, real = training_sequence("mrcr", 1025, TRAIN_SEED_BASE + seed, 0,
                                              mrcr_extra_queries=3)
        text = tokenizer.decode(seq[real])
        rounds = re.findall(r"User: write a (\w+) about (\w+)\nBot: ([a-z :]+)\n", text)
        asked = re.findall(r"User: repeat the (\d)\w\w (\w+) about (\w+)\nBot: ", text)
        spans = np.split(np.flatnonzero(answer),
                         np.flatnonzero(np.diff(np.flatnonzero(answer)) > 1) + 1)
        assert len(asked) == len(spans) >= 2
        for (n, kind, topic), span in zip(asked, spans):
            bodies = [b for k, t, b in rounds if (k, t) == (kind, topic)]
            assert tokenizer.decode(seq[span]) == bodies[int(n) - 1] + "\n"

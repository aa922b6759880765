"""Drafter training (training/drafter.py): a few steps on CPU reduce the distillation loss,
an interrupted run resumes to the same parameters, and the checkpoint loads back."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lsparse_jax.config import DrafterConfig
from lsparse_jax.model.drafter import init_drafter
from lsparse_jax.model.presets import fit_max_len
from lsparse_jax.model.transformer import init_params
from lsparse_jax.training import save_params
from lsparse_jax.training.data import make_batch
from lsparse_jax.training.drafter import (
    DrafterTrainConfig,
    drafter_step,
    load_drafter,
    make_optimizer,
    train_drafter,
)
from tests.helpers import tiny

DCFG = DrafterConfig(gamma=4, window=16, target_layers=(1, 3), num_heads=2, head_dim=16,
                     mlp_hidden=64)
TC = DrafterTrainConfig(seq_len=320, batch=2, steps=4, lr=3e-3, warmup=1, anchors=8,
                        mix=(("niah", 1.0),), checkpoint_every=2)


# slow tier (session 49): 17 s of training steps
@pytest.mark.slow
def test_drafter_steps_reduce_the_distillation_loss():
    """Three optimizer steps on one batch of NIAH text lower the drafter's loss against a
    frozen (random) target; the target's parameters are untouched (frozen)."""
    cfg = fit_max_len(tiny(), TC.seq_len)
    params = init_params(cfg, 0)
    before = jax.tree.map(np.asarray, params)
    dparams = init_drafter(cfg, DCFG, 0)
    opt = make_optimizer(TC).init(dparams)
    tokens = jnp.asarray(make_batch(0, 2, TC.seq_len, {"niah": 1.0}, 1.0).tokens)
    losses = []
    for _ in range(3):
        dparams, opt, aux = drafter_step(dparams, opt, params, cfg, DCFG, TC, tokens,
                                         jax.random.key(0))
        losses.append(float(aux["loss"]))
    assert losses[-1] < losses[0]
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(params)):
        np.testing.assert_array_equal(a, np.asarray(b))


@pytest.mark.slow
def test_drafter_trains_resumes_and_loads(tmp_path):
    cfg = fit_max_len(tiny(), TC.seq_len)
    params = init_params(cfg, 0)
    quiet = lambda *a: None  # noqa: E731
    whole, hist = train_drafter(params, cfg, DCFG, TC, tmp_path / "a", log=quiet, eval_every=3)
    assert hist[-1]["eval_loss"] < hist[0]["eval_loss"]
    assert all(1.0 <= h["acceptance"] <= DCFG.gamma + 1 for h in hist)
    train_drafter(params, cfg, DCFG, TC, tmp_path / "b", log=quiet, eval_every=3, stop_at=2)
    resumed, _ = train_drafter(params, cfg, DCFG, TC, tmp_path / "b", log=quiet, eval_every=3)
    for a, b in zip(jax.tree.leaves(whole), jax.tree.leaves(resumed)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    save_params(tmp_path / "ckpt", whole, {"drafter_config": dataclasses.asdict(DCFG)})
    loaded, dcfg = load_drafter(tmp_path / "ckpt")
    assert dcfg == DCFG
    assert jax.tree.structure(loaded) == jax.tree.structure(whole)
    for a, b in zip(jax.tree.leaves(whole), jax.tree.leaves(loaded)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

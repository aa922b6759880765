"""Small shared test helpers."""

import numpy as np

from lsparse_jax.model import init_params, preset

# Layer patterns covering every kind, DSA with and without index sharing.
PATTERNS = {
    "v4": dict(layer_pattern=("swa", "csa", "hca", "csa")),
    "dsa_shared": dict(layer_pattern=("dsa", "dsa", "dsa", "csa"), dsa_share_group=2),
}


def tiny(max_len=256, **overrides):
    """A small tiny-preset model: short HCA stride so HCA entries appear in short prompts."""
    fields = dict(max_len=max_len, hca_ratio=16, swa_window=8, hidden=64, num_heads=2,
                  head_dim=32, mlp_hidden=64)
    fields.update(overrides)
    return preset("tiny", **fields)


def assert_resolved_rows(rows, selected, truth):
    """Row j of a resolver's output is truth[selected[j]], or all NaN where selected[j] < 0."""
    rows = np.asarray(rows)
    for j, p in enumerate(selected):
        if p >= 0:
            np.testing.assert_array_equal(rows[j], truth[p])
        else:
            assert np.isnan(rows[j]).all()


def model_and_tokens(cfg, length, seed=0):
    params = init_params(cfg, seed)
    tokens = np.random.default_rng(seed).integers(0, cfg.vocab_size, length).astype(np.int32)
    return params, tokens


def model_and_codebooks(cfg, seed, calib_seed, calib_tokens, iters):
    """Random parameters of ``cfg`` and LeanSparse PQ codebooks calibrated on
    ``calib_tokens`` random tokens (``calibrate_codebooks``)."""
    from lsparse_jax.methods.leansparse import calibrate_codebooks

    params, _ = model_and_tokens(cfg, 1, seed=seed)
    calib = np.random.default_rng(calib_seed).integers(0, 256, calib_tokens).astype(np.int32)
    return params, calibrate_codebooks(params, cfg, calib, iters=iters)


def slot0_steps(engine, n):
    """``n`` decode steps of ``engine``: slot 0's tokens and logits."""
    outs = [engine.step() for _ in range(n)]
    return [int(o.tokens[0]) for o in outs], [np.asarray(o.logits[0]) for o in outs]


def assert_same_continuation(want_engine, got_engine, n):
    """``n`` decode steps of slot 0 on both engines: equal tokens, bit-equal logits."""
    (want, want_logits), (got, got_logits) = slot0_steps(want_engine, n), \
        slot0_steps(got_engine, n)
    assert got == want
    for a, b in zip(want_logits, got_logits, strict=True):
        np.testing.assert_array_equal(a, b)

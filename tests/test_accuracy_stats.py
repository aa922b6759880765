"""The accuracy study's statistics and seed ranges (issue 17): Wilson intervals and exact
McNemar tests against hand-computed values; evaluation seeds disjoint from training seeds by
construction."""

import numpy as np
import pytest

from experiments.accuracy import (
    CALIBRATION_SEED,
    cell_records,
    evaluation_seeds,
    mcnemar,
    pair_records,
    summarize,
    wilson,
)
from lsparse_jax.training import TRAIN_SEED_BASE, data


@pytest.mark.parametrize("k, n, lo, hi", [
    # z = 1.959964: 0/10 -> [0, z^2 / (n + z^2)] = [0, 3.841459 / 13.841459]
    (0, 10, 0.0, 0.2775328),
    (10, 10, 0.7224672, 1.0),
    # 5/10: center 0.5, half = z / 1.3841459 * sqrt(0.025 + 0.0096036) = 0.2634069
    (5, 10, 0.2365931, 0.7634069),
    # 190/200: p = 0.95, denom = 1.0192073, center = (0.95 + 0.0096036) / denom = 0.9415198,
    # half = z / denom * sqrt(0.0002375 + 0.0000240) = 1.923029 * 0.0161713 = 0.0310978
    (190, 200, 0.9104220, 0.9726176),
])
def test_wilson_interval_hand_values(k, n, lo, hi):
    got = wilson(k, n)
    assert got == pytest.approx((lo, hi), abs=1e-6)


def test_wilson_interval_edge_cases():
    assert wilson(0, 0) == (0.0, 1.0)
    lo, hi = wilson(100, 200)
    assert lo < 0.5 < hi and hi - 0.5 == pytest.approx(0.5 - lo)  # symmetric at p = 1/2


@pytest.mark.parametrize("a_only, b_only, p", [
    (5, 0, 2 / 2**5),  # 2 * C(5, 0) / 32 = 0.0625
    (6, 1, 2 * (1 + 7) / 2**7),  # 2 (C(7,0) + C(7,1)) / 128 = 0.125
    (1, 1, 1.0),  # 2 * (C(2,0) + C(2,1)) / 4 = 1.5 -> clipped to 1
    (0, 0, 1.0),
    (10, 2, 2 * (1 + 12 + 66) / 2**12),  # 158 / 4096 = 0.03857
])
def test_mcnemar_hand_values(a_only, b_only, p):
    both = 7  # concordant pairs change nothing
    a = np.array([1] * a_only + [0] * b_only + [1] * both + [0] * 3, bool)
    b = np.array([0] * a_only + [1] * b_only + [1] * both + [0] * 3, bool)
    got = mcnemar(a, b)
    assert (got["a_only"], got["b_only"]) == (a_only, b_only)
    assert got["p"] == pytest.approx(p)


def test_evaluation_seeds_are_disjoint_from_training_by_construction(monkeypatch):
    seeds = evaluation_seeds(1_000_000, 200)
    assert list(seeds) == list(range(1_000_000, 1_000_200))
    assert max(seeds) < CALIBRATION_SEED < TRAIN_SEED_BASE
    evaluation_seeds(CALIBRATION_SEED - 200, 200)  # the highest allowed range
    for offset, n in ((CALIBRATION_SEED - 199, 200), (TRAIN_SEED_BASE, 10), (-1, 10)):
        with pytest.raises(ValueError, match="seed_offset"):
            evaluation_seeds(offset, n)
    # every training example's seed is >= TRAIN_SEED_BASE (the stream the trainer draws)
    drawn = []

    def record(task, length, seed, *args):
        drawn.append(seed)
        return (np.zeros(length, np.int32), np.zeros(length, bool), np.ones(length, bool))

    monkeypatch.setattr(data, "training_sequence", record)
    for step in range(20):
        data.make_batch(step, 8, 64, {"niah": 0.5, "mrcr": 0.5}, 1.0, seed=step % 3)
    assert len(drawn) == 160 and min(drawn) >= TRAIN_SEED_BASE
    drawn.clear()
    data.make_batch(0, 8, 64, {"niah": 1.0}, 1.0, held_out=True)
    assert max(drawn) < TRAIN_SEED_BASE


def test_cell_and_pair_records():
    """Synthetic outcomes: resident right on 9 of 10, lean on 6 (3 discordant, all resident's)."""
    rows = []
    for seed in range(10):
        rows.append(dict(task="niah", length=1024, seed=seed, method="resident",
                         exact=float(seed != 0), similarity=1.0, recall=None))
        rows.append(dict(task="niah", length=1024, seed=seed, method="lean",
                         exact=float(seed >= 4), similarity=1.0, recall=0.9))
    methods, cells = ("resident", "lean"), [("niah", 1024)]
    summary = summarize(rows, methods, cells)
    recs = {r["method"]: r for r in cell_records(summary, methods, cells)}
    assert recs["resident"]["exact"] == 0.9 and recs["resident"]["n"] == 10
    assert (recs["lean"]["ci_low"], recs["lean"]["ci_high"]) == pytest.approx(wilson(6, 10))
    (pair,) = pair_records(rows, methods, cells)
    assert (pair["a"], pair["b"], pair["a_only"], pair["b_only"]) == ("resident", "lean", 3, 0)
    assert pair["p"] == pytest.approx(2 / 8)

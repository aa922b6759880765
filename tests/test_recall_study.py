"""The recall study: recall properties on a fixed input, npz validation, the CLI end to end."""

import json

import numpy as np
import pytest

from experiments import recall_study
from experiments.cli import main
from experiments.common import fit_max_len
from experiments.recall_study import evaluate, load_npz, synthetic_data
from lsparse_jax.model import preset
from lsparse_jax.model.traces import indexer_traces
from lsparse_jax.quant import pq
from lsparse_jax.tasks import niah_example

TOP_K = 8
HISTORY = 256
CANDIDATES = (8, 16, 32, 64, 256, 512)  # the last two cover the whole history


@pytest.fixture(scope="module")
def fixed():
    """One small synthetic input (D=16, H=4, 256 keys, 12 queries), PQ from a separate draw,
    evaluated with the filter off and at offset 1.0."""
    common = dict(dim=16, heads=4, clusters=8, df=3.0, seed=0)
    keys, queries, weights = synthetic_data(HISTORY, 12, **common, sample_seed=(0, 1))
    train, _, _ = synthetic_data(512, 1, **common, sample_seed=(1, 2))
    cb = pq.train_codebooks(train, 4, 16, iters=5, seed=0)  # coarse on purpose: recall < 1
    codes = pq.encode(keys, cb)
    return evaluate(queries, weights, keys, codes, cb, top_k=TOP_K, candidates=CANDIDATES,
                    offsets=(None, 1.0), chunk=5)  # 12 queries: chunks of 5, 5, 2 (padded)


def test_recall_is_monotone_in_candidates_without_filter(fixed):
    rec = fixed["c2f"][:, :, 0]  # [Q, C]
    assert np.all(np.diff(rec, axis=1) >= 0)  # per query, not just on average
    assert rec[:, 0].mean() < rec[:, 3].mean()  # and it does grow on this input


def test_full_history_candidates_give_exact_topk(fixed):
    full = [i for i, c in enumerate(CANDIDATES) if c >= HISTORY]
    assert np.all(fixed["c2f"][:, full, 0] == 1.0)
    assert np.all(fixed["kept"][:, full, 0] == HISTORY)  # filter off: every candidate kept
    assert np.all(fixed["fetched"] == fixed["kept"])  # nothing cached: every kept one is read


def test_direct_pq_is_a_lower_bound(fixed):
    direct = fixed["direct"]
    assert direct.mean() < 0.9  # the input is hard enough for the test to mean something
    assert np.all(direct[:, None] <= fixed["c2f"][:, :, 0])  # every C >= k, per query
    np.testing.assert_array_equal(direct, fixed["c2f"][:, 0, 0])  # C = k: the same set


def test_miss_filter_only_removes_candidates(fixed):
    assert np.all(fixed["c2f"][:, :, 1] <= fixed["c2f"][:, :, 0])
    assert np.all(fixed["kept"][:, :, 1] <= fixed["kept"][:, :, 0])
    assert np.any(fixed["kept"][:, :, 1] < fixed["kept"][:, :, 0])


def test_chunked_traces_equal_indexer_traces():
    cfg = fit_max_len(preset("tiny"), 256)  # the CLI test's model: compilations are shared
    params = recall_study._init_params(cfg, 0)
    tokens = niah_example(256, num_needles=1, seed=3).prompt
    for a, b in zip(indexer_traces(params, cfg, tokens, 256),
                    indexer_traces(params, cfg, tokens, 128), strict=True):
        assert a.layer == b.layer
        np.testing.assert_array_equal(a.lengths, b.lengths)
        for name in ("queries", "weights", "keys"):
            np.testing.assert_allclose(getattr(b, name), getattr(a, name), rtol=1e-4,
                                       atol=1e-5)


# --------------------------------------------------------------------------------------- npz


def _valid(n=32, q=4, h=2, d=8):
    rng = np.random.default_rng(0)
    return {"keys": rng.standard_normal((n, d)).astype(np.float32),
            "queries": rng.standard_normal((q, h, d)).astype(np.float32),
            "weights": rng.standard_normal((q, h)).astype(np.float32),
            "lengths": np.array([n, n // 2, 1, n], np.int32)[:q],
            "train_keys": rng.standard_normal((48, d)).astype(np.float32)}


def _drop(name):
    return lambda a: a.pop(name)


def _set(name, value):
    return lambda a: a.__setitem__(name, value(a) if callable(value) else value)


def _poison(name, bad):
    def edit(a):
        a[name] = a[name].copy()
        a[name].flat[3] = bad
    return edit


BAD = {
    "missing keys": ("keys", _drop("keys")),
    "missing queries": ("queries", _drop("queries")),
    "missing weights": ("weights", _drop("weights")),
    "keys 3-D": ("keys", _set("keys", lambda a: a["keys"][None])),
    "queries 2-D": ("queries", _set("queries", lambda a: a["queries"][:, 0])),
    "weights 1-D": ("weights", _set("weights", lambda a: a["weights"][:, 0])),
    "lengths 2-D": ("lengths", _set("lengths", lambda a: a["lengths"][:, None])),
    "train_keys 1-D": ("train_keys", _set("train_keys", lambda a: a["train_keys"][0])),
    "empty keys": ("keys", _set("keys", np.zeros((0, 8), np.float32))),
    "D mismatch": ("queries", _set("queries", lambda a: a["queries"][..., :4])),
    "train D mismatch": ("train_keys", _set("train_keys", lambda a: a["train_keys"][:, :4])),
    "H mismatch": ("weights", _set("weights", lambda a: a["weights"][:, :1])),
    "Q mismatch weights": ("weights", _set("weights", lambda a: a["weights"][:3])),
    "Q mismatch lengths": ("lengths", _set("lengths", lambda a: a["lengths"][:3])),
    "length 0": ("lengths", _set("lengths", np.array([32, 16, 0, 32], np.int32))),
    "length > N": ("lengths", _set("lengths", np.array([32, 16, 33, 32], np.int32))),
    "NaN keys": ("keys", _poison("keys", np.nan)),
    "inf queries": ("queries", _poison("queries", np.inf)),
    "NaN weights": ("weights", _poison("weights", np.nan)),
    "inf train_keys": ("train_keys", _poison("train_keys", -np.inf)),
    "overflow to inf": ("keys", _set("keys", lambda a: a["keys"].astype(np.float64) * 1e300)),
    "int keys": ("keys", _set("keys", lambda a: a["keys"].astype(np.int32))),
    "bool weights": ("weights", _set("weights", lambda a: a["weights"] > 0)),
    "float lengths": ("lengths", _set("lengths", lambda a: a["lengths"].astype(np.float32))),
    "object queries": ("queries", _set("queries", lambda a: a["queries"].astype(object))),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_malformed_npz_names_the_array(tmp_path, case):
    name, edit = BAD[case]
    arrays = _valid()
    edit(arrays)
    path = tmp_path / "bad.npz"
    np.savez(path, **arrays)
    with pytest.raises(ValueError, match=f"'{name}'"):
        load_npz(path)


def test_npz_that_is_not_an_archive(tmp_path):
    path = tmp_path / "x.npz"
    path.write_bytes(b"not a zip file")
    with pytest.raises(ValueError, match="cannot read"):
        load_npz(path)


def test_valid_npz_defaults(tmp_path):
    arrays = _valid()
    np.savez(tmp_path / "full.npz", **arrays)
    got = load_npz(tmp_path / "full.npz")
    np.testing.assert_array_equal(got["lengths"], [32, 16, 1, 32])
    np.testing.assert_array_equal(got["train_keys"], arrays["train_keys"])
    del arrays["lengths"], arrays["train_keys"]
    arrays["keys"] = arrays["keys"].astype(np.float16)  # any float dtype is accepted
    np.savez(tmp_path / "min.npz", **arrays)
    got = load_npz(tmp_path / "min.npz")
    np.testing.assert_array_equal(got["lengths"], [32] * 4)
    assert got["train_keys"] is None and got["keys"].dtype == np.float32


# --------------------------------------------------------------------------------------- CLI


# slow tier (session 49): an experiment CLI; the traces' identities stay in this file
@pytest.mark.slow
def test_cli_writes_results_for_every_source(tmp_path, monkeypatch):
    monkeypatch.setenv("LSPARSE_RUNS", str(tmp_path))
    keys, queries, weights = synthetic_data(96, 6, 8, 2, clusters=4, df=3.0, seed=5,
                                            sample_seed=(5, 1))
    lengths = np.array([96, 96, 80, 64, 40, 10], np.int32)
    np.savez(tmp_path / "user.npz", keys=keys, queries=queries, weights=weights,
             lengths=lengths)
    rc = main(["run", "configs/experiments/recall.gin", "--gin.run.name='r'",
               "--gin.recall_study.sources=('model', 'synthetic', 'npz')",
               "--gin.recall_study.filter_offsets=(None, 1.0)",
               "--gin.recall_study.pq_iters=2",
               "--gin.recall_model.prompt_tokens=256", "--gin.recall_model.num_needles=1",
               "--gin.recall_model.prefill_chunk=128",
               "--gin.recall_model.candidates=(16, 32)",
               "--gin.recall_model.histories=(48, 100)", "--gin.recall_model.max_queries=8",
               "--gin.recall_synthetic.num_keys=128", "--gin.recall_synthetic.dim=8",
               "--gin.recall_synthetic.num_train_keys=300", "--gin.recall_synthetic.heads=2",
               "--gin.recall_synthetic.num_queries=6", "--gin.recall_synthetic.top_k=8",
               "--gin.recall_synthetic.candidates=(16, 32)",
               "--gin.recall_synthetic.histories=(128,)",
               f"--gin.recall_npz.path='{tmp_path / 'user.npz'}'", "--gin.recall_npz.top_k=8",
               "--gin.recall_npz.candidates=(16, 32)", "--gin.recall_npz.histories=(64,)"])
    assert rc == 0
    out = tmp_path / "r"
    results = json.loads((out / "results.json").read_text())
    cells = results["cells"]
    assert all(0.0 <= c["recall_mean"] <= 1.0 and c["recall_min"] <= c["recall_mean"]
               for c in cells)
    for source in ("model", "synthetic", "npz"):
        mine = [c for c in cells if c["source"] == source]
        assert {c["method"] for c in mine} == {"direct_pq", "c2f"}
        assert {c["c_over_k"] for c in mine if c["method"] == "c2f"} == (
            {1.0, 2.0} if source == "model" else {2.0, 4.0})
    assert {c["layer"] for c in cells if c["source"] == "model"} == {1, 3, "pooled"}
    # model: 256 tokens = 64 keys, so history 100 is skipped; npz: 4 queries see >= 64 keys
    sources = results["sources"]
    assert [s["history"] for s in sources["model"]["skipped_histories"]] == [100]
    assert {c["num_queries"] for c in cells if c["source"] == "npz"} == {4}
    assert all(p["num_centroids"] == 64 for p in sources["model"]["pq"])  # 64 training keys
    assert "evaluated keys" in sources["npz"]["codebook_training"]
    assert sources["synthetic"]["pq"][0]["num_centroids"] == 256
    assert "recall_synthetic.top_k = 8" in (out / "config.gin").read_text()
    assert (out / "recall.png").stat().st_size > 0

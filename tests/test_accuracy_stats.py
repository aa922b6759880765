"""The accuracy study's statistics and seed ranges (issue 17): Wilson intervals and exact
McNemar tests against hand-computed values; the paired difference interval against its
identities and its coverage; evaluation seeds disjoint from training seeds by
construction; partial tables and the resume of finished groups."""

import json

import numpy as np
import pytest

from experiments.accuracy import (
    CALIBRATION_SEED,
    cell_records,
    evaluation_seeds,
    format_table,
    mcnemar,
    merge_results,
    pair_records,
    paired_difference,
    parse_method,
    resumed_records,
    summarize,
    wilson,
)
from experiments.validate import ConfigError
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


def _pairs(a, b, c, d):
    """Outcome vectors (ref, other) with a both right, b ref only, c other only, d neither."""
    ref = np.array([1] * a + [1] * b + [0] * c + [0] * d, bool)
    other = np.array([1] * a + [0] * b + [1] * c + [0] * d, bool)
    return ref, other


def test_paired_difference_identities():
    # identical outcomes: theta = 0, phi = 1, so the half-widths are |(p - l) - (u - p)|
    ref, other = _pairs(198, 0, 0, 2)
    lo, hi = wilson(198, 200)
    half = abs((0.99 - lo) - (hi - 0.99))
    got = paired_difference(ref, other)
    assert got["diff"] == 0.0
    assert (got["diff_low"], got["diff_high"]) == pytest.approx((-half, half), abs=1e-12)
    # an empty margin (ref always right): phi = 0, Newcombe's unpaired hybrid score interval
    ref, other = _pairs(190, 10, 0, 0)
    (l1, u1), (l2, u2) = wilson(190, 200), wilson(200, 200)
    got = paired_difference(ref, other)
    assert got["diff"] == pytest.approx(-0.05)
    assert got["diff_low"] == pytest.approx(-0.05 - np.hypot(0.95 - l1, u2 - 1.0))
    assert got["diff_high"] == pytest.approx(-0.05 + np.hypot(u1 - 0.95, 1.0 - l2))
    # swapping the two methods negates the interval
    ref, other = _pairs(150, 12, 5, 33)
    fwd, back = paired_difference(ref, other), paired_difference(other, ref)
    assert fwd["diff"] == pytest.approx(-7 / 200)
    assert (back["diff"], back["diff_low"], back["diff_high"]) == pytest.approx(
        (-fwd["diff"], -fwd["diff_high"], -fwd["diff_low"]))
    assert fwd["diff_low"] < fwd["diff"] < fwd["diff_high"]
    with pytest.raises(ValueError, match="paired_difference"):
        paired_difference(np.ones(3, bool), np.ones(4, bool))


@pytest.mark.parametrize("cells", [(0.90, 0.03, 0.01, 0.06), (0.97, 0.02, 0.0, 0.01)])
def test_paired_difference_coverage(cells):
    """Draws of 200 correlated pairs from a known table: the 95% interval holds the true
    difference in 93-98% of 2000 draws (Newcombe's method is near-nominal, a little
    conservative near the boundary)."""
    rng = np.random.default_rng(0)
    truth = cells[2] - cells[1]
    hits = 0
    for counts in rng.multinomial(200, cells, size=2000):
        got = paired_difference(*_pairs(*counts))
        hits += got["diff_low"] <= truth <= got["diff_high"]
    assert 0.93 <= hits / 2000 <= 0.98


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
    assert pair["diff"] == pytest.approx(-0.3) == recs["lean"]["diff_vs_resident"]
    assert (pair["diff_low"], pair["diff_high"]) == pytest.approx(
        (recs["lean"]["diff_low"], recs["lean"]["diff_high"]))
    assert "diff_vs_resident" not in recs["resident"]


def _rows(method, seeds, exact, task="niah", length=1024):
    return [dict(task=task, length=length, seed=s, method=method, exact=float(e),
                 similarity=1.0, recall=None) for s, e in zip(seeds, exact)]


def test_partial_table_pairs_only_common_examples():
    """A run cut short: lean holds 3 of resident's 5 examples, direct_pq none. Cells without
    records get no cell record and print "-"; McNemar pairs the examples both hold."""
    rows = _rows("resident", range(5), [1, 1, 1, 1, 0]) + _rows("lean", [4, 0, 2], [1, 0, 1])
    methods, cells = ("resident", "lean", "direct_pq"), [("niah", 1024)]
    summary = summarize(rows, methods, cells)
    recs = cell_records(summary, methods, cells)
    assert [(r["method"], r["n"]) for r in recs] == [("resident", 5), ("lean", 3)]
    # common seeds 0, 2, 4: resident 1, 1, 0 vs lean 0, 1, 1 -> one discordant pair each way
    assert summary["niah@1024"]["lean"]["mcnemar_vs_resident"] == {"a_only": 1, "b_only": 1,
                                                                   "p": 1.0}
    (pair,) = pair_records(rows, methods, cells)
    assert (pair["a"], pair["b"], pair["n"], pair["a_only"], pair["b_only"]) == \
        ("resident", "lean", 3, 1, 1)
    table = format_table(summary, methods, cells).splitlines()
    row = {line.split("|")[1].strip(): line for line in table if line.startswith("|")}
    assert row["direct_pq"].split("|")[2].strip() == "-"
    assert row["lean"].split("|")[2].strip().startswith("66.7 [")


def _run(records, methods, cells, max_len, **settings):
    return {"model": {}, "checkpoint": "c", "device": "cpu", "jax": "0", "examples_per_cell": 4,
            "evaluation_seeds": [10, 14], "training_seeds": ">= 1", "complete": True,
            "settings": {"num_slots": 4, "model": {"max_len": max_len}, **settings},
            "cells": cell_records(summarize(records, methods, cells), methods, cells),
            "records": records}


def test_merged_runs_equal_one_run_of_all_cells():
    """Two calls of one study (1K with max_len 1040, 2K with 2064) merge into what one run
    of both lengths computes: cells, McNemar pairs and table from the union of the records.
    Other settings, other seeds or a group in both runs are refused."""
    seeds, methods = range(10, 14), ("resident", "lean")
    short = _rows("resident", seeds, [1, 1, 1, 0]) + _rows("lean", seeds, [1, 0, 1, 0])
    long = (_rows("resident", seeds, [1, 1, 0, 0], length=2048)
            + _rows("lean", seeds, [0, 0, 0, 1], length=2048))
    a = _run(short, methods, [("niah", 1024)], 1040)
    b = _run(long, methods, [("niah", 2048)], 2064)
    merged = merge_results([a, b], ["a", "b"])
    cells = [("niah", 1024), ("niah", 2048)]
    whole = summarize(short + long, methods, cells)
    assert merged["cells"] == cell_records(whole, methods, cells)
    assert merged["mcnemar"] == pair_records(short + long, methods, cells)
    assert merged["table"] == format_table(whole, methods, cells)
    assert [(m["source"], m["lengths"], m["max_len"]) for m in merged["merged_from"]] == \
        [("a", [1024], 1040), ("b", [2048], 2064)]
    # a merged study merged again keeps its sources' provenance
    c = _run(_rows("resident", seeds, [1, 1, 1, 1], task="mrcr"), ("resident",),
             [("mrcr", 1024)], 1040)
    again = merge_results([merged, c], ["ab", "c"])
    assert [(m["source"], m.get("via")) for m in again["merged_from"]] == \
        [("a", "ab"), ("b", "ab"), ("c", None)]
    with pytest.raises(ValueError, match="other settings than a .num_slots"):
        merge_results([a, _run(long, methods, [("niah", 2048)], 2064, num_slots=8)], ["a", "b"])
    with pytest.raises(ValueError, match="gap"):
        merge_results([a, {**b, "evaluation_seeds": [0, 4]}], ["a", "b"])
    with pytest.raises(ValueError, match="holds seed 10 in a and b"):
        merge_results([a, _run(short, methods, [("niah", 1024)], 1040)], ["a", "b"])


def test_merge_adds_examples_from_the_next_seed_range():
    """More examples of a cell from the next seed range (14..17) merge into the cell: n and the
    statistics are those of all eight examples, pairs matched by seed; a method run on the
    new range only for some methods keeps its own n."""
    methods = ("resident", "lean")
    first = _rows("resident", range(10, 14), [1, 1, 1, 0]) + _rows("lean", range(10, 14),
                                                                    [1, 0, 1, 0])
    more = _rows("resident", range(14, 18), [1, 1, 1, 1]) + _rows("lean", range(14, 18),
                                                                   [1, 1, 0, 1])
    a = _run(first, methods, [("niah", 1024)], 1040)
    b = {**_run(more, methods, [("niah", 1024)], 1040), "evaluation_seeds": [14, 18]}
    merged = merge_results([a, b], ["a", "b"])
    whole = summarize(first + more, methods, [("niah", 1024)])
    assert merged["cells"] == cell_records(whole, methods, [("niah", 1024)])
    assert [c["n"] for c in merged["cells"]] == [8, 8]
    assert merged["evaluation_seeds"] == [10, 18] and merged["examples_per_cell"] == 8
    (pair,) = merged["mcnemar"]
    assert (pair["n"], pair["a_only"], pair["b_only"]) == (8, 2, 0)
    assert [m["seeds"] for m in merged["merged_from"]] == [[10, 14], [14, 18]]
    # only resident got the new range: lean keeps 4 examples, the pair its 4 common ones
    part = merge_results([a, {**_run(more[:4], ("resident",), [("niah", 1024)], 1040),
                              "evaluation_seeds": [14, 18]}], ["a", "b"])
    assert {c["method"]: c["n"] for c in part["cells"]} == {"resident": 8, "lean": 4}
    assert part["mcnemar"][0]["n"] == 4


def test_resume_keeps_only_finished_groups_of_the_same_settings(tmp_path):
    """Finished (task, length, method) groups are kept, a group cut short is dropped (it runs
    again), records outside this run's cells are ignored, other settings are an error."""
    seeds = range(10, 14)
    old = (_rows("resident", seeds, [1, 1, 1, 1]) + _rows("lean", [10, 11], [1, 1])
           + _rows("resident", seeds, [0, 0, 0, 0], length=2048)
           + _rows("resident", seeds, [1, 0, 1, 0], task="mrcr"))
    settings = {"num_slots": 4, "model": {"max_len": 2064}}
    path = tmp_path / "results.json"
    path.write_text(json.dumps({"settings": settings, "records": old}))
    kept = resumed_records(path, settings, ("niah",), (1024, 2048), ("resident", "lean"), seeds)
    assert sorted({(r["length"], r["method"]) for r in kept}) == [(1024, "resident"),
                                                                   (2048, "resident")]
    assert [r["seed"] for r in kept if r["length"] == 1024] == list(seeds)
    # more examples this time: no group holds them all
    assert resumed_records(path, settings, ("niah",), (1024,), ("resident",), range(10, 15)) \
        == []
    assert resumed_records(tmp_path / "none.json", settings, ("niah",), (1024,), ("lean",),
                           seeds) == []
    with pytest.raises(ConfigError, match=r"other settings \(num_slots\)"):
        resumed_records(path, {**settings, "num_slots": 8}, ("niah",), (1024,), ("lean",),
                        seeds)


def test_results_json_holds_the_same_value_a_record_a_line(tmp_path):
    """results.json's text (``experiments.common.results_json``): the value json.dumps gives,
    each top-level record on one line (the rest indented), and a resumed run reads it back."""
    from experiments.common import results_json

    seeds = range(10, 13)
    records = _rows("resident", seeds, [1, 0, 1])
    records[1].update(note="@records@", x=np.float32(0.5))  # the writer's mark, a numpy value
    results = {"settings": {"num_slots": 4}, "records": records, "after": [1, 2]}
    text = results_json(results)
    assert json.loads(text) == json.loads(json.dumps(results, default=float))
    lines = [line.rstrip(",") for line in text.splitlines()]
    for r in records:
        assert "    " + json.dumps(r, default=float) in lines
    assert '  "after": [' in lines  # the rest as json.dumps(indent=2) writes it
    no_records = {"settings": {"a": 1}, "records": []}
    assert results_json(no_records) == json.dumps(no_records, indent=2) + "\n"
    path = tmp_path / "results.json"
    path.write_text(text)
    assert resumed_records(path, {"num_slots": 4}, ("niah",), (1024,), ("resident",),
                           seeds) == json.loads(json.dumps(records, default=float))


def test_controller_warmup_without_writeback_compiles_none(monkeypatch):
    """``Engine.warmup(writeback=False)`` (the accuracy study's) leaves the paged methods'
    completed-page writeback uncompiled; the default compiles one width per power of two up
    to num_slots (log2(S) + 1 widths)."""
    from lsparse_jax.config import CacheConfig, EngineConfig
    from lsparse_jax.methods import base
    from lsparse_jax.serving.state import empty_state
    from tests.helpers import tiny

    lowered = []

    class Recorder:
        def lower(self, method, state, slots):
            lowered.append(slots.shape[0])
            return self

        def compile(self):
            return None

    monkeypatch.setattr(base, "write_completed", Recorder())
    engine = EngineConfig(model=tiny(), method="hisparse",
                          cache=CacheConfig(num_slots=5, prefill_chunk=64, hot_cache_rows=16,
                                            page_size=16))
    control = base.policy(engine).controller()
    state = empty_state(engine)
    assert control.warmup(state, writeback=False) is state and lowered == []
    control.warmup(state)
    assert lowered == [1, 2, 4, 8]


def test_method_names_parse_to_their_settings():
    """leansparse_C<C>[_w][_B][_seed][_fp8][_pq]: each part sets its LeanSparseConfig field."""
    full = parse_method("leansparse_C64_w2_B128_seed_fp8_pq2", top_k=16, miss_filter_offset=1.0)
    assert (full.engine_method, full.seed) == ("leansparse", True)
    lean = full.lean
    assert (lean.num_candidates, lean.warm_steps, lean.key_cache_rows, lean.coarse_precision,
            lean.miss_filter_offset, lean.pq_subspace_dim) == (64, 2, 128, "fp8", 1.0, 2)
    plain = parse_method("leansparse_C64", top_k=16, miss_filter_offset=None)
    assert (plain.seed, plain.lean.coarse_precision, plain.lean.key_cache_rows,
            plain.lean.pq_subspace_dim) == (False, "bf16", 64, 4)
    with pytest.raises(ValueError, match="pq_subspace_dim 0"):
        parse_method("leansparse_C64_pq0", top_k=16, miss_filter_offset=None)
    with pytest.raises(ValueError, match="unknown method"):
        parse_method("leansparse_C64_fp16", top_k=16, miss_filter_offset=None)


def test_codebooks_are_calibrated_at_each_methods_subvector_width(monkeypatch):
    """Methods whose LeanSparseConfig.pq_subspace_dim differ each get codebooks of their own
    width (one calibration per width); an engine given another width's books would refuse."""
    import dataclasses

    import experiments.accuracy as acc
    from lsparse_jax.model import init_params, preset
    from lsparse_jax.model.presets import fit_max_len

    cfg = fit_max_len(preset("tiny"), 512)
    widths = []
    real = acc.calibrate_codebooks

    def spy(*args, subspace_dim, **kw):
        widths.append(subspace_dim)
        return real(*args, subspace_dim=subspace_dim, **kw)

    monkeypatch.setattr(acc, "calibrate_codebooks", spy)
    lean = parse_method("leansparse_C32", top_k=16, miss_filter_offset=1.0)
    specs = [parse_method("resident", 16, 1.0), lean,
             dataclasses.replace(lean, name="lean_w2",
                                 lean=dataclasses.replace(lean.lean, pq_subspace_dim=2)),
             parse_method("direct_pq", 16, None)]
    engines = acc.build_engines(init_params(cfg, 0), cfg, specs, num_slots=1,
                                prefill_chunk=128, hot_cache_rows=32, page_size=8,
                                calibration_tokens=256, implementation=None, host_pages=None)
    assert sorted(widths) == [2, 4]
    assert set(engines) == {"resident", "leansparse_C32", "lean_w2", "direct_pq"}


def test_merge_counts_a_field_added_since_at_its_default():
    """A run written before a model field existed (here the indexer's score_precision) merges
    with one that has it at its default, and not with one that set it otherwise."""
    seeds, methods = range(10, 14), ("resident",)
    rows = _rows("resident", seeds, [1, 1, 0, 1])
    more = _rows("resident", range(14, 18), [1, 0, 1, 1])
    indexer = {"num_heads": 4, "head_dim": 32, "top_k": 16, "fp8_block": 32}
    old = _run(rows, methods, [("niah", 1024)], 1040)
    old["settings"]["model"]["indexer"] = indexer
    for precision, merges in (("f32", True), ("fp8", False)):
        new = {**_run(more, methods, [("niah", 1024)], 1040), "evaluation_seeds": [14, 18]}
        new["settings"]["model"]["indexer"] = indexer | {"score_precision": precision}
        if merges:
            assert merge_results([old, new], ["old", "new"])["cells"][0]["n"] == 8
        else:
            with pytest.raises(ValueError, match="other settings"):
                merge_results([old, new], ["old", "new"])

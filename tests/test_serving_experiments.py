"""The serving experiments' arithmetic (no model runs): capacity's calibrated budget and
predictions, replay's statistics from request records."""

import dataclasses
import json

import pytest

from experiments.capacity import PAPER, engine_for, predict, step_fit
from experiments.replay import replay_summary
from lsparse_jax.config import LeanSparseConfig
from lsparse_jax.memory.accounting import Layout, request_bytes
from lsparse_jax.model import preset


def test_capacity_budget_holds_exactly_the_calibrated_count():
    """The budget calibrated on hisparse at 200K holds exactly 76 of its requests (76 x bytes
    <= budget < 77 x bytes); every prediction is floor(budget / bytes per request), and a
    method holding fewer bytes per request fits at least as many."""
    model = preset("v4_flash")
    lean = LeanSparseConfig(num_candidates=2048, key_cache_rows=4096)
    hot = {"hisparse": 4096, "leansparse": 2048}
    facts, pred = predict(model, ("hisparse", "leansparse"), (204800, 972800),
                          ("hisparse", 204800, 76), hot, 64, lean, Layout.v4_serving())
    n, per = pred[("hisparse", 204800)]
    assert n == 76 and 76 * per <= facts["budget_bytes"] < 77 * per
    assert facts["per_layer_budget_mib"] == pytest.approx(
        facts["budget_bytes"] / 43 / 2**20)
    for count, bytes_ in pred.values():
        assert count == facts["budget_bytes"] // bytes_
        assert count * bytes_ <= facts["budget_bytes"] < (count + 1) * bytes_
    assert pred[("leansparse", 204800)][1] < per  # PQ codes instead of exact keys on the GPU
    assert pred[("leansparse", 204800)][0] > 76
    eng = engine_for(model, "hisparse", hot, 64, lean)
    assert request_bytes(eng, 204800, Layout.v4_serving()).gpu_total == per


def test_step_fit_passes_through_both_timed_points_and_the_papers():
    """step = a + b n through the method's own cell and its equal-N cell; the paper's pair
    (its step at HiSparse's N, N / tok/s at its own N) likewise; one timed point: no fit."""
    paper = dict(zip(("max_concurrency", "throughput_tok_s", "step_ms_at_his_n"),
                     PAPER[("leansparse", 204800)]))
    records = [{"method": "leansparse", "context": 204800, "timed_batch": 164,
                "step_ms": 25.5, "paper": paper},
               {"method": "hisparse", "context": 204800, "timed_batch": 76, "step_ms": 11.2,
                "paper": None}]
    equal = [{"method": "leansparse", "context": 204800, "batch": 76, "step_ms": 12.4}]
    (fit,) = step_fit(records, equal)
    assert fit["batches"] == [76, 164]
    for n, ms in ((76, 12.4), (164, 25.5)):
        assert fit["fixed_ms"] + fit["per_request_ms"] * n == pytest.approx(ms)
    his_n = PAPER[("hisparse", 204800)][0]
    assert fit["paper_fixed_ms"] + fit["paper_per_request_ms"] * his_n == pytest.approx(33.3)
    assert fit["paper_fixed_ms"] + fit["paper_per_request_ms"] * 156 == pytest.approx(
        156 / 3216 * 1e3)
    assert step_fit(records, []) == []


def _rec(session, turn, arrival, first, finished, tokens):
    return {"session": session, "turn": turn, "arrival_s": arrival, "first_token_s": first,
            "finished_s": finished, "output_tokens": tokens, "ttft_s": first - arrival,
            "tpot_s": (finished - first) / (tokens - 1) if tokens > 1 else None}


def test_replay_summary_follows_the_papers_definitions():
    """Turn 0 is warmup (not measured); TTFT/TPOT over turns >= 2 (TTFT also over turns >= 1,
    ``ttft_measured``); session time from the
    first measured call's arrival to the last finish; throughput over turns >= 1."""
    recs = [_rec(0, 0, 0.0, 1.0, 2.0, 5), _rec(0, 1, 3.0, 3.5, 4.5, 3),
            _rec(0, 2, 5.0, 6.0, 8.0, 5), _rec(1, 0, 1.0, 1.5, 2.0, 2),
            _rec(1, 1, 2.5, 3.0, 3.5, 2), _rec(1, 2, 4.0, 4.2, 4.2, 1)]
    s = replay_summary(recs)
    assert s["continuation_calls"] == 2 and s["sessions"] == 2
    assert s["ttft_p50_s"] == pytest.approx((1.0 + 0.2) / 2)
    assert s["tpot_p50_s"] == pytest.approx(0.5)  # the 1-token call has no TPOT
    assert s["session_p50_s"] == pytest.approx(((8.0 - 3.0) + (4.2 - 2.5)) / 2)
    assert s["output_tokens"] == 3 + 5 + 2 + 1
    assert s["throughput_tok_s"] == pytest.approx(11 / (8.0 - 2.5))
    assert s["ttft_measured_p50_s"] == pytest.approx(0.5)  # turns >= 1: 0.5, 1.0, 0.5, 0.2


def test_replay_merge_runs_puts_methods_side_by_side(tmp_path):
    """Runs of the same settings merge into one results.json (methods side by side, sources
    in merged_from, summaries from the records, a plot); a method in two runs or another
    setting is an error."""
    from experiments.replay import merge_runs

    recs = [_rec(0, 0, 0.0, 1.0, 2.0, 5), _rec(0, 1, 3.0, 3.5, 4.5, 3),
            _rec(0, 2, 5.0, 6.0, 8.0, 5)]
    base = {"model": {"name": "tiny"}, "workload": {"sessions": 1}, "settings": {"slots": 2},
            "device": "cpu"}
    paths = []
    for i, method in enumerate(("leansparse", "echo")):
        rec = {"records": recs, "sessions": [{"session_s": 5.0}], "reuse": 0.1,
               "scheduler": {"waits_by": {}}, "summary": {}}
        (tmp_path / f"r{i}").mkdir()
        paths.append(tmp_path / f"r{i}" / "results.json")
        paths[-1].write_text(json.dumps(base | {"methods": {method: rec}}))
        (tmp_path / f"r{i}" / "config.gin").write_text(
            f"replay.hot = 1\nreplay.methods = ('{method}',)\n")
    out = merge_runs(paths, tmp_path / "merged")
    config = (tmp_path / "merged" / "config.gin").read_text().splitlines()
    assert config[-2:] == ["replay.hot = 1", "replay.methods = ('leansparse', 'echo')"]
    assert config[1:3] == [f"#   {p}" for p in paths]
    assert list(out["methods"]) == ["leansparse", "echo"]
    assert [m["methods"] for m in out["merged_from"]] == [["leansparse"], ["echo"]]
    assert out["methods"]["echo"]["summary"]["ttft_p50_s"] == pytest.approx(1.0)
    assert json.loads((tmp_path / "merged" / "results.json").read_text()) == out
    assert (tmp_path / "merged" / "replay_cdf.png").is_file()
    with pytest.raises(ValueError, match="in two runs"):
        merge_runs([paths[0], paths[0]], tmp_path / "x")
    other = tmp_path / "other.json"
    other.write_text(json.dumps(base | {"settings": {"slots": 3}, "methods": {}}))
    with pytest.raises(ValueError, match="another settings"):
        merge_runs([paths[0], other], tmp_path / "y")


def test_capacity_times_the_equal_n_cells_before_larger_batches(monkeypatch, tmp_path):
    """With the model runs stubbed out, the timed cells run in ascending batch order: the
    calibrated method at its N and the others at that N before each method's own larger N;
    the records and equal-N records carry what the stub measured."""
    import experiments.capacity as cap

    calls = []

    def fake_decode(cfg, params, books, pre, prompt, method, batch, *args, **kw):
        calls.append((method, batch))
        return {"step_ms": float(batch), "reuse": 0.0}

    monkeypatch.setattr(cap, "_prefill", lambda *a, **k: (None, None, None, None, None))
    monkeypatch.setattr(cap, "decode_cell", fake_decode)
    monkeypatch.setattr(cap, "run_dir", lambda name: tmp_path)
    lean = LeanSparseConfig(num_candidates=2048, key_cache_rows=4096)
    records = cap.capacity("t", model=preset("v4_flash"), predict_model="v4_flash",
                           contexts=(204800,), leansparse=lean, max_timed_batch=512)
    assert calls == [("hisparse", 76), ("leansparse", 76), ("leansparse", 164)]
    own = {r["method"]: (r["timed_batch"], r["step_ms"]) for r in records}
    assert own == {"hisparse": (76, 76.0), "leansparse": (164, 164.0)}
    equal = json.loads((tmp_path / "results.json").read_text())["equal_n"]
    assert [(e["method"], e["batch"], e["step_ms"]) for e in equal] == [("leansparse", 76, 76.0)]


def test_capacity_equal_n_ratio_and_its_block_range(monkeypatch, tmp_path):
    """With ``repeats`` blocks a cell (stubbed), each timed record keeps its blocks, and the
    equal-N record carries its step over the calibrated method's at that N with the widest
    range the blocks allow (min mine / max theirs, max mine / min theirs)."""
    import experiments.capacity as cap

    blocks = {"hisparse": [10.0, 11.0, 12.0], "leansparse": [8.0, 9.5, 9.0]}

    def fake_decode(cfg, params, books, pre, prompt, method, batch, *args, repeats=1, **kw):
        got = blocks[method] if batch == 76 else [2.0 * b for b in blocks[method]]
        assert repeats == 3
        return {"step_ms": sorted(got)[1], "step_ms_blocks": got, "reuse": 0.0}

    monkeypatch.setattr(cap, "_prefill", lambda *a, **k: (None, None, None, None, None))
    monkeypatch.setattr(cap, "decode_cell", fake_decode)
    monkeypatch.setattr(cap, "run_dir", lambda name: tmp_path)
    lean = LeanSparseConfig(num_candidates=2048, key_cache_rows=4096)
    records = cap.capacity("t", model=preset("v4_flash"), predict_model="v4_flash",
                           contexts=(204800,), leansparse=lean, max_timed_batch=512, repeats=3)
    his = next(r for r in records if r["method"] == "hisparse")
    assert his["step_ms_blocks"] == blocks["hisparse"]
    (equal,) = json.loads((tmp_path / "results.json").read_text())["equal_n"]
    assert equal["step_ms_blocks"] == blocks["leansparse"]
    assert equal["vs_calibrated"] == pytest.approx(9.0 / 11.0)
    assert equal["vs_calibrated_range"] == pytest.approx([8.0 / 12.0, 9.5 / 10.0])


@pytest.mark.parametrize("run", ["capacity_s34", "capacity_s35", "capacity_s36"])
def test_capacity_s34_reruns_the_p03_jt_settings(run):
    """configs/experiments/capacity_s34.gin (and capacity_s35.gin, after session 35's HCA
    changes; capacity_s36.gin, with bf16 weights and attention) re-measure
    results/capacity_p0.3_jt/'s cells (the step ratios the claims table quotes) against
    today's HiSparse: the same budget, contexts, hot rows, reuse and LeanSparse coarse pass
    as that run's recorded config; capacity_s36 also stores the weights and attends in bf16
    (the recorded run: f32 weights, f32 attention, the defaults)."""
    import gin

    import experiments.registry  # noqa: F401  (the configurables)
    from experiments.cli import CONFIG_ROOT

    keys = ("capacity.calibrate", "capacity.contexts", "capacity.hot_cache_rows",
            "capacity.input_repeat", "capacity.page_size", "capacity.implementation",
            "capacity.steps", "LeanSparseConfig.coarse_implementation",
            "LeanSparseConfig.coarse_precision", "LeanSparseConfig.num_candidates",
            "LeanSparseConfig.key_cache_rows", "model_preset.kv_dtype",
            "model_preset.matmul_precision", "model_preset.layer_pattern")

    def bindings(path):
        gin.clear_config()
        gin.add_config_file_search_path(str(CONFIG_ROOT))
        gin.parse_config_files_and_bindings([str(path)], None, finalize_config=False)
        return {k: gin.query_parameter(k) for k in keys}, gin.query_parameter("run.name")

    serving = ("model_preset.weight_dtype", "model_preset.attention_precision")

    def serving_settings():
        out = {}
        for k in serving:
            try:
                out[k] = gin.query_parameter(k)
            except ValueError:  # not bound: the ModelConfig default (f32)
                out[k] = None
        return out

    try:
        new, name = bindings(CONFIG_ROOT / f"experiments/{run}.gin")
        new_serving = serving_settings()
        old, _ = bindings(CONFIG_ROOT.parent / "results/capacity_p0.3_jt/config.gin")
        old_serving = serving_settings()
    finally:
        gin.clear_config()
    assert name == run and new == old
    assert old_serving == dict.fromkeys(serving)
    want = dict.fromkeys(serving, "bf16") if run == "capacity_s36" else dict.fromkeys(serving)
    assert new_serving == want


def test_capacity_s41_is_capacity_s39_with_v4_fp8_scores():
    """configs/experiments/capacity_s41.gin binds what capacity_s39.gin binds, under its own
    run name, and its model scores in V4's fp8 indexer arithmetic (s39's at the f32 default)."""
    import gin

    import experiments.registry  # noqa: F401  (the configurables)
    from experiments.cli import CONFIG_ROOT
    from experiments.common import model_preset

    def parsed(run):
        gin.clear_config()
        gin.add_config_file_search_path(str(CONFIG_ROOT))
        gin.parse_config_files_and_bindings([str(CONFIG_ROOT / f"experiments/{run}.gin")], None,
                                            finalize_config=False)
        text = gin.config_str()
        model = model_preset()  # the gin-bound preset and its overrides
        return text, gin.query_parameter("run.name"), model

    try:
        s39, name39, model39 = parsed("capacity_s39")
        s41, name41, model41 = parsed("capacity_s41")
    finally:
        gin.clear_config()
    assert (name39, name41) == ("capacity_s39", "capacity_s41")
    assert model39.indexer.score_precision == "f32"
    assert model41.indexer.score_precision == "fp8"
    assert model41 == dataclasses.replace(
        model39, indexer=dataclasses.replace(model39.indexer, score_precision="fp8"))
    lines = lambda t: {ln for ln in t.splitlines() if ln and not ln.startswith("#")}  # noqa: E731
    assert lines(s41) - lines(s39) == {"model_preset.score_precision = 'fp8'",
                                       "run.name = 'capacity_s41'"}

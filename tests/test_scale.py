"""The scale study end to end on CPU at toy shapes: one record per cell, resumable."""

import json

import pytest

from experiments.cli import main
from experiments.common import fit_max_len
from experiments.scale import extrapolate
from lsparse_jax.config import LeanSparseConfig
from lsparse_jax.model import preset


# slow tier (session 49): an experiment CLI (62 s); the scale cells' engines are tested in their
# own files
@pytest.mark.slow
def test_scale_study_runs_every_cell_and_resumes(tmp_path, monkeypatch):
    monkeypatch.setenv("LSPARSE_RUNS", str(tmp_path))
    args = ["run", "configs/experiments/scale.gin", "--gin.model_preset.name='tiny'",
            "--gin.scale.contexts=(256,)", "--gin.scale.batches=(2,)", "--gin.scale.steps=2",
            "--gin.scale.warm_steps=1", "--gin.scale.prefill_chunk=128",
            "--gin.scale.hot_cache_rows=32", "--gin.scale.page_size=8",
            "--gin.LeanSparseConfig.num_candidates=32", "--gin.LeanSparseConfig.key_cache_rows=48",
            "--gin.scale.calibration_tokens=256", "--gin.run.name='scale'",
            "--gin.scale.time_both_modes=True", "--gin.scale.input_repeat=0.5",
            "--gin.scale.methods=('resident','hisparse','leansparse')",
            "--gin.scale.memory_analysis=True", "--gin.scale.repeats=3"]
    assert main(args) == 0
    records = json.loads((tmp_path / "scale" / "results.json").read_text())["records"]
    cells = {(r["method"], r["context"], r["batch"]) for r in records}
    assert cells == {(m, 256, 2) for m in ("resident", "hisparse", "leansparse")}
    for r in records:
        assert r["step_ms"] > 0 and r["layers"] == 4
        assert r["step_ms"] == r["step_ms_pipelined"] and r["step_ms_stepwise"] > 0
        assert r["pipelined"] and r["input_repeat"] == 0.5
        # three timed blocks on one engine; the cell's step is their median
        assert len(r["step_ms_blocks"]) == 3 and min(r["step_ms_blocks"]) > 0
        assert r["step_ms"] == sorted(r["step_ms_blocks"])[1]
        # the donated state is aliased whole: a step allocates no second copy of it
        mem = r["decode_memory"]
        assert mem["alias_bytes"] + mem["host_alias_bytes"] == \
            mem["state_bytes"] + mem["state_host_bytes"] > 0, r["method"]
    by = {(r["method"], r["batch"]): r for r in records}
    # paged methods keep less per request on the device than resident
    assert by[("hisparse", 2)]["device_bytes_per_request"] < \
        by[("resident", 2)]["device_bytes_per_request"]
    assert by[("resident", 2)]["host_bytes_per_token"] == 0
    # the whole-model extrapolation: 43 layers; with the slice's own pattern it reproduces
    # the measured allocation and step (it sizes the same configuration)
    cfg = fit_max_len(preset("tiny"), 256 + (3 + 1) * 2 + 1 + 3 + 2)
    lean = LeanSparseConfig(num_candidates=32, key_cache_rows=48, miss_filter_offset=1.0)
    for r in records:
        assert r["full_model"]["layers"] == 43
        same = extrapolate(cfg, r, cfg.layer_pattern, 32, 8, lean)
        assert same["device_bytes_per_request"] == r["device_bytes_per_request"], r["method"]
        assert same["step_ms_extrapolated"] == r["step_ms"]
    assert main(args) == 0  # a rerun finds every cell done and adds none
    again = json.loads((tmp_path / "scale" / "results.json").read_text())["records"]
    assert again == records


def test_variants_estimates_and_grid_checks():
    from experiments.scale import _check, _Estimates, method_variant

    lean = LeanSparseConfig(num_candidates=32, key_cache_rows=48)
    assert method_variant("leansparse_g2", lean) == ("leansparse", LeanSparseConfig(
        num_candidates=32, key_cache_rows=48, groups=2))
    assert method_variant("leansparse_g2_fp8", lean) == ("leansparse", LeanSparseConfig(
        num_candidates=32, key_cache_rows=48, groups=2, coarse_precision="fp8"))
    assert method_variant("leansparse_fp8", lean)[1].groups == lean.groups
    assert method_variant("leansparse_fp8_jt", lean) == ("leansparse", LeanSparseConfig(
        num_candidates=32, key_cache_rows=48, coarse_precision="fp8",
        coarse_implementation="jax_triton"))
    assert method_variant("leansparse_fp8_jt_pk", lean) == ("leansparse", LeanSparseConfig(
        num_candidates=32, key_cache_rows=48, coarse_precision="fp8",
        coarse_implementation="jax_triton", host_key_rows="packed"))
    with pytest.raises(ValueError, match="unknown method 'leansparse_pk_fp8'"):
        _check(("leansparse_pk_fp8",), (256,), (1,), 2)
    with pytest.raises(ValueError, match="unknown method 'leansparse_jt_fp8'"):
        _check(("leansparse_jt_fp8",), (256,), (1,), 2)
    assert method_variant("hisparse", lean) == ("hisparse", lean)
    with pytest.raises(ValueError, match="unknown method 'leansparse_fp16'"):
        _check(("leansparse_fp16",), (256,), (1,), 2)
    with pytest.raises(ValueError, match="unknown method 'hisparse_g2'"):
        _check(("hisparse_g2",), (256,), (1,), 2)
    with pytest.raises(ValueError, match="batches_by_context: 512"):
        _check(("resident",), (256,), (1,), 2, {512: (1,)})
    recs = [dict(method="hisparse", context=1024, batch=8, step_ms=16.0, prefill_s=10.0,
                 warmup_s=30.0, admit_s=4.0, cell_s=40.0, host_bytes_per_request=4e9)]
    est = _Estimates(recs, 1024)
    assert est.prefill_s(1024) == 10.0 and est.prefill_s(2048) == 40.0  # (2x)^2
    assert est.prefill_s(512) == 0.0  # nothing smaller recorded: unknown
    assert est.cell_s("hisparse", 8, 10) == pytest.approx(1.25 * (36 + 8 * (0.5 + 10 * 2e-3
                                                                            + 2.0)))
    assert _Estimates([], 1024).cell_s("resident", 1, 0) == pytest.approx(1.25 * 20.5)
    recs.append(dict(recs[0], method="resident", batch=1, cell_s=10.0, admit_s=1.0,
                     host_bytes_per_request=0.0))  # its own fixed part: 9 s, not 36
    est = _Estimates(recs, 1024)
    # per request: the largest admission (1 s) and step (16 ms) per request recorded
    assert est.cell_s("resident", 1, 10) == pytest.approx(1.25 * (9 + 1.0 + 10 * 16e-3))
    assert est.cell_s("adaptive", 1, 0) == pytest.approx(1.25 * (36 + 1.0 + 2.0))


@pytest.mark.slow
def test_scale_groups_variant_budget_and_prefill_cache(tmp_path, monkeypatch):
    """leansparse_g2 beside leansparse: the same statistics at batch 2 (its selections are the
    same), skipped at batch 1; a budget too small for anything runs nothing and lists every
    cell as pending; a later run that adds a batch loads the cached prefill."""
    monkeypatch.setenv("LSPARSE_RUNS", str(tmp_path))
    base = ["run", "configs/experiments/scale.gin", "--gin.model_preset.name='tiny'",
            "--gin.scale.contexts=(256,)", "--gin.scale.steps=2",
            "--gin.scale.warm_steps=1", "--gin.scale.prefill_chunk=128",
            "--gin.scale.hot_cache_rows=32", "--gin.scale.page_size=8",
            "--gin.LeanSparseConfig.num_candidates=32", "--gin.LeanSparseConfig.key_cache_rows=48",
            "--gin.scale.calibration_tokens=256", "--gin.run.name='groups'",
            "--gin.scale.methods=('leansparse', 'leansparse_g2')",
            f"--gin.scale.prefill_cache='{tmp_path / 'prefills'}'"]
    path = tmp_path / "groups" / "results.json"
    assert main(base + ["--gin.scale.batches=(2, 1)", "--gin.scale.time_budget_s=1e-9"]) == 0
    got = json.loads(path.read_text())
    assert got["records"] == [] and got["pending"] == [
        ["leansparse", 256, 2], ["leansparse_g2", 256, 2], ["leansparse", 256, 1],
        ["leansparse_g2", 256, 1]]
    assert main(base + ["--gin.scale.batches=(2, 1)"]) == 0
    got = json.loads(path.read_text())
    assert got["pending"] == []
    by = {(r["method"], r["batch"]): r for r in got["records"]}
    assert "skipped" in by[("leansparse_g2", 1)] and by[("leansparse_g2", 2)]["groups"] == 2
    for key in ("reuse", "resolved_fraction", "host_bytes_per_token",
                "device_bytes_per_request"):
        assert by[("leansparse_g2", 2)][key] == by[("leansparse", 2)][key], key
    assert main(base + ["--gin.scale.batches=(2, 1, 4)"]) == 0
    again = json.loads(path.read_text())["records"]
    assert again[:4] == got["records"] and len(again) == 6
    assert {r["prefill_s"] for r in again} == {got["records"][0]["prefill_s"]}  # loaded


@pytest.mark.parametrize("name, contexts, batches, by_context, g2", [
    ("scale_batch", (524288, 1048576), (8, 64, 32, 1), {1048576: (8, 1)}, True),
    ("scale_batch_short", (32768, 131072), (64, 32), None, True),
    ("scale_batch_1m", (1048576,), (64, 32), None, False),
    ("scale_batch_1m_fp8", (1048576,), (64,), None, False),
    ("scale_lean_jt", (131072, 524288), (32, 64), None, False),
    ("scale_lean_jt_swizzle", (524288,), (32, 64), None, False),
    ("scale_batch_1m_fp8_swizzle", (1048576,), (64,), None, False),
    ("scale_small_batch", (524288,), (1, 8), None, False),
    ("scale_small_batch_1m", (1048576,), (1, 8), None, False),
    ("scale_small_batch_s30", (524288,), (1, 8, 32, 64), None, False),
    ("scale_small_batch_s32", (524288,), (8, 1), None, False),
    ("scale_small_batch_s33", (524288,), (32, 64), None, False)])
def test_scale_batch_config_binds_the_batch_grid(name, contexts, batches, by_context, g2):
    """configs/experiments/scale_batch.gin (512K at batch 8/64/32/1, 1M at 8/1),
    scale_batch_short.gin (32K and 128K at 64/32) and scale_batch_1m.gin (1M at 64/32, the
    four methods issue 13 names; scale_batch_1m_fp8.gin: batch 64 with FP8 rows;
    scale_lean_jt.gin: hisparse and LeanSparse's FP8 jax-triton coarse pass; the _swizzle
    runs: the same cells again after the coarse kernel's bank swizzle; the _small_batch runs:
    batches 1 and 8 after the batch-1 fix of session 28, _s30 batches 1-64 after session 30's
    sort removal, _s31 batches 8 and 1 in 5 timed blocks a cell, _s33 batches 32 and 64 in
    3): the leansparse_g2 variant where asked, a per-call budget and a prefill cache; the
    grid passes the checks; the _fp8 runs store FP8 rows."""
    import gin

    import experiments.registry  # noqa: F401  (the configurables)
    from experiments.cli import CONFIG_ROOT
    from experiments.scale import _check

    gin.clear_config()
    try:
        gin.add_config_file_search_path(str(CONFIG_ROOT))
        gin.parse_config_files_and_bindings([str(CONFIG_ROOT / f"experiments/{name}.gin")],
                                            None, finalize_config=False)
        q = gin.query_parameter
        methods = q("scale.methods")
        assert ("leansparse_g2" in methods) == g2 and q("scale.contexts") == contexts
        # the fastest coarse pass beside HiSparse
        if "lean_jt" in name or "swizzle" in name or "small_batch" in name:
            assert methods == ("hisparse", "leansparse_fp8_jt")
        else:
            assert {"resident", "hisparse", "leansparse", "adaptive"} <= set(methods)
        assert q("scale.batches") == batches
        assert q("scale.batches_by_context") == by_context
        assert q("scale.time_budget_s") <= 500 and q("scale.prefill_cache")
        assert q("run.name") == name and q("scale.implementation") == "triton"
        if "_fp8" in name or name == "scale_small_batch_1m":
            assert q("model_preset.kv_dtype") == "fp8_v4"
        _check(methods, contexts, q("scale.batches"), q("scale.steps"),
               q("scale.batches_by_context"))
        if name.endswith("_s31"):
            assert q("scale.repeats") == 5
    finally:
        gin.clear_config()


def test_scale_report_ratio_range_from_timed_blocks(tmp_path):
    """Where both cells of a ratio timed several blocks (scale.repeats), the table adds the
    widest range the blocks allow, [min a / max b, max a / min b]; one-block cells add none."""
    from experiments.scale_report import load, step_table

    model = {"layer_pattern": ["swa", "csa", "hca", "csa"], "matmul_precision": "bf16"}
    full = {"device_bytes_per_request": 2e9, "step_ms_extrapolated": 99.0}

    def rec(method, batch, blocks):
        return dict(method=method, context=524288, batch=batch, prefill_s=17.0,
                    step_ms=sorted(blocks)[len(blocks) // 2], device_bytes_per_request=1,
                    full_model=full, **({"step_ms_blocks": blocks} if len(blocks) > 1 else {}))

    (tmp_path / "scale_small_batch_s32").mkdir()
    (tmp_path / "scale_small_batch_s32" / "results.json").write_text(json.dumps(
        {"model": model, "records": [
            rec("hisparse", 8, [3.8, 3.7, 3.9]), rec("leansparse_fp8_jt", 8, [3.2, 3.3, 3.1]),
            rec("hisparse", 1, [2.8]), rec("leansparse_fp8_jt", 1, [2.9])]}))
    text = step_table(load(tmp_path))
    # 3.2 / 3.8 = 0.842, 3.1 / 3.9 = 0.795, 3.3 / 3.7 = 0.892
    assert "| 512K | 8 | 3.80 | 3.20 |  | 0.84 [0.79-0.89] |" in text
    assert "| 512K | 1 | 2.80 | 2.90 |  | 1.04 |" in text


def test_scale_report_tables_and_readme(tmp_path):
    """The report takes each cell from the newest run holding it, prints step ms and ratios
    (both methods from the numerator's run, blank where that run lacks the denominator),
    labels the 43-layer step as extrapolated, and rewrites only the README's block."""
    from experiments.scale_report import BEGIN, END, load, main

    model = {"layer_pattern": ["swa", "csa", "hca", "csa"], "matmul_precision": "bf16"}

    def rec(method, batch, ms, run_bytes=1000):
        return dict(method=method, context=524288, batch=batch, step_ms=ms, prefill_s=70.0,
                    device_bytes_per_request=run_bytes,
                    full_model={"device_bytes_per_request": 2e9, "step_ms_extrapolated": 99.0})

    fp8 = dict(model, kv_dtype="fp8_v4")
    for name, rows, records in (
            ("scale_long", model, [rec("hisparse", 8, 9.5), rec("leansparse", 8, 9.0),
                                   rec("leansparse", 64, 21.0)]),
            ("scale_batch", model, [rec("leansparse", 8, 7.0), rec("leansparse_g2", 8, 6.3),
                                    rec("hisparse", 8, 7.7), rec("hisparse", 64, 20.0)]),
            ("scale_batch_1m_fp8", fp8, [dict(rec("hisparse", 64, 30.0), context=1 << 20)]),
            ("scale_lean_jt", model, [rec("leansparse_fp8_jt", 8, 7.2),
                                      rec("hisparse", 8, 8.0)])):
        (tmp_path / name).mkdir()
        (tmp_path / name / "results.json").write_text(json.dumps(
            {"model": rows, "records": records}))
    got = {(r["method"], r["batch"]): r for r in load(tmp_path)}
    assert got[("leansparse", 8)]["step_ms"] == 7.0  # the newest run's cell
    assert got[("hisparse", 8)]["run"] == "scale_lean_jt"
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{BEGIN}\nold\n{END}\noutro\n")
    merged = tmp_path / "all_cells.json"
    assert main(["--runs", str(tmp_path), "--readme", str(readme), "--json", str(merged)]) == 0
    cells = json.loads(merged.read_text())
    assert cells["runs"] == ["scale_lean_jt", "scale_batch_1m_fp8", "scale_batch", "scale_long"]
    assert {(r["method"], r["batch"], r["step_ms"], r["run"]) for r in cells["records"]} == {
        ("hisparse", 8, 8.0, "scale_lean_jt"), ("leansparse", 8, 7.0, "scale_batch"),
        ("leansparse", 64, 21.0, "scale_long"),
        ("leansparse_g2", 8, 6.3, "scale_batch"), ("hisparse", 64, 20.0, "scale_batch"),
        ("hisparse", 64, 30.0, "scale_batch_1m_fp8"),
        ("leansparse_fp8_jt", 8, 7.2, "scale_lean_jt")}
    text = readme.read_text()
    assert text.startswith("intro\n" + BEGIN) and text.endswith(END + "\noutro\n")
    assert "\nold\n" not in text and "EXTRAPOLATED" in text
    # columns: the methods present (hisparse, leansparse, leansparse_g2, leansparse_fp8_jt),
    # lean / his, g2 / lean, fp8_jt / his; lean / his is scale_batch's 7.0 / 7.7, not the
    # newest HiSparse cell's 7.0 / 8.0; at batch 64 scale_long has no HiSparse cell
    assert "| 512K | 8 | 8.00 | 7.00 | 6.30 | 7.20 | 0.91 | 0.90 | 0.90 | 70.0 (bf16) | " \
           "scale_batch, scale_lean_jt |" in text
    assert "| 512K | 64 | 20.00 | 21.00 |  |  |  |  |  | 70.0 (bf16) | scale_batch, scale_long |" \
        in text
    # a run with FP8 rows says so beside its prefill time
    assert "| 1M | 64 | 30.00 |  |  |  |  |  |  | 70.0 (bf16, fp8_v4) | scale_batch_1m_fp8 |" \
        in text

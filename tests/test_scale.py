"""The scale study end to end on CPU at toy shapes: one record per cell, resumable."""

import json

import pytest

from experiments.cli import main
from experiments.common import fit_max_len
from experiments.scale import extrapolate
from lsparse_jax.config import LeanSparseConfig
from lsparse_jax.model import preset


def test_scale_study_runs_every_cell_and_resumes(tmp_path, monkeypatch):
    monkeypatch.setenv("LSPARSE_RUNS", str(tmp_path))
    args = ["run", "configs/experiments/scale.gin", "--gin.model_preset.name='tiny'",
            "--gin.scale.contexts=(256,)", "--gin.scale.batches=(2,)", "--gin.scale.steps=2",
            "--gin.scale.warm_steps=1", "--gin.scale.prefill_chunk=128",
            "--gin.scale.hot_cache_rows=32", "--gin.scale.page_size=8",
            "--gin.LeanSparseConfig.num_candidates=32", "--gin.LeanSparseConfig.key_cache_rows=48",
            "--gin.scale.calibration_tokens=256", "--gin.run.name='scale'"]
    assert main(args) == 0
    records = json.loads((tmp_path / "scale" / "results.json").read_text())["records"]
    cells = {(r["method"], r["context"], r["batch"]) for r in records}
    assert cells == {(m, 256, 2) for m in ("resident", "hisparse", "leansparse", "adaptive")}
    for r in records:
        assert r["step_ms"] > 0 and r["layers"] == 4
    by = {(r["method"], r["batch"]): r for r in records}
    # paged methods keep less per request on the device than resident
    assert by[("hisparse", 2)]["device_bytes_per_request"] < \
        by[("resident", 2)]["device_bytes_per_request"]
    assert by[("resident", 2)]["host_bytes_per_token"] == 0
    # the whole-model extrapolation: 43 layers; with the slice's own pattern it reproduces
    # the measured allocation and step (it sizes the same configuration)
    cfg = fit_max_len(preset("tiny"), 256 + 2 + 1 + 3 + 2)
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
    assert method_variant("hisparse", lean) == ("hisparse", lean)
    with pytest.raises(ValueError, match="unknown method 'hisparse_g2'"):
        _check(("hisparse_g2",), (256,), (1,), 2)
    with pytest.raises(ValueError, match="batches_by_context: 512"):
        _check(("resident",), (256,), (1,), 2, {512: (1,)})
    recs = [dict(method="resident", context=1024, batch=8, step_ms=16.0, prefill_s=10.0,
                 warmup_s=30.0, admit_s=4.0)]
    est = _Estimates(recs, 1024)
    assert est.prefill_s(1024) == 10.0 and est.prefill_s(2048) == 40.0  # (2x)^2
    assert est.prefill_s(512) == 0.0  # nothing smaller recorded: unknown
    assert est.cell_s("hisparse", 8, 10) == pytest.approx(1.25 * (30 + 8 * (0.5 + 10 * 2e-3)))
    assert _Estimates([], 1024).cell_s("resident", 1, 0) == pytest.approx(1.25 * 20.5)


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

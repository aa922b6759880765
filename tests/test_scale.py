"""The scale study end to end on CPU at toy shapes: one record per cell, resumable."""

import json

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

"""experiments/speculative.py end to end at the V4 cost side's settings (random target weights,
checkpoint None; an untrained drafter) on the tiny preset: the speculative tokens equal plain
decoding's and the records carry what the issue names."""

import json

import pytest

from experiments.cli import main


@pytest.mark.slow
def test_v4_cost_side_config_runs_greedy_exact_without_checkpoints(tmp_path):
    argv = ["run", "configs/experiments/speculative_v4.gin", "--runs", str(tmp_path),
            "--gin.model_preset.name='tiny'", "--gin.speculative.results_dir=None",
            "--gin.speculative.methods=('hisparse',)", "--gin.speculative.prompt_tokens=512",
            "--gin.speculative.decode_tokens=8", "--gin.speculative.prefill_chunk=128",
            "--gin.speculative.hot_cache_rows=96", "--gin.speculative.page_size=16",
            "--gin.speculative.concurrencies=(2,)", "--gin.speculative.implementation='xla'",
            "--gin.DrafterConfig.target_layers=(0, 1)"]
    assert main(argv) == 0
    out = json.loads((tmp_path / "speculative_v4" / "results.json").read_text())
    assert out["checkpoint"] is None and out["drafter_checkpoint"] is None
    plain, spec = out["records"]
    assert (plain["speculative"], spec["speculative"]) == (False, True)
    assert spec["greedy_identical"] is True
    assert 1.0 <= spec["acceptance_length"] <= 5.0  # gamma 4: at most 4 drafts + a bonus
    assert 0.0 <= spec["union_miss_ratio"] <= 1.0

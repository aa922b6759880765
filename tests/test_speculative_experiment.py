"""experiments/speculative.py end to end at the V4 cost side's settings (random target weights,
checkpoint None; an untrained drafter) on the tiny preset: the speculative tokens equal plain
decoding's and the records carry what the issue names."""

import json

import pytest

from experiments.cli import main


def run(tmp_path, gin: str, name: str, *overrides: str) -> dict:
    """``lsparse run gin`` with the overrides into tmp_path; its results.json."""
    assert main(["run", gin, "--runs", str(tmp_path), *overrides]) == 0
    return json.loads((tmp_path / name / "results.json").read_text())


@pytest.mark.slow
def test_v4_cost_side_config_runs_greedy_exact_without_checkpoints(tmp_path):
    out = run(tmp_path, "configs/experiments/speculative_v4.gin", "speculative_v4",
              "--gin.model_preset.name='tiny'", "--gin.speculative.results_dir=None",
              "--gin.speculative.methods=('hisparse',)", "--gin.speculative.prompt_tokens=512",
              "--gin.speculative.decode_tokens=8", "--gin.speculative.prefill_chunk=128",
              "--gin.speculative.hot_cache_rows=96", "--gin.speculative.page_size=16",
              "--gin.speculative.concurrencies=(2,)",
              "--gin.speculative.implementation='xla'", "--gin.DrafterConfig.target_layers=(0, 1)")
    assert out["checkpoint"] is None and out["drafter_checkpoint"] is None
    plain, spec = out["records"]
    assert (plain["speculative"], spec["speculative"]) == (False, True)
    assert spec["greedy_identical"] is True and spec["first_divergence"] == [None, None]
    assert 1.0 <= spec["acceptance_length"] <= 5.0  # gamma 4: at most 4 drafts + a bonus
    assert 0.0 <= spec["union_miss_ratio"] <= 1.0


def test_first_divergence_is_the_first_differing_index():
    from experiments.speculative import first_divergence

    want = [[5, 6, 7], [1, 2, 3], [9, 9], [4]]
    got = [[5, 6, 7], [1, 8, 3], [9, 9, 9], []]
    assert first_divergence(got, want) == [None, 1, 2, 0]
    with pytest.raises(ValueError):  # one list per request on both sides
        first_divergence(got[:2], want)


@pytest.mark.slow
@pytest.mark.parametrize("ring", ["kv", "features"])
def test_serve_capped_with_the_drafter_counts_its_bytes(tmp_path, ring):
    """serve_capped.gin's path with the shipped drafter at small lengths: a SpecEngine serves
    every request under the budget of four plain hisparse requests; its ring (either kind,
    ``serve.drafter_ring``) and staging bytes count, so fewer run at once than plainly."""
    import dataclasses

    from lsparse_jax.config import CacheConfig, EngineConfig, method_storage
    from lsparse_jax.memory.accounting import request_bytes, spec_bytes
    from lsparse_jax.model import preset
    from lsparse_jax.model.presets import fit_max_len
    from lsparse_jax.training.drafter import load_drafter

    out = run(tmp_path, "configs/experiments/serve_capped.gin", "capped",
              "--gin.run.name='capped'", "--gin.serve.method='adaptive'",
              "--gin.serve.drafter_checkpoint='checkpoints/drafter_small'",
              "--gin.serve.requests=4", "--gin.serve.prompt_tokens=(512, 512)",
              "--gin.serve.max_new_tokens=(16, 16)", "--gin.serve.budget_fit=('hisparse', 4)",
              "--gin.serve.num_slots=4", "--gin.serve.prefill_chunk=256",
              "--gin.serve.optional_pages=64", f"--gin.serve.drafter_ring='{ring}'")
    assert out["speculative"] and out["completed"] == 4 and out["config"]["drafter_ring"] == ring
    cfg = fit_max_len(preset("small"), 528)
    plain = lambda m: request_bytes(EngineConfig(  # noqa: E731
        model=cfg, method=m, cache=CacheConfig(4, 256, 128, 16, optional_pages=64
                                               if method_storage(m).lent_pages else None)),
        528).gpu_total
    ring = sum(spec_bytes(EngineConfig(model=cfg, method="adaptive", cache=CacheConfig(
        4, 256, 128, 16, optional_pages=64)), dataclasses.replace(
            load_drafter("checkpoints/drafter_small")[1], ring=ring)).values())
    assert out["device_budget_bytes"] == 4 * plain("hisparse")
    fits = out["device_budget_bytes"] // (plain("adaptive") + ring)
    assert 1 <= max(it["active"] for it in out["trace"]) <= fits < 4
    assert out["peak_device_bytes"] <= out["device_budget_bytes"]

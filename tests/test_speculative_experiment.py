"""experiments/speculative.py end to end at the V4 cost side's settings (random target weights,
checkpoint None; an untrained drafter) on the tiny preset: the speculative tokens equal plain
decoding's and the records carry what the issue names."""

import dataclasses
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
              "--gin.speculative.implementation='xla'", "--gin.DrafterConfig.target_layers=(0, 1)",
              "--gin.speculative.record_margins=True")
    assert out["checkpoint"] is None and out["drafter_checkpoint"] is None
    plain, spec = out["records"]
    assert (plain["speculative"], spec["speculative"]) == (False, True)
    assert spec["greedy_identical"] is True and spec["first_divergence"] == [None, None]
    assert spec["divergences"] == [None, None]  # record_margins=True below
    assert 1.0 <= spec["acceptance_length"] <= 5.0  # gamma 4: at most 4 drafts + a bonus
    assert 0.0 <= spec["union_miss_ratio"] <= 1.0


# slow tier (session 49): an experiment CLI (45 s); speculative decoding's identities stay in
# test_speculative
@pytest.mark.slow
def test_repeats_rerun_each_cell_on_warm_engines_with_the_same_tokens(tmp_path):
    """repeats = 2: two serving runs per engine, plain and speculative alternating; the
    reported tok/s is the runs' median, each pair's ratio is kept, and every rerun emits the
    first plain run's tokens (greedy decoding is deterministic on warm engines)."""
    import numpy as np

    out = run(tmp_path, "configs/experiments/speculative_v4.gin", "speculative_v4",
              "--gin.model_preset.name='tiny'", "--gin.speculative.results_dir=None",
              "--gin.speculative.methods=('hisparse',)", "--gin.speculative.prompt_tokens=256",
              "--gin.speculative.decode_tokens=6", "--gin.speculative.prefill_chunk=128",
              "--gin.speculative.hot_cache_rows=96", "--gin.speculative.page_size=16",
              "--gin.speculative.concurrencies=(2,)", "--gin.speculative.repeats=2",
              "--gin.speculative.implementation='xla'", "--gin.DrafterConfig.target_layers=(0, 1)")
    assert out["repeats"] == 2
    plain, spec = out["records"]
    for r in (plain, spec):
        assert len(r["output_tok_s_runs"]) == 2
        assert r["output_tok_s"] == float(np.median(r["output_tok_s_runs"]))
    assert spec["speedup_runs"] == [a / b for a, b in zip(spec["output_tok_s_runs"],
                                                          plain["output_tok_s_runs"])]
    assert spec["runs_identical"] is True and spec["greedy_identical"] is True


def test_resume_keeps_finished_cells_and_reads_old_results_as_one_run_each(tmp_path):
    """``resumed``: a results.json written before ``repeats`` existed resumes a repeats = 1 run
    (its cells kept, a half-finished cell dropped) and is refused by a repeats = 2 run."""
    from experiments.speculative import resumed
    from experiments.validate import ConfigError

    cell = [{"method": "hisparse", "concurrency": 2, "speculative": s} for s in (False, True)]
    half = [{"method": "resident", "concurrency": 2, "speculative": False}]
    path = tmp_path / "results.json"
    path.write_text(json.dumps({"model": None, "checkpoint": None, "records": cell + half}))
    meta = {"model": None, "checkpoint": None, "repeats": 1}
    cells = [("hisparse", 2), ("resident", 2)]
    assert resumed(str(path), meta, cells) == cell
    with pytest.raises(ConfigError, match="repeats"):
        resumed(str(path), {**meta, "repeats": 2}, cells)


def test_first_divergence_is_the_first_differing_index():
    from experiments.speculative import first_divergence

    want = [[5, 6, 7], [1, 2, 3], [9, 9], [4]]
    got = [[5, 6, 7], [1, 8, 3], [9, 9, 9], []]
    assert first_divergence(got, want) == [None, 1, 2, 0]
    with pytest.raises(ValueError):  # one list per request on both sides
        first_divergence(got[:2], want)


def test_divergence_margins_read_the_plain_logits_at_the_departure():
    import numpy as np

    from experiments.speculative import TOP, divergence_margins

    want = [[5, 6, 7], [1, 2, 3], [4, 4], [9, 8]]
    got = [[5, 6, 7], [1, 3, 3], [4, 99], [7, 8]]
    ids = np.arange(TOP)  # step logits: token t has logit 10 - t (top-TOP ids 0..TOP-1)
    step = (np.array([2, 3, 0, 1, 4, 5, 6, 7]), 10.0 - np.array([2, 3, 0, 1, 4, 5, 6, 7]))
    tops = [[(ids, 10.0 - ids)] * 2, [step, (ids, 10.0 - ids)], [(ids + 4, 6.0 - ids)],
            [(ids, 10.0 - ids)]]
    out = divergence_margins(got, want, tops)
    assert out[0] is None
    assert out[1] == {"index": 1, "plain_token": 2, "spec_token": 3, "logit_gap": 1.0,
                      "top2_gap": 1.0}
    assert out[2] == {"index": 1, "plain_token": 4, "spec_token": 99, "logit_gap": None,
                      "top2_gap": 1.0}  # beyond the plain top-TOP
    assert out[3]["index"] == 0 and out[3]["logit_gap"] is None  # the prefill's token
    with pytest.raises(ValueError, match="misaligned"):
        divergence_margins([[5, 7]], [[5, 6]], [[(ids, 10.0 - ids)]])


def test_serve_margins_top_token_is_each_greedy_token():
    """``serve_prompts(margins=True)``: entry j - 1 of a request's top logits is the step that made
    its token j, whose top-1 id is that token (greedy), for every token after the first."""
    import numpy as np

    from experiments.speculative import serve_prompts
    from lsparse_jax.config import CacheConfig, EngineConfig, SamplingConfig
    from lsparse_jax.model import init_params
    from lsparse_jax.serving.engine import Engine
    from tests.helpers import tiny

    cfg = tiny(max_len=128)
    engine = Engine(EngineConfig(model=cfg, method="hisparse", sampling=SamplingConfig(0.0, 0),
                                 cache=CacheConfig(3, 32, 40, 8)), init_params(cfg, 0), None)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, cfg.vocab_size, n).astype(np.int32) for n in (40, 57)]
    tokens, _, tops = serve_prompts(engine, prompts, 6, margins=True)
    for toks, top in zip(tokens, tops):
        assert len(toks) == 6 and len(top) == 5
        assert [int(ids[0]) for ids, _ in top] == list(toks[1:])
        assert all(vals[0] >= vals[1] for _, vals in top)


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


def test_fill_added_fields_counts_a_new_field_at_its_default_as_unchanged():
    from experiments.common import fill_added_fields
    from lsparse_jax.config import ModelConfig

    now = json.loads(json.dumps(dataclasses.asdict(ModelConfig())))
    old = {k: v for k, v in now.items() if k != "weight_dtype"}  # written before the field
    assert fill_added_fields(old, now, ModelConfig) == now
    bf16 = now | {"matmul_precision": "bf16", "weight_dtype": "bf16"}
    old16 = {k: v for k, v in bf16.items() if k != "weight_dtype"}
    assert fill_added_fields(old16, bf16, ModelConfig) == old16  # not the default: differs
    # a field added to a nested config (IndexerConfig.score_precision, session 40)
    nested = {**now, "indexer": {k: v for k, v in now["indexer"].items()
                                 if k != "score_precision"}}
    assert fill_added_fields(nested, now, ModelConfig) == now
    fp8 = now | {"indexer": now["indexer"] | {"score_precision": "fp8"}}
    assert fill_added_fields(nested, fp8, ModelConfig) == nested

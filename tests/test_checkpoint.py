"""The shipped checkpoint (checkpoints/small, issue 7) on CPU: it loads, answers a fixed
held-out NIAH prompt, and hisparse gives exactly resident's answers."""

import pathlib

import jax.numpy as jnp
import numpy as np
import pytest

from experiments.accuracy import mcnemar, run_engine
from lsparse_jax.config import CacheConfig, EngineConfig, SamplingConfig
from lsparse_jax.model import preset
from lsparse_jax.model.presets import fit_max_len
from lsparse_jax.serving.engine import Engine
from lsparse_jax.serving.steps import forward, prefill
from lsparse_jax.tasks import score_exact, tokenizer
from lsparse_jax.training import load_params
from lsparse_jax.training.data import task_example

CHECKPOINT = pathlib.Path(__file__).resolve().parent.parent / "checkpoints" / "small"
LENGTH = 1024  # the training length


@pytest.fixture(scope="module")
def model():
    cfg = fit_max_len(preset("small"), LENGTH + 16)
    return cfg, load_params(CHECKPOINT, cfg)


@pytest.mark.parametrize("dense", [False, True])
def test_checkpoint_answers_a_held_out_niah_prompt(model, dense):
    """Teacher-forced argmax over the answer = greedy decoding's answer (seed 0 < the training
    seed base, so the prompt was never trained on)."""
    cfg, params = model
    ex = task_example("niah", LENGTH, 0)
    answer = tokenizer.encode(ex.answer)
    tokens = np.concatenate([ex.prompt, answer])
    logits = forward(params, cfg, tokens, dense_selection=dense)
    predicted = np.asarray(jnp.argmax(logits[len(ex.prompt) - 1:-1], axis=-1))
    assert tokenizer.decode(predicted) == ex.answer


def test_hisparse_answers_equal_resident_on_every_example(model):
    cfg, params = model
    batch = [task_example(task, LENGTH, seed) for task in ("niah", "mrcr") for seed in (1, 2)]
    answers = [tokenizer.encode(ex.answer) for ex in batch]
    prefilled = [prefill(params, cfg, ex.prompt, 512) for ex in batch]
    texts = {}
    for method, hot in (("resident", None), ("hisparse", 32)):
        engine = Engine(EngineConfig(model=cfg, cache=CacheConfig(len(batch), 512, hot, 16),
                                     sampling=SamplingConfig(0.0, 0), method=method), params)
        texts[method], _ = run_engine(engine, batch, prefilled, answers, forced=False)
    assert texts["hisparse"] == texts["resident"]
    niah = [score_exact(t, ex.answer) for t, ex in zip(texts["resident"], batch)][:2]
    assert niah == [1.0, 1.0]


def test_mcnemar_exact_values():
    """Discordant pairs 2 vs 5: p = 2 * (C(7,0) + C(7,1) + C(7,2)) / 2^7 = 58 / 128."""
    a = np.array([1, 0, 0, 0, 0, 0, 1, 1], bool)
    b = np.array([0, 1, 1, 1, 1, 1, 1, 0], bool)
    got = mcnemar(a, b)
    assert (got["a_only"], got["b_only"]) == (2, 5)
    assert got["p"] == pytest.approx(2 * (1 + 7 + 21) / 2**7)
    assert mcnemar(a, a)["p"] == 1.0


# slow tier (session 49): an experiment CLI (42 s); the checkpoint's answers stay in
# test_hisparse_answers_equal_resident_on_every_example
@pytest.mark.slow
def test_accuracy_cli_on_the_checkpoint(tmp_path, monkeypatch):
    """The accuracy study end to end (shortened): results, table and per-example records; the
    lossless method answers exactly as resident on every example, and the McNemar test of two
    identical outcome vectors has p = 1."""
    import json

    from experiments.cli import main

    monkeypatch.setenv("LSPARSE_RUNS", str(tmp_path))
    rc = main(["run", "configs/experiments/accuracy.gin", "--gin.accuracy.lengths=(1024,)",
               "--gin.accuracy.examples=2", "--gin.accuracy.tasks=('niah',)",
               "--gin.accuracy.methods=('resident', 'hisparse', 'direct_pq')",
               "--gin.accuracy.num_slots=2", "--gin.accuracy.calibration_tokens=2048",
               "--gin.run.name='acc'"])  # direct_pq's codebooks: 2K tokens, not 4K
    assert rc == 0
    results = json.loads((tmp_path / "acc" / "results.json").read_text())
    assert results["complete"] and (tmp_path / "acc" / "accuracy.png").exists()
    by = {}
    for r in results["records"]:
        by.setdefault(r["method"], []).append(r)
    assert [r["generated"] for r in by["hisparse"]] == [r["generated"] for r in by["resident"]]
    cell = results["summary"]["niah@1024"]
    assert cell["hisparse"]["mcnemar_vs_resident"]["p"] == 1.0
    assert cell["hisparse"]["recall"] == 1.0 and 0.0 < cell["direct_pq"]["recall"] < 1.0
    assert cell["resident"]["exact"] == 1.0


@pytest.mark.slow
def test_accuracy_resume_equals_an_uncut_run(tmp_path, monkeypatch, capsys):
    """A study resumed with one more method runs only that method (the finished groups are
    kept as they were) and its records equal those of one uncut run of every method, bit for
    bit; 3 examples in slots of 2 also cover a partial last batch."""
    import json

    from experiments.cli import main

    base = ["run", "configs/experiments/accuracy.gin", "--gin.accuracy.lengths=(1024,)",
            "--gin.accuracy.examples=3", "--gin.accuracy.tasks=('niah',)",
            "--gin.accuracy.num_slots=2", "--gin.accuracy.recall=False", "--gin.run.name='acc'"]
    three = "--gin.accuracy.methods=('resident', 'direct_pq', 'hisparse')"

    def records(root):
        rows = json.loads((root / "acc" / "results.json").read_text())
        return rows["complete"], {(r["method"], r["seed"]): r for r in rows["records"]}

    monkeypatch.setenv("LSPARSE_RUNS", str(tmp_path / "cut"))
    assert main(base + ["--gin.accuracy.methods=('resident', 'direct_pq')"]) == 0
    first = records(tmp_path / "cut")[1]
    capsys.readouterr()
    assert main(base + [three, "--gin.accuracy.resume=True"]) == 0
    assert "resumed 2 finished (task, length, method) groups" in capsys.readouterr().out
    complete, resumed = records(tmp_path / "cut")
    assert complete and {k: resumed[k] for k in first} == first
    monkeypatch.setenv("LSPARSE_RUNS", str(tmp_path / "whole"))
    assert main(base + [three]) == 0
    complete, whole = records(tmp_path / "whole")
    assert complete and whole == resumed and len(whole) == 9
    assert [whole[("hisparse", s)]["generated"] for s in range(3)] == \
        [whole[("resident", s)]["generated"] for s in range(3)]

"""Bad settings and inputs fail before any model work, with one line naming the setting or file
and what is allowed, a non-zero exit status, and nothing written under the runs root."""

import os
import shutil

import numpy as np
import pytest

from experiments import validate
from experiments.cli import main

CHECKPOINT = validate.REPO_ROOT / "checkpoints" / "small"


def fails(capfd, tmp_path, argv, *expected):
    """Runs the CLI with a fresh runs root; asserts a one-line error holding ``expected``."""
    runs = tmp_path / "runs"
    assert main(["run", *argv, "--runs", str(runs), "--gin.run.name='bad'"]) == 2
    err = capfd.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith("lsparse: error: ") and "Traceback" not in err
    for text in expected:
        assert text in err, err
    assert not runs.exists() or not any(runs.iterdir())
    return err


@pytest.fixture(autouse=True)
def _no_debug(monkeypatch):
    monkeypatch.delenv("LSPARSE_DEBUG", raising=False)
    monkeypatch.delenv("LSPARSE_ROOT", raising=False)


QS = "configs/quickstart.gin"


def test_zero_decode_steps(capfd, tmp_path):
    fails(capfd, tmp_path, [QS, "--gin.quickstart.decode_steps=0"],
          "quickstart.decode_steps=0", "int >= 1")


def test_fractional_decode_steps_blames_the_setting(capfd, tmp_path):
    err = fails(capfd, tmp_path, [QS, "--gin.quickstart.decode_steps=2.5"],
                "quickstart.decode_steps=2.5", "int >= 1")
    assert "max_len" not in err


def test_unquoted_string_hints_at_quotes(capfd, tmp_path):
    fails(capfd, tmp_path, [QS, "--gin.quickstart.decode_steps=four"],
          "--gin.quickstart.decode_steps=four", "'four'", "strings in gin are quoted",
          "\"'triton'\"")


def test_unknown_configurable(capfd, tmp_path):
    fails(capfd, tmp_path, [QS, "--gin.quikstart.decode_steps=4"], "quikstart")


def test_misspelled_method(capfd, tmp_path):
    fails(capfd, tmp_path, [QS, "--gin.quickstart.methods=('resident', 'hisprase')"],
          "quickstart.methods", "'hisprase'", "'hisparse'", "'leansparse'")


def test_misspelled_method_of_the_accuracy_study(capfd, tmp_path):
    fails(capfd, tmp_path, ["configs/experiments/accuracy.gin",
                            "--gin.accuracy.methods=('resident', 'hisparce')"],
          "accuracy.methods", "'hisparce'", "leansparse_C<candidates>")


def test_hot_cache_smaller_than_top_k(capfd, tmp_path):
    fails(capfd, tmp_path, [QS, "--gin.quickstart.hot_cache_rows=8"],
          "quickstart.hot_cache_rows=8", ">= 16")


def test_residency_hot_cache_smaller_than_top_k(capfd, tmp_path):
    fails(capfd, tmp_path, ["configs/experiments/residency.gin",
                            "--gin.residency.hot_cache_rows=8"],
          "residency.hot_cache_rows=8", ">= 16")


def test_bad_implementation(capfd, tmp_path):
    fails(capfd, tmp_path, [QS, "--gin.quickstart.implementation='cuda'"],
          "quickstart.implementation='cuda'", "'triton'")


def test_host_pages_too_few(capfd, tmp_path):
    fails(capfd, tmp_path, [QS, "--gin.quickstart.host_pages=1"],
          "quickstart.host_pages=1", "must be >=")


def test_max_len_smaller_than_the_run_needs(capfd, tmp_path):
    fails(capfd, tmp_path, [QS, "--gin.quickstart.prompt_tokens=1024",
                            "--gin.model_preset.max_len=512"],
          "model_preset.max_len=512", "1089 tokens")


def test_kernel_compare_unknown_op(capfd, tmp_path):
    fails(capfd, tmp_path, ["configs/experiments/kernel_compare.gin",
                            "--gin.kernel_compare.ops=('topk', 'pq')"],
          "kernel_compare.ops", "'pq'", "'pq_topc'")


def test_train_fractional_batch(capfd, tmp_path):
    fails(capfd, tmp_path, ["configs/experiments/train.gin", "--gin.TrainConfig.batch=2.5"],
          "TrainConfig.batch=2.5")


def test_train_warmup_not_shorter_than_training(capfd, tmp_path):
    fails(capfd, tmp_path, ["configs/experiments/train.gin", "--gin.TrainConfig.dense_steps=2",
                            "--gin.TrainConfig.sparse_steps=2"],
          "TrainConfig.warmup=100", "dense_steps + sparse_steps = 4")


def test_recall_unknown_source(capfd, tmp_path):
    fails(capfd, tmp_path, ["configs/experiments/recall.gin",
                            "--gin.recall_study.sources=('model', 'npy')"],
          "recall_study.sources", "'npy'", "'npz'")


def test_bad_value_inside_a_config_file_names_the_file(capfd, tmp_path):
    bad = tmp_path / "bad.gin"
    bad.write_text("include 'quickstart.gin'\nquickstart.decode_steps = four\n")
    fails(capfd, tmp_path, [str(bad)], f"config file {bad}", "'four'",
          "strings in gin are quoted")


def test_missing_config_file(capfd, tmp_path):
    fails(capfd, tmp_path, ["configs/nope.gin"], "configs/nope.gin", "configs/quickstart.gin")


def test_missing_checkpoint(capfd, tmp_path):
    fails(capfd, tmp_path, ["configs/experiments/accuracy.gin",
                            f"--gin.accuracy.checkpoint='{tmp_path / 'nothing'}'"],
          "accuracy.checkpoint", str(tmp_path / "nothing"), "does not exist")


# orbax's reader threads report their closed event loop as unraisable exceptions
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_truncated_checkpoint_names_the_path(capfd, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(CHECKPOINT, broken)
    data = max((p for p in (broken / "params").rglob("*") if p.is_file()),
               key=lambda p: p.stat().st_size)
    os.truncate(data, 1000)
    fails(capfd, tmp_path, ["configs/experiments/residency.gin",
                            f"--gin.residency.checkpoint='{broken}'"],
          "residency.checkpoint", f"checkpoint {broken} cannot be loaded", "OUT_OF_RANGE")


def test_text_file_given_as_npz(capfd, tmp_path):
    text = tmp_path / "traces.npz"
    text.write_text("keys,queries\n1,2\n")
    err = fails(capfd, tmp_path, ["configs/experiments/recall.gin",
                                  "--gin.recall_study.sources=('npz',)",
                                  f"--gin.recall_npz.path='{text}'"],
                "recall_npz.path", str(text), "not an .npz archive", "numpy.savez")
    assert "pickle" not in err


def test_npz_source_without_path(capfd, tmp_path):
    fails(capfd, tmp_path, ["configs/experiments/recall.gin",
                            "--gin.recall_study.sources=('model', 'npz')"],
          "recall_npz.path is not set")


def test_debug_env_shows_the_traceback(monkeypatch, tmp_path):
    monkeypatch.setenv("LSPARSE_DEBUG", "1")
    with pytest.raises(ValueError, match="quickstart.decode_steps=0"):
        main(["run", QS, "--runs", str(tmp_path), "--gin.quickstart.decode_steps=0"])


def test_paths_resolve_against_the_repo_root(capfd, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # not the repository: configs and checkpoints still resolve
    assert validate.resolve_path("x", "checkpoints/small", "dir") == CHECKPOINT
    fails(capfd, tmp_path, ["configs/experiments/accuracy.gin", "--gin.accuracy.examples=0"],
          "accuracy.examples=0")
    monkeypatch.setenv("LSPARSE_ROOT", str(tmp_path))
    with pytest.raises(validate.ConfigError, match=f"against {tmp_path}"):
        validate.resolve_path("accuracy.checkpoint", "checkpoints/small", "dir")


def test_help_lists_experiments_configs_and_override_syntax(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    for name in ("quickstart", "accuracy", "residency", "recall_study", "kernel_compare",
                 "train_model", "scale", "configs/quickstart.gin",
                 "configs/experiments/accuracy.gin", "configs/experiments/train.gin"):
        assert name in out
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    out = capsys.readouterr().out
    assert "--gin.NAME=VALUE" in out and "--gin.quickstart.implementation=\"'triton'\"" in out


def test_npz_loader_rejects_text_directly(tmp_path):
    from experiments.recall_study import load_npz

    path = tmp_path / "t.npz"
    path.write_text("hello\n")
    with pytest.raises(ValueError, match="not an .npz archive"):
        load_npz(path)
    np.savez(tmp_path / "ok.npz", keys=np.ones((4, 2), np.float32))
    with pytest.raises(ValueError, match="missing array 'queries'"):
        load_npz(tmp_path / "ok.npz")


def test_max_len_bound_in_gin_is_kept_else_fitted_and_recorded():
    import gin

    from lsparse_jax.model import preset

    gin.clear_config()
    validate.reset_derived()
    cfg = validate.fit_model(preset("tiny"), 600, "test")  # unbound: fitted, recorded
    assert cfg.max_len == 640 and validate.derived() == {"model_preset.max_len": 640}
    import experiments.common  # noqa: F401  (registers model_preset)

    validate.reset_derived()
    gin.parse_config("model_preset.max_len = 4096")
    try:  # bound and large enough: the run uses it as given, nothing derived
        assert validate.fit_model(preset("tiny", max_len=4096), 600, "test").max_len == 4096
        assert validate.derived() == {}
        with pytest.raises(validate.ConfigError, match="model_preset.max_len=4096 is too small"):
            validate.fit_model(preset("tiny", max_len=4096), 5000, "test")
    finally:
        gin.clear_config()

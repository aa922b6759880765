"""Trains the small sparse-attention model on NIAH + MRCR and ships its checkpoint.

Gin header -- must be set: run.experiment, run.name, train_model.model.
Run (GPU, minutes): lsparse run configs/experiments/train.gin
Run (CPU smoke):    lsparse run configs/experiments/train.gin --gin.TrainConfig.dense_steps=2 \\
                      --gin.TrainConfig.sparse_steps=2 --gin.TrainConfig.seq_len=512 \\
                      --gin.TrainConfig.batch=4 --gin.TrainConfig.warmup=1 \\
                      --gin.train_model.export=None
                    (~100 s on 2 cores; export=None leaves the shipped checkpoints/small alone)
Writes runs/<name>/{config.gin, results.json (history), loss.png, checkpoint/ (params),
state/ (resumable optimizer state)}; rerunning the same command resumes.
"""

from __future__ import annotations

import dataclasses
import shutil

import gin
import jax

from experiments import validate as v
from experiments.common import pyplot, run_dir, write_results
from lsparse_jax.config import ModelConfig
from lsparse_jax.model.presets import fit_max_len
from lsparse_jax.tasks import TASKS
from lsparse_jax.training import TrainConfig, save_params, train
from lsparse_jax.training.trainer import completed_steps

gin.external_configurable(TrainConfig)


@gin.configurable
def train_model(name: str, model=gin.REQUIRED, config: TrainConfig = gin.REQUIRED,
                export: str | None = None, eval_every: int = 100,
                max_seconds: float | None = None, recipe: str = ""):
    """export: also copy the final params to this directory (e.g. checkpoints/small; a relative
    path resolves against the repository root).
    max_seconds: stop (checkpointed) once a step ends past this many seconds; the run is then
    unfinished (no export; rerunning the same command resumes), e.g. a time-limited GPU call.
    recipe: a sentence recorded in the exported meta.json (what the run is and why)."""
    export, init = check_settings(model, config, export, eval_every, max_seconds)
    out = run_dir(name)
    init_tree = None if init is None else v.load_checkpoint(
        "TrainConfig.init_from", init, fit_max_len(model, config.stage(0)[0]))
    params, history = train(model, config, out, eval_every=eval_every,
                            max_seconds=max_seconds, init_params_tree=init_tree)
    done = completed_steps(out)
    if done < config.total_steps:
        write_results(out, {"complete": False, "completed_steps": done, "history": history})
        print(f"unfinished: {done} of {config.total_steps} steps in {out}/state; rerun the same "
              "command to resume")
        return
    meta = {"preset_fields": dataclasses.asdict(model), "train_config": dataclasses.asdict(config),
            "recipe": recipe, "final": history[-1], "device": jax.devices()[0].device_kind,
            "jax": jax.__version__,
            "stage_seconds": stage_seconds(history)}
    save_params(out / "checkpoint", params, meta)
    if export:
        shutil.rmtree(export, ignore_errors=True)
        shutil.copytree(out / "checkpoint", export)
    write_results(out, {"complete": True, "meta": meta, "history": history})
    plot(history, out / "loss.png", config.dense_steps)
    print(f"wrote {out}/results.json, loss.png and checkpoint/")


def stage_seconds(history) -> dict:
    """{seq_len: seconds} spent per curriculum length (from the logged rows' clocks; a
    resumed run's clock restarts, so each call's first row counts from that call's start)."""
    out, prev = {}, 0.0
    for h in history:
        dt = h["seconds"] - prev if h["seconds"] >= prev else h["seconds"]
        out[str(h.get("seq_len", 0))] = out.get(str(h.get("seq_len", 0)), 0.0) + dt
        prev = h["seconds"]
    return out


def check_settings(model, config, export, eval_every, max_seconds=None):
    """Validates every setting before training starts; returns (the export path or None, the
    init_from checkpoint path or None)."""
    v.instance("train_model.model", model, ModelConfig, "@model_preset()")
    v.instance("train_model.config", config, TrainConfig, "@TrainConfig()")
    v.integer("train_model.eval_every", eval_every)
    for field in ("seq_len", "batch", "warmup", "checkpoint_every"):
        v.integer(f"TrainConfig.{field}", getattr(config, field))
    v.number("train_model.max_seconds", max_seconds, lo=1.0, none_ok=True)
    for field in ("dense_steps", "sparse_steps", "seed", "extra_queries", "mrcr_extra_queries"):
        v.integer(f"TrainConfig.{field}", getattr(config, field), lo=0)
    total = config.dense_steps + config.sparse_steps
    if total < 1 or config.warmup >= total:
        v.fail("TrainConfig.warmup", config.warmup,
               f"must be < dense_steps + sparse_steps = {total} (warm-up, then cosine decay)")
    mix = v.sequence("TrainConfig.mix", config.mix, "(('niah', 0.8), ('mrcr', 0.2))")
    for entry in mix:
        if not (isinstance(entry, (tuple, list)) and len(entry) == 2 and entry[0] in TASKS
                and isinstance(entry[1], (int, float)) and entry[1] > 0):
            v.fail("TrainConfig.mix", config.mix, f"entries are (task, weight > 0) with task in "
                                                  f"{TASKS}, e.g. (('niah', 0.8), ('mrcr', 0.2))")
    # the trainer fits max_len to seq_len: record what runs
    v.derive("model_preset.max_len", fit_max_len(model, config.max_seq_len).max_len)
    init = None if config.init_from is None else v.checkpoint_path("TrainConfig.init_from",
                                                                    config.init_from)
    return (None if export is None else v.resolve_path("train_model.export", export, None)), init


def plot(history, path, dense_steps: int):
    plt = pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    steps = [h["step"] for h in history]
    a.plot(steps, [h["lm"] for h in history], label="LM loss (weighted)")
    a.plot(steps, [h["kl"] for h in history], label="indexer KL")
    a.set_yscale("log")
    a.set_xlabel("step")
    a.axvline(dense_steps, color="gray", ls="--", label="dense -> sparse")
    a.legend()
    for key in sorted({k for h in history for k in h if k.startswith("eval_")}):
        pts = [(h["step"], h[key]) for h in history if key in h]
        b.plot(*zip(*pts), "o-", label=key.removeprefix("eval_") + " exact match (held out)")
    b.axvline(dense_steps, color="gray", ls="--")
    b.set_xlabel("step")
    b.set_ylim(-0.02, 1.02)
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

"""Trains the speculative drafter (model/drafter.py) against the frozen shipped target.

Gin header -- must be set: run.experiment, run.name, train_drafter_model.model,
train_drafter_model.checkpoint.
Run (GPU, minutes): lsparse run configs/experiments/train_drafter.gin
Run (CPU smoke):    lsparse run configs/experiments/train_drafter.gin \\
                      --gin.DrafterTrainConfig.steps=3 --gin.DrafterTrainConfig.warmup=1 \\
                      --gin.DrafterTrainConfig.seq_len=256 --gin.DrafterTrainConfig.batch=2 \\
                      --gin.train_drafter_model.export=None --gin.run.name="'drafter_smoke'"
Writes runs/<name>/{config.gin, results.json (history), checkpoint/ (drafter params and its
DrafterConfig in meta.json), state/ (resumable)}; rerunning the same command resumes.
"""

from __future__ import annotations

import dataclasses
import shutil

import gin
import jax

from experiments import validate as v
from experiments.common import run_dir, write_results
from lsparse_jax.config import DrafterConfig, ModelConfig
from lsparse_jax.training import save_params
from lsparse_jax.training.drafter import DrafterTrainConfig, train_drafter

gin.external_configurable(DrafterConfig)
gin.external_configurable(DrafterTrainConfig)


@gin.configurable
def train_drafter_model(name: str, model=gin.REQUIRED, checkpoint: str = gin.REQUIRED,
                        drafter: DrafterConfig = gin.REQUIRED,
                        config: DrafterTrainConfig = gin.REQUIRED, export: str | None = None,
                        eval_every: int = 100):
    """checkpoint: the frozen target's params; export: also copy the trained drafter there
    (e.g. checkpoints/drafter_small)."""
    v.instance("train_drafter_model.model", model, ModelConfig, "@model_preset()")
    v.instance("train_drafter_model.drafter", drafter, DrafterConfig, "@DrafterConfig()")
    v.instance("train_drafter_model.config", config, DrafterTrainConfig,
               "@DrafterTrainConfig()")
    v.integer("train_drafter_model.eval_every", eval_every)
    try:
        drafter.check(model)
    except ValueError as err:
        raise v.ConfigError(str(err)) from err
    path = v.checkpoint_path("train_drafter_model.checkpoint", checkpoint)
    export = None if export is None else v.resolve_path("train_drafter_model.export", export,
                                                        None)
    params = v.load_checkpoint("train_drafter_model.checkpoint", path, model)
    out = run_dir(name)
    dparams, history = train_drafter(params, model, drafter, config, out,
                                     eval_every=eval_every)
    meta = {"drafter_config": dataclasses.asdict(drafter), "target_checkpoint": str(checkpoint),
            "train_config": dataclasses.asdict(config), "final": history[-1],
            "device": jax.devices()[0].device_kind, "jax": jax.__version__}
    save_params(out / "checkpoint", dparams, meta)
    if export:
        shutil.rmtree(export, ignore_errors=True)
        shutil.copytree(out / "checkpoint", export)
    write_results(out, {"meta": meta, "history": history})
    print(f"wrote {out}/results.json and checkpoint/ (final eval acceptance "
          f"{history[-1].get('eval_acceptance', float('nan')):.2f})")

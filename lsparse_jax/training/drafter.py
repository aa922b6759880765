"""Trains a block drafter (``model.drafter``) against a frozen target by self-distillation.

Each step runs the frozen target over a batch of task sequences (NIAH/MRCR, ``data.py``),
keeping its logits and the hidden states of ``DrafterConfig.target_layers``; then samples
anchors p per sequence (DSpark's recipe): the block [x_p, MASK x gamma] at p attends to the
target features of positions p-W .. p-1 (its window, as the serving ring holds) and to itself,
and its row i learns the target's distribution at position p + i - 1 (soft labels, so the
drafter learns what greedy verification accepts). Resumable with orbax like ``trainer.py``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import pathlib
import time

import jax
import jax.numpy as jnp
import optax

from lsparse_jax.config import DrafterConfig, ModelConfig
from lsparse_jax.model.cache import empty_cache
from lsparse_jax.model.drafter import context_kv, draft_logits, init_drafter, target_io
from lsparse_jax.model.presets import fit_max_len
from lsparse_jax.model.transformer import Transformer
from lsparse_jax.training.data import make_batch
from lsparse_jax.training.trainer import resume


@dataclasses.dataclass(frozen=True)
class DrafterTrainConfig:
    """Attributes:
      seq_len, batch: tokens per sequence and sequences per step.
      steps: optimizer steps; lr, warmup, weight_decay, clip: AdamW, warm-up then cosine.
      anchors: blocks sampled per sequence per step.
      mix: task probabilities, as ``TrainConfig.mix``.
      seed: drafter init and data stream seed (held-out evaluation uses other seeds).
      checkpoint_every: steps between orbax checkpoints (resumable).
    """

    seq_len: int = 1024
    batch: int = 16
    steps: int = 1000
    lr: float = 1e-3
    warmup: int = 50
    weight_decay: float = 0.01
    clip: float = 1.0
    anchors: int = 64
    mix: tuple = (("niah", 0.8), ("mrcr", 0.2))
    seed: int = 0
    checkpoint_every: int = 250

    def __post_init__(self):
        for name in ("seq_len", "batch", "steps", "warmup", "anchors", "checkpoint_every"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"DrafterTrainConfig.{name}={value!r} must be a positive int")
        if self.warmup >= self.steps:
            raise ValueError(f"DrafterTrainConfig.warmup={self.warmup} must be < steps="
                             f"{self.steps}")


def target_outputs(params, cfg: ModelConfig, layers: tuple[int, ...], tokens):
    """The frozen target over sequences [B, n]: (logits [B, n, V], features [B, n, n_L, H])."""
    model = Transformer(cfg, hidden_layers=layers)
    caches = empty_cache(cfg)

    def one(t):
        logits, _, _, feats = model.apply({"params": params}, t, caches, 0, t.shape[0])
        return logits, feats

    logits, feats = jax.vmap(one)(tokens)
    return jax.lax.stop_gradient(logits), jax.lax.stop_gradient(feats)


def block_loss(dparams, dcfg: DrafterConfig, target, tokens, logits, feats, anchors):
    """Distillation loss of one sequence's anchored blocks.

    Notation: n tokens, A anchors, T = gamma + 1, V vocab.
    tokens [n]; logits [n, V] the target's (teacher-forced); feats [n, n_L, H]; anchors [A]
    int32 in [1, n - T].
    Math: for anchor p, q_i = softmax(drafter block at p)[i], t_i = softmax(logits[p + i - 1])
      for i = 1..gamma; loss = mean over anchors and i of CE(t_i, q_i).
    Returns (loss, acceptance length: mean of 1 + sum_i prod_{j<=i} [argmax q_j = argmax t_j],
      the greedy acceptance if the block's prefix were the target's own tokens).
    """
    n = tokens.shape[0]
    pos = jnp.arange(n)
    k, v = context_kv(dparams, dcfg, feats, pos)

    def one(p):
        ok = (pos < p) & (pos >= p - dcfg.window)
        out = draft_logits(dparams, dcfg, target, tokens[p], p, k, v, ok)[1:]
        teacher = jax.lax.dynamic_slice_in_dim(logits, p, dcfg.gamma)
        ce = optax.softmax_cross_entropy(out, jax.nn.softmax(teacher))
        match = jnp.argmax(out, -1) == jnp.argmax(teacher, -1)
        return jnp.mean(ce), 1.0 + jnp.sum(jnp.cumprod(match.astype(jnp.float32)))

    ce, acc = jax.vmap(one)(anchors)
    return jnp.mean(ce), jnp.mean(acc)


def batch_loss(dparams, params, cfg, dcfg, tokens, key, num_anchors: int):
    logits, feats = target_outputs(params, cfg, dcfg.target_layers, tokens)
    n = tokens.shape[1]
    anchors = jax.random.randint(key, (tokens.shape[0], num_anchors), 1, n - dcfg.gamma)
    target = jax.tree.map(jax.lax.stop_gradient, target_io(params))
    loss, acc = jax.vmap(lambda t, lg, f, a: block_loss(dparams, dcfg, target, t, lg, f, a))(
        tokens, logits, feats, anchors)
    return jnp.mean(loss), jnp.mean(acc)


def make_optimizer(tc: DrafterTrainConfig):
    schedule = optax.warmup_cosine_decay_schedule(0.0, tc.lr, tc.warmup, tc.steps, tc.lr / 10)
    return optax.chain(optax.clip_by_global_norm(tc.clip),
                       optax.adamw(schedule, weight_decay=tc.weight_decay))


@functools.partial(jax.jit, static_argnames=("cfg", "dcfg", "tc"), donate_argnums=(0, 1))
def drafter_step(dparams, opt_state, params, cfg: ModelConfig, dcfg: DrafterConfig,
                 tc: DrafterTrainConfig, tokens, key):
    (loss, acc), grads = jax.value_and_grad(batch_loss, has_aux=True)(
        dparams, params, cfg, dcfg, tokens, key, tc.anchors)
    updates, opt_state = make_optimizer(tc).update(grads, opt_state, dparams)
    return optax.apply_updates(dparams, updates), opt_state, {"loss": loss, "acceptance": acc}


@functools.partial(jax.jit, static_argnames=("cfg", "dcfg", "num_anchors"))
def drafter_eval(dparams, params, cfg: ModelConfig, dcfg: DrafterConfig, tokens, key,
                 num_anchors: int):
    return batch_loss(dparams, params, cfg, dcfg, tokens, key, num_anchors)


def train_drafter(params, cfg: ModelConfig, dcfg: DrafterConfig, tc: DrafterTrainConfig,
                  workdir, log=print, eval_every: int = 100, eval_batch: int = 16,
                  stop_at: int | None = None):
    """Trains from scratch, or resumes from ``workdir``'s last checkpoint (target frozen).

    Writes workdir/{state (orbax, resumable), history.json}. Returns (drafter params,
    history: [{step, loss, acceptance, seconds[, eval_loss, eval_acceptance]}], eval_* on
    held-out sequences of the same tasks).
    """
    import orbax.checkpoint as ocp

    dcfg.check(cfg)
    cfg = fit_max_len(cfg, tc.seq_len)
    workdir = pathlib.Path(os.path.abspath(os.fspath(workdir)))
    workdir.mkdir(parents=True, exist_ok=True)
    manager = ocp.CheckpointManager(workdir / "state",
                                    options=ocp.CheckpointManagerOptions(max_to_keep=2))
    dparams = init_drafter(cfg, dcfg, tc.seed)
    opt_state = make_optimizer(tc).init(dparams)
    dparams, opt_state, history, start = resume(manager, workdir, dparams, opt_state, log)
    hist_path = workdir / "history.json"
    mix = dict(tc.mix)
    held_out = jnp.asarray(make_batch(0, eval_batch, tc.seq_len, mix, 1.0, tc.seed,
                                      held_out=True).tokens)
    end = tc.steps if stop_at is None else min(stop_at, tc.steps)
    t0 = time.perf_counter()
    key = jax.random.key(tc.seed + 1)
    for step in range(start, end):
        batch = make_batch(step, tc.batch, tc.seq_len, mix, 1.0, tc.seed + 1)
        dparams, opt_state, aux = drafter_step(dparams, opt_state, params, cfg, dcfg, tc,
                                               jnp.asarray(batch.tokens),
                                               jax.random.fold_in(key, step))
        if step % 10 == 0 or step == tc.steps - 1:
            row = {k: float(v) for k, v in aux.items()}
            row.update(step=step, seconds=time.perf_counter() - t0)
            if step % eval_every == 0 or step == tc.steps - 1:
                loss, acc = drafter_eval(dparams, params, cfg, dcfg, held_out,
                                         jax.random.key(12345), tc.anchors)
                row.update(eval_loss=float(loss), eval_acceptance=float(acc))
                log(f"step {step} loss {row['loss']:.3f} acceptance {row['acceptance']:.2f} "
                    f"eval acceptance {row['eval_acceptance']:.2f} t {row['seconds']:.0f}s")
            history.append(row)
        if (step + 1) % tc.checkpoint_every == 0 or step + 1 == end:
            manager.save(step + 1, args=ocp.args.StandardSave(
                {"params": dparams, "opt_state": opt_state}))
            hist_path.write_text(json.dumps(history) + "\n")
    manager.wait_until_finished()
    hist_path.write_text(json.dumps(history) + "\n")
    return dparams, history


def load_drafter(path):
    """(drafter params, DrafterConfig) from a directory written by ``save_params`` with the
    drafter's config in meta.json["drafter_config"]."""
    from lsparse_jax.training.trainer import _checkpointer

    path = pathlib.Path(os.path.abspath(os.fspath(path)))
    meta_path = path / "meta.json"
    if not (path / "params").is_dir() or not meta_path.exists():
        raise FileNotFoundError(f"load_drafter: no drafter checkpoint at {path}")
    meta = json.loads(meta_path.read_text())
    dcfg = DrafterConfig(**meta["drafter_config"])
    params = _checkpointer().restore(path / "params")
    layers = params["layers"]
    if isinstance(layers, dict):  # orbax stores a list as {"0": .., "1": ..}
        params["layers"] = [layers[k] for k in sorted(layers, key=int)]
    return jax.tree.map(jnp.asarray, params), dcfg


__all__ = ["DrafterTrainConfig", "block_loss", "drafter_step", "load_drafter",
           "target_outputs", "train_drafter"]

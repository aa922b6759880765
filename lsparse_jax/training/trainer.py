"""The training loop: dense warm-up, then sparse training (DeepSeek-V3.2's indexer recipe).

Phase 1 (dense warm-up): CSA layers attend to every eligible compressed entry; the indexer
learns by KL divergence to the attention distribution (its input is detached, so only that
loss trains it). Phase 2 (sparse): CSA layers attend to the indexer's top-k, exactly as in
serving; the indexer's KL is taken over the selected entries. The language-model loss trains
everything else in both phases.
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

from lsparse_jax.config import ModelConfig
from lsparse_jax.model.cache import empty_cache
from lsparse_jax.model.presets import fit_max_len
from lsparse_jax.model.transformer import Transformer, init_params
from lsparse_jax.training.data import make_batch


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Attributes:
      seq_len: training length T (tokens per sequence).
      batch: sequences per step.
      dense_steps, sparse_steps: steps of the dense warm-up and of sparse training.
      lr, warmup, weight_decay, clip: AdamW with linear warm-up then cosine decay to lr / 10.
      answer_weight: loss weight of answer tokens (every other token weighs 1).
      indexer_weight: weight of the indexer KL loss (it only reaches the indexer).
      mix: task probabilities, e.g. (("niah", 0.7), ("mrcr", 0.3)).
      extra_queries: NIAH training sequences ask up to this many more needles (data.py).
      seed: parameter init and data stream seed.
      checkpoint_every: steps between orbax checkpoints (resumable).
      curriculum: length stages ((steps, seq_len, batch), ...) run in order, steps summing to
        dense_steps + sparse_steps; () = every step at (seq_len, batch). Evaluation batches use
        the stage's length.
      init_from: a save_params checkpoint (e.g. "checkpoints/small") the parameters start from
        (the optimizer starts fresh); None = random init from ``seed``.
      mrcr_extra_queries: MRCR training sequences ask up to this many more rounds (data.py);
        0 = the plain task format.
    """

    seq_len: int = 1024
    batch: int = 32
    dense_steps: int = 1000
    sparse_steps: int = 1000
    lr: float = 2e-3
    warmup: int = 100
    weight_decay: float = 0.01
    clip: float = 1.0
    answer_weight: float = 4.0
    indexer_weight: float = 1.0
    mix: tuple = (("niah", 0.7), ("mrcr", 0.3))
    extra_queries: int = 3  # more NIAH question/answer pairs per training sequence
    seed: int = 0
    checkpoint_every: int = 250
    curriculum: tuple = ()
    init_from: str | None = None
    mrcr_extra_queries: int = 0

    def __post_init__(self):
        for name in ("seq_len", "batch", "warmup", "checkpoint_every"):
            if getattr(self, name) <= 0:
                raise ValueError(f"TrainConfig.{name}={getattr(self, name)} must be > 0")
        if self.dense_steps < 0 or self.sparse_steps < 0 or self.total_steps == 0:
            raise ValueError("TrainConfig: dense_steps and sparse_steps must be >= 0, not both 0")
        if self.curriculum:
            for stage in self.curriculum:
                if len(stage) != 3 or any(not isinstance(v, int) or v <= 0 for v in stage):
                    raise ValueError(f"TrainConfig.curriculum: stage {stage!r} must be "
                                     "(steps, seq_len, batch) of positive integers")
            if sum(s[0] for s in self.curriculum) != self.total_steps:
                raise ValueError(f"TrainConfig.curriculum: stage steps sum to "
                                 f"{sum(s[0] for s in self.curriculum)}, not dense_steps + "
                                 f"sparse_steps = {self.total_steps}")

    def stage(self, step: int) -> tuple[int, int]:
        """(seq_len, batch) of training step ``step``."""
        end = 0
        for steps, seq_len, batch in self.curriculum:
            end += steps
            if step < end:
                return seq_len, batch
        return self.seq_len, self.batch

    @property
    def max_seq_len(self) -> int:
        return max([self.seq_len] + [s[1] for s in self.curriculum])

    @property
    def total_steps(self) -> int:
        return self.dense_steps + self.sparse_steps


def loss_fn(params, cfg: ModelConfig, tokens, targets, weights, dense: bool,
            indexer_weight: float):
    """Weighted next-token cross entropy plus the indexers' KL.

    Notation: B sequences of T tokens; L_c CSA layers.
    tokens, targets [B, T] int32; weights [B, T] f32.
    Math: lm = sum w_bt CE(logits_bt, target_bt) / sum w_bt;
      kl = mean over sequences and CSA layers of the per-layer indexer KL;
      loss = lm + indexer_weight * kl (the KL's gradient reaches only the indexers).
    Returns (loss, {"lm", "kl", "accuracy" of answer-weighted argmax}).
    """
    model = Transformer(cfg, dense_selection=dense, indexer_loss=True)
    caches = empty_cache(cfg)
    t_len = tokens.shape[1]

    def one(tok):
        (logits, _, _), state = model.apply({"params": params}, tok, caches, 0, t_len,
                                            mutable=["losses"])
        kls = jax.tree.leaves(state.get("losses", {}))
        kl = jnp.mean(jnp.stack(kls)) if kls else jnp.zeros((), jnp.float32)
        return logits, kl

    logits, kl = jax.vmap(one)(tokens)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    lm = jnp.sum(weights * ce) / jnp.sum(weights)
    kl = jnp.mean(kl)
    return lm + indexer_weight * kl, {"lm": lm, "kl": kl}


def answer_accuracy(logits, targets, answer_mask):
    """Fraction of sequences whose every answer target is the argmax (= greedy exact match:
    greedy decoding reproduces the answer iff each answer token is the argmax given the
    previous ones)."""
    right = (jnp.argmax(logits, -1) == targets) | ~answer_mask
    return jnp.mean(jnp.all(right, axis=-1))


def make_optimizer(tc: TrainConfig):
    schedule = optax.warmup_cosine_decay_schedule(0.0, tc.lr, tc.warmup, tc.total_steps,
                                                  tc.lr / 10)
    return optax.chain(optax.clip_by_global_norm(tc.clip),
                       optax.adamw(schedule, weight_decay=tc.weight_decay))


@functools.partial(jax.jit, static_argnames=("cfg", "tc", "dense"), donate_argnums=(0, 1))
def train_step(params, opt_state, cfg: ModelConfig, tc: TrainConfig, tokens, targets, weights,
               dense: bool):
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    (loss, aux), grads = grad_fn(params, cfg, tokens, targets, weights, dense,
                                 tc.indexer_weight)
    updates, opt_state = make_optimizer(tc).update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    norm = jnp.sqrt(sum(jnp.sum(jnp.square(g)) for g in jax.tree.leaves(grads)))
    return params, opt_state, dict(aux, loss=loss, grad_norm=norm)


@functools.partial(jax.jit, static_argnames=("cfg",))
def eval_logits(params, cfg: ModelConfig, tokens):
    """Teacher-forced logits [B, T, V] with sparse selection (the serving computation)."""
    model = Transformer(cfg)
    caches = empty_cache(cfg)
    return jax.vmap(lambda t: model.apply({"params": params}, t, caches, 0, t.shape[0])[0])(
        tokens)


def _checkpointer():
    import orbax.checkpoint as ocp  # lazy: slow to import

    return ocp.PyTreeCheckpointer()


def save_params(path, params, meta: dict | None = None) -> None:
    """Writes params (f32 pytree) to the orbax directory ``path`` and meta as meta.json."""
    path = pathlib.Path(os.path.abspath(os.fspath(path)))
    _checkpointer().save(path / "params", jax.device_get(params), force=True)
    if meta is not None:
        (path / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")


def load_params(path, cfg: ModelConfig | None = None):
    """Params from a ``save_params`` directory; with ``cfg``, checked against its shapes."""
    path = pathlib.Path(os.path.abspath(os.fspath(path)))
    if not (path / "params").is_dir():
        raise FileNotFoundError(f"load_params: no checkpoint at {path}/params")
    params = _checkpointer().restore(path / "params")
    if cfg is not None:
        want = jax.tree.map(lambda x: (x.shape, x.dtype), jax.eval_shape(lambda: init_params(cfg)))
        got = jax.tree.map(lambda x: (x.shape, x.dtype), params)
        if jax.tree.structure(want) != jax.tree.structure(got) or want != got:
            raise ValueError(f"load_params: the checkpoint at {path} does not match the model "
                             "config (different parameter names or shapes)")
    return jax.tree.map(jnp.asarray, params)


def resume(manager, workdir, params, opt_state, log):
    """(params, opt_state, history, start): the newest state ``manager`` saved (with the
    history of workdir/history.json before it) or, if none, the given ones at step 0."""
    import orbax.checkpoint as ocp

    start = manager.latest_step()
    if start is None:
        return params, opt_state, [], 0
    restored = manager.restore(start, args=ocp.args.StandardRestore(
        {"params": params, "opt_state": opt_state}))
    hist_path = pathlib.Path(workdir) / "history.json"
    history = ([h for h in json.loads(hist_path.read_text()) if h["step"] < start]
               if hist_path.exists() else [])
    log(f"resumed from step {start} in {workdir}")
    return restored["params"], restored["opt_state"], history, start


def completed_steps(workdir) -> int:
    """Training steps the orbax state in ``workdir`` holds (0 when none)."""
    import orbax.checkpoint as ocp

    state = pathlib.Path(os.path.abspath(os.fspath(workdir))) / "state"
    if not state.is_dir():
        return 0
    return ocp.CheckpointManager(state).latest_step() or 0


def train(cfg: ModelConfig, tc: TrainConfig, workdir, progress: bool = True,
          eval_every: int = 100, eval_batch: int = 64, log=print, stop_at: int | None = None,
          max_seconds: float | None = None, init_params_tree=None):
    """Trains from scratch (or from ``tc.init_from``), or resumes from ``workdir``'s last
    checkpoint.

    stop_at: stop after this many steps (checkpointed; a later call resumes), e.g. to split a
    run across time-limited jobs. The schedule always spans ``tc.total_steps``.
    max_seconds: stop (checkpointed) after the first step that ends past this many seconds of
    this call, so a time-limited job exits cleanly; ``completed_steps(workdir)`` then tells
    whether the run is finished.
    init_params_tree: the parameters ``tc.init_from`` names, already loaded (else loaded here).

    Writes workdir/{state (orbax, resumable), history.json}. Returns (params, history):
    history is a list of {step, phase, seq_len, loss, lm, kl, grad_norm, seconds[, eval_<task>]}
    (eval_<task>: greedy exact match on a fixed batch of held-out examples at the stage's
    length, sparse model; eval_batch is scaled by 1024 / seq_len, at least 8).
    """
    import orbax.checkpoint as ocp
    from tqdm.auto import tqdm

    t0 = time.perf_counter()
    cfgs = {}  # seq_len -> the model with max_len fitted (one compile per stage length)

    def model_for(seq_len):
        if seq_len not in cfgs:
            cfgs[seq_len] = fit_max_len(cfg, seq_len)
        return cfgs[seq_len]

    workdir = pathlib.Path(os.path.abspath(os.fspath(workdir)))
    workdir.mkdir(parents=True, exist_ok=True)
    manager = ocp.CheckpointManager(workdir / "state",
                                    options=ocp.CheckpointManagerOptions(max_to_keep=2))
    first = model_for(tc.stage(0)[0])
    if init_params_tree is not None:
        params = init_params_tree
    elif tc.init_from:
        params = load_params(tc.init_from, first)
    else:
        params = init_params(first, tc.seed)
    opt_state = make_optimizer(tc).init(params)
    params, opt_state, history, start = resume(manager, workdir, params, opt_state, log)
    hist_path = workdir / "history.json"
    mix = dict(tc.mix)
    evals = {}  # seq_len -> {task: held-out batch} (evaluation seeds)

    def eval_batches(seq_len):
        if seq_len not in evals:
            n = max(8, eval_batch * 1024 // seq_len)
            evals[seq_len] = {task: make_batch(0, n, seq_len, {task: 1.0}, tc.answer_weight,
                                               tc.seed, held_out=True) for task in mix}
        return evals[seq_len]

    end = tc.total_steps if stop_at is None else min(stop_at, tc.total_steps)
    bar = tqdm(range(start, end), initial=start, total=tc.total_steps,
               desc="train", unit="step", disable=not progress)
    for step in bar:
        dense = step < tc.dense_steps
        seq_len, batch = tc.stage(step)
        mcfg = model_for(seq_len)
        b = make_batch(step, batch, seq_len, mix, tc.answer_weight, tc.seed,
                       extra_queries=tc.extra_queries, mrcr_extra_queries=tc.mrcr_extra_queries)
        params, opt_state, aux = train_step(params, opt_state, mcfg, tc, jnp.asarray(b.tokens),
                                            jnp.asarray(b.targets), jnp.asarray(b.weights),
                                            dense)
        last = step == tc.total_steps - 1
        stage_end = tc.curriculum and tc.stage(step + 1) != (seq_len, batch)
        if step % 10 == 0 or last or stage_end:
            row = {k: float(v) for k, v in aux.items()}
            row.update(step=step, phase="dense" if dense else "sparse", seq_len=seq_len,
                       seconds=time.perf_counter() - t0)
            if step % eval_every == 0 or last or stage_end:
                for task, eb in eval_batches(seq_len).items():
                    logits = eval_logits(params, mcfg, jnp.asarray(eb.tokens))
                    row[f"eval_{task}"] = float(answer_accuracy(
                        logits, jnp.asarray(eb.targets), jnp.asarray(eb.answer_mask)))
                log(f"step {step} {row['phase']} T={seq_len} loss {row['loss']:.3f} "
                    f"lm {row['lm']:.3f} kl {row['kl']:.3f} " + " ".join(
                        f"{k} {v:.3f}" for k, v in row.items() if k.startswith("eval_"))
                    + f" t {row['seconds']:.0f}s")
            history.append(row)
            bar.set_postfix(loss=f"{row['loss']:.3f}", kl=f"{row['kl']:.3f}")
        out_of_time = max_seconds is not None and time.perf_counter() - t0 > max_seconds
        if (step + 1) % tc.checkpoint_every == 0 or step + 1 == end or out_of_time:
            manager.save(step + 1, args=ocp.args.StandardSave(
                {"params": params, "opt_state": opt_state}))
            hist_path.write_text(json.dumps(history) + "\n")
        if out_of_time and step + 1 < end:
            log(f"stopping at step {step + 1} of {tc.total_steps} after "
                f"{time.perf_counter() - t0:.0f} s (max_seconds={max_seconds}); rerun to resume")
            break
    manager.wait_until_finished()
    hist_path.write_text(json.dumps(history) + "\n")
    return params, history


__all__ = ["TrainConfig", "train", "completed_steps", "train_step", "loss_fn", "eval_logits",
           "answer_accuracy", "save_params", "load_params"]

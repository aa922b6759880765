"""Trains the small target model on the synthetic tasks (optax, orbax checkpoints)."""

from lsparse_jax.training.data import TRAIN_SEED_BASE, Batch, make_batch
from lsparse_jax.training.trainer import TrainConfig, load_params, loss_fn, save_params, train

__all__ = ["TRAIN_SEED_BASE", "Batch", "make_batch", "TrainConfig", "train", "loss_fn",
           "load_params", "save_params"]

"""Synthetic long-context tasks over byte tokens."""

from __future__ import annotations

import numpy as np

from lsparse_jax.tasks import tokenizer
from lsparse_jax.tasks.mrcr import MrcrExample, mrcr_example
from lsparse_jax.tasks.niah import NiahExample, niah_example
from lsparse_jax.tasks.scoring import score_exact, score_similarity

TASKS = ("niah", "mrcr")


def example(task: str, length: int, seed: int,
            num_needles: int | None = None) -> NiahExample | MrcrExample:
    """One prompt/answer pair (``.prompt``: [length] int32 byte tokens, ``.answer``: str) of
    ``task``, e.g. for training batches.

    "niah": ``niah_example(length, num_needles=n, seed=seed, value_digits=4)`` with
    ``n = num_needles``, or when None ``1 + np.random.default_rng(seed).integers(4)`` (1..4).
    "mrcr": ``mrcr_example(length, seed=seed)`` (default 4 rounds, 2 of them similar).
    """
    if task == "niah":
        n = num_needles or 1 + int(np.random.default_rng(seed).integers(4))
        return niah_example(length, num_needles=n, seed=seed, value_digits=4)
    if task == "mrcr":
        return mrcr_example(length, seed=seed)
    raise ValueError(f"example: unknown task={task!r}, expected one of {TASKS}")


__all__ = ["tokenizer", "NiahExample", "niah_example", "MrcrExample", "mrcr_example",
           "score_exact", "score_similarity", "example", "TASKS"]

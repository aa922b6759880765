"""Synthetic long-context tasks over byte tokens."""

from lsparse_jax.tasks import tokenizer
from lsparse_jax.tasks.niah import NiahExample, niah_example, score_exact

__all__ = ["tokenizer", "NiahExample", "niah_example", "score_exact"]

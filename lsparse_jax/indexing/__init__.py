"""Indexer scoring and selection."""

from lsparse_jax.indexing.scores import index_scores
from lsparse_jax.indexing.topk import topk_positions

__all__ = ["index_scores", "topk_positions"]

"""Indexer scoring and selection (math only: no model, no stores)."""

from lsparse_jax.indexing.scores import index_scores
from lsparse_jax.indexing.topk import topk_positions

__all__ = ["index_scores", "topk_positions"]

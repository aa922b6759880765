"""Indexer scoring and selection."""

from lsparse_jax.indexing.scores import index_scores
from lsparse_jax.indexing.topk import topk_positions

__all__ = ["index_scores", "topk_positions", "calibrate_codebooks"]


def __getattr__(name):  # lazy: calibrate imports the model, which imports this package
    if name == "calibrate_codebooks":
        from lsparse_jax.indexing.calibrate import calibrate_codebooks

        return calibrate_codebooks
    raise AttributeError(name)

"""Exact lightning-indexer scores (defined beside the ``index_scores`` op's XLA reference)."""

from pallas_kernels.index_scores.reference import exact_index_scores as index_scores

__all__ = ["index_scores"]

"""Offline PQ codebook training from a model's own indexer keys (per CSA layer)."""

from __future__ import annotations

from lsparse_jax.config import ModelConfig
from lsparse_jax.indexing.traces import indexer_traces
from lsparse_jax.quant.pq import train_codebooks


def calibrate_codebooks(params, cfg: ModelConfig, tokens, *, subspace_dim: int = 4,
                        num_centroids: int = 256, iters: int = 20, seed: int = 0) -> dict:
    """Runs the model over calibration ``tokens`` (use text the evaluation never sees) and
    trains one codebook per CSA layer on the dequantized FP8 keys its indexer stored.
    Returns {layer: [M, K, subspace_dim]} with M = indexer head_dim / subspace_dim and
    K = min(num_centroids, keys available)."""
    books = {}
    for trace in indexer_traces(params, cfg, tokens):
        k = min(num_centroids, trace.keys.shape[0])
        books[trace.layer] = train_codebooks(trace.keys, cfg.indexer.head_dim // subspace_dim,
                                             k, iters=iters, seed=seed + trace.layer)
    return books

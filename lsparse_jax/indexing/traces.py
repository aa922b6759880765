"""Indexer traces: the queries, head weights and stored keys a model's indexers produce.

Used by the recall study (and by anyone who wants to dump real indexer inputs to .npz).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from lsparse_jax.config import ModelConfig
from lsparse_jax.model.cache import CSACache, empty_cache
from lsparse_jax.model.transformer import Transformer
from lsparse_jax.quant import dequantize_index_keys


@dataclasses.dataclass(frozen=True)
class IndexerTrace:
    layer: int
    queries: np.ndarray  # [T, H, D] f32 indexer queries of every token
    weights: np.ndarray  # [T, H] f32 head weights
    keys: np.ndarray  # [N, D] f32 dequantized FP8 keys of every completed compressed entry
    lengths: np.ndarray  # [T] int32 eligible entries for each query: (t + 1) // m


def indexer_traces(params, cfg: ModelConfig, tokens) -> list[IndexerTrace]:
    """One teacher-forced forward over ``tokens``; a trace per CSA layer."""
    tokens = jnp.asarray(tokens, jnp.int32)
    n = tokens.shape[0]

    @jax.jit
    def run(params, tokens):
        (_, caches, _), inter = Transformer(cfg).apply(
            {"params": params}, tokens, empty_cache(cfg), 0, n, mutable=["intermediates"])
        return caches, inter["intermediates"]

    caches, inter = run(params, tokens)
    traces = []
    for i, cache in enumerate(caches):
        if not isinstance(cache, CSACache):
            continue
        got = inter[f"block_{i}"]["attn"]
        done = n // cfg.csa_ratio
        keys = dequantize_index_keys(cache.keys.values[:done], cache.keys.scales[:done])
        traces.append(IndexerTrace(
            layer=i, queries=np.asarray(got["indexer_q"][0]),
            weights=np.asarray(got["indexer_w"][0]), keys=np.asarray(keys),
            lengths=(np.arange(n, dtype=np.int32) + 1) // cfg.csa_ratio))
    return traces

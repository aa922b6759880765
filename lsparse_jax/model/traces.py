"""Indexer traces: the queries, head weights and stored keys a model's indexers produce.

Used by the recall study, codebook calibration, and anyone who wants to dump real indexer
inputs to .npz.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from lsparse_jax.config import ModelConfig
from lsparse_jax.model.cache import empty_cache
from lsparse_jax.model.transformer import Transformer
from lsparse_jax.quant import dequantize_index_keys


@dataclasses.dataclass(frozen=True)
class IndexerTrace:
    layer: int
    queries: np.ndarray  # [T, H, D] f32 indexer queries of every token
    weights: np.ndarray  # [T, H] f32 head weights
    keys: np.ndarray  # [N, D] f32 dequantized FP8 keys of every completed compressed entry
    #   (DSA leaders: of every token)
    lengths: np.ndarray  # [T] int32 eligible entries for each query: (t + 1) // m (DSA: t + 1)


@functools.partial(jax.jit, static_argnames=("cfg",))
def _trace_chunk(params, cfg: ModelConfig, caches, tokens, start, num_valid):
    (_, caches, _), inter = Transformer(cfg).apply(
        {"params": params}, tokens, caches, start, num_valid, mutable=["intermediates"])
    got = {i: (inter["intermediates"][f"block_{i}"]["attn"]["indexer_q"][0],
               inter["intermediates"][f"block_{i}"]["attn"]["indexer_w"][0])
           for i in cfg.indexer_layers}
    return caches, got


def indexer_traces(params, cfg: ModelConfig, tokens, chunk: int = 512) -> list[IndexerTrace]:
    """A teacher-forced forward over ``tokens`` in prefill chunks (memory linear in the
    prompt; chunking is invisible to the model); a trace per indexer layer (CSA layers and DSA
    group leaders)."""
    tokens = np.asarray(tokens, np.int32)
    n = len(tokens)
    padded = np.pad(tokens, (0, -n % chunk))
    caches, qs, ws = empty_cache(cfg), {}, {}
    for start in range(0, n, chunk):
        valid = min(chunk, n - start)
        caches, got = _trace_chunk(params, cfg, caches, jnp.asarray(padded[start:start + chunk]),
                                   start, valid)
        for i, (q, w) in got.items():
            qs.setdefault(i, []).append(np.asarray(q)[:valid])
            ws.setdefault(i, []).append(np.asarray(w)[:valid])
    def trace(i):
        m = cfg.csa_ratio if cfg.layer_pattern[i] == "csa" else 1  # DSA: a key per token
        done, keys = n // m, caches[i].keys
        return IndexerTrace(layer=i, queries=np.concatenate(qs[i]), weights=np.concatenate(ws[i]),
                            keys=np.asarray(dequantize_index_keys(keys.values[:done],
                                                                  keys.scales[:done])),
                            lengths=(np.arange(n, dtype=np.int32) + 1) // m)

    return [trace(i) for i in sorted(qs)]

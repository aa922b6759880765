"""The sparse-attention transformer: embedding, blocks, final norm, LM head."""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from lsparse_jax.config import ModelConfig
from lsparse_jax.model.blocks import Block
from lsparse_jax.model.cache import empty_cache
from lsparse_jax.model.layers import RMSNorm, dense, matmul_precision
from lsparse_jax.model.store import (
    RESIDENT_DSA,
    RESIDENT_KV,
    RESIDENT_ROWS,
    DSAStores,
    KeyIndex,
    KVStore,
)


class Transformer(nn.Module):
    """Maps a chunk of tokens and one slot's caches to logits and updated caches.

    ``__call__(tokens [T] int32, caches, start, num_valid, contexts)`` ->
      (logits [T, V] f32, caches, selections: tuple of Selection | None per layer), and with
      ``hidden_layers`` a 4th output: the residual stream after each of those layers
      [T, len(hidden_layers), hidden] (a drafter's conditioning, ``model.drafter``).
    Tokens past ``num_valid`` are padding: they write nothing and their logits are junk.
    CSA layers keep their compressed history in ``kv_store`` / ``key_index`` (``model.store``;
    default: resident); ``contexts`` gives each layer what its stores read from shared state
    (a serving method's per-slot view; None per layer, or None for all).
    """

    cfg: ModelConfig
    dense_selection: bool = False
    implementation: str | None = "xla"  # kernel implementation (pallas_kernels api switch)
    indexer_loss: bool = False  # training: CSA layers sow "losses"/"indexer_kl"
    kv_store: KVStore = RESIDENT_KV
    key_index: KeyIndex | None = None  # None: every key resident, exact top-k
    hca_store: Any = RESIDENT_ROWS  # where HCA layers keep their rows (default: resident)
    dsa_stores: DSAStores = RESIDENT_DSA  # where DSA layers keep rows and keys (resident)
    hidden_layers: tuple[int, ...] = ()  # also return the residual stream after these layers
    #   (a drafter's conditioning, model/drafter.py): a 4th output [T, len, hidden]

    @nn.compact
    def __call__(self, tokens, caches, start, num_valid, contexts=None):
        cfg = self.cfg
        x = self.embedding("embed")(tokens)
        new_caches, selections, hidden = [], [], {}
        for i in range(cfg.num_layers):
            x, c, sel = self.block(i, f"block_{i}")(
                x, caches[i], start, num_valid, shared_selection(cfg, i, selections),
                None if contexts is None else contexts[i])
            new_caches.append(c)
            selections.append(sel)
            hidden[i] = x
        logits = head(cfg, x)
        if self.hidden_layers:
            feats = jnp.stack([hidden[i] for i in self.hidden_layers], axis=1)
            return logits, tuple(new_caches), tuple(selections), feats
        return logits, tuple(new_caches), tuple(selections)

    @nn.nowrap
    def embedding(self, name: str | None = None) -> nn.Embed:
        """The token embedding (params "embed")."""
        return nn.Embed(self.cfg.vocab_size, self.cfg.hidden, name=name,
                        embedding_init=nn.initializers.normal(1.0))

    @nn.nowrap
    def block(self, i: int, name: str | None = None) -> Block:
        """Layer i's Block as this model builds it (params f"block_{i}")."""
        indexer_loss = self.indexer_loss and self.cfg.layer_pattern[i] == "csa"
        return Block(self.cfg, i, self.dense_selection, self.implementation, indexer_loss,
                     self.kv_store, self.key_index, self.hca_store, self.dsa_stores,
                     name=name)


def shared_selection(cfg: ModelConfig, i: int, selections):
    """The Selection layer i reuses (a DSA group member: its leader's, from ``selections`` of
    the layers before it), else None."""
    if cfg.layer_pattern[i] == "dsa" and cfg.dsa_leader(i) != i:
        return selections[cfg.dsa_leader(i)]
    return None


def head(cfg: ModelConfig, x):
    """Final norm and LM head: x [T, hidden] -> logits [T, V]. Builds its modules
    ("final_norm", "lm_head") in the calling compact scope (``Transformer``, ``Head``)."""
    x = RMSNorm(name="final_norm")(x)
    with matmul_precision(cfg.matmul_precision):
        return dense(cfg.vocab_size, "lm_head")(x)


class Head(nn.Module):
    """A Transformer's ``head`` alone: ``Head(cfg).apply({"params": transformer params}, x)``."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self, x):
        return head(self.cfg, x)


def serving_params(params, cfg: ModelConfig):
    """``params`` as serving stores them (``ModelConfig.weight_dtype``): with "bf16" every
    Dense kernel (the model's matmul weights, leaves named "kernel") cast to bfloat16; the
    embedding table, norm scales and other parameters stay f32. Idempotent."""
    if cfg.weight_dtype == "f32":
        return params

    def cast(path, leaf):
        named = getattr(path[-1], "key", None) == "kernel"
        return leaf.astype(jnp.bfloat16) if named and leaf.dtype == jnp.float32 else leaf

    return jax.tree_util.tree_map_with_path(cast, params)


def init_params(cfg: ModelConfig, seed: int = 0):
    """Random parameters of the model ``cfg`` from an integer seed."""
    return _init_params(cfg, jax.random.key(seed))


@functools.partial(jax.jit, static_argnums=0)
def _init_params(cfg: ModelConfig, key):
    # one compiled program: flax's init runs the forward once for the shapes; eagerly that is
    # hundreds of single-op compiles (most of a CPU test's time), under jit the forward and its
    # empty cache are dead code
    tokens = jnp.zeros((cfg.csa_ratio,), jnp.int32)
    variables = Transformer(cfg).init(key, tokens, empty_cache(cfg), 0, cfg.csa_ratio)
    return variables["params"]

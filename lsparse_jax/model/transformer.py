"""The sparse-attention transformer: embedding, blocks, final norm, LM head."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from lsparse_jax.config import LeanSparseConfig, ModelConfig
from lsparse_jax.model.blocks import Block
from lsparse_jax.model.cache import empty_cache
from lsparse_jax.model.layers import RMSNorm, dense


class Transformer(nn.Module):
    """Maps a chunk of tokens and one slot's caches to logits and updated caches.

    ``__call__(tokens [T] int32, caches, start, num_valid, hosts)`` ->
      (logits [T, V] f32, caches, selections: tuple of Selection | None per layer).
    Tokens past ``num_valid`` are padding: they write nothing and their logits are junk.
    ``hosts`` (decode over paged KV): per layer a ``HostView`` or None.
    """

    cfg: ModelConfig
    dense_selection: bool = False
    lean: LeanSparseConfig | None = None  # leansparse decode: coarse-to-fine settings
    implementation: str | None = "xla"  # kernel implementation (pallas_kernels api switch)
    indexer_loss: bool = False  # training: CSA layers sow "losses"/"indexer_kl"

    @nn.compact
    def __call__(self, tokens, caches, start, num_valid, hosts=None):
        cfg = self.cfg
        x = nn.Embed(cfg.vocab_size, cfg.hidden, name="embed",
                     embedding_init=nn.initializers.normal(1.0))(tokens)
        new_caches, selections = [], []
        for i in range(cfg.num_layers):
            shared = None
            if cfg.layer_pattern[i] == "dsa" and cfg.dsa_leader(i) != i:
                shared = selections[cfg.dsa_leader(i)]
            indexer_loss = self.indexer_loss and cfg.layer_pattern[i] == "csa"
            x, c, sel = Block(cfg, i, self.dense_selection, self.lean, self.implementation,
                              indexer_loss, name=f"block_{i}")(
                x, caches[i], start, num_valid, shared, None if hosts is None else hosts[i])
            new_caches.append(c)
            selections.append(sel)
        x = RMSNorm(name="final_norm")(x)
        logits = dense(cfg.vocab_size, "lm_head")(x)
        return logits, tuple(new_caches), tuple(selections)


def init_params(cfg: ModelConfig, seed: int = 0):
    """Random parameters of the model ``cfg`` from an integer seed."""
    model = Transformer(cfg)
    tokens = jnp.zeros((cfg.csa_ratio,), jnp.int32)
    variables = model.init(jax.random.key(seed), tokens, empty_cache(cfg), 0, cfg.csa_ratio)
    return variables["params"]

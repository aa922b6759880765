"""The native sparse-attention model family (Flax)."""

from lsparse_jax.model.blocks import AttentionLayer, Indexer, Selection
from lsparse_jax.model.cache import empty_cache
from lsparse_jax.model.presets import PRESETS, preset
from lsparse_jax.model.transformer import Transformer, init_params, serving_params

__all__ = ["AttentionLayer", "Indexer", "Selection", "Transformer", "empty_cache",
           "init_params", "PRESETS", "preset", "serving_params"]

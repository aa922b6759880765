"""The decode state pytree: every cache of every slot, plus lengths and the sampling key."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from lsparse_jax.config import ModelConfig
from lsparse_jax.model.cache import LayerCache, empty_cache


@struct.dataclass
class DecodeState:
    caches: tuple[LayerCache, ...]  # per layer; every array has a leading slot axis [S, ...]
    lengths: jnp.ndarray  # [S] int32 tokens each slot holds (prompt + generated)
    rng: jnp.ndarray  # PRNG key for temperature sampling

    @property
    def num_slots(self) -> int:
        return self.lengths.shape[0]


def empty_state(cfg: ModelConfig, num_slots: int, seed: int = 0) -> DecodeState:
    one = empty_cache(cfg)
    caches = jax.tree.map(lambda a: jnp.broadcast_to(a, (num_slots,) + a.shape), one)
    return DecodeState(caches=caches, lengths=jnp.zeros((num_slots,), jnp.int32),
                       rng=jax.random.key(seed))


def slot_bytes(state: DecodeState) -> int:
    """GPU bytes of one slot's caches in this state (every array is per slot)."""
    return sum(a.nbytes // state.num_slots for a in jax.tree.leaves(state.caches))


def insert(state: DecodeState, slot, caches: tuple[LayerCache, ...], length) -> DecodeState:
    """Puts one request's caches (no slot axis) into ``slot``."""
    new = jax.tree.map(lambda big, one: big.at[slot].set(one), state.caches, caches)
    return state.replace(caches=new, lengths=state.lengths.at[slot].set(length))

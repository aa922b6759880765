"""The decode state pytree: every slot's caches, lengths, the sampling key, and the state the
serving method shares across slots (its ``tier``)."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from lsparse_jax.config import EngineConfig
from lsparse_jax.methods import policy
from lsparse_jax.methods.base import Grant, insert
from lsparse_jax.model.cache import LayerCache
from lsparse_jax.parallel import engine_mesh, replicate


@struct.dataclass
class DecodeState:
    caches: tuple[LayerCache, ...]  # per layer; every array has a leading slot axis [S, ...];
    #   CSA layers hold the method's stores' state (``Method.kv_store`` / ``key_index``)
    lengths: jnp.ndarray  # [S] int32 tokens each slot holds (prompt + generated)
    rng: jnp.ndarray  # PRNG key for temperature sampling
    tier: Any  # the method's shared state (``Method.empty_tier``: host pools, page tables,
    #   codebooks, lent pages, device pools; ``NoTier`` for resident without device pools)

    @property
    def num_slots(self) -> int:
        return self.lengths.shape[0]


def empty_state(engine: EngineConfig, codebooks: dict | None = None) -> DecodeState:
    """Empty (NaN-poisoned) slots and the method's empty shared state; leansparse needs
    per-CSA-layer codebooks ({layer: [M, K, D_I/M]})."""
    method = policy(engine)
    slots = engine.cache.num_slots
    caches = jax.tree.map(lambda a: jnp.broadcast_to(a, (slots,) + a.shape), method.empty_slot())
    state = DecodeState(caches=caches, lengths=jnp.zeros((slots,), jnp.int32),
                        rng=jax.random.key(engine.sampling.seed),
                        tier=method.empty_tier(codebooks))
    # Commit every array to its memory now: jitted steps return committed arrays, and a jit
    # called with uncommitted inputs first would compile a second time. With tp > 1 every
    # device holds a copy (the state has no head axis: ``lsparse_jax.parallel``).
    mesh = engine_mesh(engine)
    if mesh is not None:
        return replicate(state, mesh)
    return jax.tree.map(lambda a: jax.device_put(a, a.sharding), state)


def slot_bytes(engine: EngineConfig, state: DecodeState) -> int:
    """Device bytes of one slot in this state: its caches and its rows of the method's
    per-slot maps (page table, ready map)."""
    per_slot = jax.tree.leaves(state.caches) + jax.tree.leaves(
        policy(engine).slot_rows(state.tier))
    return sum(a.nbytes // state.num_slots for a in per_slot)


@functools.partial(jax.jit, static_argnames=("engine",), donate_argnames=("state",))
def admit(engine: EngineConfig, state: DecodeState, slot, caches, length,
          grant: Grant) -> DecodeState:
    """Puts one prefilled request (resident caches, no slot axis) into ``slot`` as the method
    stores it (``Method.admit``)."""
    return policy(engine).admit(state, slot, caches, length, grant)


@functools.partial(jax.jit, static_argnames=("engine", "layer"), donate_argnames=("state",))
def admit_layer(engine: EngineConfig, state: DecodeState, slot, layer: int, cache: LayerCache,
                length, grant: Grant) -> DecodeState:
    """One layer of ``admit``: layer ``layer``'s finished resident cache (no slot axis) into
    ``slot`` as the method stores it (``Method.admit_one``), as soon as a layer-streamed
    prefill finishes it. ``admit_layer`` for every layer, then ``admit_done``, equals
    ``admit`` bit for bit (the same functions, one layer at a time)."""
    return policy(engine).admit_one(state, slot, layer, cache, length, grant)


@functools.partial(jax.jit, static_argnames=("engine",), donate_argnames=("state",))
def admit_done(engine: EngineConfig, state: DecodeState, slot, length,
               grant: Grant) -> DecodeState:
    """The end of a layer-by-layer admission: the slot's page tables and length."""
    return policy(engine).admit_done(state, slot, length, grant)


__all__ = ["DecodeState", "admit", "admit_done", "admit_layer", "empty_state", "insert",
           "slot_bytes"]

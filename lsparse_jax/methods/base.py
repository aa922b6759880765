"""The serving-method policy type: one value per method, passed to the same engine.

A method decides where a CSA layer's compressed KV and indexer keys live and how the top-k is
selected from them (its ``kv_store`` and ``key_index``, which the model calls), what state it
shares across slots (its ``tier``: host pools, page tables, codebooks) and how a prefilled
request enters a slot (``admit``). Those are the data plane: pure functions of the decode state,
traced under jit with the method as a static argument. Its ``controller`` is the control plane:
host-side bookkeeping (free pages, lent pages) that says what an admission needs and which
jitted updates a release, the next step or the last step's completed pages must run.

The base class is the ``resident`` method: every row and key on the device. A new method is a
subclass in a module of its own, registered by name with ``register``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, ClassVar

import jax
from flax import struct

from lsparse_jax.config import EngineConfig, Storage, invalid, register_method
from lsparse_jax.model.cache import LayerCache, empty_cache
from lsparse_jax.model.store import RESIDENT_KV, ExactIndex, KeyIndex, KVStore

Update = Callable[[Any], Any]  # a jitted function of the decode state, run by the engine

_POLICIES: dict[str, type[Method]] = {}


def register(cls: type[Method]) -> type[Method]:
    """Class decorator: makes ``cls.name`` a valid ``EngineConfig.method``."""
    _POLICIES[cls.name] = cls
    register_method(cls.name, cls.validate, cls.storage)
    return cls


def policy(engine: EngineConfig) -> Method:
    """The policy value serving ``engine.method``."""
    return _POLICIES[engine.method](engine)


@struct.dataclass
class NoTier:
    """Shared state of a method that shares nothing across slots."""


@struct.dataclass
class Grant:
    """What the controller reserved for one admission (passed to ``Method.admit``)."""

    pages: Any = None  # [max_pages] int32 physical host pages, -1 past the reservation (paged)
    lent: Any = None  # [max_pages] int32 optional device page of each logical page, -1 none
    #   (adaptive)


class Controller:
    """Control plane of a method that keeps no host-side bookkeeping."""

    def reserve(self, slot: int, total_tokens: int,
                prompt_tokens: int) -> tuple[Grant, list[Update]]:
        """Reserves what a request of ``total_tokens`` needs, or raises before changing
        anything (``memory.HostCapacityError``). Returns the grant and the state updates to
        run before the admission (e.g. reclaiming other requests' lent pages)."""
        return Grant(), []

    def release(self, slot: int) -> list[Update]:
        """Frees the slot's reservation; returns the state updates that must follow."""
        return []

    def before_step(self) -> list[Update]:
        """State updates to run before the next decode step."""
        return []

    def after_step(self, lengths_before, active) -> list[Update]:
        """State updates to run after a decode step (numpy [S] lengths before it, active)."""
        return []

    def warmup(self, state):
        """Compiles the updates ``before_step`` may return, by running ones that change
        nothing."""
        return state

    def metrics(self, state) -> dict:
        """The controller's figures for ``Engine.metrics``."""
        return {}


@dataclasses.dataclass(frozen=True)
class Method:
    """``resident``: compressed KV and FP8 indexer keys of every slot on the device; exact
    top-k. The reference every other method is compared with."""

    engine: EngineConfig
    name: ClassVar[str] = "resident"
    exact: ClassVar[bool] = True  # selections equal resident's (identity 3)
    storage: ClassVar[Storage] = Storage()  # where KV rows and keys live (memory accounting)

    @classmethod
    def validate(cls, engine: EngineConfig) -> None:
        """Raises ValueError naming a setting this method cannot serve."""
        if (engine.cache.optional_pages is not None) != cls.storage.lent_pages:
            invalid("EngineConfig", "cache.optional_pages", engine.cache.optional_pages,
                    "the adaptive method needs it (device pages lent to imported history); "
                    "other methods must leave it None")

    # ------------------------------------------------------------------------------ data plane
    def kv_store(self) -> KVStore:
        return RESIDENT_KV

    def key_index(self) -> KeyIndex:
        return ExactIndex(self.engine.model.indexer.top_k)


    def empty_slot(self) -> tuple[LayerCache, ...]:
        """One slot's decode-time caches (no slot axis), NaN poisoned."""
        return empty_cache(self.engine.model, self.kv_store(), self.key_index())

    def empty_tier(self, codebooks: dict | None = None):
        """The state shared by all slots. ``codebooks`` ({CSA layer: [M, K, D_I/M]}) serve the
        methods that keep PQ codes; the others ignore them (one set can serve every engine)."""
        return NoTier()

    def slot_rows(self, tier):
        """The tier's per-slot arrays ([S, ...]; mapped over slots in the decode step)."""
        return None

    def contexts(self, tier, rows) -> tuple | None:
        """Per layer, the (kv, keys) contexts one slot's stores read (inside the slot map)."""
        return None

    def admit(self, state, slot, caches: tuple[LayerCache, ...], length, grant: Grant):
        """Puts one prefilled request (resident caches, no slot axis) into ``slot``."""
        return insert(state, slot, caches, length)

    def controller(self) -> Controller:
        return Controller()


def insert(state, slot, caches: tuple[LayerCache, ...], length):
    """The decode state with one request's caches (no slot axis) in ``slot``."""
    new = jax.tree.map(lambda big, one: big.at[slot].set(one), state.caches, caches)
    return state.replace(caches=new, lengths=state.lengths.at[slot].set(length))


__all__ = ["Controller", "Grant", "Method", "NoTier", "Update", "insert", "policy", "register"]

"""The control plane: admits prompts into slots, runs decode steps, collects metrics.

Host-side Python with small numpy bookkeeping; all caches live in the jitted ``DecodeState``.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from lsparse_jax.config import EngineConfig
from lsparse_jax.model.cache import empty_cache
from lsparse_jax.serving.sampling import sample
from lsparse_jax.serving.state import DecodeState, empty_state, insert, slot_bytes
from lsparse_jax.serving.steps import DecodeOutput, decode_step, forward_chunk, prefill


@dataclasses.dataclass
class SelectionStats:
    """Per sparse layer, running sums over decode steps of active slots."""

    steps: int = 0
    eligible: float = 0.0  # eligible positions per query
    selected: float = 0.0  # positions selected per query (<= top-k)
    reused: float = 0.0  # selected positions that the same slot also selected the step before
    reuse_base: float = 0.0  # selected positions of steps that have a previous step

    def as_dict(self) -> dict:
        n = max(self.steps, 1)
        return {"eligible": self.eligible / n, "selected": self.selected / n,
                "reuse_fraction": self.reused / max(self.reuse_base, 1.0)}


class Engine:
    """Serves up to ``config.cache.num_slots`` requests with one jitted decode step."""

    def __init__(self, config: EngineConfig, params):
        self.config, self.params = config, params
        self.state: DecodeState = empty_state(config.model, config.cache.num_slots,
                                              config.sampling.seed)
        slots = config.cache.num_slots
        self.active = np.zeros(slots, bool)
        self.next_token = np.zeros(slots, np.int32)
        self.generated: list[list[int]] = [[] for _ in range(slots)]
        self._prev_sel: np.ndarray | None = None
        self._has_prev = np.zeros(slots, bool)  # slot has a previous decode step's selection
        self.selection = SelectionStats()
        self.prefill_seconds = 0.0
        self.decode_seconds = 0.0
        self.decode_tokens = 0
        self._rng = jax.random.key(config.sampling.seed + 1)

    @property
    def slot_bytes(self) -> int:
        """Device bytes of one slot's caches."""
        return slot_bytes(self.state)

    def warmup(self):
        """Compiles the prefill chunk and the decode step so that timings exclude compilation."""
        cfg, chunk = self.config.model, self.config.cache.prefill_chunk
        jax.block_until_ready(forward_chunk(self.params, cfg, empty_cache(cfg),
                                            jnp.zeros((chunk,), jnp.int32), 0, 0))
        idle = jnp.zeros(self.active.shape, bool)
        copy = jax.tree.map(jnp.copy, self.state)  # the step donates its state
        jax.block_until_ready(decode_step(self.params, self.config, copy,
                                          jnp.asarray(self.next_token), idle))

    def admit(self, prompt, progress=None) -> int:
        """Prefills ``prompt`` into a free slot and samples its first token; returns the slot."""
        free = np.flatnonzero(~self.active)
        if free.size == 0:
            raise RuntimeError(f"admit: all {self.active.size} slots are busy")
        slot = int(free[0])
        t0 = time.perf_counter()
        caches, last = prefill(self.params, self.config.model, prompt,
                               self.config.cache.prefill_chunk, progress)
        self.state = insert(self.state, slot, caches, len(prompt))
        self._rng, key = jax.random.split(self._rng)
        first = int(sample(last[None], key, self.config.sampling.temperature)[0])
        jax.block_until_ready(self.state)
        self.prefill_seconds += time.perf_counter() - t0
        self.active[slot], self.next_token[slot] = True, first
        self.generated[slot] = [first]
        self._has_prev[slot] = False
        return slot

    def release(self, slot: int) -> list[int]:
        self.active[slot] = False
        return self.generated[slot]

    def step(self) -> DecodeOutput:
        """One decode step of every active slot."""
        lengths = np.asarray(self.state.lengths)
        full = self.active & (lengths >= self.config.model.max_len)
        if full.any():
            raise RuntimeError(f"step: slots {np.flatnonzero(full).tolist()} reached "
                               f"max_len={self.config.model.max_len}; release them first")
        t0 = time.perf_counter()
        self.state, out = decode_step(self.params, self.config, self.state,
                                      jnp.asarray(self.next_token), jnp.asarray(self.active))
        tokens = np.asarray(out.tokens)
        self.decode_seconds += time.perf_counter() - t0
        self.decode_tokens += int(self.active.sum())
        self.next_token = np.where(self.active, tokens, self.next_token)
        for s in np.flatnonzero(self.active):
            self.generated[s].append(int(tokens[s]))
        self._record_selection(np.asarray(out.selected), np.asarray(out.eligible))
        return out

    def _record_selection(self, selected: np.ndarray, eligible: np.ndarray):
        act = self.active
        if selected.shape[1] == 0 or not act.any():
            return
        sel = selected[act]  # [A, L, k]
        self.selection.steps += sel.shape[0] * sel.shape[1]
        self.selection.eligible += float(eligible[act].sum())
        self.selection.selected += float((sel >= 0).sum())
        both = act & self._has_prev
        if both.any():
            cur, prev = selected[both], self._prev_sel[both]
            self.selection.reuse_base += float((cur >= 0).sum())
            for cur_row, prev_row in zip(cur.reshape(-1, cur.shape[-1]),
                                         prev.reshape(-1, prev.shape[-1])):
                cur_set = set(cur_row[cur_row >= 0].tolist())
                self.selection.reused += len(cur_set & set(prev_row[prev_row >= 0].tolist()))
        self._prev_sel = selected
        self._has_prev |= act

    def metrics(self) -> dict:
        return {
            "method": self.config.method,
            "prefill_seconds": self.prefill_seconds,
            "decode_tokens": self.decode_tokens,
            "decode_seconds": self.decode_seconds,
            "decode_tokens_per_second": self.decode_tokens / max(self.decode_seconds, 1e-9),
            "device_bytes_per_request": self.slot_bytes,
            "selection": self.selection.as_dict(),
        }

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
from lsparse_jax.memory.host_pool import PageAllocator
from lsparse_jax.memory.hot_cache import NUM_SOURCES
from lsparse_jax.serving.prefill_stream import streamed_prefill
from lsparse_jax.serving.residency import OptionalResidency
from lsparse_jax.serving.sampling import sample
from lsparse_jax.serving.state import (
    DecodeState,
    admit_paged,
    empty_state,
    insert,
    reclaim,
    refill,
    slot_bytes,
)
from lsparse_jax.serving.steps import DecodeOutput, decode_step, prefill


@dataclasses.dataclass
class SelectionStats:
    """Per sparse layer and active slot, running sums over decode steps."""

    steps: int = 0
    eligible: float = 0.0  # eligible positions per query
    selected: float = 0.0  # positions selected per query (<= top-k)
    reused: float = 0.0  # selected positions that the same slot also selected the step before
    reuse_base: float = 0.0  # selected positions of steps that have a previous step
    sources: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(NUM_SOURCES))
    key_sources: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(NUM_SOURCES))

    def as_dict(self, row_bytes: int, key_bytes: int) -> dict:
        n = max(self.steps, 1)
        frac = [float(x) for x in self.sources / max(self.sources.sum(), 1.0)]
        key_frac = [float(x) for x in self.key_sources / max(self.key_sources.sum(), 1.0)]
        names = ("tail_or_resident", "hot_cache", "host_copy")
        return {"eligible": self.eligible / n, "selected": self.selected / n,
                "reuse_fraction": self.reused / max(self.reuse_base, 1.0),
                "resolved_fraction": dict(zip(names, frac)),
                "key_resolved_fraction": dict(zip(("tail_or_resident", "key_cache",
                                                   "host_copy"), key_frac)),
                "host_rows": float(self.sources[2]),
                "host_key_rows": float(self.key_sources[2]),
                "host_bytes": float(self.sources[2]) * row_bytes
                + float(self.key_sources[2]) * key_bytes}


class Engine:
    """Serves up to ``config.cache.num_slots`` requests with one jitted decode step."""

    def __init__(self, config: EngineConfig, params, codebooks: dict | None = None):
        """codebooks: {CSA layer: [M, K, D_I/M]} PQ codebooks, needed by leansparse."""
        self.config, self.params = config, params
        self.state: DecodeState = empty_state(config, codebooks)
        slots = config.cache.num_slots
        self.active = np.zeros(slots, bool)
        self.limit = np.zeros(slots, np.int64)  # tokens each slot may hold (its reservation)
        self.next_token = np.zeros(slots, np.int32)
        self.generated: list[list[int]] = [[] for _ in range(slots)]
        self.pages = PageAllocator(config.host_pages) if config.paged else None
        self.slot_pages: dict[int, list[int]] = {}
        self.residency = None  # adaptive: optional device pages lent to imported history
        if config.adaptive:
            self.residency = OptionalResidency(config.cache.optional_pages,
                                               config.pages_per_slot, config.cache.refill_pages)
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
        tokens = np.zeros(min(chunk + 1, cfg.max_len), np.int32)  # a full and a partial chunk
        jax.block_until_ready(prefill(self.params, cfg, tokens, chunk))
        # An all-idle step writes nothing and selects nothing (only the sampling key moves).
        idle = jnp.zeros(self.active.shape, bool)
        self.state, _ = decode_step(self.params, self.config, self.state,
                                    jnp.asarray(self.next_token), idle)
        if self.residency is not None:  # the step's refill; an all -1 plan changes nothing
            none = jnp.full((self.config.cache.refill_pages,), -1, jnp.int32)
            self.state = refill(self.config, self.state, 0, none, none)
        jax.block_until_ready(self.state)

    def admit(self, prompt, max_new_tokens: int | None = None, progress=None,
              prefilled=None) -> int:
        """Prefills ``prompt`` into a free slot and samples its first token; returns the slot.

        Paged methods reserve host pages for prompt + max_new_tokens (default: up to max_len)
        first, so running out of host memory fails here, before anything changes.
        prefilled: (caches, last logits) that ``steps.prefill`` returned for this prompt and
        model, to share one prefill between engines (every method prefills alike).
        """
        cfg = self.config.model
        total = cfg.max_len if max_new_tokens is None else len(prompt) + max_new_tokens
        if total > cfg.max_len:
            raise ValueError(f"admit: prompt {len(prompt)} + max_new_tokens {max_new_tokens} "
                             f"exceeds ModelConfig.max_len={cfg.max_len}")
        free = np.flatnonzero(~self.active)
        if free.size == 0:
            raise RuntimeError(f"admit: all {self.active.size} slots are busy")
        slot = int(free[0])
        pages = None
        if self.pages is not None:
            rows = total // cfg.csa_ratio
            pages = self.pages.allocate(-(-rows // self.config.cache.page_size),
                                        what=f"a request of {total} tokens")
        t0 = time.perf_counter()
        if prefilled is None:
            run = streamed_prefill if self.config.cache.streamed_prefill else prefill
            caches, last = run(self.params, cfg, prompt, self.config.cache.prefill_chunk,
                               progress=progress)
        else:
            caches, last = prefilled
        if pages is None:
            self.state = insert(self.state, slot, caches, len(prompt))
        else:
            table = np.full(self.config.pages_per_slot, -1, np.int32)
            table[:len(pages)] = pages
            ready = None
            if self.residency is not None:  # resident-first: reclaim others' pages if needed
                full = len(prompt) // cfg.csa_ratio // self.config.cache.page_size
                victims, ready = self.residency.admit(slot, full)
                for victim in victims:
                    self.state = reclaim(self.config, self.state, victim)
                ready = jnp.asarray(ready)
            self.state = admit_paged(self.config, self.state, slot, caches, len(prompt),
                                     jnp.asarray(table), ready)
            self.slot_pages[slot] = pages
        self._rng, key = jax.random.split(self._rng)
        first = int(sample(last[None], key, self.config.sampling.temperature)[0])
        jax.block_until_ready(self.state)
        self.prefill_seconds += time.perf_counter() - t0
        self.active[slot], self.next_token[slot], self.limit[slot] = True, first, total
        self.generated[slot] = [first]
        self._has_prev[slot] = False
        return slot

    def release(self, slot: int) -> list[int]:
        """Ends a request: frees its slot and host pages; returns its generated tokens."""
        if not self.active[slot]:
            raise ValueError(f"release: slot {slot} is not active")
        self.active[slot] = False
        if self.residency is not None and self.residency.release(slot):
            self.state = reclaim(self.config, self.state, slot)
        if self.pages is not None:
            self.pages.release(self.slot_pages.pop(slot))
            table = self.state.host.page_table.at[slot].set(-1)
            self.state = self.state.replace(host=self.state.host.replace(page_table=table))
        return self.generated[slot]

    def step(self, tokens=None) -> DecodeOutput:
        """One decode step of every active slot. ``tokens`` [S] forces each active slot's
        next input (teacher forcing, e.g. to compare methods on identical contexts); by
        default each slot feeds the token it sampled last."""
        if tokens is not None:
            tokens = np.asarray(tokens, np.int32)
            self.next_token = np.where(self.active, tokens, self.next_token)
            for s in np.flatnonzero(self.active):
                self.generated[s][-1] = int(tokens[s])
        lengths = np.asarray(self.state.lengths)
        full = self.active & (lengths >= self.limit)
        if full.any():
            raise RuntimeError(f"step: slots {np.flatnonzero(full).tolist()} reached their "
                               "reserved length (max_new_tokens or max_len); release them")
        if self.residency is not None:  # bounded round-robin refill of lent pages
            for slot, logical, lent in self.residency.plan_refill():
                self.state = refill(self.config, self.state, slot, jnp.asarray(logical),
                                    jnp.asarray(lent))
        t0 = time.perf_counter()
        self.state, out = decode_step(self.params, self.config, self.state,
                                      jnp.asarray(self.next_token), jnp.asarray(self.active))
        tokens = np.asarray(out.tokens)
        self.decode_seconds += time.perf_counter() - t0
        self.decode_tokens += int(self.active.sum())
        self.next_token = np.where(self.active, tokens, self.next_token)
        for s in np.flatnonzero(self.active):
            self.generated[s].append(int(tokens[s]))
        self._record_selection(np.asarray(out.selected), np.asarray(out.eligible),
                               np.asarray(out.sources), np.asarray(out.key_sources))
        return out

    def _record_selection(self, selected, eligible, sources, key_sources):
        act = self.active
        if selected.shape[1] == 0 or not act.any():
            return
        sel = selected[act]  # [A, L, k]
        self.selection.steps += sel.shape[0] * sel.shape[1]
        self.selection.eligible += float(eligible[act].sum())
        self.selection.selected += float((sel >= 0).sum())
        self.selection.sources += sources[act].sum(axis=(0, 1))
        self.selection.key_sources += key_sources[act].sum(axis=(0, 1))
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
        row_bytes = 4 * self.config.model.head_dim
        key_bytes = self.config.model.indexer.key_bytes
        host_bytes = float(self.selection.sources[2]) * row_bytes \
            + float(self.selection.key_sources[2]) * key_bytes
        return {
            "method": self.config.method,
            "prefill_seconds": self.prefill_seconds,
            "decode_tokens": self.decode_tokens,
            "decode_seconds": self.decode_seconds,
            "decode_tokens_per_second": self.decode_tokens / max(self.decode_seconds, 1e-9),
            "device_bytes_per_request": self.slot_bytes,
            "selection": self.selection.as_dict(row_bytes, key_bytes),
            "host_bytes_per_token": host_bytes / max(self.decode_tokens, 1),
            **({} if self.residency is None else
               {"optional_pages_in_use": self.residency.in_use(),
                "optional_pool_bytes": sum(p.optional.nbytes for p in self.state.host.pools
                                           if p is not None)}),
        }

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
from lsparse_jax.methods import policy
from lsparse_jax.model.store import NUM_SOURCES
from lsparse_jax.serving.prefill_stream import streamed_prefill
from lsparse_jax.serving.request import Request
from lsparse_jax.serving.sampling import sample
from lsparse_jax.serving.state import DecodeState, admit, empty_state, slot_bytes
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
    """Serves up to ``config.cache.num_slots`` requests with one jitted decode step.

    The serving method is a policy value (``lsparse_jax.methods``): its data plane runs inside
    the jitted steps, its controller (host pages, lent pages) is asked what an admission needs
    and what a release or a step must run. The engine itself never asks which method it runs.
    """

    def __init__(self, config: EngineConfig, params, codebooks: dict | None = None):
        """codebooks: {CSA layer: [M, K, D_I/M]} PQ codebooks, needed by leansparse."""
        self.config, self.params = config, params
        self.method = policy(config)
        self.control = self.method.controller()
        self.state: DecodeState = empty_state(config, codebooks)
        slots = config.cache.num_slots
        self.active = np.zeros(slots, bool)
        self.limit = np.zeros(slots, np.int64)  # tokens each slot may hold (its reservation)
        self.next_token = np.zeros(slots, np.int32)
        self.generated: list[list[int]] = [[] for _ in range(slots)]
        self.requests: dict[int, Request] = {}  # slot -> the request it serves
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
        return slot_bytes(self.config, self.state)

    def warmup(self):
        """Compiles the prefill chunk and the decode step so that timings exclude compilation."""
        cfg, chunk = self.config.model, self.config.cache.prefill_chunk
        tokens = np.zeros(min(chunk + 1, cfg.max_len), np.int32)  # a full and a partial chunk
        jax.block_until_ready(prefill(self.params, cfg, tokens, chunk))
        # An all-idle step writes nothing and selects nothing (only the sampling key moves).
        idle = jnp.zeros(self.active.shape, bool)
        self.state, _ = decode_step(self.params, self.config, self.state,
                                    jnp.asarray(self.next_token), idle)
        self.state = self.control.warmup(self.state)  # what the controller runs between steps
        jax.block_until_ready(self.state)

    def admit(self, request: Request | np.ndarray, max_new_tokens: int | None = None,
              progress=None, prefilled=None) -> int:
        """Prefills ``request`` into a free slot and samples its first token; returns the slot.

        ``request``: a ``Request`` (or a prompt, with ``max_new_tokens``, made into one).
        The method's controller reserves what prompt + max_new_tokens need (paged methods:
        host pages) first, so running out of host memory fails here, before anything changes.
        prefilled: (caches, last logits) that ``steps.prefill`` returned for this prompt and
        model, to share one prefill between engines (every method prefills alike).
        """
        if not isinstance(request, Request):
            request = Request(request, max_new_tokens)
        elif max_new_tokens is not None:
            raise ValueError("admit: max_new_tokens belongs to the Request")
        cfg, prompt = self.config.model, request.prompt
        new = request.max_new_tokens
        total = cfg.max_len if new is None else len(prompt) + new
        if total > cfg.max_len:
            raise ValueError(f"admit: prompt {len(prompt)} + max_new_tokens {new} "
                             f"exceeds ModelConfig.max_len={cfg.max_len}")
        free = np.flatnonzero(~self.active)
        if free.size == 0:
            raise RuntimeError(f"admit: all {self.active.size} slots are busy")
        slot = int(free[0])
        grant, before = self.control.reserve(slot, total, len(prompt))
        t0 = time.perf_counter()
        request.admitted_at = t0
        if prefilled is None:
            run = streamed_prefill if self.config.cache.streamed_prefill else prefill
            caches, last = run(self.params, cfg, prompt, self.config.cache.prefill_chunk,
                               progress=progress)
        else:
            caches, last = prefilled
        for update in before:
            self.state = update(self.state)
        self.state = admit(self.config, self.state, slot, caches, len(prompt), grant)
        self._rng, key = jax.random.split(self._rng)
        first = int(sample(last[None], key, self.config.sampling.temperature)[0])
        jax.block_until_ready(self.state)
        now = time.perf_counter()
        self.prefill_seconds += now - t0
        self.active[slot], self.next_token[slot], self.limit[slot] = True, first, total
        self.generated[slot] = request.tokens
        request.tokens[:] = [first]
        request.first_token_at = now
        request.token_times[:] = [now]
        self.requests[slot] = request
        self._has_prev[slot] = False
        return slot

    def release(self, slot: int) -> list[int]:
        """Ends a request: frees its slot and what the method reserved; returns its tokens."""
        if not self.active[slot]:
            raise ValueError(f"release: slot {slot} is not active")
        self.active[slot] = False
        for update in self.control.release(slot):
            self.state = update(self.state)
        request = self.requests.pop(slot)
        request.finished_at = time.perf_counter()
        return request.tokens

    def step(self, tokens=None) -> DecodeOutput:
        """One decode step of every active slot. ``tokens`` [S] forces each active slot's
        next input (teacher forcing, e.g. to compare methods on identical contexts); by
        default each slot feeds the token it sampled last."""
        if tokens is not None:
            tokens = np.asarray(tokens, np.int32)
            self.next_token = np.where(self.active, tokens, self.next_token)
            for s in np.flatnonzero(self.active):
                self.generated[s][-1] = int(tokens[s])  # the request's token list
        lengths = np.asarray(self.state.lengths)
        full = self.active & (lengths >= self.limit)
        if full.any():
            raise RuntimeError(f"step: slots {np.flatnonzero(full).tolist()} reached their "
                               "reserved length (max_new_tokens or max_len); release them")
        for update in self.control.before_step():  # e.g. adaptive's refill of lent pages
            self.state = update(self.state)
        t0 = time.perf_counter()
        self.state, out = decode_step(self.params, self.config, self.state,
                                      jnp.asarray(self.next_token), jnp.asarray(self.active))
        tokens = np.asarray(out.tokens)
        now = time.perf_counter()
        self.decode_seconds += now - t0
        self.decode_tokens += int(self.active.sum())
        self.next_token = np.where(self.active, tokens, self.next_token)
        for s in np.flatnonzero(self.active):
            self.generated[s].append(int(tokens[s]))
            self.requests[s].token_times.append(now)
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
            **self.control.metrics(self.state),
        }

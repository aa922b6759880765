"""``echo``: the LeanSparse paper's multi-turn baseline, an ECHO-style KV offloading policy.

ECHO (Liu et al., OSDI 2026) offloads the compressed KV history to host memory and keeps a GPU
KV pool shared across requests; each decoding request owns a small buffer in it (512 entries
per CSA layer in the LeanSparse replay, out of 256K shared entries per layer) that selected
rows are prefetched into from the host, losslessly: a row the prefetch missed is fetched on
demand, so outputs equal fully resident serving. Indexer keys stay on the GPU, as in HiSparse
("the two baselines have nearly identical decode paths", LeanSparse section 6.1). Prefill, as
in HiSparse, holds the prompt's whole KV history on the GPU (no layer streaming): with a shared
pool, a long prompt (a continuation call's reused prefix included) must find its rows free
in the pool before it starts, which is what delays admission under load.

What we implement:
- Data plane: HiSparse's (``methods.hisparse``): complete pages in host pages, the per-request
  buffer is the hot cache of ``CacheConfig.hot_cache_rows`` rows (LRU), misses copied from host
  in the step. Exact, so bit-identical to ``resident`` (identity 3).
- Control plane: the shared pool of ``CacheConfig.shared_pool_rows`` entries per CSA layer as
  a counted capacity. An admission holds hot_cache_rows (its buffer, until release) plus
  prompt // csa_ratio entries (its prefill's history, until the next decode step starts, i.e.
  until it has entered decode and its rows are in host pages); if the pool cannot hold them
  now it raises ``SharedPoolCapacityError`` before anything changes (a scheduler waits).
Simplifications (stated, not hidden):
- The buffers are per-slot arrays (the hot caches) and the prefill's rows the prefill's
  resident caches, not slices of one preallocated pool array; the pool bounds them by count.
- Prefetch is not ahead of the step: rows are fetched at resolve time (a prefetch with no
  lookahead). Outputs are the same by losslessness; only overlap of copies with compute is
  not modelled, which the scheduler's measured clock then charges to the step.
- ECHO's own prefetch predictor and eviction policy are not reproduced (LRU buffer instead).
  ``CacheConfig.prefetch_rows`` = P adds its intra-query prefetch in our terms: each decode
  step ranks the top-(k + P) exact index scores, attends over the top-k and also loads ranks
  k .. k + P - 1 into the buffer when missing (one resolve of [selection; band], band rows
  stamped as used after the selection's), betting that the next step's selection crosses the
  boundary. Lossless (tested bit for bit against resident); its copies are counted apart
  (``selection.prefetched_rows``). Not ahead of the step: they are copied in the step that
  ranks them, so no overlap with compute is modelled.
- With prefix reuse (``Engine.admit(prefix=...)``) the engine streams every method's prefix
  from host layer by layer (one data path); echo's pool still charges the whole history
  (prefix included) for the admission, as ECHO loads it onto the GPU before prefilling.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from lsparse_jax.config import EngineConfig, invalid
from lsparse_jax.memory.host_pool import CapacityError
from lsparse_jax.methods.base import register
from lsparse_jax.methods.hisparse import HiSparse, PagedController
from lsparse_jax.model.store import ExactIndex


class SharedPoolCapacityError(CapacityError):
    """An admission needs more entries of echo's shared GPU KV pool than are free now."""

    wait_reason = "shared_pool"


@register
@dataclasses.dataclass(frozen=True)
class Echo(HiSparse):
    name: ClassVar[str] = "echo"
    shared_pool: ClassVar[bool] = True

    @classmethod
    def validate(cls, engine: EngineConfig) -> None:
        super().validate(engine)
        rows, buffer = engine.cache.shared_pool_rows, engine.cache.hot_cache_rows
        if rows < buffer:
            invalid("EngineConfig", "cache.shared_pool_rows", rows,
                    f"must hold at least one request's buffer (hot_cache_rows={buffer})")
        band, k = engine.cache.prefetch_rows, engine.model.indexer.top_k
        if band and buffer < k + band:
            invalid("EngineConfig", "cache.prefetch_rows", band,
                    f"the buffer must hold a step's selection and its prefetch: "
                    f"hot_cache_rows={buffer} < top_k + prefetch_rows = {k + band}")
        if band and k + band > engine.model.num_compressed("csa"):
            invalid("EngineConfig", "cache.prefetch_rows", band,
                    f"top_k + prefetch_rows = {k + band} exceeds the "
                    f"{engine.model.num_compressed('csa')} compressed rows of max_len")
        if band and engine.cache.device_pages is not None:
            invalid("EngineConfig", "cache.prefetch_rows", band,
                    "prefetch ranks the exact keys kept in each slot; with device_pages "
                    "leave it 0")

    def key_index(self):
        """HiSparse's exact index; with ``CacheConfig.prefetch_rows`` = P > 0 it also ranks
        the next P positions (``Selection.band``), which decode loads with the selection
        (``PagedKVStore.gather_band``)."""
        band = self.engine.cache.prefetch_rows
        if not band:
            return super().key_index()
        return ExactIndex(self.engine.model.indexer.top_k, self.engine.implementation, band)

    def controller(self) -> EchoController:
        return EchoController(self)


class EchoController(PagedController):
    """Host pages as HiSparse's, plus the shared pool's entries (per CSA layer, counted once:
    every CSA layer holds the same number): each slot's buffer until release, each
    admission's prompt rows until the next decode step."""

    def __init__(self, method: Echo):
        super().__init__(method)
        cache = method.engine.cache
        self.capacity, self.buffer_rows = cache.shared_pool_rows, cache.hot_cache_rows
        self.buffers: dict[int, int] = {}  # slot -> buffer entries held
        self.prefills: dict[int, int] = {}  # slot -> prompt entries held until the next step
        self.peak = 0

    @property
    def in_use(self) -> int:
        """Entries of the shared pool held now (per CSA layer)."""
        return sum(self.buffers.values()) + sum(self.prefills.values())

    def prefill_rows(self, prompt_tokens: int) -> int:
        """Compressed CSA rows of a prompt (the prefill's history held in the pool)."""
        return prompt_tokens // self.method.engine.model.csa_ratio

    def reserve(self, slot: int, total_tokens: int, prompt_tokens: int, held=()):
        history = self.prefill_rows(prompt_tokens)
        need = self.buffer_rows + history
        if need > self.capacity:
            raise ValueError(
                f"echo: a prompt of {prompt_tokens} tokens needs {need} shared pool entries "
                f"(buffer {self.buffer_rows} + {history} rows of history) but "
                f"CacheConfig.shared_pool_rows={self.capacity}: it can never be admitted")
        if need > self.capacity - self.in_use:
            raise SharedPoolCapacityError(
                f"echo shared pool: a prompt of {prompt_tokens} tokens needs {need} entries, "
                f"{self.capacity - self.in_use} of {self.capacity} are free")
        grant, before = super().reserve(slot, total_tokens, prompt_tokens, held)  # host pages
        self.buffers[slot], self.prefills[slot] = self.buffer_rows, history
        self.peak = max(self.peak, self.in_use)
        return grant, before

    def before_step(self) -> list:
        self.prefills.clear()  # every admitted prefill has entered decode (rows on the host)
        return super().before_step()

    def release(self, slot: int) -> list:
        self.buffers.pop(slot)
        self.prefills.pop(slot, None)
        return super().release(slot)

    def metrics(self, state) -> dict:
        return super().metrics(state) | {"shared_pool_rows_in_use": self.in_use,
                                         "shared_pool_rows_peak": self.peak}


__all__ = ["Echo", "EchoController", "SharedPoolCapacityError"]

"""The jitted data-plane functions: prefill chunks and the batched decode step."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import struct

from lsparse_jax.config import EngineConfig, ModelConfig
from lsparse_jax.methods import policy
from lsparse_jax.model.cache import empty_cache
from lsparse_jax.model.store import NUM_SOURCES
from lsparse_jax.model.transformer import Transformer, serving_params
from lsparse_jax.parallel import engine_mesh, mesh_scope
from lsparse_jax.serving import stats as selection_stats
from lsparse_jax.serving.sampling import sample
from lsparse_jax.serving.state import DecodeState


@struct.dataclass
class DecodeOutput:
    logits: jnp.ndarray  # [S, V] f32 logits of each slot's input token
    tokens: jnp.ndarray  # [S] int32 sampled next tokens (junk for inactive slots)
    selected: jnp.ndarray  # [S, L_sparse, k] int32 positions chosen by each leading indexer
    eligible: jnp.ndarray  # [S, L_sparse] int32 eligible positions per sparse layer
    sources: jnp.ndarray  # [S, L_sparse, 3] int32 selected rows found in tail/resident, hot, host
    key_sources: jnp.ndarray  # [S, L_sparse, 3] int32 exact keys scored from tail/resident,
    #   key cache, host (resident and hisparse score every eligible key from the GPU)
    prefetched: jnp.ndarray  # [S, L_sparse] int32 rows copied from host beyond the selection
    #   (echo's prefetch, ``CacheConfig.prefetch_rows``; 0 elsewhere)


def sparse_layers(cfg: ModelConfig) -> tuple[int, ...]:
    """Layers that run their own indexer (CSA layers and leading DSA layers)."""
    return cfg.indexer_layers


@functools.partial(jax.jit, static_argnames=("cfg", "dense_selection", "implementation"))
def forward_chunk(params, cfg: ModelConfig, caches, tokens, start, num_valid,
                  dense_selection: bool = False, implementation: str | None = "xla"):
    """One slot, one chunk: tokens [T] at positions start.. -> (logits [T, V], caches, sels).
    ``implementation``: the kernels of the chunk's exact selections (the ``topk`` op, and with
    bf16 matmuls the ``index_logits`` op: ``model.store.logits_of_queries``)."""
    model = Transformer(cfg, dense_selection, implementation=implementation)
    return model.apply({"params": params}, tokens, caches, start, num_valid)


def forward(params, cfg: ModelConfig, tokens, dense_selection: bool = False):
    """Teacher-forced forward of a whole sequence from empty caches: logits [T, V]."""
    tokens = jnp.asarray(tokens, jnp.int32)
    logits, _, _ = forward_chunk(params, cfg, empty_cache(cfg), tokens, 0, tokens.shape[0],
                                 dense_selection)
    return logits


class PrefillChunks:
    """Chunked prefill of one prompt from empty caches, one chunk per ``next``: yields
    ((caches, logits of the chunk's last valid token [V]), valid tokens of the chunk).

    Every chunk has ``chunk`` tokens (the last is padded), so one compilation serves any prompt.
    The last yield holds the prompt's caches and last logits (a scheduler interleaves the
    chunks with decode steps; ``prefill`` runs them all). A caller may run the next chunk
    itself (``serving.mixed``: fused with a decode step): ``pending`` gives its inputs,
    ``advance`` takes its result. ``last``: the latest yield (None before the first chunk).
    """

    def __init__(self, params, cfg: ModelConfig, tokens, chunk: int,
                 implementation: str | None = "xla"):
        tokens = jnp.asarray(tokens, jnp.int32)
        n = tokens.shape[0]
        if n == 0:
            raise ValueError("prefill: the prompt is empty")
        if n > cfg.max_len:
            raise ValueError(f"prefill: prompt of {n} tokens exceeds "
                             f"ModelConfig.max_len={cfg.max_len}")
        self.params = serving_params(params, cfg)  # ModelConfig.weight_dtype (once per prompt)
        self.cfg, self.chunk, self.implementation = cfg, chunk, implementation
        self.caches, self.length, self.start, self.last = empty_cache(cfg), n, 0, None
        self.padded = jnp.pad(tokens, (0, -n % chunk))

    def __iter__(self):
        return self

    def __next__(self):
        tokens, start, valid = self.pending()
        logits, caches, _ = forward_chunk(self.params, self.cfg, self.caches, tokens, start,
                                          valid, implementation=self.implementation)
        return self.advance(logits, caches)

    def pending(self):
        """The next chunk: (tokens [chunk] int32, start, valid); StopIteration after the last."""
        if self.start >= self.length:
            raise StopIteration
        valid = min(self.chunk, self.length - self.start)
        return self.padded[self.start:self.start + self.chunk], self.start, valid

    def advance(self, logits, caches):
        """Takes the next chunk's result (logits [chunk, V], caches); returns its yield."""
        _, start, valid = self.pending()
        self.caches, self.start = caches, start + self.chunk
        self.last = (caches, logits[valid - 1]), valid
        return self.last


def prefill_chunks(params, cfg: ModelConfig, tokens, chunk: int,
                   implementation: str | None = "xla") -> PrefillChunks:
    """``PrefillChunks`` of ``tokens`` (the prompt checked here)."""
    return PrefillChunks(params, cfg, tokens, chunk, implementation)


def prefill(params, cfg: ModelConfig, tokens, chunk: int, progress=None,
            implementation: str | None = "xla"):
    """Chunked prefill of one prompt from empty caches (``prefill_chunks`` run to the end).
    Returns (caches, logits of the last prompt token [V]). ``implementation``: the kernels of
    the exact top-k selections (the same positions in the same order as "xla")."""
    out = None
    for out in prefill_chunks(params, cfg, tokens, chunk, implementation):
        if progress is not None:
            progress.update(out[1])
    return out[0]


def decode_model(engine: EngineConfig) -> Transformer:
    """The decode step's model: the method's stores, the engine's kernels."""
    method = policy(engine)
    return Transformer(engine.model, implementation=engine.implementation,
                       kv_store=method.kv_store(), key_index=method.key_index(),
                       hca_store=method.hca_store(), dsa_stores=method.dsa_stores())


def step_selections(cfg: ModelConfig, sels) -> tuple:
    """One slot's per-layer selections (T = 1) as the DecodeOutput fields they fill:
    (selected [L_sparse, k], eligible, sources, key_sources, prefetched)."""
    picked = [sels[i] for i in sparse_layers(cfg)]

    def stack(field, shape):  # shape: one layer's entry; a field left None counts 0
        rows = [jnp.zeros(shape, jnp.int32) if getattr(s, field) is None
                else getattr(s, field)[0] for s in picked]
        return jnp.stack(rows) if rows else jnp.zeros((0,) + shape, jnp.int32)

    return (stack("positions", (cfg.indexer.top_k,)), stack("eligible", ()),
            stack("sources", (NUM_SOURCES,)), stack("key_sources", (NUM_SOURCES,)),
            stack("prefetched", ()))


def sample_step(engine: EngineConfig, state: DecodeState, logits, caches, active, picked):
    """A decode step's end: samples each slot's next token from logits [S, V] and advances
    the state (caches, the active slots' lengths, the key) -> (state, DecodeOutput).
    picked: the stacked ``step_selections`` [S, ...] of every slot."""
    rng, key = jax.random.split(state.rng)
    next_tokens = sample(logits, key, engine.sampling.temperature)
    new = state.replace(caches=caches, lengths=state.lengths + active.astype(jnp.int32), rng=rng)
    return new, DecodeOutput(logits, next_tokens, *picked)


@functools.partial(jax.jit, static_argnames=("engine",), donate_argnames=("state",))
def decode_step(params, engine: EngineConfig, state: DecodeState, tokens, active):
    """Feeds one token per slot and samples the next.

    tokens [S] int32 (each slot's newest token, at position lengths[s]); active [S] bool.
    Inactive slots write nothing and keep their length. Returns (state, DecodeOutput).
    What the method's controller runs between steps (paged methods: the writeback of completed
    pages, ``Controller.after_step``) is the caller's: ``Engine.step`` runs it.
    """
    cfg, method, model = engine.model, policy(engine), decode_model(engine)

    def one(caches, rows, token, start, live):
        # the method's shared state (host pools, codebooks) is closed over, not mapped; its
        # per-slot rows (page table, ready map) are
        logits, caches, sels = model.apply({"params": params}, token[None], caches, start,
                                           live.astype(jnp.int32),
                                           method.contexts(state.tier, rows))
        return logits[0], caches, step_selections(cfg, sels)

    with mesh_scope(engine_mesh(engine)):  # kernels per head shard (tp > 1)
        logits, caches, picked = jax.vmap(one)(
            state.caches, method.slot_rows(state.tier), tokens, state.lengths, active)
    return sample_step(engine, state, logits, caches, active, picked)


def choose_feed(tokens, prev_feed, use_prev, forced, use_forced):
    """Each slot's input of a step [S]: ``forced`` where use_forced, else ``prev_feed`` (a
    launched step's sampled tokens, on the device) where use_prev, else ``tokens``."""
    return jnp.where(use_forced, forced, jnp.where(use_prev, prev_feed, tokens))


@functools.partial(jax.jit, static_argnames=("engine",), donate_argnames=("state", "stats"))
def launch_step(params, engine: EngineConfig, state: DecodeState, stats, tokens, prev_feed,
                use_prev, forced, use_forced, active):
    """What ``Engine.launch`` dispatches for one decode step, as one program: the inputs
    chosen on the device (``choose_feed``; tokens, use_prev, forced, use_forced and active
    [S] may be host arrays), ``decode_step``, the selection statistics
    (``stats.record``), and the next step's feed (each active slot's sampled token).
    Returns (state, stats, DecodeOutput, feed [S]). It replaces three ``jnp.asarray`` copies
    and four dispatches a step (two ``where``, ``decode_step``, ``record``): at batch 8 the
    H200 idled 1.5-1.9 ms at each step's start waiting for the host (session 28,
    ``results/decode_profile_b1_b8/``); on a 2-core CPU with the tiny model, 0.82 -> 0.62 ms
    a step (hisparse), 1.04 -> 0.85 (leansparse) (``benchmarks/launch_overhead.py``); on the
    H200 at 128K, batch 8, HiSparse's step 4.47 -> 3.29 ms, step / kernels 1.50 -> 1.10
    (session 29, ``results/decode_profile_session29/before/``)."""
    feed = choose_feed(tokens, prev_feed, use_prev, forced, use_forced)
    state, out = decode_step(params, engine, state, feed, active)
    return state, *step_tail(stats, out, feed, active)


def step_tail(stats, out: DecodeOutput, feed, active):
    """A step's end on the device: -> (stats with the step recorded, out, the next feed [S]:
    each active slot's sampled token, else its feed)."""
    stats = selection_stats.record(stats, out.selected, out.eligible, out.sources,
                                   out.key_sources, active, out.prefetched)
    return stats, out, jnp.where(active, out.tokens, feed)


__all__ = ["DecodeOutput", "PrefillChunks", "choose_feed", "decode_model", "decode_step",
           "forward", "forward_chunk", "launch_step", "prefill", "prefill_chunks",
           "sample_step", "sparse_layers", "step_selections", "step_tail"]

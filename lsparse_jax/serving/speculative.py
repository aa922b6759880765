"""Speculative decoding over the sparse KV hierarchy (Adaptive DHiSparse, DFlash-style drafter).

One step per slot: the drafter proposes gamma tokens from its ring window
(``model.drafter``); the target verifies the block [last accepted token, d1 .. d_gamma] in one
forward of gamma + 1 queries, each with its own causal top-k; the accepted prefix plus one bonus
token is emitted (greedy at temperature 0, rejection sampling otherwise); the caches, lengths and
the drafter ring advance by the accepted count.

Verification staging. The block's new rows go where a plain decode step would put them (the SWA
and compressor rings, the tail page of paged methods, the resident tables), so every query of
the block reads them through the method's own stores; ``commit`` then takes back what rejected
tokens wrote: ring slots they overwrote get their previous rows back, and compressed rows (KV and
indexer keys) they completed are written NaN again through the store's own ``write`` (rows past a
slot's length are NaN in every store). A block never crosses a page end: it is cut at the token
that completes the tail page, so a page is only ever completed by a block's last committed token
and the controller's writeback (``Controller.after_step``) runs exactly as after a plain decode
step, on committed rows only. Hot caches and key caches are filled from host pages only, which
hold committed rows only. ``tests/test_speculative.py`` checks that no rejected row survives.

Shared miss retrieval. The block's gamma + 1 selections of a CSA layer are merged into one
union (``UnionKV``), resolved once through the method's store (tail / lent pages / hot cache /
host copy), and each query reads its rows from it; the union's host rows are counted beside the
sum of each query's own misses.

Keep to the method interfaces: ``Method.kv_store``/``key_index`` are wrapped, never changed;
``SpecState`` lives beside ``DecodeState``.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from lsparse_jax.config import DrafterConfig, EngineConfig, ModelConfig, invalid
from lsparse_jax.memory.accounting import spec_bytes
from lsparse_jax.methods import policy
from lsparse_jax.model.cache import CSACache, DSACache, HCACache, SWACache, empty_cache
from lsparse_jax.model.drafter import DrafterWindow, draft_block, ring_rows, target_io
from lsparse_jax.model.store import (
    NUM_SOURCES,
    DSAStores,
    ExactIndex,
    IndexerQuery,
    Locations,
    RowView,
    select_block,
    write_rows,
)
from lsparse_jax.model.transformer import Transformer
from lsparse_jax.quant import KVRowFormat
from lsparse_jax.serving.engine import Engine
from lsparse_jax.serving.request import Request
from lsparse_jax.serving.state import DecodeState
from lsparse_jax.serving.steps import sparse_layers

MISS_COLUMNS = NUM_SOURCES + 1  # verification sources per query: 0 (not split), rows found on
#   the device, rows it would copy from the host alone (its own misses); and in row 0 the
#   union's host rows (fetched once for the block)


# ---------------------------------------------------------------------------------- the stores
@dataclasses.dataclass(frozen=True)
class UnionKV:
    """``KVStore`` for a verification block: the method's store, whose ``gather`` serves T
    queries by resolving the union of their selections once (shared miss retrieval)."""

    inner: Any

    def empty(self, num_rows, rows):
        return self.inner.empty(num_rows, rows)

    def write(self, state, completed, ids, rows, ok):
        return self.inner.write(state, completed, ids, rows, ok)

    def all_rows(self, state):
        return self.inner.all_rows(state)

    def gather(self, state, completed, selected, context):
        """Notation: T queries, k selected each, U = T * k.
        selected [T, k] -> (state, RowView with table [1, U, ...] of the union's rows and slots
        [T, k] into it; sources [T, MISS_COLUMNS])."""
        t_len, k = selected.shape
        big = jnp.iinfo(jnp.int32).max
        flat = jnp.where(selected >= 0, selected, big).reshape(-1)
        union = jnp.unique(flat, size=t_len * k, fill_value=big)  # sorted, padding last
        union = jnp.where(union == big, -1, union)
        new, view = self.inner.gather(state, completed, union[None], context)
        rows = jax.tree.map(lambda t: t[0][jnp.maximum(view.slots[0], 0)][None], view.table)
        where = jnp.searchsorted(jnp.where(union >= 0, union, big), flat).reshape(t_len, k)
        slots = jnp.where(selected >= 0, where, -1)
        # a union row is a miss if the step brought it into the hot cache (never tail/lent)
        hot_before = getattr(state, "hot", None)
        if hot_before is None:
            missed = jnp.zeros(union.shape, bool)
        else:
            missed = ((union >= 0) & jnp.isin(union, new.hot.positions)
                      & ~jnp.isin(union, hot_before.positions))
        per_query = jnp.sum(jnp.where(slots >= 0, missed[jnp.maximum(slots, 0)], False), -1)
        valid = jnp.sum(selected >= 0, -1)
        first = jnp.full((t_len,), 0, jnp.int32)  # per query: hits split is not tracked
        sources = jnp.stack([first, valid - per_query, per_query,
                             jnp.zeros((t_len,), jnp.int32).at[0].set(view.sources[0, 2])],
                            axis=-1).astype(jnp.int32)
        return new, RowView(rows, slots, sources, plan=Locations(view.slots, view.plan))

    def follow(self, state, completed, locations: Locations, context):
        """A DSA member layer: its own rows of the leader's union, rebuilt from the union's
        location vector (``locations.plan``: the union's misses fetched once, from this
        layer's host pages), read at the block's slots. sources: the union's host rows in
        row 0 (as ``gather``)."""
        new, view = self.inner.follow(state, completed, locations.plan, context)
        rows = jax.tree.map(lambda t: t[0][jnp.maximum(view.slots[0], 0)][None], view.table)
        t_len = locations.slots.shape[0]
        sources = jnp.zeros((t_len, MISS_COLUMNS), jnp.int32).at[0, 3].set(view.sources[0, 2])
        return new, RowView(rows, locations.slots, sources)


@dataclasses.dataclass(frozen=True)
class PerQueryIndex:
    """``KeyIndex`` for a verification block: the method's index, the results of one query at a
    time (each with its own causal top-k; the key cache is threaded through them in order),
    batched where the index knows how (``model.store.select_block``)."""

    inner: Any

    def empty(self, num_rows, dim, num_scales):
        return self.inner.empty(num_rows, dim, num_scales)

    def write(self, state, completed, ids, values, scales, ok):
        return self.inner.write(state, completed, ids, values, scales, ok)

    def select(self, state, completed, query: IndexerQuery, eligible, context):
        return select_block(self.inner, state, completed, query, eligible, context)


# ---------------------------------------------------------------------------------- the state
@struct.dataclass
class SpecState:
    """Speculative state beside ``DecodeState`` (never offloaded, never lent)."""

    windows: DrafterWindow  # each leaf with a leading slot axis [S, ...]: the drafter's rings


def empty_spec_state(dcfg: DrafterConfig, hidden: int, num_slots: int) -> SpecState:
    """Empty rings of ``num_slots`` slots for a target of hidden size ``hidden``."""
    window = jax.tree.map(lambda a: jnp.broadcast_to(a, (num_slots,) + a.shape),
                          DrafterWindow.empty(dcfg, hidden))
    state = SpecState(window)
    return jax.tree.map(lambda a: jax.device_put(a, a.sharding), state)


@struct.dataclass
class VerifyOutput:
    tokens: jnp.ndarray  # [S, gamma + 1] int32 emitted tokens (accepted drafts, bonus), -1 after
    emitted: jnp.ndarray  # [S] int32 tokens emitted = tokens committed to the caches
    next_token: jnp.ndarray  # [S] int32 the bonus token (the next block's first token)
    logits: jnp.ndarray  # [S, gamma + 1, V] f32 the target's logits of the block
    union_misses: jnp.ndarray  # [S] int32 host rows fetched for the block (all CSA layers)
    query_misses: jnp.ndarray  # [S] int32 sum over queries of each query's own misses
    selected: jnp.ndarray  # [S, gamma + 1, L_sparse, k] int32 positions each query selected
    union_selected: jnp.ndarray  # [S] int32 distinct (layer, position) the block's queries select
    query_selected: jnp.ndarray  # [S] int32 the same summed query by query


def selection_overlap(selected, valid):
    """How much a verification block's queries select in common, before any cache: the
    union/sum of the selections themselves, beside the union/sum of their misses.

    Notation: T block queries (the first ``valid`` verified), L sparse layers, k selected.
    selected [T, L, k] int32 positions (-1 = none) -> (union, total) int32: per layer the
    distinct positions the valid queries select, and their selections counted query by query,
    each summed over layers."""
    t_len, layers, k = selected.shape
    big = jnp.iinfo(jnp.int32).max
    live = (jnp.arange(t_len) < valid)[:, None, None] & (selected >= 0)
    flat = jnp.sort(jnp.where(live, selected, big).transpose(1, 0, 2).reshape(layers, -1), -1)
    first = (flat < big) & jnp.concatenate(
        [jnp.ones((layers, 1), bool), flat[:, 1:] != flat[:, :-1]], axis=-1)
    return jnp.sum(first).astype(jnp.int32), jnp.sum(live).astype(jnp.int32)


# ---------------------------------------------------------------------------------- commit
def commit_ring(old, new, start, committed, end):
    """A position ring (slot r holds the newest position with residue r) after only the first
    ``committed`` of the block's tokens, from the ring before (``old``) and after all of them
    (``new``, written up to position ``end`` - 1). Needs end - start <= ring size.

    Notation: R ring slots; slot r of ``new`` holds q_r = newest position < end with q_r % R = r.
    Math: q_r >= start + committed (a rejected token) -> the old row (position q_r - R < start);
      otherwise the new one (equal to the old where q_r < start)."""
    r = old.shape[0]
    q = end - 1 - ((end - 1 - jnp.arange(r)) % r)
    keep = (q < start + committed).reshape((r,) + (1,) * (old.ndim - 1))
    return jnp.where(keep, new, old)


def _rejected(start, committed, end, stride: int, count: int):
    """(ids [count], ok [count]): compressed rows of stride ``stride`` completed by the block's
    rejected tokens, positions start + committed .. end - 1 (row i completes at (i+1)m - 1)."""
    ids = (start + committed) // stride + jnp.arange(count)
    return ids, ids < end // stride


def commit(cfg: ModelConfig, kv_store, key_index, dsa: DSAStores, old, new, start, committed,
           end, t_len: int):
    """One slot's caches after committing ``committed`` of the block's tokens at positions
    start .. end - 1 (end - start <= t_len, the block size): rings take back rejected slots,
    rows completed by rejected tokens are written NaN again (through the method's stores for
    CSA layers), so that every store holds exactly what plain decoding of the committed tokens
    would have written (DSA layers through ``dsa``'s stores)."""
    out = []
    for o, n in zip(old, new):
        ring = functools.partial(commit_ring, start=start, committed=committed, end=end)
        if isinstance(n, SWACache):
            n = n.replace(window=ring(o.window, n.window))
        elif isinstance(n, CSACache):
            m = cfg.csa_ratio
            ids, ok = _rejected(start, committed, end, m, t_len // m + 1)
            done = start // m
            nan_rows = KVRowFormat.of(cfg).empty(ids.shape[0])
            ic = cfg.indexer
            nan_keys = jnp.full((ids.shape[0], ic.head_dim), jnp.nan, jnp.float8_e4m3fn)
            nan_scales = jnp.full((ids.shape[0], ic.head_dim // ic.fp8_block), jnp.nan)
            n = n.replace(window=ring(o.window, n.window), kv_ring=ring(o.kv_ring, n.kv_ring),
                          index_ring=ring(o.index_ring, n.index_ring),
                          kv=kv_store.write(n.kv, done, ids, nan_rows, ok),
                          keys=key_index.write(n.keys, done, ids, nan_keys, nan_scales, ok))
        elif isinstance(n, HCACache):
            m = cfg.hca_ratio
            ids, ok = _rejected(start, committed, end, m, t_len // m + 1)
            nan_rows = KVRowFormat.of(cfg).empty(ids.shape[0])
            n = n.replace(window=ring(o.window, n.window), kv_ring=ring(o.kv_ring, n.kv_ring),
                          entries=write_rows(n.entries, ids, nan_rows, ok))
        elif isinstance(n, DSACache):  # per-token rows (row = position) of the block
            pos = start + committed + jnp.arange(t_len)
            ok = pos < end
            ic = cfg.indexer
            leads = n.keys is not None
            store = dsa.kv if leads else dsa.member
            if n.kv is not None:  # None: a member reading its leader's rows (dsa_shared_kv)
                n = n.replace(kv=store.write(n.kv, start, pos, jnp.full(
                    (t_len, cfg.head_dim), jnp.nan), ok))
            if leads:
                n = n.replace(keys=(dsa.keys or ExactIndex(ic.top_k)).write(
                    n.keys, start, pos, jnp.full((t_len, ic.head_dim), jnp.nan,
                                                 jnp.float8_e4m3fn),
                    jnp.full((t_len, ic.head_dim // ic.fp8_block), jnp.nan), ok))
        out.append(n)
    return tuple(out)


# ---------------------------------------------------------------------------------- acceptance
def accept_greedy(logits, drafts, num_valid):
    """Greedy verification. logits [T, V] of the block [x, d_1 .. d_gamma]; drafts [gamma];
    num_valid: the block's verified length (<= T). Returns (accepted a, bonus token): a is the
    longest prefix with d_i = argmax logits[i-1] (i < num_valid), bonus = argmax logits[a]."""
    best = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    i = jnp.arange(1, logits.shape[0])
    match = (drafts == best[:-1]) & (i < num_valid)
    a = jnp.sum(jnp.cumprod(match.astype(jnp.int32)))
    return a, best[a]


def accept_sampled(logits, draft_probs, drafts, num_valid, key, temperature: float):
    """Rejection sampling (speculative sampling): the emitted tokens follow the target's
    distribution at ``temperature`` whatever the drafter proposed.

    Notation: T = gamma + 1; p_i = softmax(logits[i] / temperature) the target's distribution
      after the block's first i + 1 tokens; q_i = draft_probs[i - 1] the distribution d_i was
      drawn from.
    Math: d_i is accepted with probability min(1, p_{i-1}(d_i) / q_i(d_i)), in order, while
      i < num_valid; at the first rejection i the bonus is drawn from norm(max(p_{i-1} - q_i, 0)),
      after a+1 = num_valid tokens from p_a.
    Returns (accepted a, bonus token)."""
    t_len = logits.shape[0]
    p = jax.nn.softmax(logits / temperature, axis=-1)
    k_u, k_b = jax.random.split(key)
    u = jax.random.uniform(k_u, (t_len - 1,))
    pd = jnp.take_along_axis(p[:-1], drafts[:, None], -1)[:, 0]
    qd = jnp.take_along_axis(draft_probs, drafts[:, None], -1)[:, 0]
    i = jnp.arange(1, t_len)
    ok = (u * qd <= pd) & (i < num_valid)
    a = jnp.sum(jnp.cumprod(ok.astype(jnp.int32)))
    rejected = a < num_valid - 1
    q_next = jnp.concatenate([draft_probs, jnp.zeros_like(draft_probs[:1])])[a]
    residual = jnp.maximum(p[a] - q_next, 0.0)
    dist = jnp.where(rejected & (jnp.sum(residual) > 0), residual, p[a])
    bonus = jax.random.categorical(k_b, jnp.log(dist)).astype(jnp.int32)
    return a, bonus


# ---------------------------------------------------------------------------------- jitted steps
@functools.partial(jax.jit, static_argnames=("dcfg", "temperature"))
def draft_step(params, dparams, dcfg: DrafterConfig, spec: SpecState, tokens, lengths, key,
               temperature: float):
    """Every slot's draft block from its ring: (drafts [S, gamma] int32, their distributions
    [S, gamma, V] f32: one-hot at temperature 0)."""
    target = target_io(params)
    logits = jax.vmap(lambda w, x, s: draft_block(dparams, dcfg, target, w, x, s))(
        spec.windows, tokens, lengths)[:, 1:]
    if temperature == 0.0:
        drafts = jnp.argmax(logits, -1).astype(jnp.int32)
        return drafts, jax.nn.one_hot(drafts, logits.shape[-1])
    probs = jax.nn.softmax(logits / temperature, axis=-1)
    drafts = jax.random.categorical(key, logits / temperature, axis=-1).astype(jnp.int32)
    return drafts, probs


@functools.partial(jax.jit, static_argnames=("engine", "dcfg"), donate_argnames=("state", "spec"))
def verify_step(params, dparams, engine: EngineConfig, dcfg: DrafterConfig, state: DecodeState,
                spec: SpecState, tokens, drafts, draft_probs, num_valid):
    """Verifies every slot's block [tokens[s], drafts[s]] and commits the accepted prefix.

    tokens [S] int32 each slot's next input (at position lengths[s]); drafts [S, gamma];
    draft_probs [S, gamma, V]; num_valid [S] int32 the block tokens each slot verifies (0 =
    inactive; the engine cuts blocks at page ends and request limits).
    Returns (state, spec, VerifyOutput); lengths advance by the tokens emitted.
    """
    cfg, method = engine.model, policy(engine)
    kv_store, key_index = UnionKV(method.kv_store()), PerQueryIndex(method.key_index())
    dsa = method.dsa_stores()  # DSA leaders and members alike: one union per group
    dsa = DSAStores(UnionKV(dsa.kv), PerQueryIndex(dsa.keys or ExactIndex(cfg.indexer.top_k)),
                    UnionKV(dsa.member), dsa.location_reuse)
    # the engine's kernels, as its decode step: CSA attention of the block through the
    # sparse_attention op query by query (blocks.KERNEL_QUERIES)
    model = Transformer(cfg, implementation=engine.implementation, kv_store=kv_store,
                        key_index=key_index, hidden_layers=dcfg.target_layers, dsa_stores=dsa)
    temperature = engine.sampling.temperature
    rng, key = jax.random.split(state.rng)
    keys = jax.random.split(key, state.num_slots)

    def one(caches, rows, window, token, draft, q, start, valid, k):
        block = jnp.concatenate([token[None], draft])
        logits, new, sels, feats = model.apply({"params": params}, block, caches, start, valid,
                                               method.contexts(state.tier, rows))
        if temperature == 0.0:
            a, bonus = accept_greedy(logits, draft, valid)
        else:
            a, bonus = accept_sampled(logits, q, draft, valid, k, temperature)
        emitted = jnp.where(valid > 0, a + 1, 0)
        t_len = block.shape[0]
        new = commit(cfg, kv_store, key_index, dsa, caches, new, start, emitted, start + valid,
                     t_len)
        positions = start + jnp.arange(t_len)
        window = window.write(ring_rows(dparams, dcfg, feats, positions), positions,
                              jnp.arange(t_len) < emitted)
        out = jnp.where(jnp.arange(t_len) < a, jnp.concatenate([draft, draft[:1]]), -1)
        out = out.at[a].set(jnp.where(valid > 0, bonus, -1))
        picked = [sels[i] for i in sparse_layers(cfg)]
        srcs = [s.sources for s in picked if s.sources.shape[-1] == MISS_COLUMNS]
        union = sum((jnp.sum(s[:, 3]) for s in srcs), jnp.zeros((), jnp.int32))
        per_query = sum((jnp.sum(s[:, 2]) for s in srcs), jnp.zeros((), jnp.int32))
        selected = (jnp.stack([s.positions for s in picked], axis=1) if picked else
                    jnp.zeros((t_len, 0, cfg.indexer.top_k), jnp.int32))
        return (new, window, out, emitted, bonus, logits, union, per_query, selected,
                *selection_overlap(selected, valid))

    caches, windows, out, emitted, bonus, logits, *rest = jax.vmap(one)(
        state.caches, method.slot_rows(state.tier), spec.windows, tokens, drafts, draft_probs,
        state.lengths, num_valid, keys)
    state = state.replace(caches=caches, lengths=state.lengths + emitted, rng=rng)
    return state, spec.replace(windows=windows), VerifyOutput(
        out, emitted, bonus, logits, *rest)


@functools.partial(jax.jit, static_argnames=("dcfg",), donate_argnames=("spec",))
def fill_window(dparams, dcfg: DrafterConfig, spec: SpecState, slot, feats, positions, ok):
    """Replaces ``slot``'s ring with the features of ``positions`` [W] (where ``ok``)."""
    empty = DrafterWindow.empty(dcfg, feats.shape[-1])
    window = empty.write(ring_rows(dparams, dcfg, feats, positions), positions, ok)
    windows = jax.tree.map(lambda big, one: big.at[slot].set(one), spec.windows, window)
    return spec.replace(windows=windows)


@functools.partial(jax.jit, static_argnames=("cfg", "layers", "implementation"))
def _chunk_with_features(params, cfg: ModelConfig, layers, caches, tokens, start, num_valid,
                         implementation):
    model = Transformer(cfg, implementation=implementation, hidden_layers=layers)
    logits, caches, _, feats = model.apply({"params": params}, tokens, caches, start, num_valid)
    return logits, caches, feats


@struct.dataclass
class SpecPrefill:
    """A prompt's prefill as ``SpecEngine.admit(prefilled=...)`` takes it: the caches and last
    logits, and the target features of its last W positions (the drafter's ring)."""

    caches: tuple
    last: jnp.ndarray  # [V] logits of the last prompt token
    feats: jnp.ndarray  # [W, n_L, H] target features, zero where not ok
    positions: jnp.ndarray  # [W] int32 their positions, -1 where not ok
    ok: jnp.ndarray  # [W] bool


def feature_chunks(params, cfg: ModelConfig, tokens, chunk: int, layers: tuple[int, ...],
                   window: int, implementation: str | None = "xla"):
    """Chunked prefill (as ``steps.prefill_chunks``, top-k by ``implementation``), one chunk
    per ``next``, that also keeps the target features of the last ``window`` prompt positions:
    yields (``SpecPrefill`` once the last chunk ran, else None; valid tokens of the chunk)."""
    tokens = jnp.asarray(tokens, jnp.int32)
    n = tokens.shape[0]
    if not 0 < n <= cfg.max_len:
        raise ValueError(f"prefill: prompt of {n} tokens must be 1 .. max_len={cfg.max_len}")
    caches, padded, kept = empty_cache(cfg), jnp.pad(tokens, (0, -n % chunk)), []
    for start in range(0, n, chunk):
        valid = min(chunk, n - start)
        logits, caches, feats = _chunk_with_features(params, cfg, layers, caches,
                                                     padded[start:start + chunk], start, valid,
                                                     implementation)
        if start + chunk > n - window:
            kept.append(feats[:valid])
        if start + chunk < n:
            yield None, valid
    feats = jnp.concatenate(kept)[-window:]
    first = n - feats.shape[0]
    pad = window - feats.shape[0]
    positions = jnp.concatenate([first + jnp.arange(feats.shape[0]),
                                 jnp.full((pad,), -1)]).astype(jnp.int32)
    feats = jnp.pad(feats, ((0, pad), (0, 0), (0, 0)))
    yield SpecPrefill(caches, logits[valid - 1], feats, positions, positions >= 0), valid


def prefill_features(params, cfg: ModelConfig, tokens, chunk: int, layers: tuple[int, ...],
                     window: int, implementation: str | None = "xla") -> SpecPrefill:
    """``feature_chunks`` run to the end: the prompt's ``SpecPrefill``."""
    chunks = feature_chunks(params, cfg, tokens, chunk, layers, window, implementation)
    return [out for out, _ in chunks][-1]


# ---------------------------------------------------------------------------------- the engine
def check_spec(engine: EngineConfig, dcfg: DrafterConfig) -> None:
    """Raises ValueError if speculative decoding with ``dcfg`` cannot serve ``engine``."""
    if engine.tp != 1:
        invalid("EngineConfig", "tp", engine.tp, "speculative decoding runs on one device "
                "(tp=1); its drafter and verification step are not split over a mesh")
    dcfg.check(engine.model)
    rows, k = engine.cache.hot_cache_rows, engine.model.indexer.top_k
    if rows is not None and rows < (dcfg.gamma + 1) * k:
        invalid("EngineConfig", "cache.hot_cache_rows", rows,
                f"speculative decoding resolves the union of gamma + 1 = {dcfg.gamma + 1} "
                f"selections of top_k = {k} at once: needs >= {(dcfg.gamma + 1) * k}")


class SpecEngine(Engine):
    """``Engine`` whose ``step`` is one speculative verification per active slot.

    drafter: (params from ``model.drafter.init_drafter`` or a trained checkpoint, its
    ``DrafterConfig``). ``step(drafts=...)`` [S, gamma] replaces the drafter's proposals where
    >= 0 (tests: an oracle drafter that proposes the target's own tokens). time_drafter:
    wait for the drafts before verifying, to time the drafter (``drafter_time_share``);
    otherwise the verification is queued behind the drafting without a host round trip
    (``drafter_seconds`` times the drafter apart).
    """

    # a verification's accepted count decides the next block on the host: no launch-ahead
    # (Engine.decode / launch / Scheduler(overlap=True) refuse it)
    pipelines = False

    def __init__(self, config: EngineConfig, params, drafter, codebooks: dict | None = None,
                 time_drafter: bool = False):
        self.dparams, self.dcfg = drafter
        self.time_drafter = time_drafter
        check_spec(config, self.dcfg)
        super().__init__(config, params, codebooks)
        self.control.request_extra_bytes = sum(spec_bytes(config, self.dcfg).values())
        self.spec = empty_spec_state(self.dcfg, config.model.hidden, config.cache.num_slots)
        self._draft_rng = jax.random.key(config.sampling.seed + 2)
        self.acceptance: list[int] = []  # tokens emitted per slot per verification
        self.union_misses = 0
        self.query_misses = 0
        self.union_selected = 0  # selection_overlap, summed over verifications
        self.query_selected = 0
        self.draft_seconds = 0.0
        self.verifications = 0
        self.steps = 0  # verification steps with an active slot

    def request_device_bytes(self, context: int) -> int:
        """The plain engine's bytes plus the request's drafter ring and verification staging
        (``memory.accounting.spec_bytes``: never lent, so a budget counts them)."""
        return super().request_device_bytes(context) + sum(
            spec_bytes(self.config, self.dcfg).values())

    def warmup(self):
        """Compiles prefill, drafting and verification (an all-idle verification)."""
        cfg, chunk = self.config.model, self.config.cache.prefill_chunk
        tokens = np.zeros(min(chunk + 1, cfg.max_len), np.int32)
        jax.block_until_ready(prefill_features(self.params, cfg, tokens, chunk,
                                               self.dcfg.target_layers, self.dcfg.window,
                                               self.config.implementation))
        self._verify(np.zeros(self.active.shape, np.int32), None)
        free = int(np.flatnonzero(~self.active)[0]) if (~self.active).any() else None
        if free is not None:  # an idle slot's ring, rewritten empty: compiles the ring fill
            w, h = self.dcfg.window, self.config.model.hidden
            self.spec = fill_window(self.dparams, self.dcfg, self.spec, free,
                                    jnp.zeros((w, len(self.dcfg.target_layers), h)),
                                    jnp.zeros((w,), jnp.int32), jnp.zeros((w,), bool))
        self.state = self.control.warmup(self.state)
        jax.block_until_ready(self.state)

    def prefill_chunks(self, prompt: np.ndarray):
        """``Engine.prefill_chunks`` whose last ``prefilled`` is a ``SpecPrefill`` (the
        prompt's caches and the target features of its last W positions)."""
        cfg = self.config
        yield from feature_chunks(self.params, cfg.model, prompt, cfg.cache.prefill_chunk,
                                  self.dcfg.target_layers, self.dcfg.window, cfg.implementation)

    def admit(self, request: Request | np.ndarray, max_new_tokens: int | None = None,
              progress=None, prefilled: SpecPrefill | None = None, *, prefix=None) -> int:
        """``Engine.admit`` that also fills the slot's drafter ring from the prompt's last W
        target features. prefilled: the last ``SpecPrefill`` of ``prefill_chunks`` (chunked
        admission); None prefills here. prefix: not supported (the ring would need the
        prefix's target features)."""
        if prefix is not None:
            raise ValueError("SpecEngine.admit: prefix reuse (admit(prefix=...)) is not "
                             "implemented for speculative decoding (the drafter ring needs "
                             "the target features of the prompt's last positions)")
        if prefilled is not None and not isinstance(prefilled, SpecPrefill):
            raise ValueError("SpecEngine.admit: prefilled must be the SpecPrefill that "
                             "SpecEngine.prefill_chunks yields last (the drafter needs the "
                             f"prompt's target features), got {type(prefilled).__name__}")
        t0 = time.perf_counter()
        if prefilled is None:
            prompt = request.prompt if isinstance(request, Request) else np.asarray(request)
            prefilled = prefill_features(
                self.params, self.config.model, prompt, self.config.cache.prefill_chunk,
                self.dcfg.target_layers, self.dcfg.window, self.config.implementation)
            jax.block_until_ready(prefilled.last)
        prefill_s = time.perf_counter() - t0
        p = prefilled
        slot = super().admit(request, max_new_tokens, progress, prefilled=(p.caches, p.last))
        self.spec = fill_window(self.dparams, self.dcfg, self.spec, slot, p.feats, p.positions,
                                p.ok)
        self.requests[slot].admitted_at = t0  # the prefill ran here, before Engine.admit
        self.prefill_seconds += prefill_s
        return slot

    def block_lengths(self) -> np.ndarray:
        """[S] tokens each active slot verifies: gamma + 1, cut at the token that completes the
        tail page (so that only a block's last token can complete a page) and at the slot's
        reserved length; 0 for inactive slots."""
        cfg, page = self.config.model, self.config.cache.page_size
        m = cfg.csa_ratio
        page_end = ((self.lengths // m) // page * page + page) * m - 1  # completes the page
        room = np.minimum(page_end - self.lengths + 1, self.limit - self.lengths)
        return np.where(self.active, np.minimum(self.dcfg.gamma + 1, room), 0).astype(np.int32)

    def step(self, tokens=None, drafts=None) -> VerifyOutput:
        """One verification of every active slot; returns its ``VerifyOutput``."""
        if tokens is not None:
            raise ValueError("SpecEngine.step does not take forced tokens")
        full = self.active & (self.lengths >= self.limit)
        if full.any():
            raise RuntimeError(f"step: slots {np.flatnonzero(full).tolist()} reached their "
                               "reserved length (max_new_tokens or max_len); release them")
        for update in self.control.before_step():
            self.state = update(self.state)
        valid = self.block_lengths()
        out = self._verify(valid, drafts)
        emitted, emitted_tokens, next_token, union, per_query, u_sel, q_sel = jax.device_get(
            (out.emitted, out.tokens, out.next_token, out.union_misses, out.query_misses,
             out.union_selected, out.query_selected))
        now = time.perf_counter()
        for s in np.flatnonzero(self.active):
            new = self._emit(s, emitted_tokens[s, :emitted[s]].tolist())
            self.requests[s].token_times.extend([now] * new)
            self.acceptance.append(int(emitted[s]))
            self.decode_tokens += new
        self.next_token = np.where(self.active, next_token, self.next_token)
        before = self.lengths + emitted - 1
        for update in self.control.after_step(before, self.active & (emitted > 0)):
            self.state = update(self.state)
        self.lengths = self.lengths + emitted
        self.union_misses += int(union.sum())
        self.query_misses += int(per_query.sum())
        self.union_selected += int(u_sel.sum())
        self.query_selected += int(q_sel.sum())
        self.verifications += int(self.active.sum())
        return out

    def _emit(self, slot: int, tokens: list[int]) -> int:
        """Gives the request the block's tokens one by one until it is done (max_new_tokens,
        a stop token or a stop string: a block may commit past them, the request ends there,
        as with plain decoding); returns how many it took."""
        r, taken = self.requests[slot], 0
        for t in tokens:
            if r.done:
                break
            r.tokens.append(t)
            taken += 1
        return taken

    def _verify(self, valid: np.ndarray, drafts) -> VerifyOutput:
        t0 = time.perf_counter()
        temperature = self.config.sampling.temperature
        tokens, lengths = jnp.asarray(self.next_token), self.state.lengths
        self._draft_rng, key = jax.random.split(self._draft_rng)
        proposed, probs = draft_step(self.params, self.dparams, self.dcfg, self.spec, tokens,
                                     lengths, key, temperature)
        if drafts is not None:  # forced drafts where >= 0 (drawn from a point mass)
            forced = jnp.asarray(drafts, jnp.int32)
            mask = forced >= 0
            proposed = jnp.where(mask, forced, proposed)
            probs = jnp.where(mask[..., None], jax.nn.one_hot(
                proposed, self.config.model.vocab_size), probs)
        if self.time_drafter:
            jax.block_until_ready(proposed)
        t1 = time.perf_counter()
        self.state, self.spec, out = verify_step(self.params, self.dparams, self.config,
                                                 self.dcfg, self.state, self.spec, tokens,
                                                 proposed, probs, jnp.asarray(valid))
        jax.block_until_ready(out.emitted)
        t2 = time.perf_counter()
        if valid.any():
            self.draft_seconds += t1 - t0
            self.decode_seconds += t2 - t0
            self.steps += 1
        return out

    def drafter_seconds(self, reps: int = 10) -> float:
        """Mean seconds of one drafting of every slot (timed apart, after a compile)."""
        args = (self.params, self.dparams, self.dcfg, self.spec, jnp.asarray(self.next_token),
                self.state.lengths, self._draft_rng, self.config.sampling.temperature)
        jax.block_until_ready(draft_step(*args))
        t0 = time.perf_counter()
        for _ in range(reps):
            out = draft_step(*args)
        jax.block_until_ready(out)
        return (time.perf_counter() - t0) / reps

    def metrics(self) -> dict:
        acc = np.asarray(self.acceptance or [0])
        return {
            "method": self.config.method,
            "speculative": True,
            "gamma": self.dcfg.gamma,
            "verifications": self.verifications,
            "acceptance_length": float(acc.mean()),
            "acceptance_histogram": np.bincount(  # verifications emitting 0 .. gamma+1 tokens
                np.asarray(self.acceptance, np.int64),
                minlength=self.dcfg.gamma + 2).tolist(),
            "decode_tokens": self.decode_tokens,
            "decode_seconds": self.decode_seconds,
            "decode_tokens_per_second": self.decode_tokens / max(self.decode_seconds, 1e-9),
            "drafter_time_share": (self.draft_seconds / max(self.decode_seconds, 1e-9)
                                   if self.time_drafter else None),
            "steps": self.steps,
            "union_miss_rows": self.union_misses,
            "query_miss_rows": self.query_misses,
            "union_miss_ratio": (self.union_misses / self.query_misses if self.query_misses
                                 else None),  # None: no query missed (nothing to share)
            "selection_union_ratio": (self.union_selected / self.query_selected
                                      if self.query_selected else None),  # None: no sparse layer
            "device_bytes_per_request": self.slot_bytes,
            "spec_state_bytes_per_request": sum(
                a.nbytes for a in jax.tree.leaves(self.spec)) // self.active.size,
            **self.control.metrics(self.state),
        }


__all__ = ["PerQueryIndex", "SpecEngine", "SpecPrefill", "SpecState", "UnionKV",
           "VerifyOutput", "accept_greedy", "accept_sampled", "check_spec", "commit",
           "commit_ring", "draft_step", "empty_spec_state", "feature_chunks", "fill_window",
           "prefill_features", "selection_overlap", "verify_step"]

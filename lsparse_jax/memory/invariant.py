"""The hierarchy's invariant: every compressed row is on the GPU or has a host copy.

Checked against the same rows held fully resident (a ``resident`` run of the same requests).
Used by the tests after every step; also handy when changing a policy.
"""

from __future__ import annotations

import jax
import numpy as np

from lsparse_jax.config import EngineConfig
from lsparse_jax.memory.hot_cache import HotCache
from lsparse_jax.memory.key_store import host_rows_numpy
from lsparse_jax.model.cache import CSACache, DSACache


def _read(x) -> np.ndarray:
    """x's values, leaving nothing cached in x: ``np.asarray`` of a jax array caches its numpy
    value on the array; on a GPU the next step then failed to donate the state ("Donation
    requested for buffer with external reference", H100, session 33, FP8 rows in pinned_host
    pools: most likely that value is a zero-copy view of a host buffer). Read through a copy,
    the same test passes (H200)."""
    return np.asarray(x.copy() if isinstance(x, jax.Array) else x)


def _same(a, b) -> bool:
    """Bit equality that also holds for NaN payloads and FP8 values."""
    a, b = _read(a), _read(b)
    return a.shape == b.shape and a.tobytes() == b.tobytes()


def _check_store(name, tail, pool, cache, table, truth, done, paged, page, s, bad):
    """Rows < done must be in the tail (>= paged) or in the slot's host pages; every occupied
    cache row must hold the truth row of its position, no position twice."""
    leaves = lambda t: t if isinstance(t, tuple) else (t,)  # noqa: E731
    for i in range(done):
        if i >= paged:
            got = [leaf[s, i - paged] for leaf in leaves(tail)]
        elif table[s, i // page] < 0:
            bad.append(f"{name} slot {s} row {i}: no host page")
            continue
        else:
            got = [leaf[table[s, i // page] * page + i % page] for leaf in leaves(pool)]
        if not all(_same(g, w[s, i]) for g, w in zip(got, leaves(truth))):
            bad.append(f"{name} slot {s} row {i}: {'tail' if i >= paged else 'host'} differs")
    pos = _read(cache.positions)[s]
    held = pos[pos >= 0]
    if len(set(held.tolist())) != held.size:
        bad.append(f"{name} slot {s}: a position is cached twice")
    rows = [_read(leaf) for leaf in leaves(cache.rows)]
    for j in np.flatnonzero(pos >= 0):
        p = pos[j]
        if p >= paged or not all(_same(r[s, j], w[s, p]) for r, w in zip(rows, leaves(truth))):
            bad.append(f"{name} slot {s} cache row {j} (position {p}) is stale")


def _check_lent(layer, optional, ready, truth, paged, page, s, bad):
    """Every optional page lent to the slot holds the truth rows of its (paged) logical page
    (optional, truth: an array or a tuple of arrays, one per array of a row)."""
    leaves = lambda t: t if isinstance(t, tuple) else (t,)  # noqa: E731
    for logical in np.flatnonzero(ready >= 0):
        at, want = ready[logical] * page, logical * page
        same = all(_same(o[at:at + page], w[want:want + page])
                   for o, w in zip(leaves(optional), leaves(truth)))
        if (logical + 1) * page > paged or not same:
            bad.append(f"layer {layer} slot {s}: optional page of logical page {logical} "
                       "is stale or not yet paged")


def hierarchy_violations(engine: EngineConfig, state, truth_caches, active,
                         encode_keys=None, layers=None) -> list[str]:
    """Lists every row that is lost or wrong (empty list = invariant holds).

    state: a paged DecodeState (its tier has ``kv_pools`` and ``page_table``, and where the
    method has them ``key_pools``, ``optional_pools`` and ``ready``); truth_caches: the caches
    of a resident DecodeState holding the same requests in the same slots; active [S] bool:
    slots to check. Covers compressed KV (tail, host pages, hot cache, adaptive's lent
    optional pages) and, for leansparse, FP8 indexer keys (tail, host pages, key cache) and
    the PQ codes of paged keys (``encode_keys(values, scales, layer)`` -> codes); paged DSA
    layers alike (rows per token, pages of P * m rows; a member under location reuse holds
    its hot rows at its leader's hot positions).
    ``layers`` limits the check (an approximate method changes the rows of later layers, so
    only layers before its first approximate selection can be checked against resident).
    """
    cfg, m = engine.model, engine.model.csa_ratio
    lengths = _read(state.lengths)
    tier = state.tier
    table = _read(tier.page_table)
    np_tree = lambda t: tuple(_read(x) for x in t)  # noqa: E731
    # KV rows: one array, or a tuple of arrays (quant.KVRowFormat other than f32/bf16)
    np_rows = lambda t: np_tree(t) if isinstance(t, tuple) else _read(t)  # noqa: E731
    at_slot = lambda t, s: tuple(x[s] for x in t) if isinstance(t, tuple) else t[s]  # noqa
    bad = []
    for layer, (cache, truth) in enumerate(zip(state.caches, truth_caches)):
        paged_dsa = isinstance(cache, DSACache) and tier.kv_pools[layer] is not None
        if not (isinstance(cache, CSACache) or paged_dsa) or (layers is not None
                                                             and layer not in layers):
            continue
        stride = 1 if paged_dsa else m  # tokens per row
        page = engine.cache.page_size * m // stride  # rows per page id
        hot = cache.kv.hot
        if not isinstance(hot, HotCache):  # a DSA member under location reuse: rows only,
            #   at its leader's hot positions
            lead = state.caches[cfg.dsa_leader(layer)].kv.hot
            hot = HotCache(cache.kv.hot, lead.positions, lead.stamps, lead.clock)
        want_kv = np_rows(truth.kv.entries)
        has_keys = engine.storage.keys_on_host and cache.keys is not None
        if has_keys:
            want_keys = (_read(truth.keys.values), _read(truth.keys.scales))
        for s in np.flatnonzero(active):
            done = int(lengths[s]) // stride
            paged = done // page * page
            _check_store(f"layer {layer} kv", np_rows(cache.kv.tail),
                         np_rows(tier.kv_pools[layer]), hot, table, want_kv, done,
                         paged, page, s, bad)
            if engine.storage.lent_pages:
                _check_lent(layer, np_rows(tier.optional_pools[layer]),
                            _read(tier.ready)[s], at_slot(want_kv, s), paged, page, s,
                            bad)
            if has_keys:
                _check_store(f"layer {layer} keys", np_tree(cache.keys.tail),
                             host_rows_numpy(tier.key_pools[layer]), cache.keys.cache, table,
                             want_keys, done, paged, page, s, bad)
                if encode_keys is not None and paged:
                    want = _read(encode_keys(want_keys[0][s, :paged],
                                             want_keys[1][s, :paged], layer))
                    if engine.cache.device_pages is None or paged_dsa:
                        codes = _read(cache.keys.codes)[s, :paged]
                    else:  # the slot's device pages of the codes pool
                        rows = np.arange(paged)
                        dev = _read(tier.pools.page_table)[s, rows // page]
                        codes = _read(tier.pools.codes[layer])[dev * page + rows % page]
                        if (dev < 0).any():
                            bad.append(f"layer {layer} slot {s}: a paged code has no device "
                                       "page")
                    if not _same(codes, want):
                        bad.append(f"layer {layer} slot {s}: PQ codes differ from encode()")
    return bad

"""The hierarchy's invariant: every compressed row is on the GPU or has a host copy.

Checked against the same rows held fully resident (a ``resident`` run of the same requests).
Used by the tests after every step; also handy when changing a policy.
"""

from __future__ import annotations

import numpy as np

from lsparse_jax.config import EngineConfig
from lsparse_jax.model.cache import CSACache


def hierarchy_violations(engine: EngineConfig, state, truth_caches, active) -> list[str]:
    """Lists every row that is lost or wrong (empty list = invariant holds).

    state: a paged DecodeState; truth_caches: the caches of a resident DecodeState holding the
    same requests in the same slots; active [S] bool: slots to check.
    For each active slot and CSA layer, rows 0 .. completed-1 must be bit-equal to the truth
    either in the tail (rows >= paged) or in the slot's host pages (rows < paged); every
    occupied hot-cache row must equal the truth row of the position it claims, with no
    position held twice.
    """
    page, m = engine.cache.page_size, engine.model.csa_ratio
    lengths = np.asarray(state.lengths)
    table = np.asarray(state.host.page_table)
    bad = []
    for layer, (cache, truth) in enumerate(zip(state.caches, truth_caches)):
        if not isinstance(cache, CSACache):
            continue
        pool = np.asarray(state.host.pools[layer])
        tails = np.asarray(cache.kv.tail)
        hot_rows, hot_pos = np.asarray(cache.kv.hot.rows), np.asarray(cache.kv.hot.positions)
        want = np.asarray(truth.kv.entries)
        for s in np.flatnonzero(active):
            done = int(lengths[s]) // m
            paged = done // page * page
            for i in range(done):
                if i >= paged:
                    got = tails[s, i - paged]
                elif table[s, i // page] < 0:
                    bad.append(f"layer {layer} slot {s} row {i}: no host page")
                    continue
                else:
                    got = pool[table[s, i // page], i % page]
                if not np.array_equal(got, want[s, i]):
                    where = "tail" if i >= paged else "host"
                    bad.append(f"layer {layer} slot {s} row {i}: {where} copy differs")
            held = hot_pos[s][hot_pos[s] >= 0]
            if len(set(held.tolist())) != held.size:
                bad.append(f"layer {layer} slot {s}: a position is cached twice")
            for j in np.flatnonzero(hot_pos[s] >= 0):
                p = hot_pos[s, j]
                if p >= paged or not np.array_equal(hot_rows[s, j], want[s, p]):
                    bad.append(f"layer {layer} slot {s} hot row {j} (position {p}) is stale")
    return bad

"""Benchmark case of the ``hot_resolve`` kernel op for experiments/kernel_compare.py.

Notation: B requests (vmapped), k selected positions per request, R hot rows per request,
D values per row (f32), P rows per host page, M = round(miss_fraction * k) misses per request.
Defaults: HiSparse decode at batch 64, k = 512 (V4-Flash top-k), R = 2048, D = 512 f32 (2 KiB
rows), 5% misses, a 1 GiB pinned_host pool shared by all requests (64-row pages).

bytes = B * M * D * 4, the missed rows. The binding resource is the host link (~48 GB/s
pinned_host -> device measured on the H200), not HBM: kernel_compare's roofline divides bytes
by 3.0 TB/s, so the case also carries ``params["link_bytes"]`` (the same bytes) for reporting
% of LINK_BYTES_PER_S. The hot rows, positions and stamps are donated (``Case.donate``), as
the decode step donates its state: the op writes them in place. Until session 43 they were
not, and every implementation also paid one copy of the B * R * D * 4 hot rows per call
(268 MB: ~178 us of a ~0.3 ms call on the H100).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

LINK_BYTES_PER_S = 48e9  # measured pinned_host -> device on the H200 (../shared/gpu_facts)
HOST = jax.memory.Space.Host


def make_pool(key, batch, dim=512, page=64, pool_gib=1.0):
    """(pool [NP * P, D] f32 in pinned_host, page_table [B, MP] int32): NP pages of random rows
    (about ``pool_gib``), split among the B requests in a random page order."""
    num_pages = int(pool_gib * 2**30) // (page * dim * 4)
    per_request = num_pages // batch
    kp, kt = jax.random.split(key)
    pool = jax.device_put(jax.random.normal(kp, (num_pages * page, dim), jnp.float32), HOST)
    order = jax.random.permutation(kt, num_pages)[:batch * per_request]
    return pool, order.reshape(batch, per_request).astype(jnp.int32)


def make_inputs(key, batch, k, rows, dim, miss_fraction, page_table, page=64):
    """Per-request (selected [B, k], hot_rows [B, R, D], hot_positions [B, R], hot_stamps
    [B, R], clock [B]) of a full hot cache where exactly M selected positions miss.

    Each request draws a random order of its MP * P positions: the first R are held (random
    distinct stamps, all older than this step), k - M of them are selected (hits), and the next
    M positions are the misses; the selection is shuffled.
    """
    n_miss = int(round(miss_fraction * k))
    universe = page_table.shape[1] * page
    if universe < rows + n_miss:
        raise ValueError(f"hot_resolve case: {universe} positions per request < R + M")
    k1, k2, k3, k4, k5 = jax.random.split(key, 5)
    order = jnp.argsort(jax.random.uniform(k1, (batch, universe)), axis=1).astype(jnp.int32)
    held = order[:, :rows]
    pick = jnp.argsort(jax.random.uniform(k2, (batch, rows)), axis=1)[:, :k - n_miss]
    chosen = jnp.concatenate([jnp.take_along_axis(held, pick, axis=1),
                              order[:, rows:rows + n_miss]], axis=1)
    shuffle = jnp.argsort(jax.random.uniform(k3, (batch, k)), axis=1)
    selected = jnp.take_along_axis(chosen, shuffle, axis=1)
    stamps = jnp.argsort(jax.random.uniform(k4, (batch, rows)), axis=1).astype(jnp.int32)
    clock = jnp.full((batch,), -(-rows // k) + 1, jnp.int32)  # clock * k > every stamp
    hot_rows = jax.random.normal(k5, (batch, rows, dim), jnp.float32)
    return selected, hot_rows, held, stamps, clock


def batched_hot_resolve(implementation, page=64):
    """vmap over requests of ``hot_resolve`` (page table per request, pool shared)."""
    from pallas_kernels.hot_resolve.api import hot_resolve

    def one(selected, hot_rows, positions, stamps, clock, table, pool):
        return hot_resolve(selected, hot_rows, positions, stamps, clock, table, pool,
                           page_size=page, implementation=implementation)

    return jax.vmap(one, in_axes=(0, 0, 0, 0, 0, 0, None))


def hot_resolve_case(batch=64, k=512, rows=2048, dim=512, miss_fraction=0.05, page=64,
                     pool_gib=1.0):
    """``experiments.kernel_compare.Case`` of ``hot_resolve`` (f32 rows; see the module doc)."""
    from experiments.kernel_compare import Case  # lazy: kernel_compare registers this case

    n_miss = int(round(miss_fraction * k))
    link_bytes = float(batch * n_miss * dim * 4)
    shared = {}

    def make(key):
        if "pool" not in shared:  # one pool for every input set
            shared["pool"], shared["table"] = make_pool(jax.random.key(1234), batch, dim,
                                                        page, pool_gib)
        return make_inputs(key, batch, k, rows, dim, miss_fraction, shared["table"],
                           page) + (shared["table"], shared["pool"])

    return Case("hot_resolve", dict(B=batch, k=k, R=rows, D=dim, misses=n_miss,
                                    miss_fraction=miss_fraction, link_bytes=link_bytes),
                flops=0.0, bytes=link_bytes, make=make,
                call=lambda impl, *a: batched_hot_resolve(impl, page)(*a), donate=(1, 2, 3))

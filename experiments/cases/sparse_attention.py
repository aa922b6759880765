"""Benchmark case of the ``sparse_attention`` kernel op for experiments/kernel_compare.py.

Notation: B requests (one decode query each), H heads, D head dim, R table rows per request,
K selected rows (distinct slots), W window rows (all valid). Defaults: the V4-Flash CSA
decode shape (H = 64, D = 512, K = 512, W = 128, bf16).
FLOPs = 4 B H (K + W) D (QK and PV); bytes = the rows read, B (K + W) D itemsize, plus q (and
the f32 out), the slots and the window mask.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def make_inputs(key, batch, k=512, window=128, heads=64, dim=512, rows=2048,
                dtype="bfloat16"):
    """(q, table, slots, window, window_mask, sink) with K distinct random slots a request."""
    dt = jnp.dtype(dtype)
    kq, kt, ks, kw, kk = jax.random.split(key, 5)
    q = jax.random.normal(kq, (batch, heads, dim), jnp.float32).astype(dt)
    table = jax.random.normal(kt, (batch, rows, dim), jnp.float32).astype(dt)
    order = jnp.argsort(jax.random.uniform(ks, (batch, rows)), axis=1)  # distinct rows
    slots = order[:, :k].astype(jnp.int32)
    win = jax.random.normal(kw, (batch, window, dim), jnp.float32).astype(dt)
    mask = jnp.ones((batch, window), bool)
    sink = jax.random.normal(kk, (heads,), jnp.float32)
    return q, table, slots, win, mask, sink


def flops_and_bytes(batch, k, window, heads, dim, dtype) -> tuple[float, float]:
    item = jnp.dtype(dtype).itemsize
    flops = 4.0 * batch * heads * (k + window) * dim
    nbytes = (batch * (k + window) * dim * item + batch * heads * dim * (item + 4)
              + batch * k * 4 + batch * window)
    return flops, float(nbytes)


def sparse_attention_case(batch, k=512, window=128, heads=64, dim=512, rows=2048,
                          dtype="bfloat16"):
    """``experiments.kernel_compare.Case`` of ``sparse_attention`` at one shape."""
    from experiments.kernel_compare import Case  # lazy: kernel_compare registers this case
    from pallas_kernels.sparse_attention.api import sparse_attention
    from pallas_kernels.sparse_attention.triton import sparse_attention_triton

    flops, nbytes = flops_and_bytes(batch, k, window, heads, dim, dtype)

    def call(impl, *args):  # "triton_fused": the Triton kernel with its splits merged inside
        if impl == "triton_fused":
            return sparse_attention_triton(*args, fused_combine=True)
        return sparse_attention(*args, implementation=impl)

    def make(key):
        return make_inputs(key, batch, k, window, heads, dim, rows, dtype)

    return Case("sparse_attention", dict(B=batch, k=k, W=window, H=heads, D=dim, R=rows,
                                         dtype=dtype),
                flops=flops, bytes=nbytes, make=make,
                call=call)

"""Run by tests/test_kernel_pq_topc_interpreted.py in a fresh process with TRITON_INTERPRET=1:
the jax-triton score kernel under Triton's interpreter for each launch variant and codes
layout, against ``jax_triton.emulated_scores`` (the kernel's math in jnp). Prints one JSON
line per case. precision "fp8" only: Triton 3.6's interpreter computes bf16 ``tl.dot``s
wrongly (a 16 x 16 x 16 product of normal bf16 values came out 2.8e10 off), so the bf16
kernel stays with the GPU tests."""

from __future__ import annotations

import json
import sys

import jax.numpy as jnp
import numpy as np

from pallas_kernels.pq_topc import interpreted
from pallas_kernels.pq_topc import jax_triton as jt

B, N, H, M, K, DS, PAGE = 3, 512, 64, 32, 256, 4, 64
VARIANTS = {
    "default": jt.Params(block_n=64, steps=2),
    "prefetch": jt.Params(block_n=64, steps=2, prefetch=True),
    "book_per_tile": jt.Params(block_n=64, steps=2, book_per_tile=True),
    "prefetch+book_per_tile": jt.Params(block_n=64, steps=2, prefetch=True,
                                        book_per_tile=True),
    "smem (swizzled)": jt.Params(block_n=64, steps=2, decode="smem"),
    "keys_as_b": jt.Params(block_n=64, steps=2, book_per_tile=True, keys_as_b=True),
}


def inputs(seed: int):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(B, H, M * DS)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(B, H)), jnp.float32)
    codes = jnp.asarray(rng.integers(0, K, size=(B, N, M)), jnp.uint8)
    books = jnp.asarray(rng.normal(size=(M, K, DS)), jnp.float32)
    lengths = jnp.asarray([N, 300, 0], jnp.int32)  # whole, a partial tile, empty
    return q, w, codes, books, lengths


def paged(codes, seed: int):
    """codes [B, N, M] -> (a shuffled pool [R, M] with a spare page, page table [B, N / P])."""
    rng = np.random.default_rng(seed)
    pages = np.asarray(codes).reshape(-1, PAGE, M)  # B * N / P pages, request-major
    order = rng.permutation(len(pages) + 1)  # one spare pool page (garbage) stays unmapped
    pool = rng.integers(0, K, size=(len(pages) + 1, PAGE, M)).astype(np.uint8)
    pool[order[:len(pages)]] = pages
    table = order[:len(pages)].reshape(B, N // PAGE).astype(np.int32)
    return jnp.asarray(pool.reshape(-1, M)), jnp.asarray(table)


def main() -> int:
    q, w, codes, books, lengths = inputs(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
    pool, table = paged(codes, 1)
    want = np.asarray(jt.emulated_scores(q, w, codes, books, lengths, precision="fp8"))
    live = np.isfinite(want)
    for name, params in VARIANTS.items():
        for layout in ("contiguous", "paged"):
            extra = {} if layout == "contiguous" else dict(page_table=table, page=PAGE)
            got = interpreted.interpreted_scores(
                q, w, pool if extra else codes, books, lengths, params=params,
                precision="fp8", **extra)
            print(json.dumps(dict(
                variant=name, precision="fp8", layout=layout,
                mask_ok=bool(np.array_equal(np.isneginf(got), ~live)),
                max_abs_err=float(np.abs(got[live] - want[live]).max()),
                scale=float(np.abs(want[live]).max()))), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

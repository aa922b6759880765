"""Plain Triton kernel of ``index_scores`` (``triton.language``), called through jax-triton.

Notation:
  B requests, H indexer heads, D head dim, C gathered candidates per request,
  NB scale blocks per key, BS = D / NB values per scale block,
  HP = H padded to a power of two >= 16 (the smallest tl.dot dimension; masked, not copied),
  BC = candidates per block, STEPS = blocks per program (powers of two).

Same design as the Pallas kernel (``triton.py``): grid (B, cdiv(C, STEPS * BC)); program (b, i)
loads q[b] [HP, D] as bf16 and, for each of its STEPS blocks of BC candidates (a loop Triton
software-pipelines when STEPS > 1), the FP8 key block [BC, D] cast to bf16, accumulates
sum_j dot(k[:, j], q[:, j]^T) * scale[:, j] in f32 -> [BC, HP], applies ReLU and the weighted
sum over heads, and writes -inf to invalid rows with tl.where (NaN poison stays in its own
row and is selected away). Rows past C and heads past H are masked loads (other = 0).

``triton`` and ``jax_triton`` are imported lazily, so the package imports without them; this
path needs a CUDA GPU (jax-triton 0.3.1 with triton 3.6 on the H200 image).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.index_scores.triton import check_triton_shapes, padded_heads, resolve_config


@functools.cache
def _kernel():
    """Builds the @triton.jit kernel on first use (imports triton lazily)."""
    import triton
    import triton.language as tl

    @triton.jit
    def index_scores_kernel(
        # inputs
        q_ptr,       # [B, H, D]   f32 or bf16
        w_ptr,       # [B, H]      f32
        kv_ptr,      # [B, C, D]   fp8e4nv
        ks_ptr,      # [B, C, NB]  f32
        valid_ptr,   # [B, C]      i1 (bool, stored as bytes)
        # outputs
        out_ptr,     # [B, C]      f32
        # scratch: none
        C: tl.constexpr, H: tl.constexpr, D: tl.constexpr, NB: tl.constexpr,
        BS: tl.constexpr, HP: tl.constexpr, BC: tl.constexpr, STEPS: tl.constexpr,
    ):
        b = tl.program_id(0).to(tl.int64)
        first = tl.program_id(1) * (BC * STEPS)                    # first candidate of program
        heads = tl.arange(0, HP)                                   # [HP]
        head_ok = heads < H
        cols = tl.arange(0, BS)                                    # [BS]
        q_base = q_ptr + b * H * D + heads[None, :] * D + cols[:, None]  # [BS, HP] -> q^T
        w = tl.load(w_ptr + b * H + heads, mask=head_ok, other=0.0)      # [HP]
        if NB == 1:  # V4: q^T loaded once per program
            qt0 = tl.load(q_base, mask=head_ok[None, :], other=0.0).to(tl.bfloat16)
        for t in range(STEPS):
            rows = first + t * BC + tl.arange(0, BC)               # [BC] candidate ids
            row_ok = rows < C
            dots = tl.zeros((BC, HP), dtype=tl.float32)
            for j in tl.static_range(NB):
                k_ptrs = kv_ptr + b * C * D + rows[:, None] * D + (j * BS + cols)[None, :]
                k = tl.load(k_ptrs, mask=row_ok[:, None], other=0.0)  # [BC, BS] fp8
                if NB == 1:
                    qt = qt0
                else:
                    qt = tl.load(q_base + j * BS, mask=head_ok[None, :], other=0.0)
                    qt = qt.to(tl.bfloat16)                        # [BS, HP]
                part = tl.dot(k.to(tl.bfloat16), qt)               # [BC, HP] f32
                s = tl.load(ks_ptr + b * C * NB + rows * NB + j, mask=row_ok, other=0.0)
                dots += part * s[:, None]                          # scale of block j
            scores = tl.sum(tl.maximum(dots, 0.0) * w[None, :], axis=1)  # [BC]
            valid = tl.load(valid_ptr + b * C + rows, mask=row_ok, other=0)
            scores = tl.where(valid, scores, float("-inf"))        # drops NaN poison
            tl.store(out_ptr + b * C + rows, scores, mask=row_ok)

    return index_scores_kernel


def index_scores_jax_triton(q: jnp.ndarray, weights: jnp.ndarray, key_values: jnp.ndarray,
                            key_scales: jnp.ndarray, valid: jnp.ndarray, *,
                            block_c: int | None = None, steps: int | None = None,
                            num_warps: int | None = None,
                            num_stages: int | None = None) -> jnp.ndarray:
    """``index_scores`` as a plain Triton kernel launched by ``jax_triton.triton_call``.

    Inputs: q [B, H, D] f32/bf16, weights [B, H] f32, key_values [B, C, D] float8_e4m3fn,
    key_scales [B, C, NB] f32, valid [B, C] bool (checked by ``api.index_scores``).
    Output: scores [B, C] f32, -inf on invalid rows. Needs a CUDA GPU.
    Tuning knobs as in ``triton.index_scores_triton`` (None = ``triton.default_config``).
    """
    import jax_triton

    b, h, d = q.shape
    c, nb = key_values.shape[1], key_scales.shape[2]
    check_triton_shapes("index_scores", d, nb)
    block_c, steps, num_warps = resolve_config(b, h, c, block_c, steps, num_warps)
    return jax_triton.triton_call(
        q, weights.astype(jnp.float32), key_values, key_scales, valid,
        kernel=_kernel(),
        out_shape=jax.ShapeDtypeStruct((b, c), jnp.float32),
        grid=(b, -(-c // (block_c * steps))),
        num_warps=num_warps,
        num_stages=num_stages,
        C=c, H=h, D=d, NB=nb, BS=d // nb, HP=padded_heads(h), BC=block_c, STEPS=steps,
    )

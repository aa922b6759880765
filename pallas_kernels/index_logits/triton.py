"""Pallas (Triton lowering) kernel of ``index_logits``: a GEMM whose epilogue is the indexer's
ReLU and head sum, so the [T, H, N] products never leave registers.

Notation:
  T queries, H heads (HP: padded to a power of two >= 16, zero weights), D head dim (a power of
  two >= 16), N keys; BT queries per program, BM = BT HP rows of the GEMM (query-major: row
  t HP + h), BN keys per block, STEPS blocks per program.

Design: the products q[t, h] . k[n] are one GEMM of M = T HP rows (q viewed as [T HP, D], a
free reshape) against the N keys (K = D: one tensor-core dot per tile, no K loop). Grid
(cdiv(T, BT), cdiv(N, STEPS BN)); program (i, j) loads its BM rows of q (cast to bf16) and
their weights once, then for each of its STEPS key blocks: keys [BN, D] -> bf16, dots [BM, BN]
(f32 accumulation), ReLU, times each row's weight, summed over the HP rows of each query
(reshape [BT, HP, BN], sum over HP) -> [BT, BN] logits written out, -inf at keys >= num_keys.
A program whose keys all lie at or past num_keys computes nothing and writes -inf (a prefill
chunk scores only the history so far: half the keys on average). Bytes per program: BM D q
values once, STEPS BN D keys, BT STEPS BN f32 out; the XLA twin writes and reads back the
[T, H, N] f32 products instead (HP = 64 times the output).
Padding: T to whole programs and N to whole key blocks with zeros (sliced off), H to HP with
zero q and zero weights (adding nothing). NaN in a key reaches only its own column.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels import common

MIN_DOT = 16  # smallest dimension of a Triton tl.dot


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def check_triton_shapes(d: int) -> None:
    """Raises ValueError unless D is a power of two >= 16 (a tl.dot contraction)."""
    if d < MIN_DOT or d & (d - 1):
        raise ValueError(f"index_logits: implementation='triton' needs the head dim D a power "
                         f"of two >= {MIN_DOT}, got D={d}; use implementation='xla'")


def default_config(t: int, h: int, n: int) -> dict:
    """BM = BT HP = 256 GEMM rows (BT = 4 queries at H = 64), BN = 64 keys a block, STEPS = 16
    blocks a program (fewer for short N), 4 warps: a [256, 64] f32 accumulator is 128
    registers a thread. H200, T 1024, H 64, D 128 (session 27, benchmarks/index_logits_gpu.py):
    BT 4 took 2.93 / 11.05 / 21.56 ms at N 32768 / 131072 / 262144 against BT 2's 3.19 /
    12.22 / 24.10 (187-204 TFLOP/s)."""
    hp = max(MIN_DOT, _pow2(h))
    bt = max(1, min(_pow2(t), 256 // hp))
    bn = 64
    steps = max(1, min(16, _pow2(-(-n // bn))))
    return dict(block_t=bt, block_n=bn, steps=steps, num_warps=4, num_stages=2)


def _kernel(n_ref, q_ref, w_ref, k_ref, out_ref, *, bt: int, hp: int, bn: int, steps: int):
    # inputs
    #   n_ref    [1]            int32 num_keys
    #   q_ref    [BT HP, D]     f32 or bf16 (row t HP + h: query t, head h)
    #   w_ref    [BT HP]        f32
    #   k_ref    [STEPS BN, D]  f32 or bf16
    # outputs
    #   out_ref  [BT, STEPS BN] f32
    num_keys = n_ref[0]
    first = pl.program_id(1) * (steps * bn)                       # this program's first key

    @pl.when(first >= num_keys)
    def _():
        out_ref[...] = jnp.full((bt, steps * bn), -jnp.inf, jnp.float32)

    @pl.when(first < num_keys)
    def _():
        a = q_ref[...].astype(jnp.bfloat16)                       # [BM, D], loaded once
        w = w_ref[...].astype(jnp.float32)                        # [BM]

        def block(start):
            cols = pl.ds(start, bn)
            k = k_ref[cols, :].astype(jnp.bfloat16)               # [BN, D]
            dots = jax.lax.dot_general(a, k, (((1,), (1,)), ((), ())),
                                       preferred_element_type=jnp.float32)  # [BM, BN]
            weighted = jnp.maximum(dots, 0.0) * w[:, None]
            logits = jnp.sum(weighted.reshape(bt, hp, bn), axis=1)  # [BT, BN]
            key = first + start + jax.lax.broadcasted_iota(jnp.int32, (bt, bn), 1)
            out_ref[:, cols] = jnp.where(key < num_keys, logits, -jnp.inf)

        common.each_block(steps, bn, block)


@functools.partial(jax.jit, static_argnames=("block_t", "block_n", "steps", "num_warps",
                                             "num_stages"))
def index_logits_triton(q: jnp.ndarray, weights: jnp.ndarray, keys: jnp.ndarray,
                        num_keys: jnp.ndarray | int | None = None, *,
                        block_t: int | None = None, block_n: int | None = None,
                        steps: int | None = None, num_warps: int | None = None,
                        num_stages: int | None = None) -> jnp.ndarray:
    """Pallas-Triton ``index_logits`` (interpret mode without a GPU).

    Inputs: q [T, H, D] f32/bf16, weights [T, H], keys [N, D] f32/bf16, num_keys an int32
    scalar in [0, N] (None: N) (checked by ``api.index_logits``). Output: logits [T, N] f32,
    -inf at n >= num_keys.
    Tuning (None = ``default_config``; powers of two): block_t (BT queries a program), block_n
    (BN keys a block), steps (key blocks a program), num_warps, num_stages.
    """
    t, h, d = q.shape
    n = keys.shape[0]
    check_triton_shapes(d)
    cfg = default_config(t, h, n)
    bt = cfg["block_t"] if block_t is None else block_t
    bn = cfg["block_n"] if block_n is None else block_n
    steps = cfg["steps"] if steps is None else steps
    for name, v in (("block_t", bt), ("block_n", bn), ("steps", steps)):
        if v < 1 or v & (v - 1):
            raise ValueError(f"index_logits: {name}={v} must be a power of two")
    hp = max(MIN_DOT, _pow2(h))
    if bn < MIN_DOT:
        raise ValueError(f"index_logits: block_n={bn} must be >= {MIN_DOT}")
    t_pad, cols = -(-t // bt) * bt, bn * steps
    n_pad = -(-n // cols) * cols
    q = jnp.pad(q, ((0, t_pad - t), (0, hp - h), (0, 0))).reshape(t_pad * hp, d)
    w = jnp.pad(weights.astype(jnp.float32), ((0, t_pad - t), (0, hp - h))).reshape(-1)
    keys = jnp.pad(keys, ((0, n_pad - n), (0, 0)))
    num_keys = jnp.reshape(jnp.asarray(n if num_keys is None else num_keys, jnp.int32), (1,))
    kernel = functools.partial(_kernel, bt=bt, hp=hp, bn=bn, steps=steps)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((t_pad, n_pad), jnp.float32),
        grid=(t_pad // bt, n_pad // cols),
        in_specs=[
            pl.BlockSpec((1,), lambda i, j: (0,)),                 # num_keys
            pl.BlockSpec((bt * hp, d), lambda i, j: (i, 0)),       # q rows
            pl.BlockSpec((bt * hp,), lambda i, j: (i,)),           # weights
            pl.BlockSpec((cols, d), lambda i, j: (j, 0)),          # keys
        ],
        out_specs=pl.BlockSpec((bt, cols), lambda i, j: (i, j)),
        compiler_params=plt.CompilerParams(
            num_warps=cfg["num_warps"] if num_warps is None else num_warps,
            num_stages=cfg["num_stages"] if num_stages is None else num_stages),
        interpret=common.interpret(),
        name="index_logits",
    )(num_keys, q, w, keys)[:t, :n]

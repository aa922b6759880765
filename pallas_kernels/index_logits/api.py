"""Public entry point of ``index_logits``: indexer logits of T queries against N shared keys.

Notation: T queries, H indexer heads, D head dim, N keys (a prefill chunk's queries against
its layer's compressed keys).

Math: logits[t, n] = sum_h weights[t, h] * ReLU(q[t, h] . keys[n]), q and keys rounded to bf16,
products and sums in f32, for n < num_keys; -inf for n >= num_keys (a prefill chunk's keys past
the history so far: the kernel skips their blocks). NaN in a key reaches only its own column.

Implementations: "xla" (``reference.py``: the [T, H, N] products materialized), "triton"
(``triton.py``: Pallas lowered through Triton, interpret mode without a GPU; the head sum
happens in registers, so only [T, N] is written). None picks "triton" on a GPU and "xla"
elsewhere. Both need T >= 1, N >= 1; "triton" needs D a power of two >= 16.
"""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels import common

OP = "index_logits"
AVAILABLE = ("xla", "triton")
FASTEST_ON_GPU = "triton"


def _check(q, weights, keys) -> None:
    """Raises ValueError naming the first argument with a bad shape or dtype."""
    def fail(arg, what):
        raise ValueError(f"{OP}: {arg} {what}")

    floats = (jnp.float32, jnp.bfloat16)
    if q.ndim != 3 or q.dtype not in floats:
        fail("q", f"must be [T, H, D] float32 or bfloat16, got {q.dtype}{list(q.shape)}")
    t, h, d = q.shape
    if weights.shape != (t, h) or weights.dtype not in floats:
        fail("weights", f"must be [T, H] = {[t, h]} float32 or bfloat16, got "
             f"{weights.dtype}{list(weights.shape)}")
    if keys.ndim != 2 or keys.shape[1] != d or keys.dtype not in floats:
        fail("keys", f"must be [N, D] with D={d}, float32 or bfloat16, got "
             f"{keys.dtype}{list(keys.shape)}")


def index_logits(q, weights, keys, num_keys=None, *,
                 implementation: str | None = None) -> jnp.ndarray:
    """Indexer logits [T, N] f32 of q [T, H, D] with head weights [T, H] against keys [N, D];
    num_keys: an int32 scalar (traced or not), the keys that count (None: all N), -inf past it.

    Raises ValueError for bad shapes or dtypes (naming the argument), unknown or unavailable
    implementations, and shapes an implementation does not support."""
    impl = common.choose(OP, implementation, AVAILABLE, FASTEST_ON_GPU)
    q, weights, keys = (jnp.asarray(a) for a in (q, weights, keys))
    _check(q, weights, keys)
    n = keys.shape[0]
    num_keys = jnp.asarray(n if num_keys is None else num_keys)
    if num_keys.shape != () or not jnp.issubdtype(num_keys.dtype, jnp.integer):
        raise ValueError(f"{OP}: num_keys must be an integer scalar, got "
                         f"{num_keys.dtype}{list(num_keys.shape)}")
    num_keys = jnp.clip(num_keys.astype(jnp.int32), 0, n)
    if q.shape[0] == 0 or n == 0:
        return jnp.zeros((q.shape[0], n), jnp.float32)
    if impl == "xla":
        from pallas_kernels.index_logits.reference import index_logits_xla

        return index_logits_xla(q, weights, keys, num_keys)
    from pallas_kernels.index_logits.triton import check_triton_shapes, index_logits_triton

    check_triton_shapes(q.shape[2])
    return index_logits_triton(q, weights, keys, num_keys)
